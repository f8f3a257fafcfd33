"""Validate enforcement on a real NVIDIA GPU with PyTorch (standalone; no Jupyter needed).

Builds libgpushare.so, starts its own node daemon with a temporary SQLite ledger, and runs
PyTorch tenants as separate processes with the interposer preloaded:

  1. two saturating matmul tenants at request = limit 0.3 and 0.7 (target 0.3 / 0.7 +- 0.03);
  2. one tenant with limit 0.5 alone (target <= 0.53);
  3. a memory cap: torch.empty within the cap works, beyond it raises OutOfMemoryError, and
     torch.cuda.mem_get_info() reports the cap as the total;
  4. the slowdown of a small-kernel loop with and without the interposer (target <= 2 %);
  5. the lease handoff during (1): the daemon's handoff gaps (device end -> next holder's first
     launch) next to the host's own timer + futex wake-up floor probed at the same time (a blocking-
     sync event wakes the draining agent from the GPU's completion interrupt: what it costs on a
     real GPU is what this measures; target p99 <= 1.2 x the floor, benchmarks/handoff.py);
  6. the matrix of benchmarks/enforcement.py where PyTorch can express it: matmuls of about
     0.1 ms, 3 ms and 70 ms (longer than the quantum) x a sync after every launch, a deep queue
     (a sync every 256), four streams, CUDA graph replays; 0.3/0.7 and a limit 0.5 alone each;
  7. host-bound training loops (issue 26): a small MLP's step (hidden sizes 512 and 2048) with
     `loss.item()` every step, so the host waits after each step. The same tenants run without
     gpushare (plain processes, together) and with it (0.3/0.7 at their limits, requests 0.2/0.3
     with limit 1.0, 8 x 0.125): the ratio of their total steps per second with to without
     gpushare (target >= 0.97: the holder's host gaps are backfilled by the others), and each
     tenant's part next to its fair part (by request, up to its limit).

A tenant's share is its matmul throughput divided by the throughput of the same loop running
alone without gpushare (measured first). Prints a table and ends with one JSON line.
Where there is no GPU (or no PyTorch with CUDA) it prints "no GPU" and exits 0.

Run: python benchmarks/gpu_validate.py [--seconds 10] [--only item]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30

TENANT = textwrap.dedent(
    """
    import json, os, sys, time
    gate = os.environ.get("GS_TENANT_WAIT_FILE")
    while gate and not os.path.exists(gate):
        time.sleep(0.002)
    import torch
    mode, seconds = sys.argv[1], float(sys.argv[2])
    dev = torch.device("cuda")
    if mode == "matmul":
        a = torch.randn(4096, 4096, device=dev)
        b = torch.randn(4096, 4096, device=dev)
        torch.cuda.synchronize()
        start = time.monotonic_ns()
        end = start + int(seconds * 1e9)
        done = 0
        print(json.dumps({"start": start}), flush=True)
        while time.monotonic_ns() < end:
            for _ in range(4):
                c = a @ b
            torch.cuda.synchronize()
            done += 4
            print(json.dumps({"t": time.monotonic_ns(), "done": done}), flush=True)
    elif mode == "shape":
        # one workload shape of benchmarks/enforcement.py's matrix: n x n matmuls launched as
        # `pattern` says; progress lines count completed matmuls
        n, pattern = int(sys.argv[3]), sys.argv[4]
        a = torch.randn(n, n, device=dev)
        b = torch.randn(n, n, device=dev)
        c = torch.empty(n, n, device=dev)
        streams = [torch.cuda.Stream() for _ in range(4)]
        graph = None
        if pattern == "graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    torch.matmul(a, b, out=c)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(8):
                    torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        start = time.monotonic_ns()
        end = start + int(seconds * 1e9)
        done = 0
        print(json.dumps({"start": start}), flush=True)
        while time.monotonic_ns() < end:
            if pattern == "sync":  # a sync after every launch
                torch.matmul(a, b, out=c)
                torch.cuda.synchronize()
                done += 1
            elif pattern == "deep":  # far ahead: a sync every 256 launches
                for _ in range(256):
                    torch.matmul(a, b, out=c)
                torch.cuda.synchronize()
                done += 256
            elif pattern == "streams":  # four streams, 8 launches each, then a sync
                for s in streams:
                    with torch.cuda.stream(s):
                        for _ in range(8):
                            torch.matmul(a, b, out=c)
                torch.cuda.synchronize()
                done += 32
            else:  # graph: two replays of 8 matmuls, then a sync
                graph.replay()
                graph.replay()
                torch.cuda.synchronize()
                done += 16
            print(json.dumps({"t": time.monotonic_ns(), "done": done}), flush=True)
    elif mode == "item":
        # a host-bound training step: a small MLP forward and backward, then loss.item() (the
        # host waits for the step's result, as most training loops do every step)
        n = int(sys.argv[3])
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(n, n), torch.nn.ReLU(), torch.nn.Linear(n, n), torch.nn.ReLU(),
            torch.nn.Linear(n, 1),
        ).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        x = torch.randn(256, n, device=dev)
        y = torch.randn(256, 1, device=dev)
        for _ in range(20):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
        # every 20th step is timed on the device (events around its work): alone on the GPU,
        # the device time of a step
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timed, timed_ms = 0, 0.0
        start = time.monotonic_ns()
        end = start + int(seconds * 1e9)
        done = 0
        print(json.dumps({"start": start}), flush=True)
        while time.monotonic_ns() < end:
            timing = done % 20 == 0
            if timing:
                ev0.record()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if timing:
                ev1.record()
            loss.item()
            if timing:
                timed, timed_ms = timed + 1, timed_ms + ev0.elapsed_time(ev1)
            done += 1
            if done % 20 == 0:
                print(json.dumps({"t": time.monotonic_ns(), "done": done}), flush=True)
        print(json.dumps({"step_device_ms": timed_ms / max(timed, 1)}), flush=True)
    elif mode == "small":
        x = torch.zeros(1, device=dev)
        for _ in range(2000):
            x.add_(1)
        torch.cuda.synchronize()
        best = None
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20000):
                x.add_(1)
            torch.cuda.synchronize()
            took = (time.perf_counter() - t0) / 20000
            best = took if best is None else min(best, took)
        print(json.dumps({"us_per_iter": best * 1e6}), flush=True)
    elif mode == "memory":
        free, total = torch.cuda.mem_get_info()
        out = {"total": total, "free": free}
        keep = torch.empty(int(sys.argv[3]), dtype=torch.uint8, device=dev)
        out["within_cap"] = True
        try:
            more = torch.empty(int(sys.argv[4]), dtype=torch.uint8, device=dev)
            out["beyond_cap"] = "allocated"
        except torch.cuda.OutOfMemoryError:
            out["beyond_cap"] = "OutOfMemoryError"
        print(json.dumps(out), flush=True)
    """
)


def has_gpu() -> str | None:
    """None when a CUDA GPU and PyTorch with CUDA are usable, else the reason."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed"
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(torch.cuda.is_available() and torch.cuda.device_count())",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        timeout=120,
    )
    if probe.returncode != 0 or probe.stdout.strip() in ("", "False", "0"):
        return "torch.cuda.is_available() is False"
    return None


class Rig:
    """A daemon on this machine's real GPUs with a temporary ledger."""

    def __init__(self, tmp: Path) -> None:
        from jupyter_gpushare.inventory import discover_local, local_node_name
        from jupyter_gpushare.ledger.sqlite import SQLiteLedger

        self.tmp = tmp
        self.node = local_node_name()
        self.gpus = discover_local(None, node=self.node)
        self.socket = tmp / "daemon.sock"
        self.ledger = SQLiteLedger(tmp / "ledger.sqlite")
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        self.log = open(tmp / "daemon.log", "ab")
        self.daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare.daemon",
                "--socket",
                str(self.socket),
                "--ledger",
                str(tmp / "ledger.sqlite"),
                "--node",
                self.node,
                "--state-dir",
                str(tmp / "shm"),
            ],
            stdout=self.log,
            stderr=self.log,
            env=env,
        )
        from jupyter_gpushare.daemon.client import DaemonClient

        deadline = time.monotonic() + 30
        while not DaemonClient(self.socket).alive():
            if time.monotonic() > deadline or self.daemon.poll() is not None:
                raise RuntimeError("daemon did not start: " + (tmp / "daemon.log").read_text())
            time.sleep(0.1)

    def allocate(self, request: float, limit: float, memory: int | None = None):
        from jupyter_gpushare.ledger import Allocation
        from jupyter_gpushare.share import ShareSpec

        gpu = self.gpus[0]
        memory = memory or gpu.memory
        spec = ShareSpec(gpu_request=request, gpu_limit=limit, gpu_memory=memory, gpu_type=gpu.type)
        allocation = Allocation(
            id=Allocation.new_id(), node=self.node, gpus=(gpu.uuid,), spec=spec, memory=memory
        )
        while True:
            snap = self.ledger.snapshot_sync()
            if self.ledger.compare_and_swap_sync(
                self.node, snap.versions.get(self.node, 0), [*snap.on_node(self.node), allocation]
            ):
                return allocation

    def release(self, allocation) -> None:
        while True:
            snap = self.ledger.snapshot_sync()
            rest = [a for a in snap.on_node(self.node) if a.id != allocation.id]
            if self.ledger.compare_and_swap_sync(self.node, snap.versions.get(self.node, 0), rest):
                return

    def spawn(self, allocation, argv: list[str]) -> subprocess.Popen[str]:
        """A tenant under `allocation` (None: without gpushare)."""
        from dataclasses import replace

        import psutil

        from jupyter_gpushare.daemon.env import kernel_env

        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        gate = self.tmp / f"gate-{time.monotonic_ns()}"
        env["GS_TENANT_WAIT_FILE"] = str(gate)
        if allocation is not None:
            env.update(kernel_env(allocation, self.socket, self.gpus))
        else:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[0].uuid
        proc = subprocess.Popen(
            [sys.executable, "-c", TENANT, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        if allocation is not None:
            start = psutil.Process(proc.pid).create_time()
            while True:
                snap = self.ledger.snapshot_sync()
                rest = [a for a in snap.on_node(self.node) if a.id != allocation.id]
                mine = replace(allocation, pid=proc.pid, pid_start=start, state="active")
                if self.ledger.compare_and_swap_sync(
                    self.node, snap.versions[self.node], [*rest, mine]
                ):
                    break
        gate.touch()
        return proc

    def close(self) -> None:
        self.daemon.terminate()
        self.daemon.wait(10)
        self.log.close()


def lines_of(proc: subprocess.Popen[str], timeout: float) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"tenant failed ({proc.returncode}): {err[-3000:]}")
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def rate(lines: list[dict], t0: int, t1: int) -> float:
    points = [(x["t"], x["done"]) for x in lines if "t" in x]
    a = max((p for p in points if p[0] <= t0), default=points[0])
    b = min((p for p in points if p[0] >= t1), default=points[-1])
    return (b[1] - a[1]) / max((b[0] - a[0]) / 1e9, 1e-9)


#: the matrix's kernel lengths as matmul sizes (fp32 on an A100/H100: roughly 0.1 ms, 3 ms and
#: 70 ms per matmul: the last is longer than the 20 ms quantum)
MATRIX_SIZES = (1024, 4096, 12288)
MATRIX_PATTERNS = ("sync", "deep", "streams", "graph")


#: the daemon's default quantum: the cadence of the floor's probes (each side of a handoff
#: sleeps about that long, and how long a CPU slept changes how fast it wakes)
QUANTUM_US = 20000


def start_floor(seconds: float) -> subprocess.Popen[str]:
    """The host's timer + futex wake-up floor (gs_tenant futex), probed for about `seconds`."""
    probes = max(50, int(seconds * 1e6 / (QUANTUM_US * 1.05)))
    tenant = ROOT / "jupyter_gpushare" / "_lib" / "test" / "gs_tenant"
    return subprocess.Popen(
        [str(tenant), "futex", str(probes), str(QUANTUM_US)], stdout=subprocess.PIPE, text=True
    )


def handoff_vs_floor(rig: Rig, floor: subprocess.Popen[str]) -> dict:
    """The daemon's handoff figures for the run just done, next to the floor probed beside it."""
    from jupyter_gpushare.daemon.client import DaemonClient

    gpu = DaemonClient(rig.socket).status()["gpus"][0]
    out, _ = floor.communicate(timeout=120)
    both = json.loads(out)["timer_futex"]
    h, n, w = gpu["handoff_us"], gpu["handoff_notice_us"], gpu["handoff_wake_us"]
    ratio = h["p99"] / both["p99_us"] if h.get("n") and both["p99_us"] else None
    print(
        f"lease handoff (device end -> next first launch): p50 {h.get('p50')} us, p99 "
        f"{h.get('p99')} us (n={h.get('n')}); device end -> grant p99 {n.get('p99')} us, grant "
        f"-> first launch p99 {w.get('p99')} us; host floor (timer + futex wake-up) p50 "
        f"{both['p50_us']} us, p99 {both['p99_us']} us; p99 ratio "
        f"{'n/a' if ratio is None else f'{ratio:.2f}'} (target <= 1.2)"
    )
    return {"handoff_us": h, "notice_us": n, "wake_us": w, "floor_us": both, "p99_ratio": ratio}


def run_matrix(rig: Rig, args: argparse.Namespace, warm: float, span: float) -> list[dict]:
    """benchmarks/enforcement.py's matrix where PyTorch can express it: matmul sizes x launch
    patterns, each shape alone without gpushare first (its rate = share 1.0), then two tenants
    at 0.3/0.7 and a limit 0.5 alone; achieved vs promised (+-0.03) and the busy share."""
    rows = []
    print(f"\n{'matrix':<18}{'pattern':>9}{'promised':>14}{'achieved':>16}{'worst':>8}{'busy':>7}")
    for n in MATRIX_SIZES:
        for pattern in MATRIX_PATTERNS:
            argv = ["shape", str(span), str(n), pattern]
            alone = lines_of(rig.spawn(None, argv), span * 3 + 120)
            t0 = alone[0]["start"] + int(warm * 1e9)
            full = rate(alone, t0, t0 + int(args.seconds * 1e9))
            for specs in (((0.3, 0.3), (0.7, 0.7)), ((0.5, 0.5),)):
                allocations = [rig.allocate(r, lim) for r, lim in specs]
                procs = [rig.spawn(x, argv) for x in allocations]
                lines = [lines_of(p, span * 3 + 120) for p in procs]
                for x in allocations:
                    rig.release(x)
                t0 = max(x[0]["start"] for x in lines) + int(warm * 1e9)
                got = [rate(x, t0, t0 + int(args.seconds * 1e9)) / full for x in lines]
                promised = [lim for _, lim in specs]
                worst = max(abs(g - p) for g, p in zip(got, promised, strict=True))
                rows.append(
                    {
                        "matmul": n,
                        "pattern": pattern,
                        "promised": promised,
                        "achieved": got,
                        "worst_error": worst,
                        "busy": sum(got),
                        "alone_per_s": full,
                    }
                )
                print(
                    f"{f'matmul {n}':<18}{pattern:>9}{'/'.join(map(str, promised)):>14}"
                    f"{'/'.join(f'{g:.3f}' for g in got):>16}{worst:>8.3f}{sum(got):>7.3f}",
                    flush=True,
                )
    return rows


#: host-bound steps (issue 26): hidden sizes of the MLP whose step ends with loss.item()
ITEM_SIZES = (512, 2048)
#: the tenant sets: (request, limit) each, as benchmarks/enforcement.py's cases
ITEM_CASES = {
    "0.3/0.7 at their limits": ((0.3, 0.3), (0.7, 0.7)),
    "requests 0.2/0.3, limits 1.0": ((0.2, 1.0), (0.3, 1.0)),
    "8 x 0.125": ((0.125, 0.125),) * 8,
}


def fair_parts(specs, alone: float, capacity: float) -> list[float]:
    """Max-min fair parts of ``capacity`` weighted by request, each bounded by its limit and by
    what one tenant gets alone (``alone``): as benchmarks/enforcement.py's ``fair_parts``."""
    bounds = [min(lim, alone) for _, lim in specs]
    parts = [0.0] * len(specs)
    left = min(capacity, sum(bounds))
    open_ = [i for i in range(len(specs)) if bounds[i] > 0]
    while open_ and left > 1e-9:
        weight = sum(specs[i][0] for i in open_)
        step = min(left / weight, min((bounds[i] - parts[i]) / specs[i][0] for i in open_))
        for i in open_:
            parts[i] += step * specs[i][0]
        left -= step * weight
        open_ = [i for i in open_ if bounds[i] - parts[i] > 1e-9]
    return parts


def _short(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs) if len(xs) < 4 else f"{min(xs):.2f}..{max(xs):.2f}"


def run_item(rig: Rig, args: argparse.Namespace, warm: float, span: float) -> list[dict]:
    """Host-bound loops (loss.item() every step): each tenant set without gpushare (plain
    processes together) and with it, side by side in this run. A tenant's part of the GPU is its
    steps per second times the device time of a step (timed with events on the loop alone); the
    ratio is the steps of all tenants with gpushare over those without (the device time they got:
    the work per step is the same). The fair parts are those of what the tenants use together
    without gpushare: by request, each bounded by its limit and by what one loop uses alone."""
    rows = []
    print(
        f"\n{'loss.item() every step':<34}{'size':>6}{'alone/s':>9}{'plain':>7}{'with':>7}"
        f"{'ratio':>7}  {'fair':<18}achieved (of the GPU)"
    )
    for n in ITEM_SIZES:
        argv = ["item", str(span), str(n)]
        one = lines_of(rig.spawn(None, argv), span * 3 + 120)
        t0 = one[0]["start"] + int(warm * 1e9)
        alone = rate(one, t0, t0 + int(args.seconds * 1e9))
        # the GPU's time one step takes, measured alone: a tenant's part of the GPU is its steps
        # per second times that, and a loop alone keeps the GPU `busy1` busy
        step_s = next(x["step_device_ms"] for x in one if "step_device_ms" in x) / 1e3
        busy1 = min(1.0, alone * step_s)
        for name, specs in ITEM_CASES.items():
            procs = [rig.spawn(None, argv) for _ in specs]
            plain_lines = [lines_of(p, span * 3 + 120) for p in procs]
            t0 = max(x[0]["start"] for x in plain_lines) + int(warm * 1e9)
            plain = [rate(x, t0, t0 + int(args.seconds * 1e9)) * step_s for x in plain_lines]
            allocations = [rig.allocate(r, lim) for r, lim in specs]
            procs = [rig.spawn(x, argv) for x in allocations]
            lines = [lines_of(p, span * 3 + 120) for p in procs]
            for x in allocations:
                rig.release(x)
            t0 = max(x[0]["start"] for x in lines) + int(warm * 1e9)
            got = [rate(x, t0, t0 + int(args.seconds * 1e9)) * step_s for x in lines]
            fair = fair_parts(specs, busy1, min(1.0, sum(plain)))
            ratio = sum(got) / max(sum(plain), 1e-9)
            rows.append(
                {
                    "case": name,
                    "hidden": n,
                    "alone_steps_per_s": alone,
                    "step_device_ms": step_s * 1e3,
                    "alone_busy": busy1,
                    "plain": plain,
                    "achieved": got,
                    "fair": fair,
                    "ratio_to_plain": ratio,
                }
            )
            print(
                f"{name:<34}{n:>6}{alone:>9.0f}{sum(plain):>7.2f}{sum(got):>7.2f}{ratio:>7.3f}"
                f"  {_short(fair):<18}{_short(got)}",
                flush=True,
            )
    worst = min(r["ratio_to_plain"] for r in rows)
    print(f"worst ratio to the same loops without gpushare: {worst:.3f} (target 0.97)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--only",
        choices=("item",),
        help="run only the host-bound loops (loss.item() every step) of part 7",
    )
    args = parser.parse_args()
    reason = has_gpu()
    if reason is not None:
        print(
            f"no GPU: {reason}; nothing to validate (run this on a machine with an NVIDIA GPU "
            "and PyTorch)"
        )
        print(json.dumps({"gpu": None, "reason": reason}))
        return 0
    csrc = ROOT / "jupyter_gpushare" / "csrc"
    subprocess.run(["make", "-s", "-C", str(csrc)], check=True)
    subprocess.run(["make", "-s", "-C", str(csrc), "interposer-tests"], check=True)
    warm = 2.0
    span = args.seconds + warm + 0.5
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="gpushare-gpu-") as d:
        rig = Rig(Path(d))
        figures["gpu"] = rig.gpus[0].name
        try:
            if args.only == "item":
                figures["item"] = run_item(rig, args, warm, span)
                print(json.dumps(figures))
                return 0
            alone = lines_of(rig.spawn(None, ["matmul", str(span)]), span * 3 + 60)
            t0 = alone[0]["start"] + int(warm * 1e9)
            full = rate(alone, t0, t0 + int(args.seconds * 1e9))
            print(
                f"GPU {rig.gpus[0].name}: matmul 4096^2 alone without gpushare: "
                f"{full:.1f}/s (= share 1.0)"
            )

            a, b = rig.allocate(0.3, 0.3), rig.allocate(0.7, 0.7)
            pa, pb = rig.spawn(a, ["matmul", str(span)]), rig.spawn(b, ["matmul", str(span)])
            floor = start_floor(span)
            la, lb = lines_of(pa, span * 3 + 60), lines_of(pb, span * 3 + 60)
            figures["handoff"] = handoff_vs_floor(rig, floor)
            rig.release(a)
            rig.release(b)
            t0 = max(la[0]["start"], lb[0]["start"]) + int(warm * 1e9)
            sa = rate(la, t0, t0 + int(args.seconds * 1e9)) / full
            sb = rate(lb, t0, t0 + int(args.seconds * 1e9)) / full
            print(f"{'two tenants':<28}{'target':>8}{'achieved':>10}{'error':>8}")
            print(f"{'  request=limit 0.3':<28}{0.3:>8.3f}{sa:>10.3f}{sa - 0.3:>+8.3f}")
            print(f"{'  request=limit 0.7':<28}{0.7:>8.3f}{sb:>10.3f}{sb - 0.7:>+8.3f}")
            figures["two_tenants"] = {"target": [0.3, 0.7], "achieved": [sa, sb]}

            c = rig.allocate(0.5, 0.5)
            lc = lines_of(rig.spawn(c, ["matmul", str(span)]), span * 3 + 60)
            rig.release(c)
            t0 = lc[0]["start"] + int(warm * 1e9)
            sc = rate(lc, t0, t0 + int(args.seconds * 1e9)) / full
            print(f"{'  limit 0.5 alone':<28}{'<=0.53':>8}{sc:>10.3f}")
            figures["limit_alone"] = sc

            figures["matrix"] = run_matrix(rig, args, warm, span)
            figures["item"] = run_item(rig, args, warm, span)

            cap = 2 * GiB
            m = rig.allocate(0.2, 1.0, memory=cap)
            (mem,) = lines_of(rig.spawn(m, ["memory", "0", str(GiB), str(GiB + GiB // 2)]), 120)
            rig.release(m)
            print(
                f"memory cap 2 GiB: mem_get_info total {mem['total'] / GiB:.2f} GiB, 1 GiB "
                f"tensor ok, +1.5 GiB -> {mem['beyond_cap']}"
            )
            figures["memory"] = mem

            (plain,) = lines_of(rig.spawn(None, ["small", "0"]), 300)
            s = rig.allocate(1.0, 1.0)
            (ours,) = lines_of(rig.spawn(s, ["small", "0"]), 300)
            rig.release(s)
            ratio = ours["us_per_iter"] / plain["us_per_iter"]
            print(
                f"small-kernel loop (x.add_(1)): {plain['us_per_iter']:.2f} us/iter without, "
                f"{ours['us_per_iter']:.2f} with gpushare: slowdown {100 * (ratio - 1):+.2f} % "
                "(target <= 2 %)"
            )
            figures["small_kernel_us"] = {
                "without": plain["us_per_iter"],
                "with": ours["us_per_iter"],
                "ratio": ratio,
            }
        finally:
            rig.close()
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
