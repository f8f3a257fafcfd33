"""The placement box's data: compute in integer units, a decision (:class:`Placement`), a
refusal (:class:`PlacementRefused`), and the per-GPU and per-node state the engine's index keeps
(:class:`GpuState`, :class:`NodeState`).

Both :mod:`.engine` (which decides) and :mod:`.explain` (which says why nothing fits) read these;
neither imports the other's internals through here, so the box has no import cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..daemon.wire import SLOTS
from ..errors import GpushareError
from ..inventory import Gpu
from .policy import Kind

if TYPE_CHECKING:
    from ..ledger import Allocation


#: Compute is counted in millionths of a GPU.
UNITS = 1_000_000

#: The most shares one GPU holds: its lease board has this many slots, one per share
#: (``wire.SLOTS``, the one place that number is set). A share past it could be recorded but
#: never enforced, so placement counts shares as it counts compute and memory.
MAX_SHARES_PER_GPU = SLOTS

#: ``Allocation.extra`` key set on an affinity group member once it has checked, after being
#: recorded, that no other settled member of its group is on another GPU (see :mod:`.concurrent`).
SETTLED = "affinity_settled"


def to_units(fraction: float) -> int:
    """A fraction of a GPU in integer millionths (at least 1 for any positive request)."""
    return max(1, round(fraction * UNITS))


def from_units(units: int) -> float:
    return round(units / UNITS, 6)


@dataclass(frozen=True)
class Placement:
    """Where a share goes: one node, its GPU UUIDs, and the memory cap in bytes per GPU."""

    node: str
    gpus: tuple[str, ...]
    memory: int


class PlacementRefused(GpushareError):
    """Nothing fits now. ``message`` says why in user terms; ``suggestions`` what would fit."""

    code = "no_fit"
    status = 409

    def __init__(self, message: str, suggestions: Sequence[str] = ()) -> None:
        self.suggestions = list(suggestions)
        super().__init__(message, suggestions=self.suggestions)


class GpuState:
    """One GPU and what its holders use (mutable; owned by a :class:`Placer`)."""

    __slots__ = (
        "exclusive",
        "free",
        "gpu",
        "holders",
        "index",
        "kind",
        "mem_free",
        "node",
        "type",
        "usable",
        "uuid",
    )

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.uuid = gpu.uuid
        self.node = gpu.node
        self.type = gpu.type
        self.kind: Kind = (gpu.type, gpu.name)
        self.index = gpu.index
        self.usable = gpu.healthy and not gpu.cordoned
        self.free = UNITS
        self.mem_free = gpu.memory
        self.holders: dict[str, Allocation] = {}
        #: exclusive label of each holder (None: not exclusive) -> how many holders carry it
        self.exclusive: dict[str | None, int] = {}

    def exclusive_ok(self, label: str | None) -> bool:
        """May a share with exclusive label ``label`` (None: none) join this GPU's holders?"""
        held = self.exclusive
        return not held or (len(held) == 1 and label in held)


class NodeState:
    __slots__ = ("best", "free", "gpus", "name", "whole")

    def __init__(self, name: str) -> None:
        self.name = name
        self.gpus: list[GpuState] = []
        self.free = 0  # free compute over usable GPUs
        self.best: dict[Kind, int] = {}  # kind -> most free compute on one usable GPU
        self.whole: dict[Kind, int] = {}  # kind -> usable GPUs with no holder

    def refresh(self) -> None:
        free = 0
        best: dict[Kind, int] = {}
        whole: dict[Kind, int] = {}
        for g in self.gpus:
            if not g.usable:
                continue
            free += g.free
            if g.free > best.get(g.kind, -1):
                best[g.kind] = g.free
            if not g.holders:
                whole[g.kind] = whole.get(g.kind, 0) + 1
        self.free, self.best, self.whole = free, best, whole
