"""Shared helpers of the placement tests (no tests here): small clusters, and an independent
checker of the placement rules (written from DESIGN box 4, not from the engine)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence

from jupyter_gpushare.inventory import GiB, Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import Placement, Policy
from jupyter_gpushare.share import ShareSpec

MEMORY = {"A100": 80 * GiB, "T4": 16 * GiB, "H100": 80 * GiB, "L4": 24 * GiB}
PRODUCT = {
    "A100": "NVIDIA A100-SXM4-80GB",
    "T4": "Tesla T4",
    "H100": "NVIDIA H100 80GB HBM3",
    "L4": "NVIDIA L4",
}
_ids = itertools.count()


def gpu(node: str, index: int, kind: str = "A100", **flags: bool) -> Gpu:
    return Gpu(
        node=node,
        uuid=f"GPU-{node}-{index}",
        index=index,
        name=PRODUCT[kind],
        type=kind,
        memory=MEMORY[kind],
        **flags,
    )


def cluster(*nodes: str) -> list[Gpu]:
    """``cluster("2xA100", "1xT4")``: node n0 with two A100s, node n1 with one T4."""
    gpus = []
    for n, layout in enumerate(nodes):
        index = 0
        for part in layout.split("+"):
            count, kind = part.split("x")
            for _ in range(int(count)):
                gpus.append(gpu(f"n{n}", index, kind))
                index += 1
    return gpus


def record(placement: Placement, spec: ShareSpec, gpus: Sequence[Gpu]) -> Allocation:
    """The allocation the ledger would record for ``placement`` (as Ledger.allocate does)."""
    kind = spec.gpu_type or next(g.type for g in gpus if g.uuid == placement.gpus[0])
    return Allocation(
        id=f"a-{next(_ids):016x}",
        node=placement.node,
        gpus=placement.gpus,
        spec=spec.with_changes(gpu_type=kind, gpu_memory=placement.memory),
        memory=placement.memory,
    )


def units(fraction: float) -> int:
    return max(1, round(fraction * 1_000_000))


def violations(
    gpus: Sequence[Gpu], allocations: Iterable[Allocation], affinity_rule: bool = True
) -> list[str]:
    """Every broken invariant of a set of live allocations (empty when all hold). Without
    ``affinity_rule``, groups spread over several GPUs are not reported (racing placers may
    leave one for the moment between recording and settling)."""
    by_uuid = {g.uuid: g for g in gpus}
    compute: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    exclusive: dict[str, set[str | None]] = defaultdict(set)
    affinity: dict[str, set[str]] = defaultdict(set)
    anti: dict[tuple[str, str], int] = defaultdict(int)
    problems = []
    for a in allocations:
        labels = a.spec.gpu_labels
        if any(by_uuid[u].node != a.node for u in a.gpus):
            problems.append(f"{a.id} lists a GPU of another node")
        for u in a.gpus:
            compute[u] += units(a.spec.gpu_request)
            memory[u] += a.memory
            exclusive[u].add(labels.exclusive)
            if labels.affinity:
                affinity[labels.affinity].add(u)
            if labels.anti_affinity:
                anti[(labels.anti_affinity, u)] += 1
    for u, used in compute.items():
        if used > 1_000_000:
            problems.append(f"{u} compute over-allocated: {used / 1e6}")
        if memory[u] > by_uuid[u].memory:
            problems.append(f"{u} memory over-allocated: {memory[u]} > {by_uuid[u].memory}")
        if len(exclusive[u]) > 1:
            problems.append(f"{u} mixes exclusive labels {exclusive[u]}")
    for label, where in affinity.items():
        if affinity_rule and len(where) > 1:
            problems.append(f"affinity {label} spread over {sorted(where)}")
    for (label, u), n in anti.items():
        if n > 1:
            problems.append(f"anti-affinity {label} twice on {u}")
    return problems


def valid_choices(
    gpus: Sequence[Gpu], allocations: Sequence[Allocation], spec: ShareSpec, policy: Policy
) -> list[tuple[str, ...]]:
    """Every placement that keeps all rules (single GPUs, or whole-GPU sets for gpu_count > 1),
    found by trying each one and checking the result with :func:`violations`."""
    allowed = {t.lower() for t in policy.gpu_types}
    wanted = spec.gpu_type.lower() if spec.gpu_type else None
    excluded = {t.lower() for t in policy.exclude_types}

    def eligible(g: Gpu) -> bool:
        return (
            g.healthy
            and not g.cordoned
            and g.node not in policy.cordoned_nodes
            and g.uuid not in policy.cordoned_gpus
            and g.type.lower() not in excluded
            and (not allowed or g.type.lower() in allowed)
            and (wanted is None or g.type.lower() == wanted)
        )

    def trial(choice: tuple[Gpu, ...]) -> bool:
        memory = min(spec.resolved_memory(g.memory) for g in choice)
        if any(spec.resolved_memory(g.memory) > g.memory for g in choice):
            return False
        a = Allocation(
            id="trial",
            node=choice[0].node,
            gpus=tuple(g.uuid for g in choice),
            spec=spec.with_changes(gpu_memory=memory),
            memory=memory,
        )
        return not violations(gpus, [*allocations, a])

    if spec.gpu_count == 1:
        return [(g.uuid,) for g in gpus if eligible(g) and trial((g,))]
    held = {u for a in allocations for u in a.gpus}
    choices = []
    by_node: dict[tuple[str, str], list[Gpu]] = defaultdict(list)
    for g in gpus:
        if eligible(g) and g.uuid not in held:
            by_node[(g.node, g.type)].append(g)
    for group in by_node.values():
        for choice in itertools.combinations(group, spec.gpu_count):
            if trial(choice):
                choices.append(tuple(g.uuid for g in choice))
    return choices
