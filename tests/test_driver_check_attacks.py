"""Escaping one's own share must not cost another share anything (issue 23, items 2, 3, 7).

Real Unix users (``gsh3alice``, ``gsh3bob``) against one ``jupyter gpushare daemon --system`` on
simulated A100s (the agent and users' helpers of ``test_system_agent.py``). Each user's tenant
(``driver_check_tenant.py``, standard library only) runs under that user's uid with the
interposer preloaded, or without it, and drives the simulated driver; the agent learns what each
process holds and runs from the simulator's NVML (``nvmlDeviceGetComputeRunningProcesses``,
``nvmlDeviceGetProcessUtilization``: the calls a real driver answers) and acts
(``daemon/driver_check.py``). The GPU itself is simulated: nothing else here is a double.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support import python_for
from test_system_agent import (  # noqa: F401 - fixtures
    ALICE,
    BOB,
    Agent,
    agent,
    run_as,
    unix_user,
)

from jupyter_gpushare.daemon import wire
from jupyter_gpushare.daemon.env import kernel_env
from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.ledger.reconcile import process_start_time
from jupyter_gpushare.placement import allocate
from jupyter_gpushare.share import GpuLabels, ShareSpec

GiB = 2**30
TENANT = Path(__file__).with_name("driver_check_tenant.py")

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)"),
]


async def record(
    socket: str, request: float, limit: float, memory: int, pid: int, labels: str | None
) -> dict[str, Any]:
    """A share whose process is ``pid`` (one of this user's), as a kernel's record is made;
    ``labels``: its GPU labels (anti-affinity puts two shares on two GPUs)."""
    ledger = AgentLedger(socket)
    inventory = await ledger.gpus()
    made = await allocate(
        ledger,
        ShareSpec(request, limit, gpu_memory=memory, gpu_labels=GpuLabels.parse(labels)),
        inventory,
        None,
        owner="kernel",
        state="active",
        pid=pid,
        pid_start=process_start_time(pid),
        server_pid=pid,
    )
    return {"allocation": made.to_json(), "gpus": [g.to_json() for g in inventory]}


class Tenant:
    """One user's tenant process (``driver_check_tenant.py``), its output read as it comes."""

    def __init__(
        self,
        a: Agent,
        user: pwd.struct_passwd,
        share: tuple[float, float, int] | Tenant,
        argv: list[str],
        preload: bool = True,
        record_share: bool = True,
        visible: str | None = None,
        labels: str | None = None,
    ) -> None:
        """``share``: (request, limit, memory) of a new share, or another tenant whose share's
        environment this one gets (it is then no share's process: ``record_share`` False)."""
        self.user = user
        # the share is recorded first for a placeholder process of the user, then the tenant
        # is started with its environment and named as the share's process
        self.holder = subprocess.Popen(
            ["sleep", "600"], user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/"
        )
        if isinstance(share, Tenant):
            self.allocation, gpus = share.allocation, share.gpus
        else:
            outcome = run_as(user, record, str(a.socket), *share, self.holder.pid, labels)
            assert outcome[0] == "ok", outcome
            self.allocation = Allocation.from_json(outcome[1]["allocation"])
            gpus = [Gpu.from_json(g) for g in outcome[1]["gpus"]]
        self.gpus = gpus
        env = {"PATH": "/usr/bin:/bin", "HOME": user.pw_dir}
        env.update(kernel_env(self.allocation, a.socket, gpus, base={}, preload=preload))
        env["GPUSHARE_SIM_STATE"] = str(a.socket.parent / "sim.state")
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        if not record_share:
            env.pop("GPUSHARE_ALLOCATION_ID", None)
        self.proc = subprocess.Popen(
            [python_for(user), str(TENANT), *argv],
            user=user.pw_uid,
            group=user.pw_gid,
            extra_groups=[],
            cwd="/",
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if record_share:  # the tenant is the share's process (a kernel's record)
            moved = run_as(user, _repoint, str(a.socket), self.allocation.id, self.proc.pid)
            assert moved[0] == "ok", moved
            self.holder.kill()
            self.holder.wait(10)
        self.lines: list[dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def go(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return time.monotonic_ns()

    def stop(self) -> None:
        for p in (self.proc, self.holder):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(10)

    def share_over(self, t0: int, t1: int) -> float:
        """Device time it reported in [t0, t1] (ns, CLOCK_MONOTONIC), as a fraction."""
        points = [(x["t"], x["done_us"]) for x in self.lines if "t" in x]
        before = max((p for p in points if p[0] <= t0), default=(t0, 0))
        after = max((p for p in points if p[0] <= t1), default=before)
        return (after[1] - before[1]) * 1000 / max(t1 - t0, 1)


async def _repoint(socket: str, allocation_id: str, pid: int) -> bool:
    from dataclasses import replace

    ledger = AgentLedger(socket)
    start = process_start_time(pid)
    await ledger.update(
        allocation_id,
        lambda a, _o: replace(
            a,
            pid=pid,
            pid_start=start,
            server_pid=pid,
            extra={**a.extra, "server_start": start},
        ),
    )
    return True


def share_status(a: Agent, allocation_id: str) -> dict[str, Any]:
    from jupyter_gpushare.daemon.client import DaemonClient

    reply = DaemonClient(a.socket).status(allocation_id)
    assert reply.get("ok"), reply
    return reply["allocations"][0]


def wait_until(predicate: Any, timeout: float) -> float | None:
    """Seconds until ``predicate()`` held, or None after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


# -- 2: memory ---------------------------------------------------------------------------------


def test_a_share_over_its_cap_by_its_own_account_is_stopped(agent) -> None:  # noqa: F811
    """Bob (cap 1 GiB) writes 0 to his account's ``mem_used`` before each allocation and takes
    79 GiB of the 80 GiB device; the driver reports it, the agent kills his process (SIGKILL,
    largest first) and says why in his share's status and its counters; Alice's 2 GiB inside
    her 4 GiB cap then succeeds. Before the driver check: Bob kept 79 GiB, Alice's allocation
    failed with CUDA_ERROR_OUT_OF_MEMORY."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent(simulate="1xA100")
    tenants = []
    try:
        attacker = Tenant(a, bob, (0.3, 0.3, GiB), ["alloc", str(79 * GiB), "1"])
        tenants.append(attacker)
        attacker.go()
        stopped = wait_until(lambda: attacker.proc.poll() is not None, 10)
        assert stopped is not None, f"bob's process still runs: {attacker.lines}"
        assert attacker.proc.returncode == -signal.SIGKILL
        print(f"bob stopped {stopped:.2f} s after he began allocating")
        mine = share_status(a, attacker.allocation.id)
        [event] = mine["driver_check"]["events"]
        assert event["cause"] == "memory" and event["action"] == "stopped"
        assert event["pids"] == [attacker.proc.pid]
        assert "over its cap of 1.00 GiB" in event["reason"]
        assert mine["gpus"][0]["memory_kills"] == 1

        victim = Tenant(a, alice, (0.3, 0.3, 4 * GiB), ["alloc", str(2 * GiB)])
        tenants.append(victim)
        victim.go()
        assert wait_until(lambda: victim.lines, 10) is not None
        assert victim.lines[0] == {"allocated": 2 * GiB, "error": 0}
        assert victim.proc.poll() is None  # alice's process lives on
        assert share_status(a, victim.allocation.id)["driver_check"] is None
    finally:
        for t in tenants:
            t.stop()


def test_processes_that_cleared_ld_preload_are_charged_or_stopped(agent) -> None:  # noqa: F811
    """Without the interposer (``LD_PRELOAD`` cleared, no ``hello``) Bob's processes still show
    in the driver's list: one on the GPU of his share is charged to it (5 GiB over his 1 GiB cap:
    stopped); one on a GPU where he holds no share is stopped whatever it holds; Alice's
    process there, inside her share, is left alone."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent(simulate="2xA100")
    tenants = []
    try:
        over = Tenant(
            a,
            bob,
            (0.2, 0.2, GiB),
            ["alloc", str(5 * GiB)],
            preload=False,
            record_share=False,
            labels="anti_affinity=split",
        )
        tenants.append(over)
        honest = Tenant(
            a, alice, (0.3, 0.3, 4 * GiB), ["alloc", str(2 * GiB)], labels="anti_affinity=split"
        )
        tenants.append(honest)
        assert honest.allocation.gpus != over.allocation.gpus
        # bob's second process runs on alice's GPU, where he holds no share
        elsewhere = Tenant(
            a,
            bob,
            over,
            ["alloc", str(256 * 2**20)],
            preload=False,
            record_share=False,
            visible=honest.allocation.gpus[0],
        )
        tenants.append(elsewhere)
        for t in tenants:
            t.go()
        assert wait_until(lambda: over.proc.poll() is not None, 10) is not None
        assert wait_until(lambda: elsewhere.proc.poll() is not None, 10) is not None
        assert over.proc.returncode == elsewhere.proc.returncode == -signal.SIGKILL
        time.sleep(1.0)
        assert honest.proc.poll() is None and honest.lines == [{"allocated": 2 * GiB, "error": 0}]
        from jupyter_gpushare.daemon.client import DaemonClient

        status = DaemonClient(a.socket).status()
        assert status["daemon"]["unshared_kills"] == 1
    finally:
        for t in tenants:
            t.stop()


# -- 3: garbage on one board --------------------------------------------------------------------


def heartbeat_age_s(a: Agent, uuid: str) -> float:
    board = a.dir / "shm" / f"{uuid}.board"
    header = wire.Header.from_buffer_copy(board.read_bytes()[: wire.HEADER_SIZE])
    return (time.clock_gettime_ns(time.CLOCK_MONOTONIC) - header.heartbeat_ns) / 1e9


def test_garbage_on_one_gpus_board_stops_nothing_else(agent) -> None:  # noqa: F811
    """Bob (a 0.01 share on GPU 0) writes random and out-of-range values over GPU 0's whole
    board as fast as he can for 4 s. The agent's loops go on: both boards' heartbeats stay
    fresh, Alice alone on GPU 1 at limit 0.5 keeps her 0.5, the agent logs no traceback. Before
    the range checks: ``IndexError`` in ``gpu_loop._sync_holder`` ended the agent's tick for
    every GPU, heartbeats went stale and Alice fell to her fail-static 0.3."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent(simulate="2xA100")
    tenants = []
    try:
        victim = Tenant(
            a, alice, (0.3, 0.5, GiB), ["spin", "9", "2000"], labels="anti_affinity=split"
        )
        tenants.append(victim)
        attacker = Tenant(a, bob, (0.01, 0.01, GiB), ["garbage", "4"], labels="anti_affinity=split")
        tenants.append(attacker)
        assert victim.allocation.gpus != attacker.allocation.gpus
        started = victim.go()
        time.sleep(2.0)
        attacker.go()
        time.sleep(4.5)
        uuids = [victim.allocation.gpus[0], attacker.allocation.gpus[0]]
        ages = [heartbeat_age_s(a, u) for u in uuids]
        assert wait_until(lambda: any(x.get("end") for x in victim.lines), 10) is not None
        writes = [x["writes"] for x in attacker.lines if "writes" in x]
        during = victim.share_over(started + int(3e9), started + int(8e9))
        before = victim.share_over(started + int(0.5e9), started + int(2e9))
        print(f"writes {writes}, alice before {before:.3f} during {during:.3f}, ages {ages}")
        assert writes and writes[0] > 100_000, attacker.lines
        assert max(ages) < 1.0, ages
        assert 0.42 <= during <= 0.56, during
        assert a.proc.poll() is None
        assert "Traceback" not in a.log.read_text()
        assert share_status(a, victim.allocation.id)["driver_check"] is None
    finally:
        for t in tenants:
            t.stop()


# -- 7: a forged lease --------------------------------------------------------------------------


def test_a_forged_lease_loses_the_board_and_the_request_holds(agent) -> None:  # noqa: F811
    """Bob (request and limit 0.3) keeps writing a lease into his own slot of the board and runs
    back to back; Alice (request 0.3, limit 1) runs back to back beside him. The driver's
    per-process device time shows Bob beyond his limit: his processes are paused (SIGSTOP, then
    SIGCONT), his status says why, and over 10 s Alice gets at least her request and Bob about
    his limit. Before the check: Bob 0.85, Alice 0.15."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent(simulate="1xA100")
    tenants = []
    try:
        victim = Tenant(a, alice, (0.3, 1.0, GiB), ["spin", "11", "2000"])
        tenants.append(victim)
        attacker = Tenant(a, bob, (0.3, 0.3, GiB), ["spin", "11", "2000", "1"])
        tenants.append(attacker)
        t0 = victim.go()
        attacker.go()
        assert wait_until(lambda: any(x.get("end") for x in victim.lines), 30) is not None
        alice_share = victim.share_over(t0 + int(0.5e9), t0 + int(10.5e9))
        attacker.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: any(x.get("end") for x in attacker.lines), 60) is not None
        bob_share = attacker.share_over(t0 + int(0.5e9), t0 + int(10.5e9))
        print(f"over 10 s: alice {alice_share:.3f}, bob {bob_share:.3f}")
        events = share_status(a, attacker.allocation.id)["driver_check"]["events"]
        assert events and {e["cause"] for e in events} <= {"over_limit", "took_request"}
        assert all(e["action"] == "paused" for e in events)
        assert share_status(a, victim.allocation.id)["driver_check"] is None
        assert alice_share >= 0.3, (alice_share, bob_share)
        assert bob_share <= 0.4, (alice_share, bob_share)
    finally:
        for t in tenants:
            t.stop()


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_processes_paused_by_an_agent_that_died_are_resumed_by_the_next(agent) -> None:  # noqa: F811
    """The agent is killed (SIGKILL) while Bob's forging process is paused: the next agent
    (same state directory) resumes it first, identified by uid and start time, so a pause never
    outlives the agent that made it."""
    bob = unix_user(BOB)
    a = agent(simulate="1xA100")
    attacker = Tenant(a, bob, (0.3, 0.3, GiB), ["spin", "30", "2000", "1"])
    again = None
    try:
        attacker.go()
        paused = wait_until(lambda: process_state(attacker.proc.pid) == "T", 15)
        assert paused is not None, "bob was not paused"
        a.proc.kill()
        a.proc.wait(10)
        again = Agent(a.dir, simulate="1xA100")
        resumed = wait_until(lambda: process_state(attacker.proc.pid) != "T", 10)
        assert resumed is not None, "bob's process stayed stopped"
        assert "paused by an earlier agent" in a.log.read_text()
    finally:
        attacker.stop()
        if again is not None:
            again.stop()
