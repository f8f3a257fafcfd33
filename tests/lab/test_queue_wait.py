"""Waiting in line from JupyterLab's picker (issue 27, "Done when"), in headless Chromium.

Two real users on one simulated A100 behind one system node agent (``jupyter gpushare daemon
--system``, as in tests/test_queue_agent.py): gsalice holds the whole GPU (a share of hers,
placed through the agent, held by a process of hers), and carries the idle-reclaim warning her
server's reclaimer writes for an idle kernel (released 2 min from now unless it runs GPU work),
which the queue's ETA rests on. This Lab's user (the server's) starts a kernel asking for 0.5 of
an A100: tests/lab/queue_wait.mjs drives it (the steps are listed there). Checked: the picker
offers to wait where the share does not fit; the waiting dialog shows the place in line and the
ETA in the queue's words; "Cancel waiting" removes the queue entry and starts nothing; after
alice's release the kernel starts by itself, within the queue's promise, and a notification says
so. Screenshots (kept for the docs): test-artifacts/lab/queue/ -- 01-picker-offers-to-wait,
02-waiting-position-and-eta, 03-cancelled, 04-started-by-itself, 05-kernel-runs.
"""

# ruff: noqa: F811 - the fixtures of test_system_agent are imported and taken by name
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from labdriver import LabServer, driver_missing, run_driver
from support import ARTIFACTS, wait_for
from test_system_agent import holder, place, release, run_as, unix_user  # noqa: F401

from jupyter_gpushare.ledger.agent import AgentLedger

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)"),
]

KERNEL = "gpushare-python"


async def _warn_idle(socket: str, allocation_id: str, release_at: float) -> str:
    """alice's share as idle reclaim leaves it after its warning (reclaim.warning_for's shape)."""
    warning = {"warned_at": time.time(), "release_at": release_at, "idle_s": 600.0}
    changed = await AgentLedger(socket).update(
        allocation_id, lambda a, _o: replace(a, extra={**a.extra, "reclaim_warning": warning})
    )
    return str(changed.id)


def test_a_waiting_start_shows_its_place_can_be_cancelled_and_starts_by_itself(
    gpushare_env: dict[str, str], holder: Any
) -> None:
    reason = driver_missing()
    if reason:
        if os.environ.get("CI", "").lower() == "true":  # never a silent pass in CI
            pytest.fail(f"the browser tests need Chromium under CI: {reason}")
        pytest.skip(reason)
    alice = unix_user("gsalice")
    path = Path(gpushare_env["GPUSHARE_SOCKET"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare.daemon",
            "--system",
            "--socket",
            str(path),
            "--ledger",
            str(path.parent / "agent-state" / "ledger.sqlite"),
            "--simulate",
            "1xA100",
            "--state-dir",
            str(path.parent / "agent-shm"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    path.parent.chmod(0o755)  # alice reaches the socket
    artifacts = ARTIFACTS / "lab" / "queue"
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    server = None
    released: dict[str, float] = {}
    try:
        wait_for(lambda: path.exists(), 30)
        held = run_as(alice, place, str(path), 1.0, None, holder(alice))[1]["allocation"]
        run_as(alice, _warn_idle, str(path), held["id"], time.time() + 120)
        server = LabServer(gpushare_env, "1xA100", "--GpuShare.start_wait_max=120").start(90)
        label = server.get(f"/api/kernelspecs/{KERNEL}").json()["spec"]["display_name"]

        def release_on_signal() -> None:  # alice releases once the driver has seen the wait
            marker = artifacts / "release-now"
            deadline = time.monotonic() + 240
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if marker.exists():
                run_as(alice, release, str(path), held["id"])
                released["at"] = time.time()

        releaser = threading.Thread(target=release_on_signal, daemon=True)
        releaser.start()
        seen = run_driver("queue_wait.mjs", server, artifacts, timeout=240, kernelLabel=label)
        releaser.join(10)
    finally:
        if server is not None:
            server.stop()
        agent.send_signal(signal.SIGTERM)
        agent.wait(10)
    (artifacts / "seen.json").write_text(json.dumps(seen, indent=1))

    # the picker offers to wait where the share does not fit
    assert "No A100 has 50 % free" in seen["fit1"], seen["fit1"]
    assert "Wait in line" in seen["fit1"] and "at most 2 min" in seen["fit1"], seen["fit1"]
    # the waiting dialog: place and ETA, in the queue's words (the reclaim deadline)
    [entry] = seen["queue1"]["entries"]
    assert entry["position"] == 1 and entry["state"] == "waiting"
    assert entry["eta"]["hi_s"] is not None and entry["eta"]["reclaims"] == 1, entry
    for line in (seen["waiting1"], seen["waiting2"]):
        assert line.startswith("1st in line for 0.5 of an A100; expected "), line
        assert "idle share is reclaimed by" in line, line
    # Cancel: the entry is gone, no kernel, nothing else pops up
    assert seen["queueAfterCancel"]["entries"] == []
    assert seen["kernelsAfterCancel"] == []
    assert seen["dialogsAfterCancel"] == []
    # alice releases: the kernel starts by itself, the picker says so
    assert "started by itself" in seen["notice"] and "1st in line" in seen["notice"]
    assert seen["dialogsAfterStart"] == []
    [mine] = seen["allocations"]
    assert seen["cell"].strip("'") == mine["id"]
    assert mine["gpu_request"] == 0.5 and mine["extra"]["queue_entry"].startswith("q-")
    assert seen["queueAfterStart"]["entries"] == []
    # told within a few seconds of the release (the start itself begins within 1 s of it,
    # tests/test_queue_agent.py; here the kernel's launch and the page's poll come on top)
    assert seen["startedAt"] - released["at"] < 15, (seen["startedAt"], released)
