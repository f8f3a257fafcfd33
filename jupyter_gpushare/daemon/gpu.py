"""One GPU's lease loop: grants, revokes and charges leases of its shared-memory file.

Runs on the daemon's event loop (no threads); the decision itself is :func:`.scheduler.pick`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from . import wire
from .scheduler import MIN_LEASE_NS, Grant, TenantView, UsageWindow, pick
from .shm import GpuShm, monotonic_ns

log = logging.getLogger("jupyter_gpushare.daemon")

#: A lease nobody launched under for this long is taken back (the waiter went away).
UNUSED_LEASE_NS = 3_000_000
#: How long to wait for the holder's processes to drain after its lease ended.
DRAIN_GRACE_NS = 2_000_000_000


@dataclass
class Tenant:
    """One allocation on one GPU."""

    allocation: str
    slot: int
    request: float
    limit: float
    memory: int
    window: UsageWindow = field(default_factory=UsageWindow)
    last_grant_ns: int = 0
    grants: int = 0
    connections: int = 0
    #: when this daemon started tracking it (the idle clock of a share that never launched)
    created_ns: int = field(default_factory=monotonic_ns)


class GpuLoop:
    def __init__(self, uuid: str, shm: GpuShm, quantum_ns: int, window_ns: int) -> None:
        self.uuid = uuid
        self.shm = shm
        self.quantum_ns = quantum_ns
        self.window_ns = window_ns
        self.tenants: dict[str, Tenant] = {}
        self.holder: Tenant | None = None
        self.lease_start = 0
        self.lease_until = 0
        self._timers: list[asyncio.TimerHandle] = []
        self._retry: asyncio.TimerHandle | None = None
        self.handoffs = 0
        self.draining = False

    # -- tenants ------------------------------------------------------------------------------

    def upsert(self, allocation: str, request: float, limit: float, memory: int,
               busy_slots: set[int]) -> Tenant | None:
        tenant = self.tenants.get(allocation)
        if tenant is None:
            index = self.shm.slot_of(allocation)
            if index is not None and self.shm.slots[index].state == wire.STATE_ACTIVE:
                self.shm.configure(index, request, limit, memory)  # reused after a restart
            else:
                index = self.shm.claim(allocation, request, limit, memory, busy_slots)
            if index is None:
                log.error("GPU %s: no free slot for %s", self.uuid, allocation)
                return None
            tenant = Tenant(allocation, index, request, limit, memory)
            tenant.window.total_ns = self.shm.slots[index].used_ns
            self.tenants[allocation] = tenant
        elif (tenant.request, tenant.limit, tenant.memory) != (request, limit, memory):
            tenant.request, tenant.limit, tenant.memory = request, limit, memory
            self.shm.configure(tenant.slot, request, limit, memory)
            log.info("GPU %s: %s now request %.3f limit %.3f", self.uuid, allocation,
                     request, limit)
        return tenant

    def forget(self, allocation: str) -> None:
        """The allocation left the ledger: no more leases; its clients see ``released``."""
        tenant = self.tenants.pop(allocation, None)
        if tenant is None:
            return
        self.shm.release(tenant.slot)
        if self.holder is tenant:
            self._end_lease(monotonic_ns())
        log.info("GPU %s: released %s", self.uuid, allocation)

    def disconnected(self, tenant: Tenant) -> None:
        if tenant.connections == 0:  # nobody can be waiting or draining any more
            slot = self.shm.slots[tenant.slot]
            slot.waiters = 0
            slot.joined = 0
            if self.holder is tenant:
                self._end_lease(monotonic_ns())

    # -- events from clients ------------------------------------------------------------------

    def want(self, tenant: Tenant) -> None:
        self.schedule()
        self._publish_waiting()

    def done(self, tenant: Tenant, lease: int) -> None:
        if self.holder is tenant and lease == self.lease_until:
            self._maybe_finish()

    # -- the loop ----------------------------------------------------------------------------

    def schedule(self) -> None:
        """Grant the next lease if the GPU is free and someone may run."""
        if self.holder is not None:
            return
        now = monotonic_ns()
        views = self._views(now)
        grant = pick(views, self.quantum_ns, self.window_ns)
        if grant is not None:
            self._grant(grant, now)
        elif any(v.waiting for v in views):
            self._retry_at(self._next_eligible(views, now))

    def _views(self, now: int) -> list[TenantView]:
        views = []
        for t in self.tenants.values():
            slot = self.shm.slots[t.slot]
            views.append(
                TenantView(
                    key=t.allocation,
                    request=t.request,
                    limit=t.limit,
                    used_ns=t.window.used(now, self.window_ns),
                    waiting=slot.waiters > 0,
                    last_grant_ns=t.last_grant_ns,
                )
            )
        return views

    def _next_eligible(self, views: list[TenantView], now: int) -> int:
        soonest = now + self.window_ns
        for v in views:
            if v.waiting:
                allowed = int(v.limit * self.window_ns) - MIN_LEASE_NS
                t = self.tenants[v.key].window.time_when_below(allowed, now, self.window_ns)
                soonest = min(soonest, max(t, now + 100_000))
        return soonest

    def _retry_at(self, when_ns: int) -> None:
        if self._retry is not None:
            self._retry.cancel()
        loop = asyncio.get_running_loop()
        self._retry = loop.call_at(when_ns / 1e9, self._retry_fired)

    def _retry_fired(self) -> None:
        self._retry = None
        self.schedule()

    def _grant(self, grant: Grant, now: int) -> None:
        tenant = self.tenants[grant.key]
        slot = self.shm.slots[tenant.slot]
        self.holder = tenant
        self.lease_start = now
        self.lease_until = now + grant.lease_ns
        self.draining = False
        tenant.last_grant_ns = now
        tenant.grants += 1
        self.handoffs += 1
        slot.lease_start_ns = now
        slot.drain_end_ns = now
        slot.lease_until_ns = self.lease_until
        self.shm.header.holder = tenant.slot + 1
        self.shm.wake(tenant.slot)
        self._publish_waiting()
        loop = asyncio.get_running_loop()
        self._cancel_timers()
        self._timers.append(loop.call_at(self.lease_until / 1e9, self._expire))
        self._timers.append(loop.call_at((now + UNUSED_LEASE_NS) / 1e9, self._check_unused))

    def _check_unused(self) -> None:
        """Take back a lease its holder never launched under (its waiter left)."""
        tenant = self.holder
        if tenant is None or self.draining:
            return
        slot = self.shm.slots[tenant.slot]
        if slot.joined == 0 and slot.waiters == 0:
            slot.lease_until_ns = 0
            self._maybe_finish()

    def _expire(self) -> None:
        if self.holder is None:
            return
        slot = self.shm.slots[self.holder.slot]
        slot.lease_until_ns = 0  # revoke (it has also run out by the clock)
        self.draining = True
        self._maybe_finish()
        if self.holder is not None:  # processes still draining: give them a grace period
            loop = asyncio.get_running_loop()
            self._timers.append(
                loop.call_at((monotonic_ns() + DRAIN_GRACE_NS) / 1e9, self._force_finish)
            )

    def _force_finish(self) -> None:
        if self.holder is not None:
            log.warning("GPU %s: %s did not drain in time", self.uuid, self.holder.allocation)
            self.shm.slots[self.holder.slot].joined = 0
            self._end_lease(monotonic_ns())

    def _maybe_finish(self) -> None:
        tenant = self.holder
        if tenant is None:
            return
        slot = self.shm.slots[tenant.slot]
        now = monotonic_ns()
        if slot.lease_until_ns > now or slot.joined > 0:
            return
        end = min(max(slot.drain_end_ns, self.lease_start), now)
        self._end_lease(end)

    def _end_lease(self, end: int) -> None:
        tenant = self.holder
        if tenant is None:
            return
        slot = self.shm.slots[tenant.slot]
        slot.lease_until_ns = 0
        tenant.window.charge(self.lease_start, max(end, self.lease_start))
        slot.used_ns = tenant.window.total_ns
        self.holder = None
        self.draining = False
        self.shm.header.holder = 0
        self._cancel_timers()
        self.schedule()

    def _cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def _publish_waiting(self) -> None:
        count = 0
        for t in self.tenants.values():
            if t is not self.holder and self.shm.slots[t.slot].waiters > 0:
                count += 1
        self.shm.header.waiting_slots = count

    def tick(self) -> None:
        """Periodic: heartbeat, waiting count, and a schedule in case a wake-up was lost."""
        self.shm.heartbeat()
        self._publish_waiting()
        if self.holder is not None and not self.draining:
            if self.shm.slots[self.holder.slot].lease_until_ns == 0:
                self._maybe_finish()  # handed back early without a message
        self.schedule()

    # -- status -------------------------------------------------------------------------------

    def tenant_status(self, tenant: Tenant, now: int) -> dict[str, Any]:
        slot = self.shm.slots[tenant.slot]
        running = self.lease_start if self.holder is tenant else None
        used = tenant.window.used(now, self.window_ns, running)
        return {
            "gpu": self.uuid,
            "slot": tenant.slot,
            "request": tenant.request,
            "limit": tenant.limit,
            "achieved_share": round(used / self.window_ns, 4),
            "device_seconds": (tenant.window.total_ns + (now - running if running else 0)) / 1e9,
            "memory_used": int(slot.mem_used),
            "memory_cap": int(slot.mem_cap),
            "memory_peak": int(slot.mem_peak),
            "oom_refusals": int(slot.oom_count),
            "lease_waits": int(slot.lease_waits),
            "lease_wait_seconds": slot.wait_ns / 1e9,
            "grants": tenant.grants,
            "holding": self.holder is tenant,
            "waiting": slot.waiters > 0,
            "processes": tenant.connections,
            # idle-GPU reclaim: a lease is granted only to launch, so the last grant is the
            # last launch; a share holding or waiting for a lease is not idle
            "last_launch_ago_s": (now - tenant.last_grant_ns) / 1e9 if tenant.grants else None,
            "idle_s": 0.0 if self.holder is tenant or slot.waiters > 0 else
            (now - (tenant.last_grant_ns if tenant.grants else tenant.created_ns)) / 1e9,
        }

    def status(self, now: int) -> dict[str, Any]:
        busy = sum(
            t.window.used(now, self.window_ns, self.lease_start if self.holder is t else None)
            for t in self.tenants.values()
        )
        return {
            "uuid": self.uuid,
            "shm": str(self.shm.path),
            "quantum_ms": self.quantum_ns / 1e6,
            "window_ms": self.window_ns / 1e6,
            "holder": self.holder.allocation if self.holder else None,
            "busy_share": round(busy / self.window_ns, 4),
            "handoffs": self.handoffs,
            "allocations": sorted(self.tenants),
        }
