"""Kernel start time: vanilla local provisioner vs gpushare (local backend), side by side, and
gpushare's warm-pool path (a start served by a warm kernel) against gpushare's cold start.

Measures, for each, the median and p90 time from the start request to the first
``kernel_info_reply``. The cold starts are interleaved in ABBA order (vanilla first in even rounds,
gpushare first in odd ones) so that drift and whatever one start leaves behind (its shutdown, the
agent's release) fall on both alike; the warm start comes last in each round and its pool refills
before the next round (the refill is a kernel start of its own and would otherwise run alongside
the next cold start). The verdict is the ratio of the medians; the median of the per-round ratios
(each vanilla start against the gpushare start next to it) is printed beside it, and the load
average before and after (on the 2-core dev VM, quiet, 20-round runs of the old sequential order
gave ratios from 1.04 to 1.12). The gpushare kernels run on one simulated A100 (placement,
ledger CAS, environment and, once built, the interposer preload are all in the measured path).
The warm path is jupyter_server's kernel manager with gpushare pools (``PoolKernelManager``, a
pool of 2 for the kernelspec's share): the start claims a warm kernel, binds it to the session
(cwd, environment) and the client's first reply comes from a kernel that is already running; the
pool refills between rounds (not measured). Ends with one JSON line.

Where the difference goes: each cold start is split at the kernel process's start (the
provisioner's ``launch_kernel``): before it, the server's side (placement, ledger, agent check,
environment); after it, the kernel's own start to its first reply (for gpushare kernels also the
interposer's load and the ``%gpushare`` extension's import). The kernel processes' own CPU time
up to their first reply (all their threads, from ``/proc/<pid>/task/*/schedstat``) is printed
too: unlike wall time it hardly moves with the machine's load, so a kernel-side cost shows there.

The package's modules are byte-compiled first, as an installed package's are (``pip install``
writes ``.pyc`` files; an editable install under ``PYTHONDONTWRITEBYTECODE=1``, as on the
development VM, has none, and every gpushare kernel then compiles the extension's modules from
source: about 8 ms of its start on a quiet machine). ``--no-compile`` measures without that.

    python benchmarks/kernel_start.py [--rounds 10] [--no-compile]
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
from queue import Empty
from typing import Any

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
    (vanilla / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "vanilla",
                "language": "python",
            }
        )
    )
    return tmp


async def _first_reply(client: Any, timeout: float = 60) -> None:
    """Returns when the kernel's first ``kernel_info_reply`` arrives (jupyter_client's
    ``wait_for_ready`` also waits ≥ 200 ms for IOPub to go quiet, which no user waits for)."""
    asked: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        asked.add(client.kernel_info())
        try:
            while True:
                reply = await client.get_shell_msg(timeout=1)
                if reply["parent_header"].get("msg_id") in asked:
                    return
        except Empty:
            continue
    raise TimeoutError(f"no kernel_info_reply within {timeout} s")


#: when the last kernel process was started (the provisioner's ``launch_kernel``)
_LAUNCHED: list[float] = []
#: the pid of the last kernel process started
_PIDS: list[int] = []
#: per kernelspec: seconds from the start request to the kernel process's start
_TO_PROCESS: dict[str, list[float]] = {}
#: per kernelspec: the kernel process's CPU seconds (all threads) at its first reply
_KERNEL_CPU: dict[str, list[float]] = {}


def _mark_process_starts() -> None:
    """Timestamps each kernel process start (every provisioner ends in jupyter_client's
    ``LocalProvisioner.launch_kernel``, gpushare's local backend too)."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    launch = LocalProvisioner.launch_kernel

    async def marked(self: Any, cmd: list[str], **kwargs: Any) -> Any:
        _LAUNCHED.append(time.perf_counter())
        try:
            return await launch(self, cmd, **kwargs)
        finally:
            if self.pid:
                _PIDS.append(self.pid)

    LocalProvisioner.launch_kernel = marked  # type: ignore[method-assign]


def _stop_agent(socket: Path) -> None:
    """Stops the per-user agent the gpushare starts brought up on this run's socket (it runs
    detached, in a session of its own, and would outlive the run)."""
    import signal

    from jupyter_gpushare.daemon.client import DaemonClient

    try:
        pid = int(DaemonClient(socket, timeout=2.0).ping()["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and DaemonClient(socket, timeout=0.5).alive():
        time.sleep(0.1)


def _cpu_seconds(pid: int) -> float | None:
    """CPU time of the process ``pid`` so far, all its live threads (scheduler ns), or None."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _compile_package() -> str:
    """Byte-compiles the package's modules, as an install does."""
    import compileall
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        compileall.compile_dir(REPO / "jupyter_gpushare", quiet=1, workers=1)
    return "compiled"


async def _start_once(kernel_name: str) -> float:
    from jupyter_client.manager import AsyncKernelManager

    km = AsyncKernelManager(kernel_name=kernel_name)
    begin = time.perf_counter()
    _LAUNCHED.clear()
    _PIDS.clear()
    await km.start_kernel()
    client = km.client()
    client.start_channels()
    await _first_reply(client)
    elapsed = time.perf_counter() - begin
    cpu = _cpu_seconds(_PIDS[0]) if _PIDS else None
    if _LAUNCHED:
        _TO_PROCESS.setdefault(kernel_name, []).append(_LAUNCHED[0] - begin)
    if cpu is not None:
        _KERNEL_CPU.setdefault(kernel_name, []).append(cpu)
    client.stop_channels()
    await km.shutdown_kernel(now=True)
    return elapsed


def _pool_manager(tmp: Path) -> Any:
    """jupyter_server's kernel manager with a gpushare pool of 2 for gpushare-python."""
    from jupyter_gpushare.config import GpuShare
    from jupyter_gpushare.pools.kernel_manager import PoolKernelManager

    GpuShare.instance(
        pools=[
            {
                "name": "bench",
                "kernelspec": "gpushare-python",
                "share": {"gpu_request": 0.25, "gpu_limit": 0.5},
                "size": 2,
            }
        ]
    )
    root = tmp / "notebooks"
    root.mkdir(exist_ok=True)
    from jupyter_client.kernelspec import KernelSpecManager

    km = PoolKernelManager(root_dir=str(root), kernel_spec_manager=KernelSpecManager())
    km.pools.start()
    return km


async def _pool_ready(km: Any, count: int = 2, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while km.pools.model()[0]["ready"] < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool did not refill: {km.pools.model()}")
        await asyncio.sleep(0.05)


async def _warm_once(km: Any) -> float:
    """One start through the pool manager; returns start-to-first-reply (asserts it was warm)."""
    await _pool_ready(km)
    warm_ids = set(km.pools.unclaimed())
    begin = time.perf_counter()
    kernel_id = await km.start_kernel(
        kernel_name="gpushare-python",
        path="",
        env={**os.environ, "JPY_SESSION_NAME": "bench.ipynb"},
    )
    client = km.get_kernel(kernel_id).client()
    client.start_channels()
    await _first_reply(client)
    elapsed = time.perf_counter() - begin
    client.stop_channels()
    assert kernel_id in warm_ids, "the start was not served by a warm kernel"
    await km.shutdown_kernel(kernel_id, now=True)
    return elapsed


def _p90(values: list[float]) -> float:
    series = sorted(values)
    return series[int(0.9 * (len(series) - 1))]


async def main(rounds: int, tmp: Path) -> dict[str, Any]:
    times: dict[str, list[float]] = {"vanilla-python": [], "gpushare-python": [], "warm": []}
    load_before = os.getloadavg()
    km = _pool_manager(tmp)
    await _start_once("vanilla-python")  # warm the import caches of both paths
    await _start_once("gpushare-python")
    await _warm_once(km)
    _TO_PROCESS.clear()
    _KERNEL_CPU.clear()
    for i in range(rounds):
        cold = ("vanilla-python", "gpushare-python")
        for name in cold if i % 2 == 0 else cold[::-1]:  # ABBA
            times[name].append(await _start_once(name))
        times["warm"].append(await _warm_once(km))
        await _pool_ready(km)  # the refill's kernel start is over before the next cold start
    await km.shutdown_all(now=True)
    load_after = os.getloadavg()
    vanilla = statistics.median(times["vanilla-python"])
    ours = statistics.median(times["gpushare-python"])
    warm = statistics.median(times["warm"])
    paired = statistics.median(
        g / v for g, v in zip(times["gpushare-python"], times["vanilla-python"], strict=True)
    )
    print(
        f"load average 1/5/15 min: {' '.join(f'{x:.2f}' for x in load_before)} before, "
        f"{' '.join(f'{x:.2f}' for x in load_after)} after ({os.cpu_count()} CPUs)"
    )
    print(f"{'provisioner':<28}{'median ms':>12}{'p90 ms':>10}{'kernel CPU ms':>15}")
    rows = (
        ("vanilla local", "vanilla-python"),
        ("gpushare (local), cold", "gpushare-python"),
        ("gpushare warm pool", "warm"),
    )
    cpu: dict[str, float] = {}
    for label, name in rows:
        series = times[name]
        cpu_ms = ""
        if _KERNEL_CPU.get(name):
            cpu[name] = statistics.median(_KERNEL_CPU[name])
            cpu_ms = f"{cpu[name] * 1e3:.1f}"
        print(
            f"{label:<28}{statistics.median(series) * 1e3:>12.1f}"
            f"{_p90(series) * 1e3:>10.1f}{cpu_ms:>15}"
        )
    ratio = ours / vanilla
    phases: dict[str, float] = {}
    for label, name in rows[:2]:
        before = statistics.median(_TO_PROCESS.get(name) or [0.0])
        phases[name] = before
        print(
            f"  {label}: request -> kernel process {before * 1e3:.1f} ms, "
            f"process -> first reply {(statistics.median(times[name]) - before) * 1e3:.1f} ms"
        )
    print(
        f"ratio gpushare/vanilla: {ratio:.3f} of the medians (target <= 1.05), median of the "
        f"per-round ratios {paired:.3f}; {rounds} rounds each, interleaved ABBA"
    )
    extra_cpu = cpu.get("gpushare-python", 0.0) - cpu.get("vanilla-python", 0.0)
    print(f"kernel process CPU to its first reply: gpushare {extra_cpu * 1e3:+.1f} ms vs vanilla")
    warm_ratio = warm / ours
    print(
        f"ratio warm/cold (gpushare): {warm_ratio:.3f}; warm median {warm * 1e3:.1f} ms "
        f"(target <= 20 ms)"
    )
    return {
        "rounds": rounds,
        "load1_before": round(load_before[0], 2),
        "load1_after": round(load_after[0], 2),
        "vanilla_median_ms": round(vanilla * 1e3, 2),
        "vanilla_p90_ms": round(_p90(times["vanilla-python"]) * 1e3, 2),
        "gpushare_median_ms": round(ours * 1e3, 2),
        "gpushare_p90_ms": round(_p90(times["gpushare-python"]) * 1e3, 2),
        "ratio": round(ratio, 4),
        "paired_ratio_median": round(paired, 4),
        "cold_median_ms": round(ours * 1e3, 2),
        "warm_median_ms": round(warm * 1e3, 2),
        "warm_p90_ms": round(_p90(times["warm"]) * 1e3, 2),
        "warm_cold_ratio": round(warm_ratio, 4),
        "warm_target_met": warm * 1e3 <= 20,
        "target_met": ratio <= 1.05,
        "vanilla_to_process_ms": round(phases["vanilla-python"] * 1e3, 2),
        "gpushare_to_process_ms": round(phases["gpushare-python"] * 1e3, 2),
        "vanilla_kernel_cpu_ms": round(cpu.get("vanilla-python", 0.0) * 1e3, 2),
        "gpushare_kernel_cpu_ms": round(cpu.get("gpushare-python", 0.0) * 1e3, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="do not byte-compile the package first (see the module's doc)",
    )
    args = parser.parse_args()
    bytecode = "as found" if args.no_compile else _compile_package()
    _mark_process_starts()
    tmp = _isolate()
    try:
        result = asyncio.run(main(args.rounds, tmp))
    finally:
        _stop_agent(Path(os.environ["GPUSHARE_SOCKET"]))
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"benchmark": "kernel_start", "bytecode": bytecode, **result}))
