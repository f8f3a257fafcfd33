"""The order of waiting starts: dominant-share fairness between users, then arrival. Pure.

A user's *dominant share* is the larger of the fractions they hold of the machine's compute (the
sum of their requests over the number of GPUs) and of its memory (their caps over all the GPUs'
memory), divided by their group's weight. A waiting start without a memory cap (``memory`` 0:
its request's fraction of the GPU it gets) counts that fraction of a mean GPU's memory, as its
share will once placed. Waiting starts are ordered by progressive filling
(dominant resource fairness): the next start is the oldest waiting one of the user whose
dominant share is lowest counting what the starts already ahead of it will give them, so one
user's ten queued kernels do not go ahead of another user's one. An admin's group priority
comes first (a higher priority always goes ahead: a course over ad-hoc use), arrival last.

Backfill: a start further down may begin while one ahead of it does not fit (a smaller share
fits where a larger does not); once the one ahead has waited ``hold_s`` it holds the GPUs it
waits for (:class:`Pass`): later starts go elsewhere, so a large share is not starved by a
stream of small ones, and the other GPUs stay in use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: ``gpu_type`` of a start that takes any type
ANY = "*"


@dataclass(frozen=True)
class Entry:
    """One waiting start, as the order sees it: who, how much per GPU, since when."""

    id: str
    user: str
    request: float
    memory: int
    count: int = 1
    gpu_type: str | None = None
    since: float = 0.0
    priority: int = 0
    weight: float = 1.0

    @property
    def compute(self) -> float:
        return self.request * self.count

    @property
    def total_memory(self) -> int:
        return self.memory * self.count

    @property
    def kind(self) -> str:
        return (self.gpu_type or ANY).lower()


@dataclass(frozen=True)
class QueuePolicy:
    """An admin's rules for the queue (the agent's ``--queue-*`` options)."""

    #: group name -> weight (a user's dominant share is divided by their largest weight)
    weights: Mapping[str, float] = field(default_factory=dict)
    #: group name -> priority (higher first; a user has their groups' highest)
    priorities: Mapping[str, int] = field(default_factory=dict)
    #: starts one user may have waiting at once
    max_per_user: int = 8
    #: how long a start may be passed by later ones of its type that fit before it (s)
    hold_s: float = 300.0
    #: how far back the ETA looks for releases (s)
    eta_window_s: float = 1800.0

    def weight_of(self, groups: Iterable[str]) -> float:
        found = [self.weights[g] for g in groups if g in self.weights]
        return max(found) if found else 1.0

    def priority_of(self, groups: Iterable[str]) -> int:
        found = [self.priorities[g] for g in groups if g in self.priorities]
        return max(found) if found else 0


def dominant_share(compute: float, memory: float, gpus: float, total_memory: float) -> float:
    """The larger of ``compute`` over ``gpus`` and ``memory`` over ``total_memory`` (0 where a
    total is 0)."""
    parts = [compute / gpus if gpus > 0 else 0.0, memory / total_memory if total_memory else 0.0]
    return max(parts)


def fair_order(
    entries: Sequence[Entry],
    held: Mapping[str, tuple[float, float]],
    gpus: float,
    total_memory: float,
) -> list[Entry]:
    """``entries`` in the order they get capacity. ``held``: per user, the compute (in GPUs)
    and memory (bytes) they hold now; ``gpus`` and ``total_memory``: the machine's."""
    per_gpu_memory = total_memory / gpus if gpus > 0 else 0.0

    def memory_of(e: Entry) -> float:
        return float(e.total_memory) if e.memory else e.compute * per_gpu_memory

    per_user: dict[str, list[Entry]] = {}
    for e in sorted(entries, key=lambda e: (e.since, e.id)):
        per_user.setdefault(e.user, []).append(e)
    compute = {u: float(held.get(u, (0.0, 0.0))[0]) for u in per_user}
    memory = {u: float(held.get(u, (0.0, 0.0))[1]) for u in per_user}
    out: list[Entry] = []
    while per_user:

        def key(user: str) -> tuple[int, float, float, str]:
            head = per_user[user][0]
            share = dominant_share(compute[user], memory[user], gpus, total_memory)
            return (-head.priority, share / max(head.weight, 1e-9), head.since, head.id)

        user = min(per_user, key=key)
        head = per_user[user].pop(0)
        if not per_user[user]:
            del per_user[user]
        compute[user] += head.compute
        memory[user] += memory_of(head)
        out.append(head)
    return out


class Pass:
    """One pass over the ordered entries (the agent tries each in turn). An entry that did not
    fit and has waited ``hold_s`` or more holds the GPUs it is waiting for (the emptiest of its
    type, as many as it needs): later entries in this pass are placed elsewhere, so those GPUs
    drain until it fits, while the others stay in use (backfill)."""

    def __init__(self, now: float, hold_s: float) -> None:
        self.now = now
        self.hold_s = hold_s
        #: GPUs held for starts that waited past the hold
        self.held: set[str] = set()
        #: users one of whose starts holds GPUs in this pass (one start per user holds)
        self.holders: set[str] = set()

    def missed(self, entry: Entry, emptiest: Sequence[str]) -> None:
        """``entry`` was tried and did not fit; ``emptiest``: the GPUs it could use, the one
        with most room first. One start per user holds GPUs, so nobody drains the machine for
        themselves by queueing many large starts."""
        if self.now - entry.since < self.hold_s or entry.user in self.holders:
            return
        free = [g for g in emptiest if g not in self.held]
        self.held.update(free[: max(1, entry.count)])
        self.holders.add(entry.user)
