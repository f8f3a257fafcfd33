"""Idle-GPU reclaim: a kernel that holds a GPU share and runs no GPU work gives it back.

The node daemon knows when each allocation last launched (a lease is granted only to launch);
its status reports ``idle_s`` per allocation (locally over its socket; on Kubernetes in its
node's usage ConfigMap, :mod:`jupyter_gpushare.k8s.usage`). The server's :class:`IdleReclaimer`
reads it every ``GpuShare.reclaim_interval`` seconds and applies the admin's policy
(:func:`decide`, pure):

- idle for ``reclaim_idle_after`` seconds: *warn*. The warning is written into the allocation
  (``extra.reclaim_warning``: when, why, when the share goes) with a compare-and-swap, so every
  reader sees it: the daemon's status carries it to the kernel, where the notebook panel shows it
  and the next cell prints it (:mod:`jupyter_gpushare.notebook.reclaim_notice`); REST shows it
  in the allocation.
- still idle ``reclaim_grace`` seconds after the warning: *release* the share the way the panel's
  Release does — it leaves the ledger, the daemon marks it released, the interposer frees the
  process's GPU memory and refuses further CUDA work; the kernel process and its variables live.
- GPU work again before that: the warning is withdrawn.

Exempt: kernels of users in ``reclaim_exempt_users``; kernels whose kernelspec or pool is named
in ``reclaim_exempt_profiles``; pool kernels nobody has claimed; batch shares (``gpushare run``).
Every warning, withdrawal and release is logged for admins.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from .ledger import Allocation, AllocationNotFound, Ledger
from .periodic import PeriodicTask
from .share import format_bytes
from .usage import UsageView

WARN, RELEASE, WITHDRAW = "warn", "release", "withdraw"


@dataclass(frozen=True)
class ReclaimPolicy:
    idle_after: float  # seconds; 0 turns reclaim off
    grace: float
    exempt_users: frozenset[str] = frozenset()
    exempt_profiles: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Any) -> ReclaimPolicy:
        return cls(
            idle_after=float(settings.reclaim_idle_after),
            grace=float(settings.reclaim_grace),
            exempt_users=frozenset(settings.reclaim_exempt_users),
            exempt_profiles=frozenset(settings.reclaim_exempt_profiles),
        )

    def exempt(self, allocation: Allocation, profiles: Collection[str]) -> bool:
        return allocation.user in self.exempt_users or any(
            p in self.exempt_profiles for p in profiles
        )


def decide(
    allocation: Allocation,
    idle_s: float | None,
    policy: ReclaimPolicy,
    profiles: Collection[str],
    now: float,
) -> str | None:
    """What to do with ``allocation`` idle for ``idle_s`` seconds (None: unknown) at wall time
    ``now``; ``profiles`` are its kernelspec and pool names. Returns WARN, RELEASE, WITHDRAW or
    None."""
    warning = allocation.extra.get("reclaim_warning")
    if (
        policy.idle_after <= 0
        or allocation.owner != "kernel"
        or idle_s is None
        or policy.exempt(allocation, profiles)
    ):
        return WITHDRAW if warning else None
    if idle_s < policy.idle_after:
        return WITHDRAW if warning else None
    if not warning:
        return WARN
    return RELEASE if now >= float(warning.get("release_at", 0)) else None


def warning_for(
    allocation: Allocation, idle_s: float, policy: ReclaimPolicy, now: float
) -> dict[str, Any]:
    release_at = now + policy.grace
    message = (
        f"gpushare: this kernel has not used its GPU share ({allocation.spec.describe()}, "
        f"{format_bytes(allocation.memory)}) for {_duration(idle_s)}. It will be released at "
        f"{time.strftime('%H:%M:%S', time.localtime(release_at))} (in {_duration(policy.grace)})"
        " unless the kernel runs GPU work; the kernel keeps running either way."
    )
    return {
        "warned_at": now,
        "release_at": release_at,
        "idle_s": round(idle_s, 1),
        "message": message,
    }


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


class IdleReclaimer(PeriodicTask):
    """The server's background task applying :func:`decide` to its allocations.

    Which allocations: locally those on this machine's node; on Kubernetes those of this
    server's kernels (``extra.k8s_server``), on any node (the backend's ``records``). Idle times
    come from the backend's ``usage()``: the node daemon's status locally, the nodes' usage
    ConfigMaps on Kubernetes. An allocation whose node has no current usage (daemon down,
    report stale) is left alone this pass: nothing is warned, withdrawn or released on old news.
    """

    what = "idle reclaim pass"

    def __init__(
        self,
        settings: Any,
        ledger: Callable[[], Awaitable[Ledger]],
        profiles_of: Callable[[Allocation], Collection[str]],
        log: Any,
    ) -> None:
        super().__init__(log)
        self.settings = settings
        self.ledger = ledger
        self.profiles_of = profiles_of
        self._usage_problem: str | None = None

    def interval(self) -> float:
        return float(self.settings.reclaim_interval)

    def enabled(self) -> bool:
        return bool(self.settings.reclaim_idle_after > 0)

    async def usage(self) -> UsageView:
        view = await (await self.settings.get_backend().usage()).read()
        # logged when what is missing changes (not every pass; the ages in the message do)
        problem = ",".join(sorted(view.stale)) if view.stale else (None if view.nodes else "all")
        if problem is not None and problem != self._usage_problem:
            self.log.warning(
                "gpushare: idle reclaim skips allocations without current usage: %s", view.message
            )
        self._usage_problem = problem
        return view

    async def candidates(self, ledger: Ledger) -> list[Allocation]:
        return await self.settings.get_backend().records(ledger)

    async def run_once(self, now: float | None = None) -> dict[str, list[str]]:
        """One pass; returns the allocation ids per action taken."""
        done: dict[str, list[str]] = {WARN: [], RELEASE: [], WITHDRAW: []}
        policy = ReclaimPolicy.from_settings(self.settings)
        view = await self.usage()
        if not view.nodes:
            return done
        ledger = await self.ledger()
        now = time.time() if now is None else now
        for allocation in await self.candidates(ledger):
            if not view.covers(allocation.node):
                continue
            idle_s = (view.get(allocation.id) or {}).get("idle_s")
            action = decide(allocation, idle_s, policy, self.profiles_of(allocation), now)
            if action is None:
                continue
            with contextlib.suppress(AllocationNotFound):
                await self._apply(ledger, allocation, action, idle_s or 0.0, policy, now)
                done[action].append(allocation.id)
        if any(done.values()):
            await (await self.settings.get_backend().usage()).changed()
        return done

    async def _apply(
        self,
        ledger: Ledger,
        allocation: Allocation,
        action: str,
        idle_s: float,
        policy: ReclaimPolicy,
        now: float,
    ) -> None:
        who = f"{allocation.id} (kernel {allocation.kernel_id}, user {allocation.user or '?'})"
        if action == RELEASE:
            if await ledger.release(allocation.id) is not None:
                self.log.warning(
                    "gpushare: reclaimed idle GPU share %s: idle %.0f s, warned "
                    "%.0f s ago; the kernel keeps running",
                    who,
                    idle_s,
                    now - allocation.extra["reclaim_warning"]["warned_at"],
                )
            return
        warning = warning_for(allocation, idle_s, policy, now) if action == WARN else None

        def change(current: Allocation, _others: list[Allocation]) -> Allocation:
            extra = {k: v for k, v in current.extra.items() if k != "reclaim_warning"}
            if warning is not None:
                extra["reclaim_warning"] = warning
            return replace(current, extra=extra)

        await ledger.update(allocation.id, change)
        if warning is not None:
            self.log.warning(
                "gpushare: idle GPU share %s warned: idle %.0f s, release in %.0f s",
                who,
                idle_s,
                policy.grace,
            )
        else:
            self.log.info("gpushare: idle warning of %s withdrawn (GPU work again, or exempt)", who)
