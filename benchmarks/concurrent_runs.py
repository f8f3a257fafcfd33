"""Eight ``jupyter gpushare run`` started at the same instant on a fresh machine (issue 12).

Each run holds 0.10-0.12 of one simulated A100 and runs a saturating driver-API program (2 ms
kernels, a sync every 4 launches). All eight start together on fresh state (no agent, no ledger,
no simulator state), so each run tries to start the node agent; exactly one may serve the socket.
While they run, the agent's status is sampled once a second (its window is 1 s) and each
tenant's achieved share is averaged over the run.

Prints per tenant the achieved share against its limit, the number of agents that served the
socket, the worst excess over a limit, the device's busy total against the sum of the limits
(ratio; work conservation), and one JSON line.

    python3 benchmarks/concurrent_runs.py [--seconds 12] [--tenants 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's package and libraries

import psutil  # noqa: E402

from jupyter_gpushare.daemon.client import DaemonClient  # noqa: E402
from jupyter_gpushare.paths import lib_dir  # noqa: E402

CSRC = HERE.parent / "jupyter_gpushare" / "csrc"

#: the enforcement tests' tenant (tests/enforcement/c/gs_tenant.c, built by `make
#: interposer-tests`): `spin SECONDS 2000 4` saturates its share with 2 ms kernels, a sync
#: every 4 launches
TENANT = lib_dir() / "test" / "gs_tenant"


def build() -> Path:
    subprocess.run(
        ["make", "-s", "-C", str(CSRC), "all", "interposer-tests"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return TENANT


def agents(socket_path: str) -> set[int]:
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if "jupyter_gpushare.daemon" in cmdline and socket_path in cmdline:
            found.add(p.pid)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--request", type=float, default=0.1)
    parser.add_argument("--limit", type=float, default=0.12)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gs-bench-runs-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "JUPYTER_"))}
    env.update(
        GPUSHARE_SIMULATE="1xA100",
        GPUSHARE_SOCKET=str(work / "rt" / "daemon.sock"),
        GPUSHARE_LEDGER=str(work / "ledger.sqlite"),
        GPUSHARE_SIM_STATE=str(work / "sim" / "sim.state"),
        JUPYTER_DATA_DIR=str(work / "data"),
        JUPYTER_RUNTIME_DIR=str(work / "rt"),
        JUPYTER_CONFIG_DIR=str(work / "config"),
    )
    program = build()
    answered: set[int] = set()  # pids of the agents that answered a status
    samples: dict[str, list[float]] = {}
    limits: dict[str, float] = {}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare",
                "run",
                "--gpu-request",
                str(args.request),
                "--gpu-limit",
                str(args.limit),
                "--",
                str(program),
                "spin",
                str(args.seconds),
                "2000",
                "4",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(args.tenants)
    ]
    try:
        client = DaemonClient(env["GPUSHARE_SOCKET"], timeout=2.0)
        start = time.monotonic()
        while any(r.poll() is None for r in runs) and time.monotonic() - start < args.seconds + 60:
            time.sleep(1.0)
            if time.monotonic() - start < 3.0:  # every tenant connected, windows filled
                continue
            try:
                status = client.status()
            except (OSError, ValueError):
                continue
            answered.add(int(status["daemon"]["pid"]))
            live = [a for a in status.get("allocations", []) if a.get("connected")]
            if len(live) < args.tenants:
                continue  # some already ended: their neighbours may take their time
            for a in live:
                samples.setdefault(a["id"], []).append(float(a["achieved_share"]))
                limits[a["id"]] = float(a["limit"])
        codes = [r.wait(60) for r in runs]
        errors = [r.communicate()[1] for r in runs]
        serving = agents(env["GPUSHARE_SOCKET"])
    finally:
        for pid in agents(env["GPUSHARE_SOCKET"]):
            psutil.Process(pid).terminate()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"{args.tenants} runs started together, request {args.request:g}, limit "
        f"{args.limit:g}, {args.seconds:g} s each"
    )
    worst = 0.0
    total = 0.0
    for i, (allocation, values) in enumerate(sorted(samples.items())):
        mean = statistics.fmean(values)
        total += mean
        worst = max(worst, mean - limits[allocation])
        print(
            f"  tenant {i}: achieved {mean:.3f} of limit {limits[allocation]:.3f} "
            f"(ratio {mean / limits[allocation]:.3f}, {len(values)} samples)"
        )
    promised = sum(limits.values())
    print(
        f"exit codes {codes}; agents that answered: {len(answered)}; agent processes left: "
        f"{len(serving)}"
    )
    print(f"worst excess over a limit: {worst:+.3f} (promise: at most +0.03)")
    if promised:
        print(
            f"device busy {total:.3f} of the limits' sum {promised:.3f} "
            f"(ratio {total / promised:.3f})"
        )
    bad = [e.strip().splitlines()[-1] for e in errors if "gpushare:" in e]
    if bad:
        print("run errors:", bad)
    print(
        json.dumps(
            {
                "benchmark": "concurrent_runs",
                "tenants": args.tenants,
                "seconds": args.seconds,
                "exit_codes": codes,
                "agents_answered": len(answered),
                "agents_left": len(serving),
                "tenants_measured": len(samples),
                "achieved": {k: round(statistics.fmean(v), 4) for k, v in sorted(samples.items())},
                "worst_excess_over_limit": round(worst, 4),
                "busy_over_limits_ratio": round(total / promised, 4) if promised else None,
            }
        )
    )


if __name__ == "__main__":
    main()
