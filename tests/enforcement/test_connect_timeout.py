"""The interposer's connection to the agent is bounded (``connect.c``, ``dial_agent``).

An agent that is stuck or flooded with connections stops accepting; once its listen backlog is
full, a plain blocking ``connect()`` on its unix socket waits until it accepts again, and a
user's ``cuInit`` waited with it, for good. Now the connect gives up after
``GPUSHARE_CONNECT_TIMEOUT_MS`` (default 2 s) and the process runs as with no agent at all: fail
static at its request share, its memory cap from ``GPUSHARE_GPU_MEMORY``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from enforcement_support import LIB, TENANT, sanitizer_preload

from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.simulator import simulator_env

MiB = 2**20


@pytest.fixture
def full_backlog() -> Iterator[str]:
    """A unix socket that listens and never accepts, its backlog filled: the path."""
    with tempfile.TemporaryDirectory(prefix="gsct", dir="/tmp") as tmp:
        path = os.path.join(tmp, "agent.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        clients = []
        try:
            while True:  # fill the queue until a connect would wait
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.setblocking(False)
                clients.append(c)
                try:
                    c.connect(path)
                except BlockingIOError:
                    break
                assert len(clients) < 64, "the backlog never filled"
            yield path
        finally:
            for c in clients:
                c.close()
            server.close()


@pytest.mark.parametrize(
    ("kind", "timeout_ms"),
    [("plain", None), ("plain", 500), ("asan", 500), ("tsan", 500)],
    ids=["default 2 s", "500 ms", "asan", "tsan"],
)
def test_cuinit_against_an_agent_that_never_accepts_returns_in_time(
    built: None, full_backlog: str, tmp_path: Path, kind: str, timeout_ms: int | None
) -> None:
    """``cuInit`` and a memory query with the agent's backlog full: the process gives up on the
    agent after the connect timeout, runs fail static (the debug log says so), reports its cap,
    and exits 0. Before the fix it hung inside ``connect``."""
    # the socket really is full: one more connect would wait
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    with pytest.raises(BlockingIOError):
        probe.connect(full_backlog)
    probe.close()
    gpus = simulated_gpus("1xA100", "connect-node")
    preload, sanitizer = sanitizer_preload(kind, leaks=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.update(simulator_env(gpus, tmp_path / "sim.state"))
    env.update(
        {
            "GPUSHARE_SOCKET": full_backlog,
            "GPUSHARE_ALLOCATION_ID": "a-00000000000000c7",
            "CUDA_VISIBLE_DEVICES": gpus[0].uuid,
            "GPUSHARE_GPU_REQUEST": "0.5",
            "GPUSHARE_GPU_MEMORY": str(256 * MiB),
            "GPUSHARE_DEBUG": "1",
            "LD_PRELOAD": preload,
            **sanitizer,
        }
    )
    if timeout_ms is not None:
        env["GPUSHARE_CONNECT_TIMEOUT_MS"] = str(timeout_ms)
    binary = TENANT if kind == "plain" else LIB / "test" / f"gs_tenant-{kind}"
    started = time.monotonic()
    done = subprocess.run(
        [str(binary), "info"], env=env, capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - started
    wait = (timeout_ms or 2000) / 1000
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, done.stderr
    assert f"did not accept within {timeout_ms or 2000} ms" in done.stderr, done.stderr
    assert "daemon unreachable at start: running at request share 0.500" in done.stderr
    # bounded by the timeout (the first try; the agent thread's retries do not hold up main),
    # with room for a loaded machine and a sanitizer's start-up
    assert wait * 0.9 <= took < wait + 15, took
    [info] = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert info["total"] == 256 * MiB and info["over_total"] == 2  # fail static: the env's cap
