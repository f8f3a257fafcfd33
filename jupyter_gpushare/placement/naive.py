"""The naive full-scan placer: the rules of :mod:`.engine` written as plainly as possible.

Every call recomputes every GPU's usage from every allocation and scores every GPU. It is the
baseline of ``benchmarks/placement.py`` and the reference the property tests hold the engine to
(same decision for the same input), so keep it obvious rather than fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..inventory import Gpu
from ..share import ShareSpec
from .engine import (
    UNITS,
    Placement,
    PlacementRefused,
    anchor_order,
    check_request,
    to_units,
)
from .policy import Policy, resolve_types
from .state import MAX_SHARES_PER_GPU

if TYPE_CHECKING:
    from ..ledger import Allocation


def naive_place(
    gpus: Sequence[Gpu],
    allocations: Sequence[Allocation],
    spec: ShareSpec,
    policy: Policy = Policy(),  # noqa: B008 - frozen
) -> Placement:
    types = resolve_types(spec, policy, {(g.type, g.name) for g in gpus})
    check_request(spec, types, gpus)
    used: dict[str, int] = {g.uuid: 0 for g in gpus}
    mem_used: dict[str, int] = {g.uuid: 0 for g in gpus}
    holders: dict[str, list[Allocation]] = {g.uuid: [] for g in gpus}
    for a in allocations:
        for uuid in set(a.gpus):
            if uuid in used:
                used[uuid] += to_units(a.spec.gpu_request)
                mem_used[uuid] += a.memory
                holders[uuid].append(a)

    def usable(g: Gpu) -> bool:
        return (
            g.healthy
            and not g.cordoned
            and g.uuid not in policy.cordoned_gpus
            and g.node not in policy.cordoned_nodes
            and types.admits((g.type, g.name))
        )

    node_free: dict[str, int] = {}
    for g in gpus:
        node_free.setdefault(g.node, 0)
        if g.healthy and not g.cordoned:
            node_free[g.node] += UNITS - used[g.uuid]

    def node_key(node: str) -> tuple[Any, ...]:
        return policy.node_order.node_key(node_free[node], node)

    if spec.gpu_count > 1:
        return _whole(gpus, holders, spec, policy, usable, node_key)

    labels = spec.gpu_labels
    request = to_units(spec.gpu_request)
    members = [
        a for a in allocations if labels.affinity and a.spec.gpu_labels.affinity == labels.affinity
    ]
    anchor = min(members, key=anchor_order).gpus[0] if members else None

    def fits(g: Gpu) -> bool:
        if not usable(g) or UNITS - used[g.uuid] < request:
            return False
        if len(holders[g.uuid]) >= MAX_SHARES_PER_GPU:
            return False
        if g.memory - mem_used[g.uuid] < spec.resolved_memory(g.memory):
            return False
        if anchor is not None and g.uuid != anchor:
            return False
        here = holders[g.uuid]
        if labels.anti_affinity and any(
            h.spec.gpu_labels.anti_affinity == labels.anti_affinity for h in here
        ):
            return False
        return all(h.spec.gpu_labels.exclusive == labels.exclusive for h in here)

    def gpu_key(g: Gpu) -> tuple[Any, ...]:
        return policy.gpu_order.gpu_key(UNITS - used[g.uuid], g.memory - mem_used[g.uuid], g.index)

    fitting = [g for g in gpus if fits(g)]
    if not fitting:
        raise PlacementRefused(f"no {types.label} has {spec.gpu_request:g} free")
    best = min(fitting, key=lambda g: (node_key(g.node), gpu_key(g)))
    return Placement(best.node, (best.uuid,), spec.resolved_memory(best.memory))


def _whole(
    gpus: Sequence[Gpu],
    holders: dict[str, list[Allocation]],
    spec: ShareSpec,
    policy: Policy,
    usable: Callable[[Gpu], bool],
    node_key: Callable[[str], tuple[Any, ...]],
) -> Placement:
    free: dict[tuple[str, str], list[Gpu]] = {}
    for g in sorted(gpus, key=lambda g: (g.index, g.uuid)):
        if usable(g) and not holders[g.uuid] and spec.resolved_memory(g.memory) <= g.memory:
            free.setdefault((g.node, g.type), []).append(g)
    options = [
        (node_key(node), gpu_type, found[: spec.gpu_count])
        for (node, gpu_type), found in free.items()
        if len(found) >= spec.gpu_count
    ]
    if not options:
        raise PlacementRefused(f"no node has {spec.gpu_count} whole GPUs free")
    _, _, chosen = min(options, key=lambda o: (o[0], o[1]))
    memory = min(spec.resolved_memory(g.memory) for g in chosen)
    return Placement(chosen[0].node, tuple(g.uuid for g in chosen), memory)
