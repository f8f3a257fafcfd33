"""Attacks by one Unix user on another through the machine's system agent (issue 23).

Each test runs the attack as real Unix users (``gsh3alice``, ``gsh3bob``) against a
``jupyter gpushare daemon --system`` on simulated A100s, with the helpers of
``test_system_agent.py`` (the agent, users' processes forked under their own uid), and checks
that the victim's process, share or service is untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket as socketlib
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import test_run
import test_system_agent as system
from test_system_agent import (
    ALICE,
    BOB,
    NODE,
    gpushare_run,
    place,
    record_kernel,
    run_as,
    snapshot,
    unix_user,
)

from jupyter_gpushare import cli as gpushare_cli
from jupyter_gpushare import paths
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger import agent as agent_ledger
from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.ledger.reconcile import process_start_time
from jupyter_gpushare.share import ShareSpec

#: the fixtures of test_system_agent.py: the agent as a root service, users' long-lived processes
agent = system.agent
holder = system.holder
#: a native CUDA program (test_run.py's): cuInit, a context, an allocation, launches
cuda_program = test_run.cuda_program

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)")


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.1) -> Any:
    from support import wait_for as wait

    return wait(predicate, timeout=timeout, interval=interval)


# -- what the users' processes do (module level: they run in forked children) ----------------


def as_process_of(user: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["sleep", "600"], user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/"
    )


def process_at(pid: int, user: Any, tries: int = 400) -> subprocess.Popen[bytes] | None:
    """A new process of ``user`` with PID ``pid`` (free again): the kernel's next PID is set
    just below it (``ns_last_pid``, root) until a fork gets it (other forks may come first)."""
    for _ in range(tries):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = as_process_of(user)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait(10)
    return None


# -- 1: PID reuse --------------------------------------------------------------------------


def test_a_pid_bob_recorded_and_freed_is_never_signalled_once_alice_has_it(agent) -> None:
    """Bob records a kernel share naming his own process without a start time, then his
    "kernel" and "server" exit; Alice's next process gets the freed PID. The agent (root)
    releases Bob's stale share and must not signal Alice's process. A start time other than
    the named process's own is refused."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("no writable /proc/sys/kernel/ns_last_pid")
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)
    kernel, server = as_process_of(bob), as_process_of(bob)
    lied = run_as(bob, record_kernel, socket, kernel.pid, server.pid, time.time() - 3600)
    assert lied[:2] == ("error", "AgentRefused") and lied[3] == "not_permitted", lied
    assert "is not the start time of process" in lied[2]
    made = run_as(bob, record_kernel, socket, kernel.pid, server.pid)
    assert made[0] == "ok", made
    assert made[1]["pid_start"] == pytest.approx(process_start_time(kernel.pid), abs=0.05)
    freed = kernel.pid
    for proc in (kernel, server):
        proc.kill()
        proc.wait(10)
    victim = process_at(freed, alice)
    if victim is None:
        pytest.skip(f"could not get PID {freed} again (a busy machine)")
    try:
        wait_for(lambda: asyncio.run(snapshot(socket)) == [], timeout=30)
        time.sleep(1.0)  # a signal sent right after the release has arrived by now
        assert victim.poll() is None, f"alice's process was signalled: {victim.returncode}"
    finally:
        victim.kill()
        victim.wait(10)


# -- 4, 5: a user's flood of refused or malformed requests --------------------------------


def exchange(sock: socketlib.socket, lines: list[bytes]) -> list[dict[str, Any]]:
    """Send ``lines`` at once; their replies, in order."""
    sock.sendall(b"".join(lines))
    data = b""
    while data.count(b"\n") < len(lines):
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"closed after {len(data.splitlines())} replies")
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


async def flood_refused_cas(socket: str, count: int) -> dict[str, int]:
    """``count`` compare-and-swaps that would drop another user's share (each refused), 15 at a
    time then a ping (16 refusals in a row close a connection); how the agent answered."""
    version = (await AgentLedger(socket).snapshot()).versions[NODE]
    cas = json.dumps({"op": "ledger.cas", "node": NODE, "version": version, "allocations": []})
    batch = [cas.encode() + b"\n"] * 15 + [b'{"op":"ping"}\n']
    answers: dict[str, int] = {}
    with socketlib.socket(socketlib.AF_UNIX) as sock:
        sock.connect(socket)
        for _ in range(-(-count // 15)):
            for reply in exchange(sock, batch)[:15]:
                key = "ok" if reply.get("ok") else str(reply.get("error"))
                answers[key] = answers.get(key, 0) + 1
    return answers


def deep_then_ping(socket: str, depth: int) -> list[dict[str, Any]]:
    line = b'{"op":"ledger.cas","allocations":' + b"[" * depth + b"]" * depth + b"}\n"
    with socketlib.socket(socketlib.AF_UNIX) as sock:
        sock.connect(socket)
        return exchange(sock, [line, b'{"op":"ping"}\n'])


COUNT = 450


def test_a_flood_of_refused_requests_writes_a_bounded_log(agent, holder) -> None:
    """Refused ``ledger.cas`` from bob (each would drop alice's share): one log line (at most
    one a minute per uid and kind, with a count), not one each. (The agent takes a user's
    ledger writes at a bounded rate, 50 a second, so a flood is that many lines a second
    without the bound: ~7 kB a second here, 600 MB a day.)"""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)
    assert run_as(alice, place, socket, 0.25, None, holder(alice))[0] == "ok"
    before = a.log.stat().st_size
    outcome = run_as(bob, flood_refused_cas, socket, COUNT)
    assert outcome[0] == "ok", outcome
    assert sum(outcome[1].values()) >= COUNT and "ok" not in outcome[1], outcome
    grown = a.log.read_bytes()[before:]
    assert len(grown) < 2_000, grown[:2_000]
    assert len(asyncio.run(snapshot(socket))) == 1  # alice's share is still there


def test_a_deeply_nested_request_is_refused_without_a_traceback(agent) -> None:
    bob = unix_user(BOB)
    a = agent()
    replies = run_as(bob, deep_then_ping, str(a.socket), 30_000)
    assert replies[0] == "ok", replies
    refused, pong = replies[1]
    assert refused["ok"] is False and "nested deeper than 32" in refused["message"], refused
    assert pong["ok"] is True  # the same connection still answers
    log = a.log.read_text()
    assert "Traceback" not in log and "Recursion" not in log, log[-3000:]


# -- 8: tiny shares filling a GPU's lease board --------------------------------------------


async def fill_gpu(socket: str, index: int, count: int, holder_pid: int) -> bool:
    """``count`` shares of 0.01 and 1 MiB on GPU ``index``, recorded in one compare-and-swap."""
    ledger = AgentLedger(socket)
    gpu = next(g for g in await ledger.gpus() if g.index == index)
    snap = await ledger.snapshot()
    tiny = [
        Allocation(
            id=Allocation.new_id(),
            node=NODE,
            gpus=(gpu.uuid,),
            spec=ShareSpec(0.01, 0.01, gpu_memory=2**20),
            memory=2**20,
            owner="run",
            server_pid=holder_pid,
        )
        for _ in range(count)
    ]
    return await ledger.compare_and_swap(
        NODE, snap.versions.get(NODE, 0), [*snap.on_node(NODE), *tiny]
    )


def test_tiny_shares_cannot_fill_a_gpu_for_another_user(agent, holder, cuda_program) -> None:
    """Bob records 64 shares of 0.01 on GPU 1 in one go: refused by the per-user bound (16 by
    default). Without that bound, 64 fill GPU 1's lease board (a 65th is refused as over
    capacity), and alice's ``gpushare run --gpu-request 0.3`` of a CUDA program is placed on
    GPU 0 and runs (it was placed on the fuller GPU 1, where it had no slot:
    CUDA_ERROR_NOT_PERMITTED)."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    bounded = agent(simulate="2xA100")
    refused = run_as(bob, fill_gpu, str(bounded.socket), 1, 64, holder(bob))
    assert refused[:2] == ("error", "AgentRefused") and refused[3] == "not_permitted", refused
    assert "at most 16" in refused[2], refused
    assert run_as(bob, fill_gpu, str(bounded.socket), 1, 16, holder(bob)) == ("ok", True)
    bounded.stop()

    a = agent("--max-shares-per-user", "0", simulate="2xA100")
    socket = str(a.socket)
    assert run_as(bob, fill_gpu, socket, 1, 64, holder(bob)) == ("ok", True)
    over = run_as(bob, fill_gpu, socket, 1, 1, holder(bob))
    assert over[:2] == ("error", "AgentRefused") and "at most 64" in over[2], over
    program = a.dir / "prog"  # where alice may run it
    program.write_bytes(cuda_program.read_bytes())
    program.chmod(0o755)
    ran = run_as(alice, gpushare_run, socket, "--gpu-request", "0.3", "--", str(program))
    assert ran[0] == "ok" and ran[1]["code"] == 0, ran
    log = a.log.read_text()
    assert "KeyError" not in log and "no free slot" not in log, log[-3000:]


# -- 9: the system agent stopped cleanly ----------------------------------------------------


def run_found_agent(*argv: str) -> dict[str, Any]:
    """``jupyter gpushare run`` as this user with no GPUSHARE_SOCKET: discovery decides."""
    os.environ.pop("GPUSHARE_SOCKET", None)
    os.environ["GPUSHARE_NODE_NAME"] = NODE
    from jupyter_gpushare.config import GpuShare

    GpuShare.clear_instance()
    found = paths.find_agent(fresh=True)
    said = io.StringIO()
    began = time.monotonic()
    with contextlib.redirect_stderr(said):
        code = gpushare_cli.main(["run", *argv])
    return {
        "found": (str(found.socket), found.system),
        "code": code,
        "said": said.getvalue(),
        "took": time.monotonic() - began,
    }


def test_a_stopped_system_agent_is_never_replaced_by_a_private_ledger(agent, monkeypatch) -> None:
    """The system agent stopped cleanly (SIGTERM: its socket is removed): alice's ``gpushare
    run`` still finds the system agent (its state directory is there), waits a bounded time
    for it and fails with the reason; no per-user agent and no private ledger are made (they
    would book the GPUs a second time beside the system ledger)."""
    alice = unix_user(ALICE)
    a = agent()
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", a.socket)
    monkeypatch.setattr(paths, "SYSTEM_LEDGER", a.ledger)
    monkeypatch.setattr(agent_ledger, "SYSTEM_WAIT_S", 2.0)
    a.stop()  # SIGTERM: the agent removes its socket (if it was too slow and got SIGKILL, here)
    a.socket.unlink(missing_ok=True)
    outcome = run_as(alice, run_found_agent, "--gpu-request", "0.5", "--", "/bin/true")
    assert outcome[0] == "ok", outcome
    ran = outcome[1]
    assert ran["found"] == (str(a.socket), True), ran
    assert ran["code"] != 0 and "the system GPU agent is not running" in ran["said"], ran
    assert "ask your admin" in ran["said"] and "Traceback" not in ran["said"], ran
    assert 2.0 <= ran["took"] < 20, ran
    home = Path(alice.pw_dir)
    private = [p for p in home.rglob("*") if "gpushare" in p.name]
    assert not [p for p in private if p.name.endswith((".sqlite", ".sock"))], private
    agents = [
        p
        for p in psutil.process_iter(["uids", "cmdline"])
        if p.info["uids"]
        and p.info["uids"].real == alice.pw_uid
        and "jupyter_gpushare.daemon" in " ".join(p.info["cmdline"] or [])
    ]
    assert agents == []


# -- 10: a ledger row that cannot be read ---------------------------------------------------


def test_an_unreadable_row_keeps_its_share_reserved_until_repaired(agent, holder) -> None:
    """Alice's row in the agent's ledger becomes unreadable: it still holds its GPU (status
    names it for an admin), so bob's 0.75 is refused; once the row is repaired the GPU holds
    alice's 0.5 alone, never 1.25."""
    import sqlite3

    from jupyter_gpushare.daemon.client import DaemonClient

    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)
    made = run_as(alice, place, socket, 0.5, None, holder(alice))[1]["allocation"]
    with sqlite3.connect(a.ledger) as db:
        (body,) = db.execute("SELECT body FROM allocations WHERE id=?", (made["id"],)).fetchone()
        db.execute("UPDATE allocations SET body='{oops' WHERE id=?", (made["id"],))
    time.sleep(5.5)  # the agent reads its file again after 5 s (ledger/cached.py)
    refused = run_as(bob, place, socket, 0.75, None, holder(bob))
    assert refused[0] == "ok" and "refused" in refused[1], refused
    unreadable = DaemonClient(socket).status()["daemon"]["unreadable_rows"]
    assert unreadable == [made["id"]]
    assert made["id"] in a.log.read_text()  # named in the agent's log
    with sqlite3.connect(a.ledger) as db:
        db.execute("UPDATE allocations SET body=? WHERE id=?", (body, made["id"]))
        rows = [json.loads(b) for (b,) in db.execute("SELECT body FROM allocations")]
    assert sum(r["gpu_request"] for r in rows) == 0.5, rows


# -- 11: the simulator's shared state, damaged by a user --------------------------------------


def damage_device_count(state: str) -> None:
    """Bob writes a device count far past the table into the simulator's shared state (a file
    every user may write, as /dev/nvidia* are): ``struct sim_state.ndev``, at byte 24."""
    with open(state, "r+b") as f:
        f.seek(24)
        f.write((0xFFFFFFF0).to_bytes(4, "little"))


def test_a_damaged_simulator_state_fails_cuda_calls_without_a_crash(agent, cuda_program) -> None:
    """A device count out of range in the simulator's state makes alice's CUDA program fail with
    an error it can report (cuInit returns CUDA_ERROR_OPERATING_SYSTEM), never die of SIGSEGV;
    the agent goes on answering."""
    from jupyter_gpushare.daemon.client import DaemonClient
    from jupyter_gpushare.daemon.env import SIM_STATE_NAME

    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)
    program = a.dir / "prog"
    program.write_bytes(cuda_program.read_bytes())
    program.chmod(0o755)
    ran = run_as(alice, gpushare_run, socket, "--gpu-request", "0.3", "--", str(program))
    assert ran[0] == "ok" and ran[1]["code"] == 0, ran
    state = a.dir / SIM_STATE_NAME
    assert run_as(bob, damage_device_count, str(state)) == ("ok", None)
    ran = run_as(alice, gpushare_run, socket, "--gpu-request", "0.3", "--", str(program))
    assert ran[0] == "ok" and ran[1]["code"] == 10, ran  # the program's "a CUDA call failed"
    assert DaemonClient(socket).alive()
