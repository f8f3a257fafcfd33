"""The driver check's decision (``daemon/driver_check.py``: pure, hypothesis) and the lease loop
against a hostile board (``daemon/gpu_loop.py``: every value a tenant may write is range-checked,
nothing a tenant writes raises in the agent).

The attacks themselves, as real users against the system agent: tests/test_driver_check_attacks.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare.daemon import wire
from jupyter_gpushare.daemon.driver_check import (
    MEMORY,
    NO_SHARE,
    OVER_LIMIT,
    TOOK_REQUEST,
    Margins,
    Process,
    Share,
    Window,
    decide,
    memory_allowed,
)
from jupyter_gpushare.daemon.gpu_loop import GpuLoop
from jupyter_gpushare.daemon.shm import GpuShm, StateDir, monotonic_ns

GiB = 2**30
GPU = "GPU-x"


def share(name: str, request: float = 0.3, limit: float = 0.3, cap: int = GiB, **kw) -> Share:
    return Share(name, request, limit, cap, **kw)


def proc(pid: int, memory: int, owner: str | None, uid: int = 1000) -> Process:
    return Process(pid, uid, 1.0 + pid, memory, owner)


# -- memory ------------------------------------------------------------------------------------


def test_a_share_over_its_cap_loses_its_largest_processes_first() -> None:
    bob = share("bob", cap=GiB)
    procs = [proc(1, 3 * GiB, "bob"), proc(2, GiB // 2, "bob"), proc(3, 2 * GiB, "bob")]
    [action] = decide(GPU, [bob], procs)
    assert (action.kind, action.cause, action.allocation) == ("kill", MEMORY, "bob")
    assert [p.pid for p in action.processes] == [1, 3]  # 0.5 GiB left: inside the cap
    assert "over its cap of 1.00 GiB" in action.reason


def test_within_the_cap_and_its_margin_nothing_happens() -> None:
    alice = share("alice", cap=4 * GiB)
    allowed = memory_allowed(alice, 2, Margins())
    procs = [proc(1, allowed // 2, "alice"), proc(2, allowed - allowed // 2, "alice")]
    assert decide(GPU, [alice], procs) == []
    procs[1] = proc(2, allowed - allowed // 2 + 1, "alice")
    assert [a.cause for a in decide(GPU, [alice], procs)] == [MEMORY]


def test_a_process_of_no_share_is_stopped_unless_told_not_to() -> None:
    stray = proc(9, GiB, None)
    [action] = decide(GPU, [], [stray])
    assert (action.kind, action.cause, action.allocation) == ("kill", NO_SHARE, None)
    assert decide(GPU, [], [stray], stop_unshared=False) == []


@settings(max_examples=300, deadline=None)
@given(
    caps=st.lists(st.integers(1, 64 * GiB), min_size=1, max_size=4),
    held=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 96 * GiB)), max_size=12),
)
def test_memory_kills_leave_each_share_within_its_allowance(caps, held) -> None:
    """After the kills every share fits its cap plus its margin; only over-cap shares lose
    processes, and no process is killed that did not have to be (the largest go first, so
    sparing any killed one would leave the share over)."""
    shares = [share(f"s{i}", cap=c) for i, c in enumerate(caps)]
    procs = [proc(n, m, f"s{i % len(caps)}") for n, (i, m) in enumerate(held, start=1)]
    actions = decide(GPU, shares, procs)
    killed = {p.pid for a in actions for p in a.processes}
    for s in shares:
        mine = [p for p in procs if p.share == s.allocation]
        left = [p for p in mine if p.pid not in killed]
        assert sum(p.memory for p in left) <= memory_allowed(s, len(left), Margins())
        before = sum(p.memory for p in mine)
        if before <= memory_allowed(s, len(mine), Margins()):
            assert not killed & {p.pid for p in mine}
        gone = [p for p in mine if p.pid in killed]
        if gone:
            smallest = min(gone, key=lambda p: p.memory)
            spared = [*left, smallest]
            assert sum(p.memory for p in spared) > memory_allowed(s, len(spared), Margins())
            assert all(p.memory >= q.memory for p in gone for q in left)


# -- compute -----------------------------------------------------------------------------------


def test_over_its_limit_by_the_driver_is_fenced() -> None:
    bob = share("bob", 0.3, 0.3, used=0.99, granted=0.99)
    [action] = decide(GPU, [bob], [proc(1, 0, "bob")])
    assert (action.kind, action.cause) == ("fence", OVER_LIMIT)
    assert decide(GPU, [share("bob", 0.3, 0.3, used=0.39)], [proc(1, 0, "bob")]) == []
    assert decide(GPU, [share("bob", 0.3, 1.0, used=1.0)], [proc(1, 0, "bob")]) == []


def test_taking_a_waiting_shares_request_is_fenced_only_when_outside_the_schedule() -> None:
    alice = share("alice", 0.3, 1.0, used=0.1, granted=0.1, waiting=True)
    # bob ran outside his leases (LD_PRELOAD cleared, or a lease he wrote himself, which the
    # lease loop does not adopt) while alice waited below her request
    outside = share("bob", 0.3, 1.0, used=0.9, granted=0.2)
    [action] = decide(GPU, [alice, outside], [proc(1, 0, "bob"), proc(2, 0, "alice")])
    assert (action.allocation, action.cause) == ("bob", TOOK_REQUEST)
    # bob ran inside the leases he was granted: alice's waiting flag is her own word
    inside = share("bob", 0.3, 1.0, used=0.9, granted=0.9)
    assert decide(GPU, [alice, inside], [proc(1, 0, "bob")]) == []
    # not waiting, or not below her request: nothing was taken from her
    assert decide(GPU, [share("alice", 0.3, 1.0, used=0.1), outside], [proc(1, 0, "bob")]) == []
    assert decide(GPU, [share("alice", 0.3, 1.0, used=0.3, waiting=True), outside], []) == []


fractions = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.1, 0.2, 0.3, 0.5]),
            st.sampled_from([0.3, 0.5, 1.0]),
            fractions,
            fractions,
            st.booleans(),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_a_share_that_keeps_to_its_schedule_is_never_fenced(rows) -> None:
    """A share whose driver figure stays within what it was granted (the agent's own figure) and
    within its limit is never fenced, whatever its neighbours do or claim (waiting, starved)."""
    shares = []
    for i, (request, limit, used, granted, waiting) in enumerate(rows):
        limit = max(limit, request)
        shares.append(share(f"s{i}", request, limit, used=used, granted=granted, waiting=waiting))
    honest = share("honest", 0.3, 0.5, used=0.45, granted=0.4)
    actions = decide(GPU, [honest, *shares], [proc(1, 0, "honest")])
    assert not [a for a in actions if a.allocation == "honest"]


def test_the_window_averages_the_drivers_samples() -> None:
    w = Window(2_000_000_000)
    t = 0
    assert w.figures(t) is None
    for i in range(12):  # 3 s at 0.25 s: busy 1.0 for 1 s, then 0.2; granted 0.5 of the time
        t += 250_000_000
        w.add(t, 1.0 if i < 4 else 0.2, 250_000_000, t // 2, waiting=i % 2 == 0)
    used, granted, waiting = w.figures(t)  # type: ignore[misc]
    assert abs(used - 0.2) < 1e-9 and abs(granted - 0.5) < 1e-9 and waiting


# -- the lease loop against a hostile board ----------------------------------------------------


def test_random_writes_to_the_board_never_raise_in_the_lease_loop(tmp_path: Path) -> None:
    """A tenant may write anything to its GPU's board at any time (it is read-write by design),
    and to its own account: out-of-range holders and next slots, leases in the far future or
    past, huge counters. The agent's loop (tick, want, done, fence, its status, its timers) must
    never raise on it and keeps its heartbeat.
    Before the range checks: IndexError in _sync_holder on the first holder past the slots."""
    state = StateDir(tmp_path / "state")
    shm = GpuShm(state, GPU, 20_000_000, 1_000_000_000)
    loop = GpuLoop(GPU, shm, 20_000_000, 1_000_000_000)
    rand = random.Random(23)
    special = [0, 1, wire.SLOTS, wire.SLOTS + 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
    base = ctypes.addressof(shm.header)
    errors: list[BaseException] = []

    async def attack() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, ctx: errors.append(ctx.get("exception") or RuntimeError(ctx["message"]))
        )
        tenants = [loop.upsert(f"a-{i:016x}", 0.3, 0.5, GiB, set()) for i in range(3)]
        assert all(tenants)
        # and each share's account, which its own processes write
        writable = [(base, wire.FILE_SIZE)] + [
            (ctypes.addressof(shm.account(t.slot)), wire.ACCOUNT_SIZE) for t in tenants if t
        ]
        for step in range(20_000):
            for _ in range(rand.randrange(1, 8)):
                value = rand.choice(special) if rand.random() < 0.5 else rand.getrandbits(64)
                start, size = rand.choice(writable)
                offset = 8 * rand.randrange(size // 8)
                ctypes.c_uint64.from_address(start + offset).value = value
            t = rand.choice(tenants)
            assert t is not None
            match rand.randrange(5):
                case 0:
                    loop.tick()
                case 4:
                    json.dumps([loop.status(monotonic_ns()), loop.tenant_status(t, monotonic_ns())])
                case 1:
                    loop.want(t)
                case 2:
                    loop.done(t, rand.getrandbits(64))
                case _:
                    loop.fence(t.allocation, rand.random() < 0.5)
            if step % 500 == 0:
                await asyncio.sleep(0.001)  # let its timers run
        loop.tick()
        assert monotonic_ns() - shm.header.heartbeat_ns < 1_000_000_000

    asyncio.run(attack())
    assert errors == []
    shm.close()
    state.close()


# -- identification and acting (in-process, real processes) -----------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (processes of other uids)")
def test_the_check_identifies_processes_itself_and_signals_only_them(tmp_path: Path) -> None:
    """DriverCheck on a stub of the driver's readings (the NVML sampler is what cannot run
    here without a device; the processes, /proc, pidfds and signals are real): a child of a
    share's recorded process (no connection: LD_PRELOAD cleared) holding 5 GiB over a 1 GiB cap
    is killed; a process of a uid without a share on the GPU is killed; a process of uid 0 (an
    admin) and a pid with no process are left alone; the share's status says why."""
    from jupyter_gpushare.daemon.driver_check import DriverCheck
    from jupyter_gpushare.ledger import Allocation
    from jupyter_gpushare.ledger.reconcile import process_identity
    from jupyter_gpushare.share import ShareSpec

    nobody = 65534
    kernel = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], user=nobody, stdout=subprocess.PIPE, text=True
    )
    assert kernel.stdout is not None
    child = int(kernel.stdout.readline())
    stray = subprocess.Popen(["sleep", "60"], user=nobody - 1)
    admin = subprocess.Popen(["sleep", "60"])
    found = process_identity(kernel.pid)
    assert found is not None
    share_ = Allocation(
        id="a-0000000000000001",
        node="n",
        gpus=(GPU,),
        spec=ShareSpec(0.3, 0.3, gpu_memory=GiB),
        memory=GiB,
        pid=kernel.pid,
        pid_start=found[0],
        extra={"uid": nobody},
    )
    state = StateDir(tmp_path / "state")
    shm = GpuShm(state, GPU, 20_000_000, 1_000_000_000)
    loop = GpuLoop(GPU, shm, 20_000_000, 1_000_000_000)

    class Daemon:
        gpus = {GPU: loop}
        allocations = {share_.id: share_}
        clients: set[Any] = set()
        admins = None

    readings = {
        GPU: [
            {"pid": child, "memory": 5 * GiB, "busy": 0.0},
            {"pid": stray.pid, "memory": GiB, "busy": 0.0},
            {"pid": admin.pid, "memory": 10 * GiB, "busy": 1.0},
            {"pid": 2**22 + 1, "memory": GiB, "busy": 0.0},  # gone (or never was)
        ]
    }

    async def run() -> list[Any]:
        assert loop.upsert(share_.id, 0.3, 0.3, GiB, set()) is not None
        check = DriverCheck(Daemon(), None, sampler=lambda _lib, _seen: readings)  # type: ignore[arg-type]
        done = check.check(readings, monotonic_ns())
        return [done, check.report(share_.id), check.unshared_kills]

    try:
        actions, report, unshared = asyncio.run(run())
        assert {(a.cause, a.allocation) for a in actions} == {
            (MEMORY, share_.id),
            (NO_SHARE, None),
        }
        stray.wait(5)
        assert stray.returncode == -signal.SIGKILL
        assert wait_gone(child)
        assert admin.poll() is None  # (the kernel's shell ends once its child is gone)
        assert unshared == 1
        [event] = report["events"]
        assert event["pids"] == [child] and event["cause"] == MEMORY
    finally:
        for p in (kernel, stray, admin):
            p.kill()
            p.wait(5)
        shm.close()
        state.close()


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def test_the_simulators_process_memory_is_range_checked(tmp_path: Path, monkeypatch) -> None:
    """The simulator's per-process records live in a state file every user of the simulated
    device may write (as /dev/nvidia* may be opened): a process that writes all ones into its
    own record's memory must not read as "not available" (0) to the node agent's check, which
    would then charge its share nothing. NVML reports at most the whole device for it."""
    import mmap
    import sys
    import time

    from jupyter_gpushare import simulator
    from jupyter_gpushare.daemon.nvml import processes
    from jupyter_gpushare.inventory import simulated_gpus

    if not simulator.nvml_library().exists():
        pytest.skip("the simulator is not built")
    gpus = simulated_gpus("1xA100", "n")
    env = simulator.simulator_env(gpus, tmp_path / "sim.state")
    for name, value in env.items():  # the simulator's NVML in this process reads them
        monkeypatch.setenv(name, value)
    tenant = Path(__file__).parents[1] / "driver_check_tenant.py"
    proc = subprocess.Popen(
        [sys.executable, str(tenant), "alloc", str(2**20)],
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"allocated": 2**20, "error": 0}
        state = simulator._State
        with open(tmp_path / "sim.state", "r+b") as f:
            view = mmap.mmap(f.fileno(), ctypes.sizeof(state))
            raw = state.from_buffer(view)
            [mine] = [p for p in raw.proc if p.pid == proc.pid]
            mine.dev[0].mem = 2**64 - 1
            del raw, mine
            view.close()
        time.sleep(0.01)
        [row] = processes(str(simulator.nvml_library()), {})[gpus[0].uuid]
        assert row["pid"] == proc.pid and row["memory"] == gpus[0].memory
    finally:
        proc.kill()
        proc.wait(5)
