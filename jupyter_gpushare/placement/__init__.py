"""Placement: where a share goes (box 4 of DESIGN.md). A pure function over plain data.

Interface (stable; the engine behind it may grow):

``place(gpus, allocations, spec, policy=Policy()) -> Placement`` or raise :class:`PlacementRefused`
whose message explains the refusal in user terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..inventory import Gpu
from ..share import ShareSpec, format_bytes


@dataclass(frozen=True)
class Policy:
    node: str = "binpack"  # binpack | spread
    gpu: str = "binpack"  # binpack | spread


@dataclass(frozen=True)
class Placement:
    node: str
    gpus: tuple[str, ...]
    memory: int  # memory cap in bytes per GPU


class PlacementRefused(Exception):
    def __init__(self, message: str, suggestions: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.suggestions = list(suggestions)

    def to_json(self) -> dict[str, Any]:
        return {"error": "no_fit", "message": self.message, "suggestions": self.suggestions}


@dataclass
class _Free:
    gpu: Gpu
    compute: float = 1.0
    memory: int = 0
    holders: list[Any] = field(default_factory=list)


def place(
    gpus: Sequence[Gpu], allocations: Sequence[Any], spec: ShareSpec, policy: Policy = Policy()
) -> Placement:
    free = {g.uuid: _Free(g, 1.0, g.memory) for g in gpus}
    for a in allocations:
        for uuid in a.gpus:
            if uuid in free:
                free[uuid].compute -= a.spec.gpu_request
                free[uuid].memory -= a.memory
    kind = spec.gpu_type
    candidates = [
        f for f in free.values()
        if f.gpu.healthy and not f.gpu.cordoned and (kind is None or f.gpu.type == kind)
    ]
    fits = [
        f for f in candidates
        if f.compute + 1e-9 >= spec.gpu_request
        and f.memory >= spec.resolved_memory(f.gpu.memory)
    ]
    if not fits:
        what = kind or "GPU"
        most = max((f.compute for f in candidates), default=0.0)
        raise PlacementRefused(
            f"no {what} has {spec.gpu_request:g} free: {len(candidates)} {what}"
            f"{'s' if len(candidates) != 1 else ''}, most free {max(most, 0):g}"
        )
    best = min(fits, key=lambda f: (f.compute, f.gpu.node, f.gpu.index))
    return Placement(best.gpu.node, (best.gpu.uuid,), spec.resolved_memory(best.gpu.memory))


__all__ = ["Placement", "PlacementRefused", "Policy", "format_bytes", "place"]
