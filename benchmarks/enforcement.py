"""Enforcement benchmark on the simulated GPU (no GPU needed): the node daemon + libgpushare.so.

Measures, each side by side with its baseline and the ratio:
  * fast-path cost: ns per launch of a zero-length kernel with and without the interposer, in one
    run (target: <= 100 ns added);
  * wait of a small launch next to a saturating neighbour (target <= one quantum);
  * the matrix: kernel lengths (10 us .. 100 ms, longer than the 20 ms quantum) x launch patterns
    (gs_tenant `load`: a sync after every launch, deep asynchronous queues, four non-blocking
    streams, CUDA graph replays) x tenant sets (a limit alone, 2, 3 and 8 tenants at their
    limits, elastic requests), and a saturating tenant next to an interactive one: achieved vs
    promised per cell over 10 s windows, the worst error (target 0.03), the device's busy share
    (work conservation, target >= 0.97) and its ratio to the same tenants without gpushare;
  * lease handoff gap (previous holder's device end -> next holder's first launch) p50/p99 next
    to the host's own timer + futex wake-ups measured in the same run, and their ratio (target
    p99 <= 1.2 x the host's), on an idle and on a busy host (benchmarks/handoff.py).

Run: python benchmarks/enforcement.py [--quick] [--seconds 10] [--quantum-ms 20]
    [--only fastpath|small|matrix|handoff ...] [--cell CASE:KERNEL_US:PATTERN ...]
(--quick: a few cells over 4 s, for development; the full matrix takes about 25 minutes;
--cell elastic2:50000:deep runs that one cell.)
Prints a table and ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "enforcement"))
sys.path.insert(0, str(HERE.parent))  # this checkout's package and libraries, whatever is installed

import handoff  # noqa: E402  (benchmarks/handoff.py: the handoff part, on an idle and a busy host)
from enforcement_support import (  # noqa: E402
    NODE,
    TENANT,
    add_allocation,
    build_c,
    device_shares,
    peak_device_time,
    remove_allocation,
    spawn_tenant,
    start_daemon,
)

from jupyter_gpushare.inventory import simulated_gpus  # noqa: E402
from jupyter_gpushare.ledger.sqlite import SQLiteLedger  # noqa: E402

PATTERNS = ("sync", "deep", "streams", "graph")
KERNELS_US = (10, 100, 1000, 10000, 50000, 100000)
QUICK_KERNELS_US = (100, 50000)
QUICK_PATTERNS = ("sync", "deep")
#: --cell also takes the original benchmark's shape (batches of 8 launches, two queued)
CELL_PATTERNS = (*PATTERNS, "pipelined")


@dataclass(frozen=True)
class Case:
    """A set of tenants sharing one GPU: (request, limit) each, what each should get, and
    whether together they should keep the device busy (work conservation)."""

    name: str
    specs: tuple[tuple[float, float], ...]
    targets: tuple[float, ...]
    saturating: bool  # the targets add up to the whole device


CASES = {
    "limit": Case("limit 0.5 alone", ((0.5, 0.5),), (0.5,), False),
    "two": Case("2 tenants 0.3/0.7", ((0.3, 0.3), (0.7, 0.7)), (0.3, 0.7), True),
    "three": Case(
        "3 tenants 0.2/0.3/0.5", ((0.2, 0.2), (0.3, 0.3), (0.5, 0.5)), (0.2, 0.3, 0.5), True
    ),
    "eight": Case("8 tenants 0.125 each", ((0.125, 0.125),) * 8, (0.125,) * 8, True),
    "elastic": Case("request 0.3 limit 1.0 alone", ((0.3, 1.0),), (1.0,), True),
    "elastic2": Case("requests 0.2/0.3, limits 1.0", ((0.2, 1.0), (0.3, 1.0)), (0.4, 0.6), True),
}


def fair_parts(specs: tuple[tuple[float, float], ...], solo: float, capacity: float) -> list[float]:
    """Each tenant's fair part of ``capacity`` (the device time the same processes use together
    without gpushare): max-min fairness weighted by request and bounded by each tenant's limit
    and by what it uses alone (``solo``): water-filling, each share's part grows with its request
    until it reaches its bound, and what it cannot use goes to the others."""
    bounds = [min(lim, solo) for _, lim in specs]
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


def tenant_argv(kernel_us: int, pattern: str, seconds: float | str) -> list[str]:
    """gs_tenant's `load` shapes; `pipelined` is the original benchmark's (batches of 8, two
    queued) with device-time reports (spin's progress misplaced up to a batch at a window's
    edge: 0.8 s with 100 ms kernels)."""
    return ["load", str(seconds), str(kernel_us), pattern]


def window(tenants, seconds: float, warmup: float) -> tuple[int, int]:
    t0 = max(t.lines[0]["start"] for t in tenants) + int(warmup * 1e9)
    return t0, t0 + int(seconds * 1e9)


def run_tenants(daemon, ledger, gpus, tmp, case, kernel_us, pattern, seconds, warmup=1.5):
    """Each tenant's share of the device over `seconds` (after a warm-up), its most device time
    in any 1 s window of them (s) and the daemon's status (handoffs) from the middle of the
    run."""
    allocations = [add_allocation(ledger, gpus[0], r, lim) for r, lim in case.specs]
    argv = tenant_argv(kernel_us, pattern, seconds + warmup + 0.3)
    tenants = [spawn_tenant(daemon, ledger, a, gpus, argv, tmp, drain=True) for a in allocations]
    time.sleep(warmup + seconds / 2)
    status = daemon.client.status()
    for t in tenants:
        t.finish(timeout=seconds * 4 + 60)
    for a in allocations:
        remove_allocation(ledger, a.id)
    span = window(tenants, seconds, warmup)
    peaks = [peak_device_time(t, *span) for t in tenants]
    return device_shares(tenants, *span), peaks, status


def run_plain(gpus, tmp, n, kernel_us, pattern, seconds, warmup=1.0):
    """n tenants of the same shape without gpushare (no LD_PRELOAD, no daemon)."""
    from jupyter_gpushare.daemon.env import simulator_environ

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(simulator_environ(gpus, tmp / "daemon.sock"))
    env["CUDA_VISIBLE_DEVICES"] = gpus[0].uuid
    env["GPUSHARE_SIM_STATE"] = str(tmp / "sim.state")
    argv = tenant_argv(kernel_us, pattern, seconds + warmup + 0.3)
    # each writes to a file: a pipe read only after the previous tenant ended would fill and
    # block the next one in printf
    outs = [tmp / f"plain-{time.monotonic_ns()}-{i}.out" for i in range(n)]
    procs = []
    for out in outs:
        with out.open("w") as f:
            procs.append(subprocess.Popen([str(TENANT), *argv], stdout=f, text=True, env=env))
    tenants = []
    for p, out in zip(procs, outs, strict=True):
        p.wait(timeout=seconds * 4 + 60)
        text = out.read_text()
        tenants.append(
            SimpleNamespace(lines=[json.loads(x) for x in text.splitlines() if x[:1] == "{"])
        )
    return device_shares(tenants, *window(tenants, seconds, warmup))


def run_mixed(daemon, ledger, gpus, tmp, kernel_us, seconds, warmup=1.5):
    """A saturating tenant (request 0.5, limit 1.0, batches of 8 launches, two queued) next to
    an interactive one (request 0.5, limit 1.0: bursts of 5 ms every 50 ms). The interactive
    tenant gets what it asks for (about 0.1) soon; the saturating one gets the rest."""
    big = add_allocation(ledger, gpus[0], 0.5, 1.0)
    small = add_allocation(ledger, gpus[0], 0.5, 1.0)
    span = str(seconds + warmup + 0.3)
    tb = spawn_tenant(
        daemon, ledger, big, gpus, tenant_argv(kernel_us, "pipelined", span), tmp, drain=True
    )
    ts = spawn_tenant(
        daemon, ledger, small, gpus, ["load", span, "1000", "interactive"], tmp, drain=True
    )
    for t in (tb, ts):
        t.finish(timeout=seconds * 4 + 60)
    remove_allocation(ledger, big.id)
    remove_allocation(ledger, small.id)
    got = device_shares([tb, ts], *window([tb, ts], seconds, warmup))
    waits = next(x for x in ts.lines if "wait_p99_us" in x)
    return got, waits


def bench_launch(daemon, ledger, gpus, tmp, n):
    from jupyter_gpushare.daemon.env import simulator_environ

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(simulator_environ(gpus, daemon.socket))
    env["CUDA_VISIBLE_DEVICES"] = gpus[0].uuid
    env["GPUSHARE_SIM_STATE"] = str(daemon.socket.parent / "sim.state")
    out = subprocess.run(
        [str(TENANT), "bench", str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    plain = json.loads(out.splitlines()[-1])["ns_per_launch"]
    a = add_allocation(ledger, gpus[0], 1.0, 1.0)
    t = spawn_tenant(daemon, ledger, a, gpus, ["bench", str(n)], tmp)
    lines = t.finish(timeout=300)
    remove_allocation(ledger, a.id)
    return plain, lines[-1]["ns_per_launch"]


def bench_small(daemon, ledger, gpus, tmp, seconds):
    big = add_allocation(ledger, gpus[0], 0.5, 1.0)
    small = add_allocation(ledger, gpus[0], 0.5, 1.0)
    tb = spawn_tenant(daemon, ledger, big, gpus, ["spin", str(seconds + 1.5), "1000", "8"], tmp)
    time.sleep(0.7)
    ts = spawn_tenant(daemon, ledger, small, gpus, ["small", str(seconds), "20"], tmp)
    (result,) = ts.finish(timeout=seconds * 4 + 30)
    tb.finish(timeout=seconds * 4 + 30)
    remove_allocation(ledger, big.id)
    remove_allocation(ledger, small.id)
    return result


def parse_cell(text: str) -> tuple[str, int, str]:
    """``CASE:KERNEL_US:PATTERN`` (``--cell``), checked against the matrix's names."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in CASES or parts[2] not in CELL_PATTERNS:
        raise SystemExit(
            f"--cell {text!r}: expected CASE:KERNEL_US:PATTERN with CASE one of "
            f"{', '.join(CASES)} and PATTERN one of {', '.join(CELL_PATTERNS)}"
        )
    try:
        kernel_us = int(parts[1])
    except ValueError:
        kernel_us = 0
    if not 1 <= kernel_us <= 1_000_000:
        raise SystemExit(f"--cell {text!r}: KERNEL_US {parts[1]!r} must be 1..1000000")
    return parts[0], kernel_us, parts[2]


def cells(quick: bool, chosen: list[str] | None = None) -> list[tuple[str, int, str]]:
    """(case, kernel µs, pattern) of the matrix, or the ``--cell`` ones."""
    if chosen:
        return [parse_cell(c) for c in chosen]
    if quick:
        out = [
            (c, k, p) for c in ("limit", "two") for k in QUICK_KERNELS_US for p in QUICK_PATTERNS
        ]
        return [*out, ("three", 1000, "streams"), ("elastic2", 10000, "graph")]
    out = [(c, k, p) for c in ("limit", "two") for k in KERNELS_US for p in PATTERNS]
    for c in ("three", "eight", "elastic", "elastic2"):
        out += [(c, k, p) for k in (100, 50000) for p in ("sync", "deep")]
    return out


def run_matrix(daemon, ledger, gpus, tmp, args) -> dict[str, object]:
    """Achieved vs promised per cell, the worst error, the device's busy share (work conservation)
    and the ratio of busy time to the same tenants without gpushare.

    A share is a share of the GPU's device time. A host-bound shape (a sync after every short
    kernel) keeps a lone tenant's device busy only a fraction ``u`` of the time (measured: the
    same shape alone without gpushare), and several such tenants together keep it busier (each
    fills the others' host gaps: ``plain``). The promise for those cells (marked ``*``) is each
    tenant's fair part of ``plain`` (:func:`fair_parts`: by request, each bounded by its limit
    and by ``u``); ``ratio`` is busy / plain for every cell, and ``of fair`` busy / the fair
    parts' sum (below 1 only where the limits themselves leave time idle: a limit of 0.3 next
    to a tenant that can use 0.54 alone leaves 0.16 of a device that plain keeps 0.98 busy)."""
    seconds = args.seconds
    print(
        f"\n{'accuracy over ' + str(seconds) + ' s':<30}{'kernel':>8}{'pattern':>9}  "
        f"{'promised':<24}{'achieved':<26}{'worst':>7}{'busy':>7}{'plain':>7}{'ratio':>7}"
        f"{'1s-max':>8}{'of fair':>8}"
    )
    plain_cache: dict[tuple[int, int, str], float] = {}

    def plain(n: int, kernel_us: int, pattern: str) -> float:
        if (n, kernel_us, pattern) not in plain_cache:
            # alone: over the cells' own window (host-bound cells are promised a share of it);
            # several tenants: a shorter look, for the ratio column only
            length = seconds if n == 1 else min(seconds, 3.0)
            plain_cache[n, kernel_us, pattern] = sum(
                run_plain(gpus, tmp, n, kernel_us, pattern, length)
            )
        return plain_cache[n, kernel_us, pattern]

    rows = []
    for key, kernel_us, pattern in cells(args.quick, args.cell):
        case = CASES[key]
        got, peaks, status = run_tenants(
            daemon, ledger, gpus, tmp, case, kernel_us, pattern, seconds
        )
        # the most device time a limited tenant got in any 1 s window, beyond its limit (s)
        over = [p - lim for p, (_, lim) in zip(peaks, case.specs, strict=True) if lim < 1.0]
        solo = min(1.0, plain(1, kernel_us, pattern))
        host_bound = solo < 0.97
        base = plain(len(case.specs), kernel_us, pattern)
        fair = fair_parts(case.specs, solo, min(1.0, base))
        targets = fair if host_bound else list(case.targets)
        worst = max(abs(a - b) for a, b in zip(got, targets, strict=True))
        busy = sum(got)
        conserving = not case.saturating or busy >= 0.97 * solo
        row = {
            "case": case.name,
            "kernel_us": kernel_us,
            "pattern": pattern,
            "promised_share": list(case.targets),
            "solo_busy": round(solo, 4),
            "promised": [round(x, 4) for x in targets],
            "achieved": [round(x, 4) for x in got],
            "worst_error": round(worst, 4),
            "busy": round(busy, 4),
            "plain_busy": round(base, 4),
            "ratio_to_plain": round(busy / base, 4) if base > 0 else None,
            "fair": [round(x, 4) for x in fair],
            # the limits add up to the whole device: the tenants may use all plain does
            "limits_allow_all": sum(lim for _, lim in case.specs) >= 0.999,
            "ratio_to_fair": round(busy / sum(fair), 4) if sum(fair) > 0 else None,
            "saturating": case.saturating,
            "work_conserving": conserving,
            "peak_1s": [round(x, 4) for x in peaks],
            "peak_1s_over_limit": round(max(over), 4) if over else None,
            # the agent's backfills so far (cumulative over the matrix, read mid-cell): which
            # cells backfilled at all, when one agent runs them back to back
            "agent_backfills": sum(int(g.get("backfills", 0)) for g in status.get("gpus", [])),
            "agent_backfilled_s": sum(
                float(g.get("backfilled_s", 0.0)) for g in status.get("gpus", [])
            ),
        }
        rows.append(row)
        promised = "/".join(f"{x:.3g}" for x in targets)
        achieved = "/".join(f"{x:.3f}" for x in got)
        if len(promised) > 22 or len(achieved) > 24:
            promised = f"{len(targets)} x {targets[0]:.3g}"
            achieved = f"{min(got):.3f}..{max(got):.3f}"
        if host_bound:
            promised += "*"
        flag = "" if worst <= 0.03 and conserving else "  <-"
        print(
            f"{case.name:<30}{kernel_us / 1000:>6.2g}ms{pattern:>9}  {promised:<24}{achieved:<26}"
            f"{worst:>7.3f}{busy:>7.3f}{base:>7.3f}{busy / max(base, 1e-9):>7.3f}"
            f"{f'{max(over):+.3f}' if over else '':>8}{busy / max(sum(fair), 1e-9):>8.3f}{flag}",
            flush=True,
        )
    mixed = []
    for kernel_us in () if args.cell else (1000,) if args.quick else (100, 10000, 100000):
        got, waits = run_mixed(daemon, ledger, gpus, tmp, kernel_us, seconds)
        mixed.append(
            {
                "kernel_us": kernel_us,
                "achieved": [round(x, 4) for x in got],
                "busy": round(sum(got), 4),
                "interactive_wait_p50_us": waits["wait_p50_us"],
                "interactive_wait_p99_us": waits["wait_p99_us"],
            }
        )
        print(
            f"{'saturating + interactive':<30}{kernel_us / 1000:>6.2g}ms{'pipeline':>9}  "
            f"{'rest / its bursts':<24}{got[0]:.3f}/{got[1]:.3f}{'':<15}{'':>7}{sum(got):>7.3f}"
            f"   interactive wait p50 {waits['wait_p50_us'] / 1e3:.2f} ms"
            f" p99 {waits['wait_p99_us'] / 1e3:.2f} ms",
            flush=True,
        )
    worst = max(r["worst_error"] for r in rows)
    conserving = [r["busy"] / r["solo_busy"] for r in rows if r["saturating"]]
    conserving += [m["busy"] for m in mixed]
    lowest = min(conserving, default=None)
    ratios = [r["ratio_to_plain"] for r in rows if r["ratio_to_plain"] is not None]
    worst_ratio = min(ratios, default=None)
    full = [r["ratio_to_plain"] for r in rows if r["limits_allow_all"] and r["ratio_to_plain"]]
    worst_full = min(full, default=None)
    of_fair = [r["ratio_to_fair"] for r in rows if r["ratio_to_fair"] is not None]
    worst_fair = min(of_fair, default=None)
    print(
        f"worst error {worst:.3f} (target 0.03); worst ratio to the same tenants without gpushare"
        f" {'n/a' if worst_ratio is None else f'{worst_ratio:.3f}'} over all {len(rows)} cells"
        f" (a limit below what the tenants use caps it), "
        f"{'n/a' if worst_full is None else f'{worst_full:.3f}'} over the {len(full)} whose"
        f" limits add up to the whole device (target 0.97), of their fair parts"
        f" {'n/a' if worst_fair is None else f'{worst_fair:.3f}'};"
        f" lowest busy share of saturating cells "
        f"{'n/a' if lowest is None else f'{lowest:.3f}'} of what the shape can use;"
        f" * host-bound shape: promised = fair part of what the tenants use without gpushare"
        f" (by request, up to min(limit, alone));"
        f" 1s-max: a limited tenant's most device time in any 1 s window beyond its limit (s)"
    )
    return {
        "cells": rows,
        "mixed": mixed,
        "worst_error": worst,
        "worst_ratio_to_plain": worst_ratio,
        "worst_ratio_to_plain_limits_allow_all": worst_full,
        "worst_ratio_to_fair": worst_fair,
        "min_busy_saturating": lowest,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement window (s)")
    parser.add_argument("--quantum-ms", type=float, default=20.0)
    parser.add_argument("--window-ms", type=float, default=1000.0)
    parser.add_argument("--launches", type=int, default=2_000_000)
    parser.add_argument(
        "--only",
        choices=("fastpath", "small", "matrix", "handoff"),
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument(
        "--cell",
        action="append",
        metavar="CASE:KERNEL_US:PATTERN",
        help=f"matrix cells to run instead of the matrix (repeatable; cases {', '.join(CASES)};"
        f" patterns {', '.join(CELL_PATTERNS)}), e.g. elastic2:50000:deep; no mixed rows",
    )
    parser.add_argument(
        "--handoff-quantum-ms",
        type=float,
        default=5.0,
        help="quantum of the handoff part (short: thousands of handoffs per run)",
    )
    parser.add_argument(
        "--handoff-seconds", type=float, default=15.0, help="each handoff floor's probing time"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few cells over 4 s windows (development); the full matrix takes about 25 min",
    )
    args = parser.parse_args()
    if args.quick and args.seconds == 10.0:
        args.seconds = 4.0
        args.launches = 200_000
    if args.cell:
        args.only = [*(args.only or []), "matrix"]

    def want(part: str) -> bool:
        return args.only is None or part in args.only

    build_c()
    gpus = simulated_gpus("1xA100", NODE)
    figures: dict[str, object] = {
        "seconds": args.seconds,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quantum_ms": args.quantum_ms,
        "window_ms": args.window_ms,
        "device": "simulated A100",
        "cpus": os.cpu_count(),
        "load1": round(os.getloadavg()[0], 2),
        "parts": args.only or "all",
    }
    with tempfile.TemporaryDirectory(prefix="gpushare-bench-") as d:
        tmp = Path(d)
        daemon = None
        if any(want(part) for part in ("fastpath", "small", "matrix")):
            daemon = start_daemon(tmp, quantum_ms=args.quantum_ms, window_ms=args.window_ms)
            ledger = SQLiteLedger(daemon.ledger_path)
        try:
            if want("fastpath"):
                rounds = [bench_launch(daemon, ledger, gpus, tmp, args.launches) for _ in range(3)]
                plain = min(r[0] for r in rounds)
                ours = min(r[1] for r in rounds)
                fast = json.loads(
                    subprocess.run(
                        [str(TENANT.parent / "gs_fastpath")],
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout
                )
                print(f"{'fast path':<34}{'without':>12}{'with':>12}{'added':>10}{'ratio':>8}")
                print(
                    f"{'  ns per launch (busy_us(0))':<34}{plain:>12.1f}{ours:>12.1f}"
                    f"{ours - plain:>10.1f}{ours / plain:>8.3f}"
                )
                print(
                    f"{'  gs_admit alone (call loop)':<34}{fast['empty_loop_ns']:>12.1f}"
                    f"{fast['fast_path_ns']:>12.1f}"
                    f"{fast['fast_path_ns'] - fast['empty_loop_ns']:>10.1f}{'':>8}"
                )
                figures.update(
                    launch_ns_plain=plain,
                    launch_ns_interposed=ours,
                    launch_ns_added=round(ours - plain, 1),
                    fast_path_ns=fast["fast_path_ns"],
                )
            if want("small"):
                small = bench_small(daemon, ledger, gpus, tmp, min(args.seconds, 6.0))
                print(
                    f"\nsmall launch next to a saturating neighbour (quantum {args.quantum_ms} ms):"
                    f" wait p50 {small['p50_us'] / 1e3:.2f} ms, p99 {small['p99_us'] / 1e3:.2f}"
                    f" ms, max {small['max_us'] / 1e3:.2f} ms (n={small['n']});"
                    f" p99/quantum {small['p99_us'] / 1e3 / args.quantum_ms:.2f}"
                )
                figures.update(small_wait_p50_us=small["p50_us"], small_wait_p99_us=small["p99_us"])
            if want("matrix"):
                figures["matrix"] = run_matrix(daemon, ledger, gpus, tmp, args)
        finally:
            if daemon is not None:
                daemon.stop()
        if want("handoff"):
            figures["handoff"] = handoff.run_handoff(
                tmp, gpus, args.handoff_quantum_ms, args.handoff_seconds, os.cpu_count() or 2
            )
    figures["load1_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
