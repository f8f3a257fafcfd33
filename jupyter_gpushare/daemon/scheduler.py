"""The token scheduler's decision: who gets the next lease of a GPU, and for how long.

Pure functions over plain data (no clock, no I/O), so they can be tested exhaustively.

Policy (per GPU, leases exclusive, time measured as device time charged in a sliding window):

1. Only tenants that wait for a lease and have used less than ``limit * window`` are eligible;
   nobody is ever granted time that would take it past its limit in the window (the lease is
   shortened to what is left, and refused below :data:`MIN_LEASE_NS`).
2. Eligible tenants below their request go first, most behind first (smallest
   ``used / (request * window)``), like a deficit round robin.
3. Otherwise idle time goes to tenants below their limit, shared in proportion to their
   requests (smallest ``used / request`` first): work-conserving.
4. Ties go to the tenant that was granted least recently.

:class:`UsageWindow` keeps the charged intervals of one tenant and answers "how much device time
in the last ``window`` ns"; it is plain data too (the caller passes ``now``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Shorter leases than this are not worth a handoff.
MIN_LEASE_NS = 1_000_000


@dataclass(frozen=True)
class TenantView:
    """What the decision needs to know about one tenant of one GPU."""

    key: str
    request: float
    limit: float
    used_ns: int  # device time charged within the window (including a running lease)
    waiting: bool
    last_grant_ns: int = 0


@dataclass(frozen=True)
class Grant:
    key: str
    lease_ns: int
    below_request: bool


def pick(
    tenants: Sequence[TenantView], quantum_ns: int, window_ns: int
) -> Grant | None:
    """The next lease, or None when no waiting tenant may run now."""
    best: tuple[tuple[int, float, int], TenantView, int] | None = None
    for t in tenants:
        if not t.waiting or t.limit <= 0:
            continue
        room = int(t.limit * window_ns) - t.used_ns
        if room < MIN_LEASE_NS:
            continue
        owed = t.request * window_ns
        below = t.used_ns < owed
        if below:
            rank = (0, t.used_ns / owed if owed > 0 else 0.0, t.last_grant_ns)
        else:
            rank = (1, t.used_ns / max(t.request, 1e-9), t.last_grant_ns)
        if best is None or rank < best[0]:
            best = (rank, t, room)
    if best is None:
        return None
    rank, tenant, room = best
    return Grant(tenant.key, min(quantum_ns, room), rank[0] == 0)


def next_eligible_ns(tenant: TenantView, window: UsageWindow, now: int, window_ns: int) -> int:
    """When a tenant over its limit will have room for :data:`MIN_LEASE_NS` again (≥ now)."""
    allowed = int(tenant.limit * window_ns) - MIN_LEASE_NS
    return window.time_when_below(allowed, now, window_ns)


class UsageWindow:
    """Charged device-time intervals of one tenant, trimmed to the last window."""

    def __init__(self) -> None:
        self.intervals: deque[tuple[int, int]] = deque()
        self.total_ns = 0  # all time ever charged

    def charge(self, start: int, end: int) -> None:
        if end <= start:
            return
        self.intervals.append((start, end))
        self.total_ns += end - start

    def used(self, now: int, window_ns: int, running_since: int | None = None) -> int:
        """Device time within ``[now - window_ns, now]``; a running lease counts from
        ``running_since`` to ``now``."""
        lo = now - window_ns
        while self.intervals and self.intervals[0][1] <= lo:
            self.intervals.popleft()
        used = sum(min(e, now) - max(s, lo) for s, e in self.intervals if min(e, now) > max(s, lo))
        if running_since is not None and now > running_since:
            used += now - max(running_since, lo)
        return used

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
