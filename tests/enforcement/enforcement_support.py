"""Helpers for the enforcement tests and benchmarks/enforcement.py: a real daemon process on
simulated GPUs, a real SQLite ledger, and tenants (gs_tenant, a C program driving the simulated
driver) with libgpushare.so preloaded. Plain functions (the fixtures are in conftest.py); a module
of its own name because several conftest.py files share that module name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.daemon.env import kernel_env
from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.paths import lib_dir
from jupyter_gpushare.share import ShareSpec

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "jupyter_gpushare" / "csrc"
LIB = lib_dir()
TENANT = LIB / "test" / "gs_tenant"
NODE = "enforce-node"
GiB = 2**30


def build_c(targets: tuple[str, ...] = ("all", "interposer-tests")) -> None:
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("needs make and a C compiler")
    subprocess.run(["make", "-s", "-C", str(CSRC), *targets], check=True, stdout=subprocess.DEVNULL)
    if not (LIB / "sim" / "libcuda.so.1").exists():
        pytest.skip("the GPU simulator (_lib/sim/libcuda.so.1) is not built")


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    socket: Path
    ledger_path: Path
    state_dir: Path
    args: list[str]
    log: Path

    @property
    def client(self) -> DaemonClient:
        return DaemonClient(self.socket)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_daemon(
    tmp: Path,
    simulate: str = "1xA100",
    quantum_ms: float = 20,
    window_ms: float = 1000,
    extra: tuple[str, ...] = (),
) -> DaemonProc:
    socket = tmp / "daemon.sock"
    ledger_path = tmp / "ledger.sqlite"
    state_dir = tmp / "shm"
    args = [
        sys.executable,
        "-m",
        "jupyter_gpushare.daemon",
        "--socket",
        str(socket),
        "--ledger",
        str(ledger_path),
        "--node",
        NODE,
        "--simulate-devices",
        simulate,
        "--state-dir",
        str(state_dir),
        "--quantum-ms",
        str(quantum_ms),
        "--window-ms",
        str(window_ms),
        "--poll-ms",
        "100",
        *extra,
    ]
    return _spawn_daemon(args, socket, ledger_path, state_dir, tmp / "daemon.log")


def _spawn_daemon(
    args: list[str], socket: Path, ledger_path: Path, state_dir: Path, log: Path
) -> DaemonProc:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["GPUSHARE_SIM_STATE"] = str(socket.parent / "sim.state")
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, env=env)
    daemon = DaemonProc(proc, socket, ledger_path, state_dir, args, log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if daemon.client.alive():
            return daemon
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    daemon.stop()
    raise RuntimeError("daemon did not start:\n" + log.read_text())


def restart_daemon(old: DaemonProc) -> DaemonProc:
    return _spawn_daemon(old.args, old.socket, old.ledger_path, old.state_dir, old.log)


def add_allocation(
    ledger: SQLiteLedger,
    gpu: Gpu,
    request: float,
    limit: float,
    memory: int = 8 * GiB,
    pid: int | None = None,
) -> Allocation:
    spec = ShareSpec(gpu_request=request, gpu_limit=limit, gpu_memory=memory, gpu_type=gpu.type)
    allocation = Allocation(
        id=Allocation.new_id(),
        node=NODE,
        gpus=(gpu.uuid,),
        spec=spec,
        memory=memory,
        pid=pid,
        pid_start=psutil.Process(pid).create_time() if pid else None,
    )
    for _ in range(200):
        snap = ledger.snapshot_sync()
        if ledger.compare_and_swap_sync(
            NODE, snap.versions.get(NODE, 0), [*snap.on_node(NODE), allocation]
        ):
            return allocation
    raise RuntimeError("ledger contention")


def set_pid(ledger: SQLiteLedger, allocation_id: str, pid: int) -> None:
    start = psutil.Process(pid).create_time()
    for _ in range(200):
        snap = ledger.snapshot_sync()
        rest = [a for a in snap.on_node(NODE) if a.id != allocation_id]
        mine = snap.find(allocation_id)
        assert mine is not None
        if ledger.compare_and_swap_sync(
            NODE,
            snap.versions.get(NODE, 0),
            [*rest, replace(mine, pid=pid, pid_start=start, state="active")],
        ):
            return
    raise RuntimeError("ledger contention")


def remove_allocation(ledger: SQLiteLedger, allocation_id: str) -> None:
    for _ in range(200):
        snap = ledger.snapshot_sync()
        rest = [a for a in snap.on_node(NODE) if a.id != allocation_id]
        if ledger.compare_and_swap_sync(NODE, snap.versions.get(NODE, 0), rest):
            return


@dataclass
class Tenant:
    proc: subprocess.Popen[str]
    allocation: Allocation | None
    lines: list[dict] = field(default_factory=list)

    #: stdout read as it comes (spawn_tenant(drain=True)): a tenant that writes more than a
    #: pipe holds before finish() would otherwise block in printf and lose device time
    drained: list[str] | None = None
    reader: threading.Thread | None = None

    def finish(self, timeout: float = 60) -> list[dict]:
        if self.reader is not None and self.drained is not None:
            self.proc.wait(timeout=timeout)
            self.reader.join(timeout)
            out, err = "".join(self.drained), self.proc.stderr.read() if self.proc.stderr else ""
        else:
            out, err = self.proc.communicate(timeout=timeout)
        self.stderr = err
        self.lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        return self.lines


def spawn_tenant(
    daemon: DaemonProc,
    ledger: SQLiteLedger,
    allocation: Allocation | None,
    gpus: list[Gpu],
    argv: list[str],
    tmp: Path,
    *,
    register: bool = True,
    binary: Path = TENANT,
    preload: str | None = None,
    extra_env: dict[str, str] | None = None,
    drain: bool = False,
) -> Tenant:
    """Start gs_tenant under `allocation`; it waits until its pid is in the ledger. With
    `drain` its stdout is read as it comes (long runs that print much: benchmarks)."""
    gate = tmp / f"gate-{time.monotonic_ns()}"
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if allocation is not None:
        env.update(kernel_env(allocation, daemon.socket, gpus))
    else:
        env.update(kernel_env(_dummy(gpus), daemon.socket, gpus))
        env.pop("GPUSHARE_ALLOCATION_ID")
    env["GPUSHARE_SIM_STATE"] = str(daemon.socket.parent / "sim.state")
    if preload is not None:
        env["LD_PRELOAD"] = preload
    env["GS_TENANT_WAIT_FILE"] = str(gate)
    if os.environ.get("GS_DEBUG_TENANTS"):
        env["GPUSHARE_DEBUG"] = "1"
    env.update(extra_env or {})
    proc = subprocess.Popen(
        [str(binary), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    if allocation is not None and register:
        set_pid(ledger, allocation.id, proc.pid)
    tenant = Tenant(proc, allocation)
    if drain:
        tenant.drained = []
        tenant.reader = threading.Thread(
            target=lambda: tenant.drained.extend(iter(proc.stdout.readline, "")),  # type: ignore[union-attr]
            daemon=True,
        )
        tenant.reader.start()
    gate.touch()
    return tenant


def _dummy(gpus: list[Gpu]) -> Allocation:
    spec = ShareSpec(gpu_request=1.0, gpu_limit=1.0, gpu_memory=GiB, gpu_type=gpus[0].type)
    return Allocation(id="a-none", node=NODE, gpus=(gpus[0].uuid,), spec=spec, memory=GiB)


def device_shares(tenants: list[Any], t0: int, t1: int) -> list[float]:
    """Each tenant's share of device time in [t0, t1] from the device times its queues report
    (gs_tenant's ``{"q", "dt", "dd"}`` lines: a queue's work done by a device time), else from
    its progress lines (:func:`shares`). Between two reports the work done is placed as late as
    it can have run (a kernel runs right before it completes), so a tenant blocked across a
    window edge is counted for the device time it got inside the window, not at its average
    rate over a wider interval (which let 50 ms kernels in deep queues add up to 1.02)."""
    out = []
    for t in tenants:
        queues: dict[int, list[tuple[int, int]]] = {}
        for x in t.lines:
            if "q" in x and "dt" in x:
                queues.setdefault(x["q"], []).append((x["dt"], x["dd"]))
        if not queues:
            out.append(shares([t], t0, t1)[0])
            continue
        done_us = sum(_done_by(pts, t1) - _done_by(pts, t0) for pts in queues.values())
        out.append(done_us * 1000 / max(t1 - t0, 1))
    return out


def peak_device_time(tenant: Any, t0: int, t1: int, width_ns: int = 1_000_000_000) -> float:
    """The most device time (s) `tenant` got in any window of `width_ns` inside [t0, t1]
    (windows starting every 10 ms; :func:`device_shares` inside each): what a limit promises
    per window, where a share over the whole run averages bursts and debt out."""
    starts = range(t0, max(t0, t1 - width_ns) + 1, 10_000_000)
    return max(device_shares([tenant], s, s + width_ns)[0] for s in starts) * width_ns / 1e9


def _done_by(points: list[tuple[int, int]], when: int) -> float:
    """Device µs of work a queue finished by device time ``when`` (ns), from its reports
    (device time, µs done by then), the work between two reports placed as late as it can be."""
    points = sorted(points)
    done_before, at = 0, None
    for dt, dd in points:
        if dt <= when:
            done_before = dd
            continue
        at = (dt, dd)
        break
    if at is None:
        return float(done_before)
    dt, dd = at
    return float(max(done_before, dd - (dt - when) / 1000))


def shares(tenants: list[Tenant], t0: int, t1: int) -> list[float]:
    """Each tenant's device time in [t0, t1] (ns, CLOCK_MONOTONIC) from its progress lines."""
    out = []
    for t in tenants:
        points = [(x["t"], x["done_us"]) for x in t.lines if "t" in x]
        before = max((p for p in points if p[0] <= t0), default=(t0, 0))
        after = min((p for p in points if p[0] >= t1), default=points[-1] if points else (t1, 0))
        out.append((after[1] - before[1]) * 1000 / max(after[0] - before[0], 1))
    return out


def sanitizer_preload(kind: str, leaks: bool = True) -> tuple[str, dict[str, str]]:
    """``LD_PRELOAD`` and the sanitizer options for the interposer built ``kind`` ("plain",
    "asan" or "tsan"): the sanitizer runtimes first (they must come before the program's own
    libraries), then the instrumented libgpushare. ``leaks``: LeakSanitizer on, with the
    simulated driver's per-process state suppressed."""
    if kind == "plain":
        return str(LIB / "libgpushare.so"), {}
    runtimes = ["libasan.so", "libubsan.so"] if kind == "asan" else ["libtsan.so"]
    paths = [
        subprocess.run(
            ["cc", f"-print-file-name={r}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for r in runtimes
    ]
    if kind == "tsan":
        options = {"TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0"}
    else:
        suppressions = LIB / "test" / "lsan.supp"
        suppressions.write_text(
            "# the simulated driver keeps per-process state for the process lifetime\n"
            "leak:libcuda.so.1\n"
        )
        options = {
            "ASAN_OPTIONS": f"detect_leaks={int(leaks)}:abort_on_error=0:exitcode=66",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=66",
            "LSAN_OPTIONS": f"suppressions={suppressions}",
        }
    return ":".join([*paths, str(LIB / "test" / f"libgpushare-{kind}.so")]), options
