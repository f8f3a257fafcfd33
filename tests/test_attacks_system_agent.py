"""Attacks by one Unix user on another through the machine's system agent (issue 23).

Each test runs the attack as real Unix users (``gsh3alice``, ``gsh3bob``) against a
``jupyter gpushare daemon --system`` on simulated A100s, with the helpers of
``test_system_agent.py`` (the agent, users' processes forked under their own uid), and checks
that the victim's process, share or service is untouched.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import test_system_agent as system
from test_system_agent import ALICE, BOB, run_as, snapshot, unix_user

from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.ledger.reconcile import process_start_time
from jupyter_gpushare.placement import allocate
from jupyter_gpushare.share import ShareSpec

GiB = 2**30

#: the fixtures of test_system_agent.py: the agent as a root service, users' long-lived processes
agent = system.agent
holder = system.holder

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)")


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.1) -> Any:
    from support import wait_for as wait

    return wait(predicate, timeout=timeout, interval=interval)


# -- what the users' processes do (module level: they run in forked children) ----------------


async def record_kernel(
    socket: str, pid: int, server_pid: int, pid_start: float | None = None
) -> dict[str, Any]:
    """A kernel share naming ``pid`` as its process and ``server_pid`` as its server, as a
    user's own code may write it (no start times unless given)."""
    ledger = AgentLedger(socket)
    inventory = await ledger.gpus()
    made = await allocate(
        ledger,
        ShareSpec(0.1, 0.1, gpu_memory=GiB),
        inventory,
        None,
        owner="kernel",
        state="active",
        pid=pid,
        pid_start=pid_start,
        server_pid=server_pid,
    )
    return made.to_json()


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
