"""Placement speed on a big cluster: the indexed engine next to a naive full-scan placer.

The cluster: 1,000 nodes x 8 GPUs (A100, H100 and T4 nodes) holding 10,000 live allocations put
at random where they fit (fragmented, the hard case for binpack), some with affinity,
anti-affinity and exclusive labels, some whole-GPU pairs. For each policy the same mixed stream of
requests (plain fractions, typed, labelled, whole GPUs) is placed with churn: every placement is
recorded and one random live allocation is released, so the cluster stays at 10,000.

Timed per request: ``Placer.place`` (the engine, index kept current with ``add``/``remove``),
``naive_place`` (recompute every GPU's usage from every allocation, score every GPU);
then ``place()`` as ``Ledger.allocate`` calls it, on a fresh snapshot of new objects (it reuses
the thread's index and syncs it), building the index from scratch, ``Placer.sync`` alone, and the
refusal path (with its explanation).

Run: ``python benchmarks/placement.py`` (about a minute); ``--quick`` for a smaller run.
Times are wall clock (``*_ms``) and, for the engine, CPU time of the placing thread
(``*_cpu_*_ms``), which a loaded machine does not inflate. Python's garbage collector stays on.
Ends with one JSON line; times are in keys ending ``_ms``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_gpushare.inventory import GiB, Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import Placement, PlacementRefused, Placer, Policy, place
from jupyter_gpushare.placement.naive import naive_place
from jupyter_gpushare.share import GpuLabels, ShareSpec

POLICIES = {
    "binpack": Policy(node="binpack", gpu="binpack"),
    "spread": Policy(node="spread", gpu="spread"),
    "binpack_spread": Policy(node="binpack", gpu="spread"),
    "spread_binpack": Policy(node="spread", gpu="binpack"),
}
PRODUCTS = {
    "A100": ("NVIDIA A100-SXM4-80GB", 80 * GiB),
    "H100": ("NVIDIA H100 80GB HBM3", 80 * GiB),
    "T4": ("Tesla T4", 16 * GiB),
}
FRACTIONS = (0.1, 0.125, 0.2, 0.25, 0.25, 0.3, 0.5)


def build_cluster(nodes: int, per_node: int, rng: random.Random) -> list[Gpu]:
    gpus = []
    for n in range(nodes):
        kind = rng.choices(("A100", "H100", "T4"), weights=(6, 1, 3))[0]
        name, memory = PRODUCTS[kind]
        for i in range(per_node):
            gpus.append(
                Gpu(
                    node=f"node-{n:04d}",
                    uuid=f"GPU-{n:04d}-{i}",
                    index=i,
                    name=name,
                    type=kind,
                    memory=memory,
                    healthy=rng.random() > 0.002,
                    cordoned=rng.random() < 0.002,
                )
            )
    return gpus


def request(rng: random.Random) -> ShareSpec:
    """One request of the mixed stream."""
    roll = rng.random()
    fraction = rng.choice(FRACTIONS)
    if roll < 0.05:
        return ShareSpec(1.0, 1.0, gpu_count=2, gpu_type=rng.choice(("A100", None)))
    if roll < 0.20:
        return ShareSpec(fraction, 1.0, gpu_type=rng.choice(("A100", "H100", "T4")))
    if roll < 0.30:
        labels = rng.choice(
            (
                GpuLabels(affinity=f"team{rng.randrange(300)}"),
                GpuLabels(anti_affinity=f"replicas{rng.randrange(300)}"),
                GpuLabels(exclusive=f"tenant{rng.randrange(20)}"),
            )
        )
        return ShareSpec(fraction, 1.0, gpu_labels=labels)
    if roll < 0.35:
        return ShareSpec(fraction, 1.0, gpu_memory=rng.choice((2, 4, 8)) * GiB)
    return ShareSpec(fraction, min(1.0, fraction * 2))


def record(placement: Placement, spec: ShareSpec, serial: int) -> Allocation:
    return Allocation(
        id=f"a-{serial:016x}",
        node=placement.node,
        gpus=placement.gpus,
        spec=replace(spec, gpu_memory=placement.memory),
        memory=placement.memory,
        created=float(serial),
    )


def populate(gpus: list[Gpu], count: int, rng: random.Random) -> list[Allocation]:
    """``count`` allocations put on random GPUs where they fit (bypassing policies, so the
    cluster is fragmented), respecting every rule (checked through the engine's own fit test)."""
    placer = Placer(gpus)
    uuids = [g.uuid for g in gpus]
    allocations: list[Allocation] = []
    serial = 0
    while len(allocations) < count:
        spec = request(rng)
        if spec.gpu_count > 1 or spec.gpu_labels.affinity:
            try:  # whole GPUs and groups: where the engine puts them (spread, to scatter them)
                placement = placer.place(spec, POLICIES["spread"])
            except PlacementRefused:
                continue
        else:
            g = placer.gpus[rng.choice(uuids)]
            types = placer.type_filter(spec, placer.policy)
            if not placer.fits(g, spec, round(spec.gpu_request * 1e6), placer.policy, types):
                continue
            placement = Placement(g.node, (g.uuid,), spec.resolved_memory(g.gpu.memory))
        serial += 1
        allocation = record(placement, spec, serial)
        placer.add(allocation)
        allocations.append(allocation)
    return allocations


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    p99 = samples[min(len(samples) - 1, round(0.99 * (len(samples) - 1)))]
    return statistics.median(samples), p99


def timed(fn: Callable[[], object], cpu: list[float] | None = None) -> tuple[float, object]:
    """Wall-clock milliseconds of ``fn()`` (and its CPU milliseconds appended to ``cpu``)."""
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    try:
        result: object = fn()
    except PlacementRefused as refused:
        result = refused
    if cpu is not None:
        cpu.append((time.thread_time_ns() - start_cpu) / 1e6)
    return (time.perf_counter_ns() - start) / 1e6, result


def run_policy(
    name: str, gpus: list[Gpu], base: list[Allocation], args: argparse.Namespace
) -> dict[str, float]:
    policy = POLICIES[name]
    rng = random.Random(args.seed + 1)  # the same request stream for every policy
    live = {a.id: a for a in base}
    placer = Placer(gpus, base, policy)
    ours: list[float] = []
    ours_cpu: list[float] = []
    naive: list[float] = []
    refused = 0
    serial = 10**9
    naive_every = max(1, args.placements // args.naive_placements)
    for i in range(args.placements):
        spec = request(rng)
        took, result = timed(lambda spec=spec: placer.place(spec), ours_cpu)
        ours.append(took)
        if i % naive_every == 0:
            snapshot = list(live.values())
            took_naive, other = timed(
                lambda spec=spec, snapshot=snapshot: naive_place(gpus, snapshot, spec, policy)
            )
            naive.append(took_naive)
            same = (
                isinstance(result, PlacementRefused) and isinstance(other, PlacementRefused)
            ) or result == other
            assert same, f"engine and naive placer disagree on {spec}: {result} vs {other}"
        if isinstance(result, PlacementRefused):
            refused += 1
            continue
        serial += 1
        allocation = record(result, spec, serial)  # type: ignore[arg-type]
        placer.add(allocation)
        live[allocation.id] = allocation
        gone = rng.choice(list(live)) if len(live) > args.allocations else None
        if gone:
            placer.remove(gone)
            del live[gone]
    p50, p99 = percentiles(ours)
    c50, c99 = percentiles(ours_cpu)
    n50, n99 = percentiles(naive)
    return {
        f"{name}_p50_ms": round(p50, 4),
        f"{name}_p99_ms": round(p99, 4),
        f"{name}_cpu_p50_ms": round(c50, 4),
        f"{name}_cpu_p99_ms": round(c99, 4),
        f"{name}_naive_p50_ms": round(n50, 3),
        f"{name}_naive_p99_ms": round(n99, 3),
        f"{name}_speedup_p50": round(n50 / p50, 1),
        f"{name}_refused": refused,
    }


def run_cold(gpus: list[Gpu], base: list[Allocation], args: argparse.Namespace) -> dict[str, float]:
    """``place()`` as ``Ledger.allocate`` calls it (a fresh snapshot of new objects per call),
    building the index from scratch, ``Placer.sync``, and refusals."""
    rng = random.Random(args.seed + 2)
    builds = [timed(lambda: Placer(gpus, base))[0] for _ in range(max(3, args.cold // 4))]
    ledger_path = []
    syncs = []
    placer = Placer(gpus, base)
    place(gpus, base, request(rng))  # this thread's index for place(), as after a first call
    for k in range(args.cold):
        # What a ledger snapshot looks like: every allocation a new object, one released, one new
        snapshot = [replace(a) for a in base[k + 1 :]]
        snapshot += [replace(a, id=f"a-new{k:012d}") for a in base[: k + 1]]
        ledger_path.append(timed(lambda snapshot=snapshot: place(gpus, snapshot, request(rng)))[0])
        snapshot = [replace(a) for a in snapshot]
        syncs.append(timed(lambda snapshot=snapshot: placer.sync(snapshot))[0])
    # A request nothing can hold (a whole free node of 8 A100s: none left) explains itself.
    refusals = []
    for _ in range(args.cold):
        took, result = timed(
            lambda: placer.place(ShareSpec(1.0, 1.0, gpu_count=8, gpu_type="A100"))
        )
        refusals.append(took)
    figures: dict[str, float] = {}
    for key, samples in (
        ("index_build", builds),
        ("ledger_place", ledger_path),
        ("sync", syncs),
        ("refusal", refusals),
    ):
        p50, p99 = percentiles(samples)
        figures[f"{key}_p50_ms"], figures[f"{key}_p99_ms"] = round(p50, 2), round(p99, 2)
    figures["refusal_example"] = getattr(result, "message", str(result))  # type: ignore[assignment]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--allocations", type=int, default=10_000)
    parser.add_argument("--placements", type=int, default=2000, help="timed per policy")
    parser.add_argument("--naive-placements", type=int, default=40, help="naive, per policy")
    parser.add_argument("--cold", type=int, default=20, help="cold place() / sync samples")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="100 nodes, 1,000 allocations")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.allocations, args.placements, args.naive_placements = 100, 1000, 500, 20
    rng = random.Random(args.seed)
    gpus = build_cluster(args.nodes, args.gpus_per_node, rng)
    base = populate(gpus, args.allocations, rng)
    used = sum(a.spec.gpu_request * len(a.gpus) for a in base)
    print(
        f"cluster: {args.nodes} nodes x {args.gpus_per_node} GPUs = {len(gpus)} GPUs, "
        f"{len(base)} live allocations ({used:.0f} GPUs' worth of requests)"
    )
    print(
        f"{'policy':<16}{'ours p50':>10}{'ours p99':>10}{'cpu p99':>10}{'naive p50':>11}"
        f"{'naive p99':>11}{'ratio p50':>11}{'refused':>9}"
    )
    figures: dict[str, object] = {
        "nodes": args.nodes,
        "gpus": len(gpus),
        "allocations": len(base),
        "placements_per_policy": args.placements,
    }
    for name in POLICIES:
        row = run_policy(name, gpus, base, args)
        figures.update(row)
        print(
            f"{name:<16}{row[f'{name}_p50_ms']:>8.3f}ms{row[f'{name}_p99_ms']:>8.3f}ms"
            f"{row[f'{name}_cpu_p99_ms']:>8.3f}ms"
            f"{row[f'{name}_naive_p50_ms']:>9.1f}ms{row[f'{name}_naive_p99_ms']:>9.1f}ms"
            f"{row[f'{name}_speedup_p50']:>10.0f}x{row[f'{name}_refused']:>9}"
        )
    cold = run_cold(gpus, base, args)
    example = cold.pop("refusal_example")
    figures.update(cold)
    print(f"index build (1,000 nodes, 10,000 allocations): p50 {cold['index_build_p50_ms']} ms")
    print(
        f"place() on a fresh ledger snapshot (the Ledger.allocate path, index synced): p50 "
        f"{cold['ledger_place_p50_ms']} ms, p99 {cold['ledger_place_p99_ms']} ms "
        f"(naive: p50 {figures['binpack_naive_p50_ms']} ms)"
    )
    print(
        f"Placer.sync(fresh snapshot): p50 {cold['sync_p50_ms']} ms, p99 {cold['sync_p99_ms']} ms"
    )
    print(
        f"refusal with explanation: p50 {cold['refusal_p50_ms']} ms, "
        f"p99 {cold['refusal_p99_ms']} ms: {example}"
    )
    figures["worst_policy_p99_ms"] = max(figures[f"{n}_p99_ms"] for n in POLICIES)  # type: ignore[type-var]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
