"""The controller's queue on the real API server (issue 27): release -> queued start latency.

The real API server (etcd + kube-apiserver as ``tests/k8s/cluster.py`` starts them, no
scheduler) with ``--nodes`` simulated Nodes of one A100 each, all full. The controller's service
(:class:`~jupyter_gpushare.controller.kernels.KernelService`, its informers) and its queue
(:class:`~jupyter_gpushare.controller.queue.ControllerQueue`, the GpuQueue object) run in this
process with the controller's service account. Per cycle one holder's share is released while a
start of 0.5 waits for it, two ways, alternating (side by side, so load hits both):

- ``queue``: the start waits in the controller's queue (``ControllerQueue.reserve``) and is
  started by the controller's runner, woken by the GpuLedger watch;
- ``retry``: refusal and retry, what a client without a queue does: the start is refused
  (``no_fit``) and asked again every ``--retry`` seconds (1 s).

Measured on one watch of the GpuLedgers from a separate client: from the event that shows the
holder's share gone to the event that shows the waiting start's share recorded. Reported: p50,
p99 and max per way, and ``retry_over_queue_p50``. Every start is checked: one share per start.

Run: ``python benchmarks/k8s_queue.py`` (about a minute; ``--cycles 40`` per way). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from cluster import NAMESPACE, ControlPlane, apply_deploy, register_gpu_nodes  # noqa: E402

from jupyter_gpushare.controller.auth import HubUser  # noqa: E402
from jupyter_gpushare.controller.bounds import Bounds  # noqa: E402
from jupyter_gpushare.controller.kernels import KernelService  # noqa: E402
from jupyter_gpushare.controller.queue import ControllerQueue  # noqa: E402
from jupyter_gpushare.controller.servers import ServerLeases  # noqa: E402
from jupyter_gpushare.controller.usage import NodeReports  # noqa: E402
from jupyter_gpushare.inventory import GiB, Gpu, TypeAliases  # noqa: E402
from jupyter_gpushare.k8s import manifests  # noqa: E402
from jupyter_gpushare.k8s.client import connect  # noqa: E402
from jupyter_gpushare.placement import PlacementRefused, Policy  # noqa: E402
from jupyter_gpushare.queue import QueuePolicy  # noqa: E402

HALF = {"gpu_request": 0.5, "gpu_limit": 0.5, "gpu_type": "A100"}


def gpus_of(node: str) -> list[Gpu]:
    return [
        Gpu(
            node=node,
            uuid=f"GPU-{node}-0",
            index=0,
            name="NVIDIA A100-SXM4-80GB",
            type="A100",
            memory=80 * GiB,
            simulated=True,
        )
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(plane: ControlPlane, args: argparse.Namespace) -> dict[str, Any]:
    kube = await connect(str(plane.kubeconfig("controller")))
    watcher = await connect(str(plane.kubeconfig("admin")))
    service = KernelService(
        kube,
        NAMESPACE,
        TypeAliases(),
        Policy(),
        Bounds({}, {}, None),
        ServerLeases(kube, NAMESPACE, 600.0, "bench"),
        manifests.PodSettings(image="gpushare-bench:local"),
        NodeReports(),
    )
    await service.start(60)
    queue = ControllerQueue(service, QueuePolicy(max_per_user=1000), "bench")
    await queue.start()
    events: list[tuple[float, dict[str, Any]]] = []
    listing = await watcher.list_ledgers(NAMESPACE)

    async def follow() -> None:
        version = listing["metadata"]["resourceVersion"]
        async for event in watcher.watch("gpuledgers", NAMESPACE, version, timeout_seconds=3600):
            events.append((time.monotonic(), event))

    watch = asyncio.create_task(follow())
    holder, waiter = HubUser("holder"), HubUser("waiter")
    rng = random.Random(27)

    def body(share: dict[str, Any], server: str = "srv-waiter") -> dict[str, Any]:
        return {"kernel_id": "k" + uuid.uuid4().hex[:11], "server_id": server, "share": share}

    def holds(event: dict[str, Any], aid: str) -> bool:
        found = (event["object"].get("spec") or {}).get("allocations") or []
        return event["type"] != "DELETED" and any(a["id"] == aid for a in found)

    async def settle(done: Any, since: int, timeout: float = 30.0) -> float:
        """When the watch first showed ``done`` after event number ``since``."""
        deadline = time.monotonic() + timeout
        while True:
            for at, event in events[since:]:
                if done(event):
                    return at
            if time.monotonic() > deadline:
                raise TimeoutError("the watch never showed it")
            await asyncio.sleep(0.005)

    async def wait_for_start(kernel_id: str) -> str:
        """The share the queue's runner started the waiting start with."""
        while True:
            for r in queue.records.values():
                if r.kernel_id == kernel_id and r.state == "started":
                    return str((r.allocation or {})["id"])
            await asyncio.sleep(0.005)

    async def retry(start: dict[str, Any], stop: asyncio.Event) -> str:
        """Refusal and retry: ask again every ``--retry`` seconds until it fits."""
        while not stop.is_set():
            await asyncio.sleep(args.retry)
            try:
                return (await service.reserve(waiter, start)).id
            except PlacementRefused:
                continue
        return ""

    full = {"gpu_request": 1.0, "gpu_limit": 1.0, "gpu_type": "A100"}
    holders = [await service.reserve(holder, body(full, "srv-holder")) for _ in range(args.nodes)]
    out: dict[str, list[float]] = {"queue": [], "retry": []}
    twice = 0
    for cycle in range(2 * args.cycles):
        way = "queue" if cycle % 2 == 0 else "retry"
        victim = holders.pop(0)
        start = body(HALF)
        stop = asyncio.Event()
        if way == "queue":
            answer = await queue.reserve(waiter, start)
            assert "entry" in answer, answer
            task = asyncio.create_task(wait_for_start(start["kernel_id"]))
        else:
            try:
                await service.reserve(waiter, start)
                raise AssertionError("the start fit: the cluster was not full")
            except PlacementRefused:
                pass
            task = asyncio.create_task(retry(start, stop))
        await asyncio.sleep(rng.uniform(0.2, 0.2 + args.retry))  # any phase of the retries
        mark = len(events)
        await service.ledger.release(victim.id)
        started = await asyncio.wait_for(task, 30)
        stop.set()
        released = await settle(
            lambda e, v=victim: e["object"]["spec"]["node"] == v.node and not holds(e, v.id), mark
        )
        placed = await settle(lambda e, s=started: holds(e, s), mark)
        out[way].append(placed - released)
        mine = [a for a in await service.ledger.list() if a.kernel_id == start["kernel_id"]]
        twice += len(mine) != 1
        for a in mine:  # the node full again: the holder's whole GPU back where it was
            await service.ledger.release(a.id)
        holders.append(await service.reserve(holder, body(full, "srv-holder")))
    watch.cancel()
    await queue.stop()
    await service.stop()
    await kube.close()
    await watcher.close()
    result: dict[str, Any] = {"cycles_per_way": args.cycles, "retry_s": args.retry}
    for way, values in out.items():
        result[f"{way}_p50_ms"] = round(statistics.median(values) * 1000, 1)
        result[f"{way}_p99_ms"] = round(percentile(values, 0.99) * 1000, 1)
        result[f"{way}_max_ms"] = round(max(values) * 1000, 1)
    result["retry_over_queue_p50"] = round(result["retry_p50_ms"] / result["queue_p50_ms"], 1)
    result["starts_not_exactly_once"] = twice
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=40, help="releases per way")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes of one A100")
    parser.add_argument("--retry", type=float, default=1.0, help="the retrying client's period")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpushare-queue-") as tmp:
        plane = ControlPlane(Path(tmp))
        plane.start(components=False)
        try:
            apply_deploy(plane.kubeconfig("admin"))
            register_gpu_nodes(
                plane.kubeconfig("admin"),
                {f"sim-{n:02d}": gpus_of(f"sim-{n:02d}") for n in range(args.nodes)},
            )
            result = asyncio.run(run(plane, args))
        finally:
            plane.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
