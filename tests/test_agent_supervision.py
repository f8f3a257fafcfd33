"""The node agent is supervised: a Jupyter server starts a new one when it dies, and a change
(PATCH, DELETE) is acknowledged only once the agent enforces it (else 503 ``not_applied``).
Starting an agent leaves no ``ResourceWarning`` behind, and the agent outlives its starter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
from support import wait_for

from jupyter_gpushare.daemon.client import DaemonClient


def _agent_pid(socket: str) -> int | None:
    try:
        return int(DaemonClient(socket, timeout=1.0).ping()["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _enforced(socket: str, allocation_id: str) -> dict | None:
    # 10 s: an agent that has just started (or a loaded machine) may take a while to answer
    reply = DaemonClient(socket, timeout=10.0).status(allocation_id)
    return reply["allocations"][0] if reply.get("ok") else None


def _patch(server, allocation_id: str, body: dict):
    return server.request("PATCH", f"/gpushare/api/allocations/{allocation_id}", json=body)


def test_a_killed_agent_is_restarted_and_changes_are_acknowledged_only_when_enforced(
    jupyter_server, gpushare_env
):
    server = jupyter_server("1xA100")
    socket = gpushare_env["GPUSHARE_SOCKET"]
    first = wait_for(lambda: _agent_pid(socket), timeout=60)
    holder = subprocess.Popen(  # a share held by a command (cheaper than a kernel)
        [
            sys.executable,
            "-m",
            "jupyter_gpushare",
            "run",
            "--gpu-request",
            "0.25",
            "--gpu-limit",
            "0.5",
            "--",
            "sleep",
            "300",
        ],
        env={**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"},
    )
    try:
        [allocation] = wait_for(lambda: server.allocations(), timeout=60)
        aid = allocation["id"]

        # agent alive: 200, and the agent enforces the new share when the answer comes
        assert _patch(server, aid, {"gpu_limit": 0.75}).status_code == 200
        assert _enforced(socket, aid)["limit"] == 0.75

        os.kill(first, signal.SIGKILL)
        wait_for(
            lambda: (
                not psutil.pid_exists(first)
                or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
            ),
            timeout=10,
        )
        response = _patch(server, aid, {"gpu_limit": 1.0})
        if response.status_code == 200:  # the supervisor was quicker: then it is in force
            assert _enforced(socket, aid)["limit"] == 1.0
        else:
            assert response.status_code == 503, response.text
            body = response.json()
            assert body["error"] == "not_applied"
            assert "recorded" in body["message"] and "agent" in body["message"]

        # the same server (no restart) has a new agent within seconds, enforcing the ledger
        second = wait_for(lambda: _agent_pid(socket), timeout=30)
        assert second != first and server.proc.poll() is None
        assert wait_for(lambda: (_enforced(socket, aid) or {}).get("limit") == 1.0, timeout=10)
        response = _patch(server, aid, {"gpu_request": 0.5, "gpu_memory": "4GiB"})
        assert response.status_code == 200, response.text
        enforced = _enforced(socket, aid)
        assert (enforced["request"], enforced["memory_cap"]) == (0.5, 4 * 2**30)
        assert "does not answer; starting a new one" in server.log()

        # a release is acknowledged once the agent no longer holds the share
        assert server.delete(f"/gpushare/api/allocations/{aid}").status_code == 204
        assert _enforced(socket, aid) is None
    finally:
        holder.kill()
        holder.wait()


def test_a_change_is_refused_with_503_while_no_agent_can_run(jupyter_server, gpushare_env):
    """No agent can come back (a file stands where its socket's directory was): the change is
    not acknowledged, and says it is recorded for when the agent is back."""
    server = jupyter_server("1xA100")
    socket = Path(gpushare_env["GPUSHARE_SOCKET"])
    agent = wait_for(lambda: _agent_pid(str(socket)), timeout=60)
    holder = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare", "run", "--", "sleep", "300"],
        env={**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"},
    )
    moved = socket.parent.with_name(socket.parent.name + "-away")
    try:
        [allocation] = wait_for(lambda: server.allocations(), timeout=60)
        os.kill(agent, signal.SIGKILL)
        socket.parent.rename(moved)
        socket.parent.write_text("not a directory")
        response = _patch(server, allocation["id"], {"gpu_limit": 1.0})
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["error"] == "not_applied" and "recorded" in body["message"]
        assert (
            server.get(f"/gpushare/api/allocations/{allocation['id']}").json()["gpu_limit"] == 1.0
        )  # recorded: a new agent enforces it
        gone = server.delete(f"/gpushare/api/allocations/{allocation['id']}")
        assert gone.status_code == 503 and gone.json()["error"] == "not_applied"
        # the supervisor keeps trying every 2 s and says why once (no log line per try)
        failed = "could not start the node agent again"
        wait_for(lambda: failed in server.log(), timeout=10)
        time.sleep(4.5)
        assert server.log().count(failed) == 1 and "Traceback" not in server.log()
        assert server.log().count("does not answer; starting a new one") == 1
    finally:
        if moved.exists():
            socket.parent.unlink()
            moved.rename(socket.parent)
        holder.kill()
        holder.wait()


def test_starting_an_agent_leaves_no_resource_warning_and_it_outlives_the_starter(
    gpushare_env, tmp_path
):
    socket = gpushare_env["GPUSHARE_SOCKET"]
    script = textwrap.dedent(f"""
        import gc, pathlib
        from jupyter_gpushare.daemon.supervisor import ensure_daemon
        from jupyter_gpushare.inventory import simulated_gpus
        ensure_daemon(pathlib.Path({socket!r}), pathlib.Path({str(tmp_path / "l.sqlite")!r}),
                      simulated_gpus("1xA100", node="n1"), "n1")  # the Popen is not kept
        gc.collect()
        print("started")
    """)
    done = subprocess.run(
        [sys.executable, "-W", "error::ResourceWarning", "-c", script],
        env=gpushare_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == "started\n", done.stderr
    assert "ResourceWarning" not in done.stderr and "Exception ignored" not in done.stderr
    time.sleep(0.2)
    assert DaemonClient(socket).alive()  # detached: it runs on after its starter exited
