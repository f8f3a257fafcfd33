"""Start a node daemon as a child process when none answers (workstation mode).

:func:`ensure_daemon` is synchronous (a few ms when a daemon answers; up to ``timeout`` s to
start one); async callers run it with ``asyncio.to_thread``. The daemon is started detached (its
own session), so it outlives the Jupyter server that started it and keeps enforcing for kernels
that are still running; :func:`stop` ends one we started.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..inventory import Gpu
from .client import DaemonClient

_log = logging.getLogger("jupyter_gpushare.daemon")


def _simulate_arg(gpus: Sequence[Gpu]) -> str:
    """``--simulate`` value reproducing ``gpus`` (counts per type, in index order)."""
    groups: list[list[object]] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        if groups and groups[-1][1] == gpu.type:
            groups[-1][0] = int(groups[-1][0]) + 1  # type: ignore[call-overload]
        else:
            groups.append([1, gpu.type])
    return ",".join(f"{n}x{t}" for n, t in groups)


def ensure_daemon(
    socket_path: Path,
    ledger_path: Path,
    simulate_devices: Sequence[Gpu] | None,
    node: str,
    log: logging.Logger | logging.LoggerAdapter | None = None,
    *,
    extra_args: Sequence[str] = (),
    log_file: Path | None = None,
    timeout: float = 20.0,
) -> subprocess.Popen[bytes] | None:
    """Make sure a daemon answers on ``socket_path``; returns the process we started, or None
    when one was already running. Raises ``RuntimeError`` when the started one never answers."""
    log = log or _log
    client = DaemonClient(socket_path, timeout=2.0)
    if client.alive():
        return None
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "jupyter_gpushare.daemon", "--socket", str(socket_path),
           "--ledger", str(ledger_path), "--node", node, *extra_args]
    if simulate_devices:
        cmd += ["--simulate-devices", _simulate_arg(simulate_devices)]
    log_file = log_file or socket_path.parent / "daemon.log"
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the daemon itself is never interposed
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                start_new_session=True, close_fds=True)
    log.info("started gpushare daemon (pid %d) on %s, log %s", proc.pid, socket_path, log_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.alive():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"the gpushare daemon did not start; see {log_file}")


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """Stop a daemon started by :func:`ensure_daemon` (SIGTERM, then SIGKILL)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
