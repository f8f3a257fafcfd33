"""Concurrent placers against the API-server ledger, with an auditor that checks every version.

Used by ``tests/k8s/test_ledger.py`` (small) and ``benchmarks/k8s_start.py`` (16 x 1,000).

Each placer (an asyncio task with its own API client) makes ``requests`` requests: reserve a
random share with ``Ledger.allocate`` (place on a snapshot, compare-and-swap on the node's
``resourceVersion``, retry on conflict), and release one of its holdings about half the time.
The auditor watches every GpuLedger version the API server publishes and counts any GPU whose
requests sum above 1 or whose memory caps sum above its memory: an over-allocation.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.k8s.client import ApiException, Kube, connect
from jupyter_gpushare.k8s.ledger import KubernetesLedger
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import PlacementRefused, place
from jupyter_gpushare.share import ShareSpec

GiB = 2**30
REQUESTS = (0.1, 0.2, 0.25, 0.3, 0.5)


def stress_inventory(nodes: int = 4, gpus_per_node: int = 2) -> list[Gpu]:
    return [
        Gpu(
            node=f"stress-{n}",
            uuid=f"GPU-stress-{n}-{i}",
            index=i,
            name="NVIDIA A100",
            type="A100",
            memory=40 * GiB,
        )
        for n in range(nodes)
        for i in range(gpus_per_node)
    ]


@dataclass
class StressResult:
    placers: int
    requests: int
    allocated: int = 0
    refused: int = 0
    released: int = 0
    conflicts: int = 0
    seconds: float = 0.0
    versions_audited: int = 0
    over_allocations: int = 0
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies) or [0.0]
        return {
            "placers": self.placers,
            "requests_per_placer": self.requests,
            "allocated": self.allocated,
            "refused": self.refused,
            "released": self.released,
            "cas_conflicts": self.conflicts,
            "seconds": round(self.seconds, 2),
            "allocations_per_s": round(self.allocated / self.seconds, 1) if self.seconds else 0,
            "allocate_p50_ms": round(1000 * lat[len(lat) // 2], 2),
            "allocate_p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2),
            "versions_audited": self.versions_audited,
            "over_allocations": self.over_allocations,
        }


class CountingLedger(KubernetesLedger):
    """Counts lost compare-and-swaps (for the report; the logic is the ledger's own)."""

    conflicts = 0

    async def compare_and_swap(self, node: str, expected_version: int, allocations: Any) -> bool:
        ok = await super().compare_and_swap(node, expected_version, allocations)
        if not ok:
            CountingLedger.conflicts += 1
        return ok


def violations(obj: dict[str, Any], memory: dict[str, int]) -> int:
    compute: dict[str, float] = {}
    used: dict[str, int] = {}
    for record in (obj.get("spec") or {}).get("allocations") or []:
        a = Allocation.from_json(record)
        for g in a.gpus:
            compute[g] = compute.get(g, 0.0) + a.request
            used[g] = used.get(g, 0) + a.memory
    return sum(1 for g, c in compute.items() if c > 1.0 + 1e-9) + sum(
        1 for g, m in used.items() if m > memory.get(g, 0)
    )


async def audit(
    kube: Kube,
    namespace: str,
    memory: dict[str, int],
    result: StressResult,
    ready: asyncio.Event,
    stop: asyncio.Event,
) -> None:
    listing = await kube.list_ledgers(namespace)
    for obj in listing.get("items") or []:
        result.over_allocations += violations(obj, memory)
    version = listing["metadata"]["resourceVersion"]
    ready.set()
    while not stop.is_set():
        try:
            async for event in kube.watch("gpuledgers", namespace, version, timeout_seconds=30):
                obj = event["object"]
                version = obj["metadata"].get("resourceVersion", version)
                if event["type"] in ("ADDED", "MODIFIED"):
                    result.versions_audited += 1
                    result.over_allocations += violations(obj, memory)
                if stop.is_set():
                    return
        except ApiException as exc:
            if exc.status == 410:  # fell behind the watch window: the test would be blind
                raise RuntimeError("auditor lost versions (410 Gone)") from exc
            raise


async def placer(
    kubeconfig: str,
    namespace: str,
    inventory: list[Gpu],
    requests: int,
    result: StressResult,
    seed: int,
) -> None:
    rng = random.Random(seed)
    kube = await connect(kubeconfig)
    ledger = CountingLedger(kube, namespace)
    held: list[str] = []
    try:
        for _ in range(requests):
            spec = ShareSpec(
                gpu_request=rng.choice(REQUESTS),
                gpu_limit=1.0,
                gpu_memory=rng.choice((None, 4 * GiB, 10 * GiB)),
            )
            start = time.perf_counter()
            try:
                allocation = await ledger.allocate(
                    spec,
                    inventory,
                    place,
                    owner="run",
                    kernel_id=uuid.uuid4().hex,
                    backend="kubernetes",
                    extra={"k8s_server": "stress"},
                )
                result.latencies.append(time.perf_counter() - start)
                result.allocated += 1
                held.append(allocation.id)
            except PlacementRefused:
                result.refused += 1
            if held and (rng.random() < 0.5 or len(held) > 4):
                victim = held.pop(rng.randrange(len(held)))
                if await ledger.release(victim) is not None:
                    result.released += 1
        for victim in held:
            if await ledger.release(victim) is not None:
                result.released += 1
    finally:
        await kube.close()


async def run_stress(
    kubeconfig: str, namespace: str, placers: int, requests: int, inventory: list[Gpu] | None = None
) -> StressResult:
    inventory = inventory or stress_inventory()
    result = StressResult(placers, requests)
    CountingLedger.conflicts = 0
    memory = {g.uuid: g.memory for g in inventory}
    kube = await connect(kubeconfig)
    ready, stop = asyncio.Event(), asyncio.Event()
    auditor = asyncio.create_task(audit(kube, namespace, memory, result, ready, stop))
    await ready.wait()
    start = time.perf_counter()
    try:
        await asyncio.gather(
            *[
                placer(kubeconfig, namespace, inventory, requests, result, seed)
                for seed in range(placers)
            ]
        )
        result.seconds = time.perf_counter() - start
        await asyncio.sleep(1.0)  # let the auditor see the last versions
    finally:
        stop.set()
        auditor.cancel()
        try:
            await auditor
        except asyncio.CancelledError:
            pass
        await kube.close()
    result.conflicts = CountingLedger.conflicts
    return result
