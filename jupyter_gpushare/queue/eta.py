"""When a waiting start can expect to begin. Pure.

What frees capacity of a GPU type, and what the estimate may rest on:

- **Reclaim deadlines.** An idle share that idle reclaim has warned is released at its
  ``release_at`` unless its kernel runs GPU work first. Freeing them in deadline order, the
  first time the capacity freed covers what this start and the starts ahead of it need is an
  *upper bound* while those shares stay idle (``by``).
- **The observed release rate.** Releases of that type seen in the last ``window_s`` seconds (at
  least :data:`MIN_RELEASES` of them), modelled as a Poisson stream of releases of the observed
  mean size: ``k`` of them free enough, so the wait is Erlang(k, rate). The range shown runs
  from the :data:`LOW_QUANTILE` of the wait for room for this start alone (it may pass starts
  ahead of it that do not fit yet) to the :data:`HIGH_QUANTILE` of the wait for room for it and
  every start ahead, each widened by :data:`SPREAD`, and is capped by the deadline bound where
  one applies.

With neither, there is no estimate: :class:`Eta` says so (``lo`` and ``hi`` None) and why, and
nothing shows a range. The honesty of the ranges shown (the share of starts that began inside
the first one shown to them) is measured by ``benchmarks/fair_queue.py`` and by the agent's
``gpushare_queue_eta_*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: releases needed in the window before a rate is used
MIN_RELEASES = 3
#: the quantiles of the modelled wait that bound the range shown
LOW_QUANTILE = 0.02
HIGH_QUANTILE = 0.98
#: the model's releases come one at a time and the order lets a user who holds less go ahead:
#: the range is widened by this factor at both ends (measured by benchmarks/fair_queue.py, ETA
#: honesty)
SPREAD = 2.0


@dataclass(frozen=True)
class Release:
    """Capacity given back on a GPU type at wall time ``at`` (a release, a shutdown, a reclaim,
    a resize down)."""

    at: float
    request: float
    gpu_type: str


@dataclass(frozen=True)
class Deadline:
    """An idle share that idle reclaim releases at ``at`` (wall time) unless it runs again,
    on GPU ``gpu`` (a share of several GPUs: one deadline per GPU)."""

    at: float
    request: float
    gpu_type: str
    gpu: str = ""


@dataclass(frozen=True)
class Eta:
    """An estimate in seconds from ``now``: ``lo``..``hi`` (both None: no estimate; ``lo``
    None and ``hi`` set: by ``hi``), what it rests on (``basis``, the user's words), and the
    deadline bound (``by``, seconds from now) with how many idle shares it counts."""

    now: float
    lo: float | None
    hi: float | None
    basis: tuple[str, ...]
    by: float | None = None
    reclaims: int = 0

    @property
    def known(self) -> bool:
        return self.hi is not None

    def contains(self, waited: float, slack: float = 1.0) -> bool:
        """Whether a start that began ``waited`` seconds after ``now`` began inside the range
        (``slack`` seconds either side: the agent's own reaction time)."""
        if self.hi is None:
            return False
        return (self.lo or 0.0) - slack <= waited <= self.hi + slack

    def to_json(self) -> dict[str, object]:
        return {
            "computed_at": self.now,
            "lo_s": None if self.lo is None else round(self.lo, 1),
            "hi_s": None if self.hi is None else round(self.hi, 1),
            "by_s": None if self.by is None else round(self.by, 1),
            "reclaims": self.reclaims,
            "basis": list(self.basis),
        }


def erlang_quantile(k: int, q: float) -> float:
    """The ``q`` quantile of the sum of ``k`` exponential waits of rate 1 (bisection on the
    Erlang CDF, in logs: stable for large ``k``)."""
    if k <= 0:
        return 0.0

    def cdf(x: float) -> float:
        if x <= 0:
            return 0.0
        # P(T <= x) = 1 - sum_{n<k} e^-x x^n / n!
        logs = [-x + n * math.log(x) - math.lgamma(n + 1) for n in range(k)]
        top = max(logs)
        tail = math.exp(top) * sum(math.exp(v - top) for v in logs)
        return max(0.0, 1.0 - tail)

    lo, hi = 0.0, max(1.0, 2.0 * k + 10.0 * math.sqrt(k) + 10.0)
    while cdf(hi) < q:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if cdf(mid) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def estimate(
    request: float,
    gpu_type: str,
    now: float,
    releases: Sequence[Release],
    deadlines: Sequence[Deadline],
    window_s: float = 1800.0,
    ahead: float = 0.0,
    free: Mapping[str, float] | None = None,
) -> Eta:
    """When a start of ``request`` (per GPU) on ``gpu_type`` can expect to begin, seen at wall
    time ``now``, behind starts that take ``ahead`` of that type first; ``free``: each GPU's
    free compute now (per GPU of the type)."""
    kind = gpu_type.lower()
    free = dict(free or {})
    need = max(request + ahead - max(free.values(), default=0.0), 0.01)
    basis: list[str] = []
    # the deadline bound: the first time one GPU has room for this start and all ahead of it
    # (as if they all went there: an upper bound while the idle shares stay idle)
    by: float | None = None
    counted = 0
    per_gpu: dict[str, list[Deadline]] = {}
    for d in deadlines:
        if d.gpu_type.lower() == kind:
            per_gpu.setdefault(d.gpu, []).append(d)
    for gpu, due in per_gpu.items():
        room = free.get(gpu, 0.0)
        for n, d in enumerate(sorted(due, key=lambda d: d.at), 1):
            room += d.request
            if room + 1e-9 >= request + ahead:
                if by is None or d.at - now < by:
                    by, counted = max(0.0, d.at - now), n
                break
    if by is not None:
        basis.append(f"{counted} idle share{'s' if counted != 1 else ''} reclaimed by then")
    seen = [r for r in releases if r.gpu_type.lower() == kind and now - window_s <= r.at <= now]
    lo: float | None = None
    hi: float | None = None
    if len(seen) >= MIN_RELEASES:
        first = min(r.at for r in seen)
        span = max(now - first, window_s / 4)
        rate = len(seen) / span
        size = sum(r.request for r in seen) / len(seen)
        # the earliest: enough freed for this start alone (it may pass starts ahead of it
        # that do not fit yet); the latest: for every start ahead of it too
        alone = max(request - max(free.values(), default=0.0), 0.01)
        k_lo = max(1, math.ceil(alone / max(size, 0.01) - 1e-9))
        k_hi = max(1, math.ceil(need / max(size, 0.01) - 1e-9))
        lo = erlang_quantile(k_lo, LOW_QUANTILE) / rate / SPREAD
        hi = SPREAD * erlang_quantile(k_hi, HIGH_QUANTILE) / rate
        minutes = span / 60
        basis.append(f"{len(seen)} releases of {gpu_type} shares in the last {minutes:.0f} min")
    if by is not None and (hi is None or by < hi):
        hi = by  # the bound is sooner than the rate says
        lo = lo if lo is not None and lo < by else None
    return Eta(now=now, lo=lo, hi=hi, basis=tuple(basis), by=by, reclaims=counted if by else 0)
