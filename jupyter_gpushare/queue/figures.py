"""The queue's figures, kept the same way by the node agent's queue and the controller's. Pure.

:class:`QueueMetrics` counts what happened to the starts that waited (started, cancelled,
dropped, failed), how long the started ones waited, and how honest their first ETA was; its
:meth:`QueueMetrics.to_json` is the ``metrics`` object of ``GET /gpushare/api/queue`` and what
the Prometheus series of ``daemon/metrics.py`` (``QUEUE_METRICS``, ``QUEUE_HISTOGRAMS``) read,
on a node (the agent's metrics port) and on Kubernetes (the controller's ``/metrics``) alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .eta import Eta

#: the wait and ETA-error histograms' buckets (s)
BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, float("inf"))


@dataclass
class QueueMetrics:
    started: int = 0
    cancelled: int = 0
    dropped: int = 0
    failed: int = 0
    #: seconds waited by started entries (the histogram's observations, bounded)
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    #: started entries that were shown a range, and those that began inside it
    eta_shown: int = 0
    eta_inside: int = 0
    #: |start - nearest end of the first range| in seconds, for those outside it
    eta_errors: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    #: seconds from the write that freed capacity to the start (release -> start)
    reactions: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    #: cumulative histograms for Prometheus: bucket upper bound -> count, and the sums
    wait_buckets: dict[float, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    wait_sum: float = 0.0
    error_buckets: dict[float, int] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0))
    error_sum: float = 0.0

    def observe(self, buckets: dict[float, int], value: float) -> None:
        for bound in buckets:
            if value <= bound:
                buckets[bound] += 1

    def started_after(self, waited: float, first_eta: Mapping[str, Any] | None, now: float) -> None:
        """A waiting start began ``now`` after ``waited`` seconds; ``first_eta``: the first
        range it was shown (``Eta.to_json``), judged here."""
        self.started += 1
        self.waits.append(waited)
        self.observe(self.wait_buckets, waited)
        self.wait_sum += waited
        if first_eta is None or first_eta.get("hi_s") is None:
            return
        self.eta_shown += 1
        shown_at = float(first_eta["computed_at"])
        eta = Eta(shown_at, first_eta.get("lo_s"), first_eta["hi_s"], ())
        at = now - shown_at
        if eta.contains(at):
            self.eta_inside += 1
            return
        lo = float(first_eta.get("lo_s") or 0.0)
        error = lo - at if at < lo else at - float(first_eta["hi_s"])
        self.eta_errors.append(error)
        self.observe(self.error_buckets, error)
        self.error_sum += error

    def to_json(self, waiting: int) -> dict[str, Any]:
        return {
            "waiting": waiting,
            "started": self.started,
            "cancelled": self.cancelled,
            "dropped": self.dropped,
            "failed": self.failed,
            "eta_shown": self.eta_shown,
            "eta_inside": self.eta_inside,
            "waits_s": list(self.waits)[-256:],
            "eta_errors_s": list(self.eta_errors)[-256:],
            "reactions_s": list(self.reactions)[-256:],
            "wait_buckets": [[b, n] for b, n in self.wait_buckets.items()],
            "wait_sum_s": self.wait_sum,
            "eta_error_buckets": [[b, n] for b, n in self.error_buckets.items()],
            "eta_error_sum_s": self.error_sum,
        }
