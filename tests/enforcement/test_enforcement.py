"""End to end on the simulated GPU: a real daemon process, a real SQLite ledger, tenants that
drive the simulated driver with libgpushare.so preloaded.

Shares are measured by the tenants themselves (device time of the kernels they saw complete), over
5 s of steady state (5 scheduler windows of 1 s) rather than the promise's 10 s, to keep the
default run short; benchmarks/enforcement.py measures 10 s windows.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from enforcement_support import (
    GiB,
    add_allocation,
    remove_allocation,
    restart_daemon,
    shares,
    spawn_tenant,
    start_daemon,
)

from jupyter_gpushare.ledger.sqlite import SQLiteLedger

pytestmark = pytest.mark.timeout(120)

SPIN = ["spin", "7", "1000", "8"]  # 7 s of 1 ms kernels, batches of 8, one batch queued


def steady(tenants, skip=1.5, length=5.0):
    t0 = max(t.lines[0]["start"] for t in tenants) + int(skip * 1e9)
    return shares(tenants, t0, t0 + int(length * 1e9))


def test_two_tenants_get_their_requests(daemon, ledger, gpus, tmp_path):
    a = add_allocation(ledger, gpus[0], 0.3, 0.3)
    b = add_allocation(ledger, gpus[0], 0.7, 0.7)
    ta = spawn_tenant(daemon, ledger, a, gpus, SPIN, tmp_path)
    tb = spawn_tenant(daemon, ledger, b, gpus, SPIN, tmp_path)
    ta.finish()
    tb.finish()
    sa, sb = steady([ta, tb])
    # nobody exceeds its limit, tightly: a busy host can only slow a tenant down, never lend it
    # device time. Delivery is held to the regression cells' 0.05: on a loaded 2-core host a
    # tenant starved of CPU launches late (0.7 got 0.670-0.675 under two busy loops, load 8.5)
    assert sa <= 0.3 + 0.03 and sb <= 0.7 + 0.03, (sa, sb)
    assert sa >= 0.3 - 0.05 and sb >= 0.7 - 0.05, (sa, sb)


def test_limit_alone_and_work_conserving(daemon, ledger, gpus, tmp_path):
    capped = add_allocation(ledger, gpus[0], 0.5, 0.5)
    t = spawn_tenant(daemon, ledger, capped, gpus, ["spin", "4.5", "1000", "8"], tmp_path)
    t.finish()
    (share,) = steady([t], skip=1.0, length=3.0)
    assert share <= 0.53, share
    assert share >= 0.40, share  # and it does run
    remove_allocation(ledger, capped.id)
    burst = add_allocation(ledger, gpus[0], 0.3, 1.0)
    t = spawn_tenant(daemon, ledger, burst, gpus, ["spin", "4.5", "1000", "8"], tmp_path)
    t.finish()
    (share,) = steady([t], skip=1.0, length=3.0)
    assert share >= 0.95, share


def run_shape(daemon, ledger, gpus, tmp_path, specs, kernel_us, pattern, length=6.0):
    """Tenants of one workload shape (gs_tenant load) at (request, limit) each: their shares
    over `length` s after 1.5 s of warm-up."""
    allocations = [add_allocation(ledger, gpus[0], r, lim) for r, lim in specs]
    argv = ["load", str(length + 2.0), str(kernel_us), pattern]
    tenants = [spawn_tenant(daemon, ledger, a, gpus, argv, tmp_path) for a in allocations]
    for t in tenants:
        t.finish(timeout=60)
    for a in allocations:
        remove_allocation(ledger, a.id)
    return steady(tenants, length=length)


# Regression cells of benchmarks/enforcement.py's matrix (tight figures stay there): windows of
# 6 s and a tolerance of 0.05 that hold on a loaded 2-core machine.


def test_limit_holds_with_kernels_longer_than_the_quantum(daemon, ledger, gpus, tmp_path):
    """50 ms kernels (2.5 quanta), a sync after each: every lease runs past its quantum; the
    overrun is charged and paid back, the limit holds and is delivered."""
    (share,) = run_shape(daemon, ledger, gpus, tmp_path, [(0.5, 0.5)], 50_000, "sync")
    assert abs(share - 0.5) <= 0.05, share


def test_long_kernels_keep_the_device_busy(daemon, ledger, gpus, tmp_path):
    """0.3/0.7 at their limits with 100 ms kernels (5 quanta): a lease's credit is not capped
    while it runs, so neither tenant sits in debt at the same time as the other (the device
    idled 15 % of the time and the 0.7 tenant got 0.55)."""
    a, b = run_shape(daemon, ledger, gpus, tmp_path, [(0.3, 0.3), (0.7, 0.7)], 100_000, "sync")
    assert abs(a - 0.3) <= 0.05 and abs(b - 0.7) <= 0.05, (a, b)
    assert a + b >= 0.92, (a, b)


def test_deep_queues_are_bounded_on_a_shared_gpu(daemon, ledger, gpus, tmp_path):
    """Deep asynchronous queues (2 s of 10 ms kernels queued ahead without a bound): every
    tenant of a shared GPU queues at most the runahead bound, so a lease is not charged for
    seconds of work queued under it and the device stays busy."""
    a, b = run_shape(daemon, ledger, gpus, tmp_path, [(0.3, 0.3), (0.7, 0.7)], 10_000, "deep")
    assert abs(a - 0.3) <= 0.05 and abs(b - 0.7) <= 0.05, (a, b)
    assert a + b >= 0.92, (a, b)


def test_a_shares_queue_bound_holds_across_its_processes(daemon, ledger, gpus, tmp_path):
    """The runahead bound is the share's, not each process's: a kernel and a subprocess of one
    share (limit 0.5 alone: a bound of one 20 ms quantum), each with a deep queue of 1 ms
    kernels, run their leases' work at most about one bound past the lease end together
    (each queued a whole bound: half the leases ran 2 x 20 ms past their end). Measured by the
    daemon on the device's clock (drain end - lease end), the median over ~50 leases."""
    a = add_allocation(ledger, gpus[0], 0.5, 0.5)
    t = spawn_tenant(
        daemon,
        ledger,
        a,
        gpus,
        ["load", "4", "1000", "deep"],
        tmp_path,
        extra_env={"GS_TENANT_PROCESSES": "2"},
    )
    time.sleep(3.5)
    overrun = daemon.client.status()["gpus"][0]["overrun_us"]
    lines = t.finish(timeout=60)
    remove_allocation(ledger, a.id)
    ranks = {x["q"] // 16 for x in lines if "q" in x}  # a forked tenant numbers from 16
    assert ranks == {0, 1}, ranks  # both processes ran and finished their queues
    assert overrun["n"] >= 20, overrun
    assert overrun["p50"] <= 1.5 * 20_000, overrun


def test_spare_time_follows_requests_with_long_kernels(daemon, ledger, gpus, tmp_path):
    """Requests 0.2/0.3 with limits 1.0 share the device 0.4/0.6. With 50 ms kernels and a
    sync after each, a holder waiting for its kernel is not idle: its lease is extended when
    the daemon ranks it next (it was handed to the other tenant at every kernel: 0.5/0.5)."""
    a, b = run_shape(daemon, ledger, gpus, tmp_path, [(0.2, 1.0), (0.3, 1.0)], 50_000, "sync")
    assert abs(a - 0.4) <= 0.05 and abs(b - 0.6) <= 0.05, (a, b)


def test_idle_tenant_time_is_taken_up(daemon, ledger, gpus, tmp_path):
    a = add_allocation(ledger, gpus[0], 0.3, 1.0)
    b = add_allocation(ledger, gpus[0], 0.7, 1.0)
    ta = spawn_tenant(daemon, ledger, a, gpus, ["spin", "6", "1000", "8"], tmp_path)
    tb = spawn_tenant(daemon, ledger, b, gpus, ["spin", "2.5", "1000", "8"], tmp_path)
    tb.finish()
    ta.finish()
    stop = tb.lines[-1]["t"]
    start = max(ta.lines[0]["start"], tb.lines[0]["start"])
    before = shares([ta, tb], start + int(0.8e9), stop - int(0.2e9))
    assert 0.22 <= before[0] <= 0.38 and before[1] >= 0.55, before  # both ran, b more
    # within one window (1 s) after b went idle, a has the GPU
    after = shares([ta], stop + int(1e9), stop + int(3e9))
    assert after[0] >= 0.93, after


def test_small_launch_next_to_saturating_neighbour(daemon, ledger, gpus, tmp_path):
    big = add_allocation(ledger, gpus[0], 0.5, 1.0)
    small = add_allocation(ledger, gpus[0], 0.5, 1.0)
    # the neighbour queues 16-24 ms of work ahead by itself (batches of 8 x 1 ms, two in flight)
    tb = spawn_tenant(daemon, ledger, big, gpus, ["spin", "5", "1000", "8"], tmp_path)
    time.sleep(0.5)
    ts = spawn_tenant(daemon, ledger, small, gpus, ["small", "3.5", "20"], tmp_path)
    (result,) = ts.finish()
    tb.finish()
    # the neighbour runs above its request, so its queue is bounded (an eighth of the 20 ms
    # quantum) and the small tenant preempts it: typically ~3 ms (a deep queue alone would make
    # it >= 16 ms). The tail within a quantum is benchmarks/enforcement.py's figure (--only
    # small): p99 is the 2nd-worst of ~150 waits, and a 2-core host under load delays a process
    # or two by tens of ms by itself (p99 52 ms, p50 2.9 ms under two busy loops, load 8.5). A
    # lease stuck until the window's end (1 s) shows here still
    assert result["n"] > 50
    assert result["p50_us"] <= 10_000, result
    assert result["p99_us"] <= 100_000, result  # 5 quanta
    # handoffs go from process to process (the daemon is not on the path)
    gpu = daemon.client.status()["gpus"][0]
    assert gpu["preemptions"] >= result["n"] // 2, gpu
    assert gpu["direct_handoffs"] >= 0.8 * gpu["handoffs"], gpu


def test_memory_cap_under_concurrency(daemon, ledger, gpus, tmp_path):
    cap = 64 * 2**20
    allocations = [add_allocation(ledger, gpus[0], 0.2, 1.0, memory=cap) for _ in range(4)]
    tenants = [
        spawn_tenant(
            daemon, ledger, a, gpus, ["mem", "8", "400", str(16 * 2**20), str(i)], tmp_path
        )
        for i, a in enumerate(allocations)
    ]
    results = [t.finish()[-1] for t in tenants]
    for t, r in zip(tenants, results, strict=True):
        assert t.proc.returncode == 0, (r, t.stderr)
        assert r["errors"] == 0 and r["over_cap"] == 0, r
        assert r["total"] == cap, r
        assert r["ooms"] > 0, r  # the cap was reached, and refused with OUT_OF_MEMORY
        assert r["free_after"] == cap, r  # nothing leaked
    status = daemon.client.status()
    for allocation in status["allocations"]:
        g = allocation["gpus"][0]
        assert g["memory_peak"] <= g["memory_cap"] == cap
        assert g["memory_used"] == 0
        assert g["oom_refusals"] > 0


def test_memory_info_reports_the_cap(daemon, ledger, gpus, tmp_path):
    a = add_allocation(ledger, gpus[0], 0.2, 1.0, memory=3 * GiB)
    (info,) = spawn_tenant(daemon, ledger, a, gpus, ["info"], tmp_path).finish()
    assert info["total"] == info["device_total"] == 3 * GiB
    assert info["free"] == 3 * GiB
    assert info["over_total"] == 2  # CUDA_ERROR_OUT_OF_MEMORY


def test_refused_without_or_with_someone_elses_allocation(daemon, ledger, gpus, tmp_path):
    t = spawn_tenant(daemon, ledger, None, gpus, SPIN, tmp_path)
    lines = t.finish()
    assert t.proc.returncode == 3, (lines, t.stderr)
    assert lines[-1]["error"] == 800  # CUDA_ERROR_NOT_PERMITTED
    assert "GPUSHARE_ALLOCATION_ID" in t.stderr
    other = add_allocation(ledger, gpus[0], 0.5, 1.0, pid=daemon.proc.pid)  # someone else's
    t = spawn_tenant(daemon, ledger, other, gpus, SPIN, tmp_path, register=False)
    lines = t.finish()
    assert t.proc.returncode == 3, (lines, t.stderr)
    assert "is not allocation" in t.stderr
    assert daemon.client.status()["daemon"]["refused"] >= 1  # the first never got to ask


def test_released_share_refuses_further_work(daemon, ledger, gpus, tmp_path):
    a = add_allocation(ledger, gpus[0], 0.5, 1.0)
    t = spawn_tenant(daemon, ledger, a, gpus, ["spin", "20", "1000", "4"], tmp_path)
    time.sleep(1.5)
    remove_allocation(ledger, a.id)
    lines = t.finish(timeout=15)
    assert t.proc.returncode == 3, (lines[-1], t.stderr)
    assert lines[-1]["error"] == 800
    assert "released" in t.stderr


def test_daemon_kill9_fail_static_and_takeover(daemon, ledger, gpus, tmp_path):
    a = add_allocation(ledger, gpus[0], 0.3, 0.3)
    b = add_allocation(ledger, gpus[0], 0.7, 0.7)
    held = {"GS_TENANT_HOLD_BYTES": str(3 * 2**20)}
    # long enough that the measured stretch after the takeover fits in the run even when the new
    # daemon is slow to start on a loaded host
    ta = spawn_tenant(
        daemon, ledger, a, gpus, ["spin", "13", "1000", "8"], tmp_path, extra_env=held
    )
    tb = spawn_tenant(daemon, ledger, b, gpus, ["spin", "13", "1000", "8"], tmp_path)
    time.sleep(2.0)
    daemon.kill9()
    time.sleep(1.5)  # fail static: each runs at its request share on its own
    new = restart_daemon(daemon)
    try:
        deadline = time.monotonic() + 15  # the tenants' reconnects, on a loaded host too
        while time.monotonic() < deadline:
            status = new.client.status()
            if all(x["connected"] for x in status["allocations"]):
                break
            time.sleep(0.1)
        assert all(x["connected"] for x in status["allocations"]), status
        # the memory ledger survived the crash (shared-memory files are reused)
        used = {x["id"]: x["memory_used"] for x in status["allocations"]}
        assert used == {a.id: 3 * 2**20, b.id: 0}, used
        restarted = time.monotonic_ns()
        ta.finish()
        tb.finish()
        assert ta.proc.returncode == 0 and tb.proc.returncode == 0, (ta.stderr, tb.stderr)
        # enforced again within a few windows (1 s each): measured from 1.5 s after the
        # takeover for up to 3.5 s, ending before the tenants do
        end = min(t.lines[-1]["t"] for t in (ta, tb)) - int(0.3e9)
        lo, hi = restarted + int(1.5e9), min(restarted + int(5e9), end)
        assert hi - lo >= int(1.5e9), "the takeover took too long to measure after it"
        sa, sb = shares([ta, tb], lo, hi)
        assert abs(sa - 0.3) <= 0.05 and abs(sb - 0.7) <= 0.05, (sa, sb)
    finally:
        new.stop()


def test_forked_children_share_one_budget(daemon, ledger, gpus, tmp_path):
    a = add_allocation(ledger, gpus[0], 0.4, 0.4)
    t = spawn_tenant(daemon, ledger, a, gpus, ["fork", "4", "1000"], tmp_path)
    lines = t.finish()
    assert t.proc.returncode == 0, (lines, t.stderr)
    child = next(x for x in lines if x.get("who") == "child")
    parent = next(x for x in lines if x.get("who") == "parent")
    assert parent["child_status"] == 0
    total = (child["done_us"] + parent["done_us"]) / 4e6
    assert child["done_us"] > 0 and parent["done_us"] > 0
    assert total <= 0.4 + 0.05, total


def test_live_resize(daemon, ledger, gpus, tmp_path):
    from dataclasses import replace

    a = add_allocation(ledger, gpus[0], 0.2, 0.2)
    t = spawn_tenant(daemon, ledger, a, gpus, ["spin", "6", "1000", "8"], tmp_path)
    time.sleep(2.5)
    changed_at = time.monotonic_ns()
    snap = ledger.snapshot_sync()
    current = snap.find(a.id)
    spec = replace(current.spec, gpu_request=0.6, gpu_limit=0.6)
    rest = [x for x in snap.on_node(current.node) if x.id != a.id]
    assert ledger.compare_and_swap_sync(
        current.node, snap.versions[current.node], [*rest, replace(current, spec=spec)]
    )
    t.finish()
    start = t.lines[0]["start"]
    (before,) = shares([t], start + int(0.8e9), changed_at)
    (after,) = shares([t], changed_at + int(1.2e9), changed_at + int(3.2e9))
    assert abs(before - 0.2) <= 0.04, before
    assert abs(after - 0.6) <= 0.05, after


def test_metrics_and_status(built, tmp_path: Path, gpus):
    d = start_daemon(tmp_path, extra=("--metrics-port", "-1"))
    try:
        ledger = SQLiteLedger(d.ledger_path)
        a = add_allocation(ledger, gpus[0], 0.25, 0.5, memory=GiB)
        d.client.refresh()
        status = d.client.status(a.id)
        assert status["ok"] and status["allocations"][0]["memory_cap"] == GiB
        assert not d.client.status("a-unknown")["ok"]
        port = d.client.status()["daemon"]["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        text = text.decode()
        [cap] = [
            line for line in text.splitlines() if line.startswith("gpushare_allocation_memory_cap_")
        ]
        assert f'allocation="{a.id}"' in cap and f'UUID="{gpus[0].uuid}"' in cap, cap
        assert float(cap.rsplit(" ", 1)[1]) == GiB, cap
        assert "gpushare_allocation_share{" in text and "gpushare_daemon_clients" in text
    finally:
        d.stop()


LAUNCHES = [
    "cuLaunchKernel",
    "cuLaunchKernel_ptsz",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch",
]
ALLOCATIONS = [
    "cuMemAlloc_v2",
    "cuMemAllocPitch_v2",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemCreate",
    "cuArrayCreate_v2",
]


def test_every_path_is_enforced(daemon, ledger, gpus, tmp_path):
    """All launch and allocation paths, reached through cuGetProcAddress_v2 (as the CUDA runtime
    does, including the per-thread-stream variant): allowed under a share, refused without."""
    a = add_allocation(ledger, gpus[0], 0.5, 1.0, memory=GiB)
    (ok,) = spawn_tenant(daemon, ledger, a, gpus, ["paths"], tmp_path).finish()
    for name in LAUNCHES + ALLOCATIONS + ["captured_launch"]:
        assert ok[name] == 0, (name, ok)
    status = daemon.client.status(a.id)["allocations"][0]["gpus"][0]
    assert status["memory_used"] == 0 and status["memory_peak"] >= 2 << 20  # cuMemCreate
    # a process without a share cannot even get a context
    refused = spawn_tenant(daemon, ledger, None, gpus, ["paths"], tmp_path)
    (no,) = refused.finish()
    assert no["error"] == 800 and refused.proc.returncode == 3
    # a share released while the process runs: every path is refused from then on
    b = add_allocation(ledger, gpus[0], 0.5, 1.0, memory=GiB)
    gate = tmp_path / "release-gate"
    t = spawn_tenant(
        daemon, ledger, b, gpus, ["paths"], tmp_path, extra_env={"GS_TENANT_GATE2": str(gate)}
    )
    assert t.proc.stdout.readline().startswith('{"ready"')
    remove_allocation(ledger, b.id)
    daemon.client.refresh()
    gate.touch()
    (released,) = t.finish()
    # the tenant freed its memory (gpushare_release_memory, as the notebook side does) before
    # trying the paths: none of it was tracked (-1 would be: the release was not seen)
    assert released["released_bytes"] == 0, released
    for name in LAUNCHES + ALLOCATIONS:
        assert released[name] == 800, (name, released)  # CUDA_ERROR_NOT_PERMITTED
    # captured while the share held (captured work is not run): launching that graph after the
    # release is refused like any launch (cuGraphLaunch, in LAUNCHES)
    assert released["captured_launch"] == 0
    assert "released" in t.stderr
