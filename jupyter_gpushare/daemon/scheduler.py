"""The token scheduler's decision: who gets the next lease of a GPU, and for how long.

Pure functions over plain data (no clock, no I/O), so they can be tested exhaustively.

Policy (per GPU, leases exclusive, time measured as device time charged in a sliding window):

1. Only tenants that wait for a lease and have limit credit left are eligible. Credit
   (:class:`LimitCredit`) accrues at ``limit`` ns per ns, is capped at a small burst (two quanta),
   and every lease's device time is charged against it; so over any stretch of time a tenant
   uses at most ``limit`` of it plus one burst. (A sliding-window check "used < limit * window"
   fragments the GPU when limits add up to 1: both tenants sit at their limit and wait for their
   own usage to slide out, leaving gaps; credit has no such gaps.)
2. Eligible tenants below their request go first, most behind first (smallest
   ``used / (request * window)``), like a deficit round robin.
3. Otherwise idle time goes to tenants below their limit, shared in proportion to their
   requests (smallest ``used / request`` first): work-conserving.
4. Ties go to the tenant that was granted least recently.
5. While the holder's host leaves the device idle (a sync per step), others may **backfill**
   its gaps with one short launch at a time (wire.md, "Backfill"), each charged the device time
   it took (and taken off the holder's lease). :func:`backfill_allowance` says how much each may
   backfill: shares with limit credit, those below their request always, the others when the
   holder's leases leave the device idle, or unless the holder, too, runs above its request and
   is further behind than they are (idle time is split by request, as in 3).

:class:`UsageWindow` keeps the charged intervals of one tenant and answers "how much device time
in the last ``window`` ns"; it is plain data too (the caller passes ``now``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantView:
    """What the decision needs to know about one tenant of one GPU."""

    key: str
    request: float
    limit: float
    used_ns: int  # device time charged within the window (including a running lease)
    waiting: bool
    last_grant_ns: int = 0
    credit_ns: int = 1  # limit credit (LimitCredit.value); > 0 means it may run


@dataclass(frozen=True)
class Grant:
    key: str
    lease_ns: int
    below_request: bool


def pick(tenants: Sequence[TenantView], quantum_ns: int, window_ns: int) -> Grant | None:
    """The next lease, or None when no waiting tenant may run now."""
    best: tuple[tuple[int, float, int], TenantView] | None = None
    for t in tenants:
        if not t.waiting or t.limit <= 0:
            continue
        if t.limit < 1.0 and t.credit_ns <= 0:
            continue
        owed = t.request * window_ns
        below = t.used_ns < owed
        if below:
            rank = (0, t.used_ns / owed if owed > 0 else 0.0, t.last_grant_ns)
        else:
            rank = (1, t.used_ns / max(t.request, 1e-9), t.last_grant_ns)
        if best is None or rank < best[0]:
            best = (rank, t)
    if best is None:
        return None
    rank, tenant = best
    return Grant(tenant.key, quantum_ns, rank[0] == 0)


def backfill_allowance(
    tenant: TenantView,
    holder: TenantView | None,
    window_ns: int,
    burst_ns: int,
    holder_idles: bool = False,
) -> int:
    """How much device time ``tenant`` may backfill into ``holder``'s lease from now until the
    next decision (0: none): its limit credit (``credit_ns``, the burst for an unlimited share),
    when it is not the holder, below its limit, and either below its request or not
    ahead of a holder that also runs above its own (then idle time is split by request: the one
    with the smaller ``used / request`` goes first, as in :func:`pick`), or the holder leaves the
    device idle in its leases (``holder_idles``: its host is the bound, and what it cannot use
    is idle time for the others, by max-min fairness)."""
    if holder is None or tenant.key == holder.key or tenant.limit <= 0:
        return 0
    allowance = burst_ns if tenant.limit >= 1.0 else min(tenant.credit_ns, burst_ns)
    if allowance <= 0:
        return 0
    if tenant.used_ns < tenant.request * window_ns:
        return allowance
    if holder_idles or holder.used_ns < holder.request * window_ns:
        return allowance  # the holder cannot use its gaps: they are idle time
    mine = tenant.used_ns / max(tenant.request, 1e-9)
    theirs = holder.used_ns / max(holder.request, 1e-9)
    return allowance if mine <= theirs else 0


class LimitCredit:
    """How much device time a tenant may still use under its limit.

    Credit accrues at ``limit`` ns per ns and is capped at a burst (``cap_ns``) - except while
    the tenant holds the GPU: what it earns during its own lease pays for that lease (a lease
    is charged when it ends, and a kernel longer than the quantum runs on past it), so capping
    then would throw away credit the lease is about to spend. Debt (negative credit) is carried
    over: a lease that ran past its quantum is paid back before the next one, whatever window it
    falls in."""

    def __init__(self, now: int, cap_ns: int) -> None:
        self.credit = 0.0
        self.t = now
        self.cap_ns = cap_ns
        self.holding = False

    def value(self, now: int, limit: float) -> int:
        if now > self.t:
            self.credit += limit * (now - self.t)
            if not self.holding:
                self.credit = min(self.credit, float(self.cap_ns))
            self.t = now
        return int(self.credit)

    def hold(self, now: int, limit: float) -> None:
        """The tenant's lease starts at ``now``: no cap until it is charged."""
        self.value(now, limit)
        self.holding = True

    def charge(self, ns: int, now: int | None = None, limit: float = 0.0) -> None:
        """Charge a lease of ``ns`` that ended at ``now`` (accruing up to then, uncapped when it
        was held), and cap the balance again."""
        if now is not None:
            self.value(now, limit)
        self.credit -= ns
        if self.holding:
            self.holding = False
            self.credit = min(self.credit, float(self.cap_ns))

    def eligible_at(self, now: int, limit: float) -> int:
        """When the credit turns positive again (assuming no new charges)."""
        credit = self.value(now, limit)
        if credit > 0 or limit <= 0:
            return now
        return now + int(-credit / limit) + 1


class UsageWindow:
    """Charged device-time intervals of one tenant, trimmed to the last window."""

    def __init__(self) -> None:
        self.intervals: deque[tuple[int, int]] = deque()
        self.total_ns = 0  # all time ever charged
        self._in_deque_ns = 0  # sum of the intervals still kept

    def charge(self, start: int, end: int) -> None:
        if end <= start:
            return
        self.intervals.append((start, end))
        self.total_ns += end - start
        self._in_deque_ns += end - start

    def used(self, now: int, window_ns: int, running_since: int | None = None) -> int:
        """Device time within ``[now - window_ns, now]``; a running lease counts from
        ``running_since`` to ``now``. O(1) amortised (a running sum of kept intervals)."""
        lo = now - window_ns
        intervals = self.intervals
        while intervals and intervals[0][1] <= lo:
            s, e = intervals.popleft()
            self._in_deque_ns -= e - s
        used = self._in_deque_ns
        if intervals:
            s0 = intervals[0][0]
            if s0 < lo:
                used -= lo - s0
            e1 = intervals[-1][1]
            if e1 > now:  # charged into the future (clock skew between writers)
                used -= min(e1 - now, e1 - max(intervals[-1][0], lo))
        if running_since is not None and now > running_since:
            used += now - max(running_since, lo)
        return max(used, 0)

    def time_when_below(self, allowed_ns: int, now: int, window_ns: int) -> int:
        """The earliest time ≥ now at which usage in the window is ≤ ``allowed_ns`` (assuming
        no new charges)."""
        excess = self.used(now, window_ns) - allowed_ns
        if excess <= 0:
            return now
        lo = now - window_ns
        for s, e in self.intervals:  # sliding forward drops the oldest time first
            start = max(s, lo)
            if e - start >= excess:
                return start + excess + window_ns
            excess -= e - start
        return now + window_ns


def share(used_ns: Iterable[int], window_ns: int) -> list[float]:
    return [u / window_ns for u in used_ns]
