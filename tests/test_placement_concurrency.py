"""Placers racing through the real SQLite ledger: threads, asyncio tasks and processes.

Every snapshot a placer decided on, every refusal and the final state are checked with the
independent rule checker of ``test_placement_support``: compute and memory are never
over-allocated, anti-affinity and exclusive labels hold at every instant, the members of an affinity
group that were handed out are on one GPU at every instant (two placers may record a group on two
nodes for a moment; one of them gives way before returning), cordoned and unhealthy GPUs are
never chosen, and a refusal was given only when nothing valid existed in the snapshot it was
decided on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import PlacementRefused, Policy, allocate, place
from jupyter_gpushare.placement.concurrent import settle_affinity
from jupyter_gpushare.placement.engine import SETTLED
from jupyter_gpushare.share import GpuLabels, ShareError, ShareSpec

try:
    from test_placement_support import cluster, gpu, valid_choices, violations
except ImportError:  # tests/ became a package
    from tests.test_placement_support import cluster, gpu, valid_choices, violations

ROOT = Path(__file__).resolve().parents[1]
WORKERS = 4


class Recorder:
    """``place`` with a policy, remembering every decision and the snapshot it was made on."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.decisions: list[tuple[tuple[Allocation, ...], ShareSpec, object]] = []

    def __call__(self, gpus, allocations, spec):  # type: ignore[no-untyped-def]
        try:
            placement = place(gpus, allocations, spec, self.policy)
        except PlacementRefused:
            self.decisions.append((tuple(allocations), spec, None))
            raise
        self.decisions.append((tuple(allocations), spec, placement))
        return placement


class HandedOut:
    """The allocations placers handed out and did not release yet; an affinity group's are
    checked to be on one GPU each time one more is handed out (kernels may run on them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[str, Allocation] = {}

    def add(self, allocation: Allocation) -> None:
        label = allocation.spec.gpu_labels.affinity
        with self.lock:
            if label:
                where = {a.gpus for a in self.live.values() if a.spec.gpu_labels.affinity == label}
                assert where <= {allocation.gpus}, (
                    f"group {label} handed out on {where} and {allocation.gpus}"
                )
            self.live[allocation.id] = allocation

    def take(self, allocation: Allocation) -> None:
        with self.lock:
            del self.live[allocation.id]


async def worker(ledger, gpus, recorder: Recorder, plan, handed: HandedOut) -> None:  # type: ignore[no-untyped-def]
    mine: list[Allocation] = []
    for i, spec in enumerate(plan):
        try:
            allocation = await allocate(ledger, spec, gpus, place_fn=recorder)
            handed.add(allocation)
            mine.append(allocation)
        except (PlacementRefused, ShareError):
            pass
        if i % 3 == 2 and mine:
            gone = mine.pop(0)
            handed.take(gone)
            await ledger.release(gone.id)


def check_decisions(gpus: list[Gpu], recorder: Recorder) -> Counter[str]:
    """Check every recorded decision; returns how many of each kind there were."""
    seen: Counter[str] = Counter()
    for snapshot, spec, placement in recorder.decisions:
        assert not violations(gpus, snapshot, affinity_rule=False)
        if violations(gpus, snapshot):
            seen["decided during a race to start an affinity group"] += 1
            continue  # the group's members are about to settle; its anchor rule is the engine's
        choices = valid_choices(gpus, snapshot, spec, recorder.policy)
        if placement is None:
            seen["refused"] += 1
            assert choices == [], (spec, choices)
        else:
            seen["placed"] += 1
            assert placement.gpus in choices, (placement, choices)
    return seen


@st.composite
def racing_clusters(draw: st.DrawFn) -> list[Gpu]:
    gpus = []
    for n in range(draw(st.integers(1, 3))):
        for i in range(draw(st.integers(1, 3))):
            gpus.append(
                gpu(
                    f"n{n}",
                    i,
                    draw(st.sampled_from(("A100", "A100", "T4"))),
                    healthy=draw(st.sampled_from((True,) * 6 + (False,))),
                    cordoned=draw(st.sampled_from((False,) * 6 + (True,))),
                )
            )
    return gpus


@st.composite
def racing_specs(draw: st.DrawFn) -> ShareSpec:
    if draw(st.integers(0, 9)) == 0:
        return ShareSpec(1.0, 1.0, gpu_count=2)
    request = draw(st.sampled_from((0.1, 0.2, 0.25, 0.3, 0.5, 0.6, 0.75)))
    return ShareSpec(
        gpu_request=request,
        gpu_limit=1.0,
        gpu_type=draw(st.sampled_from((None, None, None, "A100", "T4"))),
        gpu_labels=GpuLabels(
            affinity=draw(st.sampled_from((None, None, None, "g"))),
            anti_affinity=draw(st.sampled_from((None, None, "r"))),
            exclusive=draw(st.sampled_from((None, None, None, "e"))),
        ),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=racing_clusters(),
    policy=st.builds(
        Policy,
        node=st.sampled_from(("binpack", "spread")),
        gpu=st.sampled_from(("binpack", "spread")),
    ),
    plan=st.lists(racing_specs(), min_size=WORKERS, max_size=32),
)
def test_threads_racing_through_the_ledger(gpus, policy, plan) -> None:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as tmp:
        ledger = SQLiteLedger(Path(tmp) / "ledger.sqlite")
        recorder = Recorder(policy)
        handed = HandedOut()
        errors: list[BaseException] = []

        def run(chunk) -> None:  # type: ignore[no-untyped-def]
            try:
                asyncio.run(worker(ledger, gpus, recorder, chunk, handed))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(plan[k::WORKERS],)) for k in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert not violations(gpus, ledger.snapshot_sync().allocations)
        for kind in check_decisions(gpus, recorder):
            event(kind)


def test_asyncio_tasks_racing_to_start_affinity_groups(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Many tasks start the same groups at once on a spread cluster, with unlabelled noise that
    makes their snapshots differ; every group ends on one GPU, nothing is over-allocated."""
    gpus = cluster("2xA100", "2xA100", "2xA100")
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    recorder = Recorder(Policy(node="spread", gpu="spread"))
    handed = HandedOut()

    async def one(spec: ShareSpec) -> Allocation | None:
        try:
            allocation = await allocate(ledger, spec, gpus, place_fn=recorder)
        except PlacementRefused:
            return None
        handed.add(allocation)
        return allocation

    async def go() -> list[Allocation | None]:
        specs = []
        for i in range(36):
            label = GpuLabels(affinity=f"g{i % 3}") if i % 2 else GpuLabels()
            specs.append(ShareSpec(0.1, 0.5, gpu_labels=label))
        return await asyncio.gather(*(one(s) for s in specs))

    results = asyncio.run(go())
    final = ledger.snapshot_sync().allocations
    assert not violations(gpus, final)
    used = Counter[str]()
    for a in final:
        used[a.gpus[0]] += a.request
    for group in ("g0", "g1", "g2"):
        members = [a for a in results if a is not None and a.spec.gpu_labels.affinity == group]
        assert members and len({a.gpus for a in members}) == 1  # one GPU per group
        # a member is refused only when its group's GPU has no room left: racing groups may
        # have started on the same GPU (each decided before seeing the other)
        assert len(members) == 6 or used[members[0].gpus[0]] > 1.0 - 0.1 + 1e-9, (group, used)
    assert check_decisions(gpus, recorder)["placed"] >= 36


def test_two_servers_start_one_group_on_two_nodes_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The race settling exists for, forced: two servers (one binpacks nodes, one spreads them)
    both decide where group "g" starts before either records it, so both record it, on different
    nodes. Both are handed out on one GPU."""
    gpus = cluster("1xA100", "1xA100")
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    asyncio.run(allocate(ledger, ShareSpec(0.25, 0.5), gpus))  # n0 is fuller than n1
    both_decided = threading.Barrier(2, timeout=30)
    spec = ShareSpec(0.25, 0.5, gpu_labels=GpuLabels(affinity="g"))
    results: dict[str, Allocation] = {}
    first_calls: list[tuple[str, ...]] = []

    def server(name: str, policy: Policy) -> None:
        recorder = Recorder(policy)

        def racing(gpus, allocations, spec):  # type: ignore[no-untyped-def]
            placement = recorder(gpus, allocations, spec)
            if len(recorder.decisions) == 1:
                first_calls.append(placement.gpus)
                both_decided.wait()
            return placement

        results[name] = asyncio.run(allocate(ledger, spec, gpus, place_fn=racing))

    threads = [
        threading.Thread(target=server, args=("packer", Policy(node="binpack"))),
        threading.Thread(target=server, args=("spreader", Policy(node="spread"))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(first_calls) == [("GPU-n0-0",), ("GPU-n1-0",)]  # the race did happen
    assert results["packer"].gpus == results["spreader"].gpus
    assert all(a.extra[SETTLED] for a in results.values())
    assert not violations(gpus, ledger.snapshot_sync().allocations)


def _member(n: int, node: str, created: float, settled: bool, request: float = 0.25) -> Allocation:
    spec = ShareSpec(request, request, gpu_labels=GpuLabels(affinity="g"))
    return Allocation(
        f"a-{n:016x}",
        node,
        (f"GPU-{node}-0",),
        spec,
        10,
        created=created,
        extra={SETTLED: True} if settled else {},
    )


def test_settling_gives_way_to_a_settled_member_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Of two members just recorded on two nodes, the first to settle keeps its GPU, whichever
    was created first; the other gives its place up."""
    gpus = cluster("1xA100", "1xA100")
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    earlier, later = _member(1, "n1", 1.0, False), _member(2, "n0", 2.0, False)
    assert ledger.compare_and_swap_sync("n1", 0, [earlier])
    assert ledger.compare_and_swap_sync("n0", 0, [later])
    kept = asyncio.run(settle_affinity(ledger, later))  # no *settled* rival yet: it stays
    assert kept is not None and kept.extra[SETTLED] and kept.gpus == ("GPU-n0-0",)
    assert asyncio.run(settle_affinity(ledger, earlier)) is None  # sees `later` settled: yields
    assert [a.id for a in ledger.snapshot_sync().allocations] == [later.id]
    # Placed again, the member goes to the settled member's GPU.
    again = asyncio.run(allocate(ledger, earlier.spec, gpus, id=earlier.id))
    assert again.id == earlier.id and again.gpus == ("GPU-n0-0",)
    assert not violations(gpus, ledger.snapshot_sync().allocations)


def test_a_full_group_gpu_refuses_with_the_reason(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gpus = cluster("1xA100", "1xA100")
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    filler = Allocation("a-00000000000000ff", "n1", ("GPU-n1-0",), ShareSpec(0.5, 0.5), 10)
    assert ledger.compare_and_swap_sync("n1", 0, [filler, _member(1, "n1", 1.0, True, 0.5)])
    spec = ShareSpec(0.5, 0.5, gpu_labels=GpuLabels(affinity="g"))
    try:
        asyncio.run(allocate(ledger, spec, gpus, Policy(node="spread")))
    except PlacementRefused as refused:
        assert "affinity group 'g' is on n1 GPU 0 (A100), which has 0 free" in refused.message
        assert "0.5 without affinity 'g'" in refused.suggestions
    else:
        raise AssertionError("a share was placed off its group's GPU or over-allocated")
    assert len(ledger.snapshot_sync().allocations) == 2  # nothing held after the refusal


_CHILD = """
import asyncio, json, sys
from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import PlacementRefused, Policy, allocate
from jupyter_gpushare.share import ShareSpec

gpus = [Gpu.from_json(g) for g in json.loads(sys.argv[2])]
ledger = SQLiteLedger(sys.argv[1])
policy = Policy(node="spread", gpu="spread")

async def main():
    placed, refused = [], []
    for _ in range(int(sys.argv[3])):
        try:
            a = await allocate(ledger, ShareSpec(0.25, 0.5, gpu_memory=2**30), gpus, policy)
            placed.append(a.id)
        except PlacementRefused as exc:
            refused.append(exc.message)
    print(json.dumps({"placed": placed, "refused": refused}))

asyncio.run(main())
"""


def test_processes_racing_never_over_allocate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Four processes ask for 6 quarters each of a cluster that holds 12 (3 GPUs; a fourth GPU
    is cordoned and a fifth unhealthy): exactly 12 are placed, none on those two."""
    gpus = [*cluster("2xA100", "1xA100"), gpu("n2", 0, cordoned=True), gpu("n3", 0, healthy=False)]
    path = tmp_path / "ledger.sqlite"
    SQLiteLedger(path)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    inventory = json.dumps([g.to_json() for g in gpus])
    started = time.monotonic()
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path), inventory, "6"],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [json.loads(c.communicate(timeout=120)[0]) for c in children]
    assert all(c.returncode == 0 for c in children)
    placed = [i for o in outputs for i in o["placed"]]
    refused = [m for o in outputs for m in o["refused"]]
    assert len(placed) == 12 and len(set(placed)) == 12
    assert len(refused) == 12
    assert all(
        m.startswith("no GPU has 0.25 free (5 GPUs, 1 unhealthy, 1 cordoned, most free 0)")
        for m in refused
    ), refused[0]
    final = SQLiteLedger(path).snapshot_sync().allocations
    assert not violations(gpus, final)
    assert {u for a in final for u in a.gpus} == {"GPU-n0-0", "GPU-n0-1", "GPU-n1-0"}
    assert time.monotonic() - started < 120


def test_allocate_through_the_ledger_settles_and_refuses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gpus = cluster("1xA100", "1xT4")
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    spec = ShareSpec(0.5, 0.5, gpu_labels=GpuLabels(affinity="pair"))

    async def go() -> str:
        a = await allocate(ledger, spec, gpus, Policy(node="spread"), owner="run")
        b = await allocate(ledger, spec, gpus, Policy(node="spread"))
        assert a.gpus == b.gpus and a.owner == "run"
        try:
            await allocate(ledger, spec, gpus)
        except PlacementRefused as refused:
            return refused.message
        raise AssertionError("a third half of the pair's GPU was placed")

    assert "affinity group 'pair' is on" in asyncio.run(go())
