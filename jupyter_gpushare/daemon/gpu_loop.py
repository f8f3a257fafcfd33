"""One GPU's lease loop: grants, revokes and charges leases on its lease board.

Runs on the daemon's event loop (no threads); the decision itself is :func:`.scheduler.pick`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import wire
from .scheduler import Grant, LimitCredit, TenantView, UsageWindow, backfill_allowance, pick
from .shm import GpuShm, monotonic_ns

log = logging.getLogger("jupyter_gpushare.daemon")

#: A lease nobody launched under for this long is taken back (the waiter went away).
UNUSED_LEASE_NS = 3_000_000
#: How long the daemon lets a lone holder's agent extend its own lease before revoking.
EXTEND_GRACE_NS = 10_000_000
#: A lease runs at least this long before a waiter below its request may preempt it.
PREEMPT_MIN_HOLD_NS = 1_000_000
#: How long to wait for the holder's processes to drain after its lease ended.
DRAIN_GRACE_NS = 2_000_000_000
#: A client's handoff moves ``holder`` and then stores the new lease; a half-done one is given
#: this long to complete before the daemon takes it as it is.
HANDOFF_SETTLE_NS = 2_000_000
#: A tenant of a shared GPU that uses more than its request (time others may claim back) queues
#: at most this share of a quantum of device work ahead (its slot's ``runahead_ns``): when a waiter
#: below its request preempts it, its lease drains in about that long.
RUNAHEAD_QUANTA = 0.125
#: An unlimited share may backfill this many quanta between two of the agent's looks (a limited
#: one its limit credit, at most that): the allowance is renewed at every lease and tick.
BACKFILL_BURST_QUANTA = 2
#: A holder whose processes measured more than this part of a lease idle is host-bound (and
#: stays so while others' backfill fills that much of its leases): any share below its limit
#: may fill its gaps (idle time, not the holder's). A holder with short gaps (a sync after 1 ms
#: kernels: ~7 %) is not: idle time then goes by request (scheduler.backfill_allowance).
IDLE_PART = 0.25


@dataclass
class Tenant:
    """One allocation on one GPU."""

    allocation: str
    slot: int
    request: float
    limit: float
    memory: int
    window: UsageWindow = field(default_factory=UsageWindow)
    credit: LimitCredit | None = None
    last_grant_ns: int = 0
    grants: int = 0
    connections: int = 0
    #: when this daemon started tracking it (the idle clock of a share that never launched)
    created_ns: int = field(default_factory=monotonic_ns)
    #: its processes are paused by the driver check (driver_check.py): no lease meanwhile
    fenced: bool = False


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
        #: tells the processes of a tenant whose lease was revoked early (the daemon's sockets)
        self.on_revoked: Callable[[Tenant], None] | None = None
        self.handoffs = 0
        self.preemptions = 0
        #: handoffs between tenants under contention: previous holder's device end -> next
        #: holder's first launch (ns)
        self.handoff_gaps: deque[int] = deque(maxlen=4096)
        #: the same handoffs in two parts: device end -> the grant (the previous holder noticed
        #: its drain's end and handed over) and the grant -> the first launch (the next holder's
        #: thread woke up and launched)
        self.handoff_notice: deque[int] = deque(maxlen=4096)
        self.handoff_wake: deque[int] = deque(maxlen=4096)
        #: how far past its end each lease's queued work ran (its drain end - lease end, ns;
        #: 0 when it ended in time): what a share's runahead bound keeps short
        self.overruns: deque[int] = deque(maxlen=4096)
        self._prev_end = 0
        self._prev_holder: Tenant | None = None
        self.draining = False
        self._deferred = False
        #: the slots (+ 1) the agent published as ``next_slot``/``next_other`` during the
        #: running lease: the only handoffs and extensions it adopts from the board
        self._offered: set[int] = set()
        #: backfill (wire.md, "Backfill"): each share's account ``backfill_ns`` as last charged,
        #: the device time others backfilled into the running lease, and all backfilled so far
        self._backfill_seen: dict[str, int] = {}
        self._lease_backfill = 0
        #: the same for ``idle_ns``: device time the holder's processes measured idle between
        #: their launches in its lease (a sync per step), taken off its charge
        self._idle_seen: dict[str, int] = {}
        self._lease_idle = 0
        #: per share, the part of its last lease it left to others or idle (its host's gaps)
        self._idle_part: dict[str, float] = {}
        self._backfill_looked = monotonic_ns()
        self.backfilled_ns = 0
        for policy in self.shm.policy:  # no allowance left by an earlier agent
            policy.backfill_cap_ns = 0

    # -- tenants ------------------------------------------------------------------------------

    def upsert(
        self, allocation: str, request: float, limit: float, memory: int, busy_slots: set[int]
    ) -> Tenant | None:
        tenant = self.tenants.get(allocation)
        if tenant is None:
            index = self.shm.slot_of(allocation)
            if index is not None and self.shm.policy[index].state == wire.STATE_ACTIVE:
                self.shm.configure(index, request, limit, memory)  # reused after a restart
            else:
                index = self.shm.claim(allocation, request, limit, memory, busy_slots)
            if index is None:
                log.error("GPU %s: no free slot for %s", self.uuid, allocation)
                return None
            tenant = Tenant(allocation, index, request, limit, memory)
            tenant.credit = LimitCredit(monotonic_ns(), 2 * self.quantum_ns)
            tenant.window.total_ns = self.shm.policy[index].used_ns
            self.tenants[allocation] = tenant
            self._backfill_seen[allocation] = int(self.shm.account(index).backfill_ns)
            self._idle_seen[allocation] = int(self.shm.account(index).idle_ns)
            # its bound (and the others': the GPU may be shared now) is in place before its
            # first lease: a first admission that read 0 (no bound) queued 32 launches unchecked
            self._publish_runahead(monotonic_ns())
        elif (tenant.request, tenant.limit, tenant.memory) != (request, limit, memory):
            tenant.request, tenant.limit, tenant.memory = request, limit, memory
            self.shm.configure(tenant.slot, request, limit, memory)
            self._publish_runahead(monotonic_ns())
            log.info(
                "GPU %s: %s now request %.3f limit %.3f", self.uuid, allocation, request, limit
            )
        return tenant

    def forget(self, allocation: str) -> None:
        """The allocation left the ledger: no more leases; its clients see ``released``."""
        tenant = self.tenants.pop(allocation, None)
        if tenant is None:
            return
        self.shm.release(tenant.slot)
        self.shm.policy[tenant.slot].backfill_cap_ns = 0
        self._backfill_seen.pop(allocation, None)
        self._idle_seen.pop(allocation, None)
        self._idle_part.pop(allocation, None)
        if self.holder is tenant:
            self._end_lease(monotonic_ns())
        log.info("GPU %s: released %s", self.uuid, allocation)

    def _publish_runahead(self, now: int) -> None:
        """Bound the queue of every tenant of a shared GPU, and of a tenant under a limit, so a
        lease is not charged for seconds of work queued under it (a deep queue of long kernels
        otherwise runs far past its quantum and puts its tenant that far into debt): tenants
        above their request (time others may claim back: a waiter below its request preempts
        them and then waits for their queue) queue at most RUNAHEAD_QUANTA of a quantum, the
        others one quantum (a short queue costs device time whenever a busy host is late to
        refill it). The bound is the share's: each of its processes (a kernel and the
        subprocesses it starts: one connection each) queues its part of it, and the interposer
        splits a process's part between the streams it uses (runahead.c)."""
        short = int(self.quantum_ns * RUNAHEAD_QUANTA)
        shared = len(self.tenants) > 1
        w = self.window_ns
        for t in self.tenants.values():
            bound = 0
            if shared or t.limit < 1.0:
                running = self.lease_start if self.holder is t else None
                over = shared and t.window.used(now, w, running) > t.request * w
                bound = short if over else self.quantum_ns
                bound = max(1, bound // max(1, t.connections))
            self.shm.policy[t.slot].runahead_ns = bound

    def fence(self, allocation: str, on: bool) -> None:
        """The driver check paused (``on``) or resumed this share's processes: while paused it
        gets no lease, and a lease it holds (or forged on the board) ends now."""
        tenant = self.tenants.get(allocation)
        if tenant is None:
            return
        tenant.fenced = on
        if on:
            self.shm.board[tenant.slot].lease_until_ns = 0
            if self.holder is tenant:
                self._end_lease(monotonic_ns())
            elif self.shm.header.holder == tenant.slot + 1:
                self.shm.header.holder = 0 if self.holder is None else self.holder.slot + 1
        self.schedule()

    def disconnected(self, tenant: Tenant) -> None:
        if tenant.connections == 0:  # nobody can be waiting or draining any more
            slot = self.shm.board[tenant.slot]
            slot.waiters = 0
            slot.joined = 0
            if self.holder is tenant:
                self._end_lease(monotonic_ns())

    # -- events from clients ------------------------------------------------------------------

    def want(self, tenant: Tenant) -> None:
        self._sync_holder()
        self._maybe_preempt(tenant)
        self.schedule()
        self._publish_waiting()
        self._update_next()

    def done(self, tenant: Tenant, lease: int) -> None:
        if self._sync_holder():
            return
        if self.holder is tenant:
            # whatever lease the message names (the holder may have extended it while we
            # revoked it), the shared state says whether it is over: expired and nobody joined
            self._maybe_finish()

    def _maybe_preempt(self, waiter: Tenant) -> None:
        """End the running lease early for a waiter below its request when the holder is well
        above its own (an interactive kernel next to a saturating one waits for the holder's
        queued work, not for the rest of its quantum). Holders near their request keep their
        quantum, so tenants that are all at their requests do not thrash."""
        holder = self.holder
        if holder is None or holder is waiter or self.draining:
            return
        now = monotonic_ns()
        w = self.window_ns
        if waiter.window.used(now, w) >= waiter.request * w:
            return
        if waiter.limit < 1.0 and self._credit(waiter).value(now, waiter.limit) <= 0:
            return
        if holder.window.used(now, w, self.lease_start) <= holder.request * w + self.quantum_ns:
            return
        if now - self.lease_start < PREEMPT_MIN_HOLD_NS:  # let it start; look again then

            def look_again() -> None:
                if self.holder is holder:
                    self._maybe_preempt(waiter)

            loop = asyncio.get_running_loop()
            self._timers.append(
                loop.call_at((self.lease_start + PREEMPT_MIN_HOLD_NS) / 1e9, look_again)
            )
            return
        self._update_next()
        self.shm.board[holder.slot].lease_until_ns = 0  # its agent drains and hands over
        self.draining = True
        self.preemptions += 1
        if self.on_revoked is not None:
            self.on_revoked(holder)  # wake its agents now (else they see it at their next look)
        self._maybe_finish()  # nobody joined: over at once
        if self.holder is not holder:
            return
        loop = asyncio.get_running_loop()
        self._timers.append(
            loop.call_at((monotonic_ns() + DRAIN_GRACE_NS) / 1e9, self._force_finish)
        )

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
            slot = self.shm.board[t.slot]
            views.append(
                TenantView(
                    key=t.allocation,
                    request=t.request,
                    limit=t.limit,
                    used_ns=t.window.used(now, self.window_ns),
                    waiting=slot.waiters > 0 and not t.fenced,
                    last_grant_ns=t.last_grant_ns,
                    credit_ns=self._credit(t).value(now, t.limit),
                )
            )
        return views

    def _credit(self, t: Tenant) -> LimitCredit:
        if t.credit is None:
            t.credit = LimitCredit(monotonic_ns(), 2 * self.quantum_ns)
        return t.credit

    def _next_eligible(self, views: list[TenantView], now: int) -> int:
        soonest = now + self.window_ns
        for v in views:
            if v.waiting:
                t = self._credit(self.tenants[v.key]).eligible_at(now, v.limit)
                soonest = min(soonest, max(t, now + 50_000))
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
        slot = self.shm.board[tenant.slot]
        until = now + grant.lease_ns
        # the bound before the lease: the woken holder reads it at its first launch, before
        # _begin would publish it (its lease has not run yet: the window as it stands)
        self._publish_runahead(now)
        slot.lease_start_ns = now
        slot.drain_end_ns = now
        slot.drain_eta_ns = 0
        slot.first_launch_ns = 0
        slot.lease_until_ns = until
        self.shm.header.holder = tenant.slot + 1
        self.shm.wake(tenant.slot)
        self._begin(tenant, now, until)

    def _begin(self, tenant: Tenant, start: int, until: int) -> None:
        """``tenant`` holds the GPU from ``start`` to ``until`` (granted by us or handed to it
        by the previous holder)."""
        self.holder = tenant
        self.lease_start = start
        self.lease_until = until
        self.draining = False
        self._deferred = False
        self._offered = set()
        tenant.last_grant_ns = start
        tenant.grants += 1
        self._credit(tenant).hold(start, tenant.limit)
        self.handoffs += 1
        self._publish_waiting()
        loop = asyncio.get_running_loop()
        self._cancel_timers()
        self._timers.append(loop.call_at(until / 1e9, self._expire))
        self._timers.append(loop.call_at((start + UNUSED_LEASE_NS) / 1e9, self._check_unused))
        self._update_next()
        self._publish_runahead(start)
        self._publish_backfill(start)

    def _update_next(self) -> None:
        """Publish who the holder should hand the GPU to when its lease ends."""
        header = self.shm.header
        if self.holder is None:
            header.next_slot = 0
            header.next_other = 0
            return
        now = monotonic_ns()
        left = max(0, self.lease_until - now)
        views = []
        for v in self._views(now):  # as they will be when the lease ends
            credit = v.credit_ns + int(v.limit * left)
            if v.key != self.holder.allocation:  # the holder's credit is not capped
                credit = min(credit, self._credit(self.tenants[v.key]).cap_ns)
            if v.key == self.holder.allocation:
                running = self.holder.window.used(now, self.window_ns, self.lease_start)
                # its lease is charged against its credit only when it ends: what it ran so
                # far is spent too (else a holder granted with some credit to spare looked
                # due again near its lease's end and was extended into a second kernel longer
                # than the quantum: twice its limit in a 1 s window)
                spent = max(0, now - self.lease_start) + left
                v = replace(v, used_ns=running + left, credit_ns=credit - spent, waiting=True)
            else:
                v = replace(v, credit_ns=credit)
            views.append(v)
        grant = pick(views, self.quantum_ns, self.window_ns)
        other = pick(
            [v for v in views if v.key != self.holder.allocation], self.quantum_ns, self.window_ns
        )
        chosen = grant or other
        if chosen is not None:
            header.next_lease_ns = chosen.lease_ns
        header.next_other = 0 if other is None else self.tenants[other.key].slot + 1
        header.next_slot = 0 if grant is None else self.tenants[grant.key].slot + 1
        self._offered.update(x for x in (header.next_other, header.next_slot) if x)

    def _sync_holder(self) -> bool:
        """Adopt a handoff a client made: ``holder`` moved off our holder's slot, or our holder
        handed the GPU to itself (its ``lease_until_ns`` is a lease we did not grant)."""
        if self.holder is None:
            return False
        moved = int(self.shm.header.holder)
        if moved == 0:
            return False
        if not 0 < moved <= len(self.shm.board):
            # written by a tenant (the board is theirs to write): no slot; the holder stays ours
            self.shm.header.holder = self.holder.slot + 1
            return False
        if moved == self.holder.slot + 1:
            until = int(self.shm.board[self.holder.slot].lease_until_ns)
            if until == 0 or until == self.lease_until:
                return False
            if moved not in self._offered:  # an extension the agent never offered: forged
                self.shm.board[self.holder.slot].lease_until_ns = self.lease_until
                return False
        elif moved not in self._offered:  # a handoff to a slot never offered: forged
            self.shm.header.holder = self.holder.slot + 1
            if any(t.slot == moved - 1 for t in self.tenants.values()):
                self.shm.board[moved - 1].lease_until_ns = 0
            return False
        new = next((t for t in self.tenants.values() if t.slot == moved - 1), None)
        if new is not None and new is not self.holder:
            slot = self.shm.board[new.slot]
            start, until = int(slot.lease_start_ns), int(slot.lease_until_ns)
            if until <= start and monotonic_ns() - start < HANDOFF_SETTLE_NS:
                # caught between the client's move of ``holder`` and its store of the lease:
                # look again in a moment (acting now would see no lease and revoke it)
                asyncio.get_running_loop().call_later(
                    HANDOFF_SETTLE_NS / 1e9 / 20, self._sync_holder
                )
                return True
        old = self.holder
        self._charge(old, int(self.shm.board[old.slot].drain_end_ns))
        if new is None:  # handed to a slot that was released meanwhile: take it back
            self.shm.board[moved - 1].lease_until_ns = 0
            self.holder = None
            self.shm.header.holder = 0
            self._cancel_timers()
            self.schedule()
            return True
        slot = self.shm.board[new.slot]
        now = monotonic_ns()
        # a lease from the board is the tenants' word: the agent's clock bounds it (a handoff
        # or an extension is never longer than a window, nor started in the future)
        start = min(int(slot.lease_start_ns), now)
        until = min(max(int(slot.lease_until_ns), start), now + self.window_ns)
        self._begin(new, start, until)
        return True

    def _check_unused(self) -> None:
        """Take back a lease its holder never launched under (its waiter left)."""
        tenant = self.holder
        if tenant is None or self.draining:
            return
        slot = self.shm.board[tenant.slot]
        if slot.joined == 0 and slot.waiters == 0:
            slot.lease_until_ns = 0
            self._maybe_finish()

    def _expire(self) -> None:
        if self.holder is None or self._sync_holder():
            return
        header = self.shm.header
        if not self._deferred and header.next_slot == self.holder.slot + 1:
            # the holder is next (nobody else may run now): its agent extends the lease itself
            # without draining; look again shortly (then revoke as usual)
            self._deferred = True
            loop = asyncio.get_running_loop()
            self._timers.append(
                loop.call_at((monotonic_ns() + EXTEND_GRACE_NS) / 1e9, self._expire)
            )
            return
        slot = self.shm.board[self.holder.slot]
        if slot.lease_until_ns != self.lease_until and self._sync_holder():
            return  # extended by its agent just now
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
            self.shm.board[self.holder.slot].joined = 0
            self._end_lease(monotonic_ns())

    def _maybe_finish(self) -> None:
        tenant = self.holder
        if tenant is None:
            return
        slot = self.shm.board[tenant.slot]
        now = monotonic_ns()
        if slot.lease_until_ns > now or slot.joined > 0:
            return
        if self._sync_holder():  # after reading joined: a handoff is visible before it drops
            return
        end = min(max(slot.drain_end_ns, self.lease_start), now)
        self._end_lease(end)

    def _charge(self, tenant: Tenant, end: int) -> None:
        self._collect_backfill(monotonic_ns())  # others' backfill into this lease is theirs
        slot = self.shm.board[tenant.slot]
        first = int(slot.first_launch_ns)
        # charged from the first launch: the wake-up before it is nobody's device time (a lease
        # never launched under is charged whole: it kept the others out)
        start = first if self.lease_start <= first <= end else self.lease_start
        end = max(min(end, monotonic_ns()), start)  # a drain end from the board: not future
        handed = self._prev_holder is not None and self._prev_holder is not tenant
        if handed and first and 0 <= self.lease_start - self._prev_end < 5_000_000:
            self.handoff_gaps.append(max(0, first - self._prev_end))  # granted on the spot
            self.handoff_notice.append(max(0, self.lease_start - self._prev_end))
            self.handoff_wake.append(max(0, first - self.lease_start))
            if first - self._prev_end > 5_000_000:
                log.debug(
                    "GPU %s: slow handoff to %s: %.1f ms (granted %.1f ms after the end, "
                    "lease %.1f ms, charged to %.1f ms)",
                    self.uuid,
                    tenant.allocation,
                    (first - self._prev_end) / 1e6,
                    (self.lease_start - self._prev_end) / 1e6,
                    (self.lease_until - self.lease_start) / 1e6,
                    (end - self.lease_start) / 1e6,
                )
        self._prev_end = end
        self._prev_holder = tenant
        self.overruns.append(max(0, end - self.lease_until))
        # what others backfilled into the lease and what its processes measured idle in it are
        # not its device time: a lease is charged the device time it used, not its length
        backfilled = min(self._lease_backfill + self._lease_idle, end - start)
        # host-bound: a quarter of the lease measured idle, and it stays so while its gaps are
        # filled (backfill covers what was idle: the holder's own idle clock then reads ~0)
        length = max(1, end - start)
        was = self._idle_part.get(tenant.allocation, 0.0) > IDLE_PART
        part = self._lease_idle / length
        if was and part <= IDLE_PART:
            part = backfilled / length
        self._idle_part[tenant.allocation] = part
        self._lease_backfill = self._lease_idle = 0
        tenant.window.charge(start, end - backfilled)
        credit = self._credit(tenant)
        # a lease runs at least one kernel: with kernels longer than the quantum a burst cap
        # of two quanta would throw away credit a tenant earns while it waits for its turn
        # (tenants whose limits add up to 1 would then all sit in debt: an idle device). The
        # cap follows the leases' length (an extension splits one kernel's lease in pieces:
        # the cap shrinks slowly)
        credit.cap_ns = max(2 * self.quantum_ns, 2 * (end - start), (3 * credit.cap_ns) // 4)
        credit.charge(end - start - backfilled, max(end, credit.t), tenant.limit)
        self.shm.policy[tenant.slot].used_ns = tenant.window.total_ns

    def _collect_backfill(self, now: int) -> None:
        """Charge each share the device time its processes backfilled since the last look (its
        account's ``backfill_ns``), and note what went into the running lease (taken off its
        holder's charge). The account is the share's own: a step back or more than the wall time
        since the last look is no figure (its own processes wrote it) and only moves the mark."""
        elapsed = max(0, now - self._backfill_looked) + self.quantum_ns
        self._backfill_looked = now
        for t in self.tenants.values():
            account = self.shm.account(t.slot)
            idle = int(account.idle_ns)
            idle_seen = self._idle_seen.get(t.allocation, idle)
            self._idle_seen[t.allocation] = idle
            if t is self.holder and 0 < idle - idle_seen <= elapsed:
                self._lease_idle += idle - idle_seen
            value = int(account.backfill_ns)
            seen = self._backfill_seen.get(t.allocation, value)
            self._backfill_seen[t.allocation] = value
            ran = value - seen
            if ran <= 0 or ran > elapsed:
                continue
            t.window.charge(now - ran, now)
            credit = self._credit(t)
            credit.value(now, t.limit)
            credit.credit -= ran  # (a holder's credit stays uncapped until its lease is charged)
            self.shm.policy[t.slot].used_ns = t.window.total_ns
            self.backfilled_ns += ran
            if self.holder is not None and t is not self.holder:
                self._lease_backfill += ran

    def _publish_backfill(self, now: int) -> None:
        """How much more each share may backfill (its policy's ``backfill_cap_ns``, against its
        account's ``backfill_ns``): :func:`.scheduler.backfill_allowance` for the running
        lease's holder, nothing while no lease runs or a share is alone."""
        self._collect_backfill(now)
        views = {v.key: v for v in self._views(now)}
        holder = None
        if self.holder is not None and self.holder.allocation in views:
            running = self.holder.window.used(now, self.window_ns, self.lease_start)
            holder = replace(views[self.holder.allocation], used_ns=running)
        burst = BACKFILL_BURST_QUANTA * self.quantum_ns
        idles = holder is not None and self._idle_part.get(holder.key, 0.0) > IDLE_PART
        for t in self.tenants.values():
            allow = 0
            if holder is not None and t.connections > 0:
                view = views[t.allocation]
                allow = backfill_allowance(view, holder, self.window_ns, burst, idles)
            seen = self._backfill_seen.get(t.allocation, 0)
            self.shm.policy[t.slot].backfill_cap_ns = seen + allow

    def _end_lease(self, end: int) -> None:
        tenant = self.holder
        if tenant is None:
            return
        slot = self.shm.board[tenant.slot]
        slot.lease_until_ns = 0
        self._charge(tenant, end)
        self.holder = None
        self.draining = False
        self.shm.header.holder = 0
        self.shm.header.next_slot = 0
        self.shm.header.next_other = 0
        self._cancel_timers()
        self.schedule()

    def _cancel_timers(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def _publish_waiting(self) -> None:
        count = 0
        for t in self.tenants.values():
            if t is not self.holder and self.shm.board[t.slot].waiters > 0:
                count += 1
        self.shm.header.waiting_slots = count

    def tick(self) -> None:
        """Periodic: heartbeat, waiting count, and a schedule in case a wake-up was lost."""
        self.shm.heartbeat()
        self._sync_holder()
        self._publish_waiting()
        self._update_next()
        self._publish_runahead(monotonic_ns())
        self._publish_backfill(monotonic_ns())
        if self.holder is not None and self.shm.board[self.holder.slot].lease_until_ns == 0:
            self._maybe_finish()  # over without a (usable) message
        self.schedule()

    # -- status -------------------------------------------------------------------------------

    def tenant_status(self, tenant: Tenant, now: int) -> dict[str, Any]:
        slot = self.shm.board[tenant.slot]
        policy = self.shm.policy[tenant.slot]
        account = self.shm.account(tenant.slot)
        running = self.lease_start if self.holder is tenant else None
        used = tenant.window.used(now, self.window_ns, running)
        return {
            "gpu": self.uuid,
            "slot": tenant.slot,
            "request": tenant.request,
            "limit": tenant.limit,
            "achieved_share": round(used / self.window_ns, 4),
            "device_seconds": (tenant.window.total_ns + (now - running if running else 0)) / 1e9,
            "memory_used": int(account.mem_used),
            "memory_cap": int(policy.mem_cap),
            "memory_peak": int(account.mem_peak),
            "oom_refusals": int(account.oom_count),
            "lease_waits": int(account.lease_waits),
            "lease_wait_seconds": account.wait_ns / 1e9,
            "grants": tenant.grants,
            "holding": self.holder is tenant,
            "waiting": slot.waiters > 0,
            "processes": tenant.connections,
            # idle-GPU reclaim: a lease is granted only to launch, so the last grant is the
            # last launch; a share holding or waiting for a lease is not idle
            "last_launch_ago_s": (now - tenant.last_grant_ns) / 1e9 if tenant.grants else None,
            "idle_s": 0.0
            if self.holder is tenant or slot.waiters > 0
            else (now - (tenant.last_grant_ns if tenant.grants else tenant.created_ns)) / 1e9,
        }

    def status(self, now: int) -> dict[str, Any]:
        busy = sum(
            t.window.used(now, self.window_ns, self.lease_start if self.holder is t else None)
            for t in self.tenants.values()
        )
        return {
            "uuid": self.uuid,
            "state_dir": str(self.shm.path),
            "quantum_ms": self.quantum_ns / 1e6,
            "window_ms": self.window_ns / 1e6,
            "holder": self.holder.allocation if self.holder else None,
            "busy_share": round(busy / self.window_ns, 4),
            "handoffs": self.handoffs,
            "direct_handoffs": int(self.shm.header.direct_handoffs),
            "preemptions": self.preemptions,
            "handoff_us": _percentiles(self.handoff_gaps),
            "handoff_notice_us": _percentiles(self.handoff_notice),
            "handoff_wake_us": _percentiles(self.handoff_wake),
            "overrun_us": _percentiles(self.overruns),
            # host gaps of holders filled by others (wire.md, "Backfill")
            "backfills": int(self.shm.header.backfills),
            "backfilled_s": round(self.backfilled_ns / 1e9, 3),
            "allocations": sorted(self.tenants),
        }


def _percentiles(values: deque[int]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    n = len(ordered)
    return {
        "n": n,
        "p50": round(ordered[n // 2] / 1e3, 1),
        "p99": round(ordered[min(n - 1, (n * 99) // 100)] / 1e3, 1),
        "p999": round(ordered[min(n - 1, (n * 999) // 1000)] / 1e3, 1),
        "max": round(ordered[-1] / 1e3, 1),
    }
