"""Fail static (DESIGN.md, box 7): while no agent answers (an agent killed, or between the old and
the new pod of a DaemonSet rollout) each kernel grants itself leases at its request share, and so
stays inside its limit.

A self-granted lease of one quantum leaves up to the runahead bound the agent last published
queued at its end; the interposer counts that work before its next lease (it once counted only
the lease: a saturating tenant at request = limit = 0.3 then ran at 0.6 with no agent).
"""

from __future__ import annotations

import time

import pytest
from enforcement_support import add_allocation, shares, spawn_tenant


@pytest.mark.parametrize("requests", [(0.3,), (0.2, 0.5)], ids=["alone", "two tenants"])
def test_with_no_agent_each_kernel_runs_at_its_request_share(
    daemon, ledger, gpus, tmp_path, requests
):
    allocations = [add_allocation(ledger, gpus[0], r, r) for r in requests]
    tenants = [
        spawn_tenant(daemon, ledger, a, gpus, ["spin", "8", "1000", "8"], tmp_path)
        for a in allocations
    ]
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
    print(f"no agent, requests = limits {requests}: shares {[round(s, 3) for s in got]}")
    for request, share in zip(requests, got, strict=True):
        assert share <= request + 0.05, (requests, got)  # inside its limit
    if len(requests) == 1:
        assert got[0] >= requests[0] - 0.1, got  # ... and it keeps its request
    else:  # uncoordinated, the tenants' own leases overlap now and then: less for each
        assert min(got) > 0 and sum(got) >= 0.7 * sum(requests), (requests, got)
