"""Kernel start time: vanilla local provisioner vs gpushare (local backend), side by side.

Measures, for each, the median time from the start request to the first ``kernel_info_reply``,
alternating the two so that machine noise falls on both alike. The gpushare kernels run on one
simulated A100 (placement, ledger CAS, environment and, once built, the interposer preload are
all in the measured path). Ends with one JSON line.

    python benchmarks/kernel_start.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _isolate() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="gs-bench-"))
    os.environ.update(
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "rt"),
        JUPYTER_PLATFORM_DIRS="1",
        GPUSHARE_LEDGER=str(tmp / "ledger.sqlite"),
        GPUSHARE_SOCKET=str(tmp / "d.sock"),
        GPUSHARE_SIMULATE="1xA100",
    )
    kernels = tmp / "data" / "kernels"
    shutil.copytree(REPO / "kernelspecs" / "gpushare-python", kernels / "gpushare-python")
    vanilla = kernels / "vanilla-python"
    vanilla.mkdir(parents=True)
    (vanilla / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "vanilla", "language": "python",
    }))
    return tmp


async def _start_once(kernel_name: str) -> float:
    from jupyter_client.manager import AsyncKernelManager

    km = AsyncKernelManager(kernel_name=kernel_name)
    begin = time.perf_counter()
    await km.start_kernel()
    client = km.client()
    client.start_channels()
    await client.wait_for_ready(timeout=60)  # returns on the first kernel_info_reply
    elapsed = time.perf_counter() - begin
    client.stop_channels()
    await km.shutdown_kernel(now=True)
    return elapsed


async def main(rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"vanilla-python": [], "gpushare-python": []}
    await _start_once("vanilla-python")  # warm the import caches of both paths
    await _start_once("gpushare-python")
    for _ in range(rounds):
        for name in times:
            times[name].append(await _start_once(name))
    vanilla = statistics.median(times["vanilla-python"])
    ours = statistics.median(times["gpushare-python"])
    print(f"{'provisioner':<28}{'median ms':>12}{'p90 ms':>10}")
    rows = (("vanilla local", "vanilla-python"), ("gpushare (local)", "gpushare-python"))
    for label, name in rows:
        series = sorted(times[name])
        p90 = series[int(0.9 * (len(series) - 1))]
        print(f"{label:<28}{statistics.median(series) * 1e3:>12.1f}{p90 * 1e3:>10.1f}")
    ratio = ours / vanilla
    print(f"ratio gpushare/vanilla: {ratio:.3f} (target <= 1.10), {rounds} rounds each")
    return {
        "rounds": rounds,
        "vanilla_median_ms": round(vanilla * 1e3, 2),
        "gpushare_median_ms": round(ours * 1e3, 2),
        "ratio": round(ratio, 4),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    tmp = _isolate()
    try:
        result = asyncio.run(main(args.rounds))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"benchmark": "kernel_start", **result}))
