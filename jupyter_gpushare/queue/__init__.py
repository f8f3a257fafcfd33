"""The queue (DESIGN box 13): where a start that does not fit waits instead of being refused.

Pure core, shared by every ledger owner (the node agent locally; the controller on Kubernetes):

- :mod:`.order`: who goes first. Dominant-share fairness between users over the compute and
  memory each holds (and has been handed in this pass), admins' group weights and priorities,
  then arrival; a start that has waited past the hold stops later ones of its type from
  jumping it (:class:`~.order.Pass`).
- :mod:`.eta`: when a waiting start can expect to begin, from what will free capacity: the
  reclaim deadlines of idle shares (an upper bound while they stay idle), the release rate
  observed on that GPU type; it says what it rests on and gives no range it did not compute.
- :mod:`.words`: position and ETA in the user's words ("3rd in line for 0.5 of an A100; expected
  within 4–12 min (2 idle shares are reclaimed by 14:32)").

The agent's shell (durable entries next to the ledger, starting entries when capacity frees) is
:mod:`jupyter_gpushare.daemon.queue_ops`.
"""

from __future__ import annotations

from .eta import Deadline, Eta, Release, estimate
from .order import Entry, Pass, QueuePolicy, dominant_share, fair_order
from .words import describe, ordinal

__all__ = [
    "Deadline",
    "Entry",
    "Eta",
    "Pass",
    "QueuePolicy",
    "Release",
    "describe",
    "dominant_share",
    "estimate",
    "fair_order",
    "ordinal",
]
