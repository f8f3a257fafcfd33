"""SQLite ledger: compare-and-swap under concurrent placers (threads and processes)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections import defaultdict

import pytest

from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.reconcile import reconcile
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import PlacementRefused, place
from jupyter_gpushare.share import ShareSpec

GPUS = simulated_gpus("2xA100", node="n1")


def _placer(path: str, count: int, results) -> None:
    async def go() -> None:
        ledger = SQLiteLedger(path)
        ok = refused = 0
        for _ in range(count):
            try:
                await ledger.allocate(ShareSpec(0.1, 0.2), GPUS, place, owner="run")
                ok += 1
            except PlacementRefused:
                refused += 1
        results.put((ok, refused))

    asyncio.run(go())


def test_concurrent_processes_never_over_allocate(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    SQLiteLedger(path)
    results: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_placer, args=(path, 8, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    outcomes = [results.get(timeout=5) for _ in procs]
    allocations = SQLiteLedger(path).snapshot_sync().allocations
    per_gpu = defaultdict(float)
    for a in allocations:
        per_gpu[a.gpus[0]] += a.spec.gpu_request
    assert all(v <= 1.0 + 1e-9 for v in per_gpu.values()), per_gpu
    assert sum(ok for ok, _ in outcomes) == len(allocations) == 20  # 2 GPUs x 10 x 0.1
    assert sum(refused for _, refused in outcomes) == 12


async def test_concurrent_tasks_and_release(tmp_path):
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    got = await asyncio.gather(
        *[ledger.allocate(ShareSpec(0.5, 0.5), GPUS, place) for _ in range(4)]
    )
    assert sorted(a.gpus[0] for a in got) == sorted([g.uuid for g in GPUS] * 2)
    with pytest.raises(PlacementRefused):
        await ledger.allocate(ShareSpec(0.5, 0.5), GPUS, place)
    assert await ledger.release(got[0].id) == got[0]
    assert await ledger.release(got[0].id) is None
    again = await ledger.allocate(ShareSpec(0.5, 0.5), GPUS, place)
    assert again.gpus == got[0].gpus


async def test_cas_refuses_a_stale_version(tmp_path):
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    snap = await ledger.snapshot()
    a = Allocation(id="a-1", node="n1", gpus=(GPUS[0].uuid,), spec=ShareSpec(), memory=1)
    assert await ledger.compare_and_swap("n1", snap.versions.get("n1", 0), [a])
    assert not await ledger.compare_and_swap("n1", 0, [])  # someone else won
    assert [x.id for x in await ledger.list()] == ["a-1"]


async def test_reconcile_releases_dead_holders_only(tmp_path):
    ledger = SQLiteLedger(tmp_path / "l.sqlite")
    dead = await ledger.allocate(ShareSpec(), GPUS, place, pid=2**22 + 7, pid_start=1.0)
    live = await ledger.allocate(ShareSpec(), GPUS, place, pid=os.getpid())
    gone_server = await ledger.allocate(ShareSpec(), GPUS, place, server_pid=2**22 + 9)
    released = await reconcile(ledger, "n1", my_server_pid=os.getpid())
    assert {a.id for a in released} == {dead.id, gone_server.id}
    assert [a.id for a in await ledger.list()] == [live.id]


def _first_use(path: str, start: object, results: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    try:
        ledger = SQLiteLedger(path)
        snap = ledger.snapshot_sync()
        ledger.compare_and_swap_sync("n", snap.versions.get("n", 0), [])  # may lose the race
        results.put("ok")  # type: ignore[attr-defined]
    except Exception as exc:
        results.put(repr(exc))  # type: ignore[attr-defined]


def test_a_fresh_ledger_opened_by_many_at_once_is_never_unavailable(tmp_path):
    """Every first connection sets WAL mode and the schema; SQLite answers the mode switch with
    SQLITE_BUSY at once while another connection holds the file. That is contention, not a
    broken ledger: processes opening a fresh file together all get through."""
    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        path = str(tmp_path / f"ledger-{attempt}.sqlite")
        start, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_first_use, args=(path, start, results)) for _ in range(8)]
        for proc in procs:
            proc.start()
        start.set()
        outcomes = [results.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(10)
        assert outcomes == ["ok"] * 8, outcomes
