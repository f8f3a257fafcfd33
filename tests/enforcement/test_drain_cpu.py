"""A lease's drain waits for the device by sleeping, not by spinning (issue 18).

The draining holder's agent thread used to sleep until shortly before the estimated end of its
queued work and then poll the device. On an idle host that was fast; on a busy one the polling
thread used up its scheduler slice and was preempted for milliseconds right at the handoff
(handoff p99 4 ms against the host's 0.25 ms floor, 2 CPU-bound processes beside 2 tenants on
2 cores: benchmarks/handoff.py). It now sleeps on blocking-sync events until the device signals
them, so its CPU time per lease is a few wake-ups' worth. The promise is checked where it can be
on a loaded machine: the agent threads' CPU time (schedstat, ns) per lease, not latencies (those
are in benchmarks/handoff.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from enforcement_support import add_allocation, spawn_tenant, start_daemon

from jupyter_gpushare.ledger.sqlite import SQLiteLedger

pytestmark = pytest.mark.timeout(120)


def agent_cpu_ns(pid: int) -> int:
    """CPU time of the process's gpushare agent thread (named by the interposer)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == "gpushare-agent":
                return int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue
    raise AssertionError(f"no gpushare-agent thread in process {pid}")


def test_a_drain_sleeps_until_the_device_is_done(tmp_path, gpus):
    """Two saturating tenants, 5 ms leases of 1 ms kernels (every lease ends in a drain and a
    handoff): their agents use under 250 us of CPU per lease (100-136 us measured, 136 in a
    whole CI run). Polling from 0.2 ms before each estimated end used 450-496 us per lease
    here."""
    daemon = start_daemon(tmp_path, quantum_ms=5)
    try:
        ledger = SQLiteLedger(daemon.ledger_path)
        allocations = [add_allocation(ledger, gpus[0], 0.5, 0.5) for _ in range(2)]
        argv = ["spin", "6", "1000", "8"]
        tenants = [
            spawn_tenant(daemon, ledger, a, gpus, argv, tmp_path, drain=True) for a in allocations
        ]
        time.sleep(1.5)  # past the first leases (stream set-up, the first marks)
        cpu0 = sum(agent_cpu_ns(t.proc.pid) for t in tenants)
        leases0 = daemon.client.status()["gpus"][0]["handoffs"]
        time.sleep(3.0)
        cpu1 = sum(agent_cpu_ns(t.proc.pid) for t in tenants)
        leases1 = daemon.client.status()["gpus"][0]["handoffs"]
        for t in tenants:
            t.finish(timeout=60)
    finally:
        daemon.stop()
    leases = leases1 - leases0
    assert leases >= 100, leases  # 5 ms leases for 3 s: ~600 on an idle host
    per_lease_us = (cpu1 - cpu0) / leases / 1e3
    assert per_lease_us < 250, f"{per_lease_us:.0f} us of agent CPU per lease ({leases} leases)"
