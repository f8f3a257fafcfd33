"""Fail static (DESIGN.md, box 7): while no agent answers (an agent killed, or between the old and
the new pod of a DaemonSet rollout) each kernel grants itself leases at its request share, and so
stays inside its limit.

A self-granted lease of one quantum leaves up to the runahead bound the agent last published
queued at its end; the interposer counts that work before its next lease (it once counted only
the lease: a saturating tenant at request = limit = 0.3 then ran at 0.6 with no agent). The
pacing is the share's, kept in its account and shared by all its processes (it was each
process's: a share of 3 processes at 0.25 took 0.62 of the GPU from its neighbour).
"""

from __future__ import annotations

import mmap
import struct
import time
from types import SimpleNamespace

import pytest
from enforcement_support import add_allocation, device_shares, shares, spawn_tenant

from jupyter_gpushare.daemon.wire import SLOTS, Header

SPIN = ["spin", "8", "1000", "8"]  # 1 ms kernels, a sync every 8 launches
SYNC = ["load", "8", "1000", "sync"]  # a sync after every launch


@pytest.mark.parametrize(
    ("requests", "argv"),
    [((0.3,), SPIN), ((0.2, 0.5), SPIN), ((0.3,), SYNC)],
    ids=["alone", "two tenants", "alone, a sync after every launch"],
)
def test_with_no_agent_each_kernel_runs_at_its_request_share(
    daemon, ledger, gpus, tmp_path, requests, argv
):
    """(A sync after every launch: the process idles while its kernel runs, and its agent thread
    handed the lease back early, as the dead agent's board said others waited; each such lease
    was charged a whole one: 0.01 of the device at request 0.3. It now gets 0.14 to 0.29.)"""
    allocations = [add_allocation(ledger, gpus[0], r, r) for r in requests]
    tenants = [spawn_tenant(daemon, ledger, a, gpus, argv, tmp_path) for a in allocations]
    time.sleep(2.5)  # connected, and the agent published its runahead bounds
    killed = time.monotonic_ns()
    daemon.kill9()
    runs = [t.finish() for t in tenants]
    for t, lines in zip(tenants, runs, strict=True):
        assert t.proc.returncode == 0, (lines[-3:], t.stderr)
        assert not [x for x in lines if "error" in x], lines[-3:]
    lo = killed + int(0.5e9)
    hi = min(lines[-1]["t"] for lines in runs) - int(0.2e9)
    assert hi - lo >= int(3e9), "the tenants ended too soon after the agent was killed"
    got = shares(tenants, lo, hi)
    print(f"no agent, requests = limits {requests}, {argv}: shares {[round(s, 3) for s in got]}")
    for request, share in zip(requests, got, strict=True):
        assert share <= request + 0.05, (requests, got)  # inside its limit
    if len(requests) == 1 and argv is SYNC:  # not all of it: see the docstring
        assert got[0] >= requests[0] / 3, got
    elif len(requests) == 1:
        assert got[0] >= requests[0] - 0.1, got  # ... and it keeps its request
    else:  # one share at a time: each keeps its request (they overlapped once: 0.12 / 0.46)
        assert all(s >= r - 0.07 for r, s in zip(requests, got, strict=True)), (requests, got)


def test_with_no_agent_a_share_of_several_processes_runs_at_its_request(
    daemon, ledger, gpus, tmp_path
):
    """A kernel and two subprocesses of one share (forked after they connected: one account),
    each with a deep queue of 1 ms kernels, beside another share, when the agent dies: the share
    as a whole stays at its request and the neighbour keeps its own. Each process paced only
    itself once: 0.62 for the 0.25 share and 0.24 left for the 0.5 one."""
    request, neighbour_request = 0.25, 0.5
    share = add_allocation(ledger, gpus[0], request, request)
    neighbour = add_allocation(ledger, gpus[0], neighbour_request, neighbour_request)
    argv = ["load", "7", "1000", "deep"]
    tenants = [
        spawn_tenant(
            daemon, ledger, share, gpus, argv, tmp_path, drain=True,
            extra_env={"GS_TENANT_PROCESSES": "3"},
        ),
        spawn_tenant(daemon, ledger, neighbour, gpus, argv, tmp_path, drain=True),
    ]  # fmt: skip
    time.sleep(2.5)  # connected, and the agent published its runahead bounds
    killed = time.monotonic_ns()
    daemon.kill9()
    runs = [t.finish(timeout=90) for t in tenants]
    for t, lines in zip(tenants, runs, strict=True):
        assert t.proc.returncode == 0, (lines[-3:], t.stderr)
    # queue reports on the device's clock ({"q", "dt", "dd"}); a forked process numbers from 16
    processes = {q // 16: [x for x in runs[0] if x.get("q", -1) // 16 == q // 16]
                 for q in {x["q"] for x in runs[0] if "q" in x}}  # fmt: skip
    assert sorted(processes) == [0, 1, 2], sorted(processes)
    lo = killed + int(0.5e9)
    hi = min(max(x["dt"] for x in lines if "dt" in x) for lines in runs) - int(0.3e9)
    assert hi - lo >= int(2.5e9), "the tenants ended too soon after the agent was killed"
    got = device_shares(tenants, lo, hi)
    each = device_shares([SimpleNamespace(lines=v) for _, v in sorted(processes.items())], lo, hi)
    print(f"no agent, 3 processes at {request} beside {neighbour_request}: shares "
          f"{[round(s, 3) for s in got]}, per process {[round(s, 3) for s in each]}")  # fmt: skip
    assert got[0] <= request + 0.1, (got, each)  # the share as a whole, not each process
    assert min(each) > 0, (got, each)  # ... every process of it still runs
    assert got[1] >= neighbour_request - 0.15, (got, each)  # the neighbour keeps its share


@pytest.mark.parametrize(
    "hostile",
    [0xFFFFFFFF, SLOTS + 1, SLOTS],  # out of range twice; then a slot that holds no lease
    ids=["all ones", "one past the slots", "an empty slot"],
)
def test_with_no_agent_a_holder_written_by_a_cotenant_is_taken_over(
    daemon, ledger, gpus, tmp_path, hostile
):
    """The board's ``holder`` is writable by every tenant of the GPU (wire.py: a co-tenant may
    disturb time-sharing, as it could by leaving the interposer). Written every millisecond,
    while no agent answers, with a value that names no lease: the interposer checks the range
    and the lease before it reads the slot, takes the GPU over, and the share keeps its request
    (no crash, no stall)."""
    share = add_allocation(ledger, gpus[0], 0.3, 0.3)
    tenant = spawn_tenant(daemon, ledger, share, gpus, SPIN, tmp_path)
    time.sleep(2.5)  # connected, and the agent published its runahead bounds
    killed = time.monotonic_ns()
    daemon.kill9()
    board = tmp_path / "shm" / f"{gpus[0].uuid}.board"
    with open(board, "r+b") as f, mmap.mmap(f.fileno(), 0) as shared:
        while tenant.proc.poll() is None:  # the co-tenant, as root: writes it over and over
            struct.pack_into("<I", shared, Header.holder.offset, hostile)
            time.sleep(0.001)
    lines = tenant.finish()
    assert tenant.proc.returncode == 0, (lines[-3:], tenant.stderr)
    assert not [x for x in lines if "error" in x], lines[-3:]
    lo, hi = killed + int(0.5e9), lines[-1]["t"] - int(0.2e9)
    assert hi - lo >= int(3e9), "the tenant ended too soon after the agent was killed"
    [got] = shares([tenant], lo, hi)
    print(f"no agent, holder written {hostile:#x} every 1 ms: share {got:.3f} at request 0.3")
    assert 0.3 - 0.1 <= got <= 0.3 + 0.05, got
