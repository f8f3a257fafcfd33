"""An on-demand node agent stops once idle (issue 24, item 15): a per-user agent with no share,
no client and no connection for ``--exit-when-idle`` seconds exits cleanly; a connected client
or a share keeps it; a system agent and an agent on Kubernetes never stop this way."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from support import wait_for

from jupyter_gpushare.daemon import idle_exit
from jupyter_gpushare.daemon.client import DaemonClient


def _agent(env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare.daemon",
            "--socket",
            env["GPUSHARE_SOCKET"],
            "--ledger",
            env["GPUSHARE_LEDGER"],
            "--simulate",
            "1xA100",
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_an_idle_on_demand_agent_stops_and_a_client_keeps_it(gpushare_env: dict[str, str]) -> None:
    proc = _agent(gpushare_env, "--exit-when-idle", "1.5")
    try:
        client = DaemonClient(Path(gpushare_env["GPUSHARE_SOCKET"]), timeout=2.0)
        wait_for(client.alive, timeout=30)
        # a client that stays connected keeps the agent (as a kernel's interposer does)
        held = socket.socket(socket.AF_UNIX)
        held.connect(gpushare_env["GPUSHARE_SOCKET"])
        time.sleep(3.5)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        held.close()
        began = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "started on demand, stops" in out, out
    assert 1.0 <= took < 15, took
    assert not client.alive()


def test_only_an_on_demand_agent_stops_when_idle() -> None:
    assert idle_exit.applies(system=False, kubernetes=False, idle_s=600)
    assert not idle_exit.applies(system=True, kubernetes=False, idle_s=600)
    assert not idle_exit.applies(system=False, kubernetes=True, idle_s=600)
    assert not idle_exit.applies(system=False, kubernetes=False, idle_s=0)
    help_text = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare.daemon", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--exit-when-idle" in help_text and "Default 600" in " ".join(help_text.split())
