"""How exactly the GPU simulator time-slices: measured time vs the model's ideal, side by side.

Runs the driver-API test program (``tests/simulator/sim_driver_test.c``, which dlopen()s the
simulated ``libcuda.so.1``) in several processes that start at one common instant and each launch
``busy_us`` kernels, then compares when the last one finished with the ideal: the device runs one
kernel at a time, so N processes x W ms of kernels on one device take N x W ms, and processes on
different devices run in parallel. Also the cost of one simulated launch (no GPU involved: this
measures the simulator, it says nothing about a real GPU).

Ends with one JSON line. ``--quick`` runs smaller scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "simulator"))

from simmachine import compile_program  # noqa: E402

from jupyter_gpushare.inventory import simulated_gpus  # noqa: E402
from jupyter_gpushare.simulator import build, simulator_env  # noqa: E402

MS = 1_000_000


def run_together(
    program: Path, env: dict[str, str], devices: list[int], us: int, count: int
) -> tuple[float, list[float]]:
    """Processes on `devices` (one each), all starting at one instant; returns the time until
    the last finished and each one's own finish time, in ms from the start."""
    start = time.monotonic_ns() + 300 * MS
    procs = [
        subprocess.Popen(
            [str(program), "busy", str(us), str(count), str(dev), "nb", str(start)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for dev in devices
    ]
    finishes = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(err)
        values = dict(line.split("=", 1) for line in out.splitlines())
        finishes.append((float(values["end_ns"]) - start) / MS)
    return max(finishes), finishes


def launch_cost_us(program: Path, env: dict[str, str], launches: int) -> float:
    """Median wall time of one cuLaunchKernel (busy_us(0): no device time) over 3 runs."""
    costs = []
    for _ in range(3):
        out = subprocess.run(
            [str(program), "busy", "0", str(launches)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        values = dict(line.split("=", 1) for line in out.splitlines())
        costs.append(float(values["launch_ms"]) * 1000 / launches)
    return statistics.median(costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller scenarios")
    args = parser.parse_args()
    total_ms = 400 if args.quick else 1000

    build("sim")
    with tempfile.TemporaryDirectory(prefix="gs-simbench-") as tmp:
        program = compile_program(Path(tmp) / "sim_driver_test", "-O2")
        gpus = simulated_gpus("2xA100", node="bench")
        base = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
        env = {**base, **simulator_env(gpus, Path(tmp) / "state", base=base)}
        sliced = {**env, "GPUSHARE_SIM_QUEUE_AHEAD_US": "5000"}

        scenarios = [
            ("1 process, 1 device", env, [0], total_ms),
            ("2 processes, 1 device", env, [0, 0], total_ms),
            ("4 processes, 1 device", env, [0, 0, 0, 0], total_ms),
            ("2 processes, 1 device, 5 ms queue", sliced, [0, 0], total_ms),
            ("2 processes, 2 devices", env, [0, 1], total_ms // 2),
        ]
        print(f"{'scenario':38} {'ideal ms':>9} {'measured':>9} {'ratio':>7}  finishes (ms)")
        figures: dict[str, object] = {}
        for name, scenario_env, devices, ideal in scenarios:
            per_process = total_ms // len(devices) if len(set(devices)) == 1 else total_ms // 2
            span, finishes = run_together(program, scenario_env, devices, 1000, per_process)
            ratio = span / ideal
            shown = " ".join(f"{f:.1f}" for f in sorted(finishes))
            print(f"{name:38} {ideal:9.1f} {span:9.1f} {ratio:6.3f}x  {shown}")
            figures[name] = {
                "ideal_ms": ideal,
                "measured_ms": round(span, 2),
                "ratio": round(ratio, 4),
            }
        launches = 20_000 if args.quick else 100_000
        cost = launch_cost_us(program, env, launches)
        print(f"{'simulated cuLaunchKernel':38} {'':9} {cost:8.3f}us  (median of 3 x {launches})")
        figures["launch_us"] = round(cost, 4)
    print(json.dumps({"benchmark": "simulator", "figures": figures}))


if __name__ == "__main__":
    main()
