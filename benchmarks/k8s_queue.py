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

``--day``: instead, ``benchmarks/fair_queue.py``'s simulated day (the same sessions of the same
seed: sizes, hold times, idle notebooks warned and released at their reclaim deadline) run
through the controller: ``--gpus`` simulated one-A100 nodes where the day's starts wait in the
controller's queue, and as many one-H100 nodes (the same size) where the same day's starts of
other users are refused and retried every ``--retry-min`` minutes (± a third), side by side in
one run on one API server. The nodes are Node objects and GpuLedgers only (no kubelet: a share
placed is the start; a kernel pod is not part of what is measured). The same figures as
``fair_queue.py``, for both ways; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

import fair_queue  # noqa: E402  (benchmarks/: the same day)
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


def one_gpu(node: str, kind: str) -> list[Gpu]:
    names = {"A100": "NVIDIA A100-SXM4-80GB", "H100": "NVIDIA H100 80GB HBM3"}
    return [replace(g, type=kind, name=names[kind]) for g in gpus_of(node)]


async def run_day(plane: ControlPlane, args: argparse.Namespace) -> dict[str, Any]:
    """``fair_queue.py``'s day through the controller: the queue on the A100 nodes, refusal
    and retry on the H100 nodes (other users), side by side."""
    sessions = fair_queue.day(args.users, args.hours, args.gpus, args.seed)
    minute_s = args.hour_s / 60
    kube = await connect(str(plane.kubeconfig("controller")))
    service = KernelService(
        kube,
        NAMESPACE,
        TypeAliases(),
        Policy(),
        Bounds({}, {}, None),
        ServerLeases(kube, NAMESPACE, 3600.0, "bench"),
        manifests.PodSettings(image="gpushare-bench:local"),
        NodeReports(),
    )
    await service.start(60)
    policy = QueuePolicy(
        max_per_user=100,
        hold_s=args.hold_min * minute_s,
        eta_window_s=args.eta_window_min * minute_s,
    )
    queue = ControllerQueue(service, policy, "bench")
    await queue.start()
    kinds = {"queue": "A100", "retry": "H100"}
    for way in kinds:  # each user's server Lease (an hour: the day never outlives it)
        for u in range(args.users):
            await service.servers.touch(HubUser(f"{way[0]}{u}"), f"srv-{way[0]}{u}", force=True)
    held: dict[str, list[tuple[float, float]]] = {way: [] for way in kinds}
    t0 = time.time() + 2.0
    give_up = args.give_up_min * minute_s
    slack = args.eta_slack_min * minute_s

    async def sample() -> None:
        while True:
            found = await service.ledger.list()
            for way, kind in kinds.items():
                total = sum(a.request * a.spec.gpu_count for a in found if a.spec.gpu_type == kind)
                held[way].append((time.time(), total))
            await asyncio.sleep(0.1)

    async def one(way: str, s: fair_queue.Session) -> dict[str, Any]:
        user = HubUser(f"{way[0]}{s.user}")
        rng = random.Random(f"{args.seed} {s.user} {s.arrive_h}")
        await asyncio.sleep(max(0.0, t0 + s.arrive_h * args.hour_s - time.time()))
        asked = time.time()
        share = {"gpu_request": s.request, "gpu_limit": s.request, "gpu_type": kinds[way]}
        start: dict[str, Any] = {
            "kernel_id": "k" + uuid.uuid4().hex[:11],
            "server_id": f"srv-{user.name}",
            "share": share,
        }
        made: str | None = None
        entry: str | None = None
        ended = ""
        tries = 0
        shown: dict[str, Any] | None = None
        if way == "queue":
            answer = await queue.reserve(user, start)
            if "allocation" in answer:
                made = str(answer["allocation"]["id"])
            else:
                view = answer["entry"]
                entry = str(view["id"])
                while True:
                    eta = view.get("eta") or {}
                    if shown is None and eta.get("hi_s") is not None:
                        shown = eta  # the first range this start was shown
                    if view["state"] != "waiting":
                        break
                    left = asked + give_up - time.time()
                    if left <= 0:
                        view = await queue.cancel(user, entry)
                        if view["state"] == "waiting":
                            continue
                        break
                    view = await queue.wait(user, entry, min(left, 5.0))
                ended = str(view["state"])
                if ended == "started":
                    made = str((view.get("allocation") or {})["id"])
        else:
            while True:
                tries += 1
                try:
                    made = (await service.reserve(user, start)).id
                    break
                except PlacementRefused:
                    pause = args.retry_min * minute_s * rng.uniform(2 / 3, 4 / 3)
                    if time.time() + pause - asked > give_up:
                        break
                    await asyncio.sleep(pause)
        began = time.time()
        out: dict[str, Any] = {
            "user": s.user,
            "request": s.request,
            "wait_min": (began - asked) / minute_s,
            "started": made is not None,
            "tries": tries,
            "queued": entry is not None,
            "ended": ended,
            "entry": entry if made else None,
            "allocation": made,
        }
        if shown is not None and made is not None:
            at = began - float(shown["computed_at"])
            lo, hi = float(shown["lo_s"] or 0.0), float(shown["hi_s"])
            out["eta"] = "early" if at < lo - slack else "late" if at > hi + slack else "inside"
            out["eta_range_min"] = [round(lo / minute_s, 1), round(hi / minute_s, 1)]
            out["eta_at_min"] = round(at / minute_s, 1)
        if made is None:
            return out
        hold = s.hold_min * minute_s
        if s.idle:  # works for half its time, then idle: warned, released at the deadline
            await asyncio.sleep(hold / 2)
            now = time.time()
            warning = {
                "warned_at": now,
                "release_at": now + args.grace_min * minute_s,
                "idle_s": 0,
                "message": "idle",
            }

            def warn(a: Any, _others: Any) -> Any:
                return replace(a, extra={**a.extra, "reclaim_warning": warning})

            await service.ledger.update(made, warn)
            await asyncio.sleep(args.grace_min * minute_s)
        else:
            await asyncio.sleep(hold)
        await service.ledger.release(made)
        return out

    sampler = asyncio.create_task(sample())
    results: dict[str, list[dict[str, Any]]] = {}
    failures: list[str] = []
    for way in kinds:
        results[way] = []
    done = await asyncio.gather(
        *(one(way, s) for way in kinds for s in sessions), return_exceptions=True
    )
    for (way, _s), r in zip([(w, s) for w in kinds for s in sessions], done, strict=True):
        if isinstance(r, BaseException):
            failures.append(f"{way}: {type(r).__name__}: {r}")
        else:
            results[way].append(r)
    sampler.cancel()
    figures = queue.figures()
    left = await service.ledger.list()
    await queue.stop()
    await service.stop()
    await kube.close()
    busy_from, busy_to = t0 + 0.15 * args.hours * args.hour_s, t0 + 0.85 * args.hours * args.hour_s
    out: dict[str, Any] = {"sessions": len(sessions), "users": args.users, "gpus": args.gpus}
    for way, rows in results.items():
        waits = [r["wait_min"] for r in rows]
        per_user: dict[int, list[float]] = {}
        for r in rows:
            per_user.setdefault(r["user"], []).append(r["wait_min"] / r["request"])
        samples = [v for t, v in held[way] if busy_from <= t <= busy_to]
        made = [r["allocation"] for r in rows if r["allocation"]]
        row: dict[str, Any] = {
            "wait_p50_min": round(fair_queue.percentile(waits, 0.5), 1),
            "wait_p95_min": round(fair_queue.percentile(waits, 0.95), 1),
            "gave_up": sum(not r["started"] for r in rows),
            "jain": round(fair_queue.jain([statistics.mean(v) for v in per_user.values()]), 3),
            "gpu_allocated": round(statistics.mean(samples) / args.gpus, 3) if samples else None,
            "lost": len(sessions) - len(rows),
            "doubled": len(made) - len(set(made)),
            "left_in_ledger": sum(a.spec.gpu_type == kinds[way] for a in left),
        }
        if way == "queue":
            judged = [r["eta"] for r in rows if "eta" in r]
            row["eta_inside"] = round(judged.count("inside") / len(judged), 3) if judged else None
            row["eta_shown"] = len(judged)
            row["eta_late"] = judged.count("late")
            row["eta_early"] = judged.count("early")
            widths = [
                r["eta_range_min"][1] / max(r["eta_at_min"], args.eta_slack_min)
                for r in rows
                if "eta" in r
            ]
            row["eta_hi_over_wait_p50"] = round(statistics.median(widths), 2) if widths else None
            row["queued"] = sum(r["queued"] for r in rows)
            # how the queued starts that did not start ended (cancelled: the user gave up)
            for state in ("cancelled", "dropped", "failed"):
                row[f"queued_{state}"] = sum(r["ended"] == state for r in rows)
            row["controller_eta_inside"] = figures["eta_inside"]
            row["controller_eta_shown"] = figures["eta_shown"]
            reactions = figures["reactions_s"]
            row["release_to_start_p99_real_s"] = (
                round(fair_queue.percentile(reactions, 0.99), 3) if reactions else None
            )
        else:
            row["tries"] = sum(r["tries"] for r in rows)
        out[way] = row
        print(f"{way:6s} " + "  ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr)
    if failures:
        out["failures"] = failures[:5]
        print("failures:", failures[:5], file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=40, help="releases per way")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes of one A100")
    parser.add_argument("--retry", type=float, default=1.0, help="the retrying client's period")
    parser.add_argument("--day", action="store_true", help="fair_queue.py's day instead")
    parser.add_argument("--hours", type=float, default=8.0, help="--day: simulated hours")
    parser.add_argument("--hour-s", type=float, default=9.0, help="--day: real s per hour")
    parser.add_argument("--users", type=int, default=8, help="--day: users per way")
    parser.add_argument("--gpus", type=int, default=6, help="--day: one-GPU nodes per way")
    parser.add_argument("--seed", type=int, default=1, help="--day: the day's seed")
    parser.add_argument("--retry-min", type=float, default=3.0, help="--day: retry period")
    parser.add_argument("--give-up-min", type=float, default=120.0)
    parser.add_argument("--grace-min", type=float, default=10.0)
    parser.add_argument("--hold-min", type=float, default=60.0, help="--day: the queue's hold")
    parser.add_argument("--eta-window-min", type=float, default=60.0)
    parser.add_argument("--eta-slack-min", type=float, default=0.5)
    args = parser.parse_args()
    if args.day:
        nodes = {f"simq-{n:02d}": one_gpu(f"simq-{n:02d}", "A100") for n in range(args.gpus)}
        nodes |= {f"simr-{n:02d}": one_gpu(f"simr-{n:02d}", "H100") for n in range(args.gpus)}
        with tempfile.TemporaryDirectory(prefix="gpushare-queue-") as tmp:
            plane = ControlPlane(Path(tmp))
            plane.start(components=False)
            try:
                apply_deploy(plane.kubeconfig("admin"))
                register_gpu_nodes(plane.kubeconfig("admin"), nodes)
                print(
                    f"the controller's day: seed {args.seed}, {args.gpus} nodes per way; "
                    f"load1 {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                )
                day_result = asyncio.run(run_day(plane, args))
            finally:
                plane.stop()
        day_result["load1_after"] = round(os.getloadavg()[0], 2)
        print(json.dumps(day_result))
        return
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
