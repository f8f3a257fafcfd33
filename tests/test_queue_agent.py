"""The node agent's queue (DESIGN box 13): a start that does not fit waits, and starts by
itself when capacity frees.

Real Unix users (gsalice, gsbob) against one ``jupyter gpushare daemon --system`` on a simulated
A100, as in ``tests/test_system_agent.py``. What is promised and checked here: a waiting start
shows its position and an ETA in words; it begins within 1 s of the release that makes room;
it is started once; the queue survives an agent restart; a start whose requester died is
dropped; a start can be cancelled; one that can never fit, or is over the user's bound, or over
the per-user cap on waiting starts, is refused at once with the reason; ``jupyter gpushare run
--wait`` waits and then runs.
"""

# ruff: noqa: F811 - the fixtures of test_system_agent are imported and taken by name
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket as socketlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_system_agent import (  # noqa: F401 - fixtures
    NODE,
    Agent,
    agent,
    as_user,
    holder,
    place,
    release,
    result_of,
    run_as,
    snapshot,
    unix_user,
)

from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.placement import Policy
from jupyter_gpushare.share import ShareSpec

ALICE, BOB = "gsalice", "gsbob"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)")


def ask(path: str, message: dict[str, Any]) -> dict[str, Any]:
    """One request on a connection of this process's own."""
    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data)
    assert isinstance(reply, dict)
    return reply


def queue_as_admin(path: str) -> list[dict[str, Any]]:
    return list(ask(path, {"op": "ledger.queue"})["entries"])


async def wait_for_share(path: str, request: float, timeout: float) -> dict[str, Any]:
    """bob's start: placed now or queued, then started by itself; what he saw meanwhile."""
    seen: list[dict[str, Any]] = []
    ledger = AgentLedger(path)
    try:
        made = await ledger.reserve_waiting(
            ShareSpec(request, request),
            Policy(),
            timeout,
            seen.append,
            owner="run",
            server_pid=os.getpid(),
        )
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seen": seen}
    return {"allocation": made.to_json(), "started_at": time.time(), "seen": seen}


def enqueue(path: str, request: float, held_by: int, **share: Any) -> dict[str, Any]:
    """A queued start held by ``held_by`` (a process of this user), without waiting for it."""
    return ask(
        path,
        {
            "op": "ledger.reserve",
            "share": {"gpu_request": request, "gpu_limit": request, **share},
            "fields": {"owner": "run", "server_pid": held_by},
            "queue": True,
        },
    )


async def name_entry(path: str, allocation_id: str, entry_id: str) -> str:
    """Write a queue entry's id into one's own share (an attack on another's waiting start)."""
    from dataclasses import replace

    ledger = AgentLedger(path)
    changed = await ledger.update(
        allocation_id, lambda a, _o: replace(a, extra={**a.extra, "queue_entry": entry_id})
    )
    return str(changed.extra.get("queue_entry"))


def release_timed(path: str, allocation_id: str) -> float:
    asyncio.run(release(path, allocation_id))
    return time.time()


def wait_until(what: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = what()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_start_that_does_not_fit_waits_and_begins_within_a_second_of_the_release(
    agent, holder
) -> None:
    alice, bob = unix_user(ALICE), unix_user(BOB)
    with socketlib.socket() as probe:  # a free port for the agent's metrics
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    a: Agent = agent("--metrics-port", str(free_port))
    path = str(a.socket)
    held = run_as(alice, place, path, 1.0, None, holder(alice))
    assert held[0] == "ok" and "allocation" in held[1], held
    full = held[1]["allocation"]

    waiting = as_user(bob, wait_for_share, path, 0.5, 60.0)
    entries = wait_until(lambda: queue_as_admin(path))
    assert len(entries) == 1, entries
    (entry,) = entries
    assert entry["user"] == BOB and entry["position"] == 1
    assert entry["message"].startswith("1st in line for 0.5 of an A100")
    # alice sees bob's start only as capacity, and her place in no line
    theirs = run_as(alice, ask, path, {"op": "ledger.queue"})[1]["entries"]
    assert [set(e) & {"user", "kernel_id"} for e in theirs] == [set()]
    # the admin's view: jupyter gpushare status
    env = {**os.environ, "GPUSHARE_SOCKET": path, "GPUSHARE_NODE_NAME": NODE}
    shown = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [e["user"] for e in json.loads(shown.stdout)["queue"]] == [BOB], shown.stderr
    table = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare.cli", "status"],
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Waiting starts (queue)" in table.stdout and BOB in table.stdout, table.stdout

    released_at = run_as(alice, release_timed, path, full["id"])[1]
    outcome = result_of(waiting, 60)
    assert outcome[0] == "ok" and "allocation" in outcome[1], outcome
    started = outcome[1]
    assert started["allocation"]["user"] == BOB
    assert started["seen"][0]["state"] == "waiting"
    assert started["started_at"] - released_at <= 1.0, (
        f"started {started['started_at'] - released_at:.3f} s after the release"
    )
    # started once: one share carries the entry
    records = asyncio.run(snapshot(path))
    carrying = [r for r in records if r["extra"].get("queue_entry") == entry["id"]]
    assert [r["id"] for r in carrying] == [started["allocation"]["id"]]
    figures = ask(path, {"op": "ledger.queue"})["metrics"]
    assert figures["started"] == 1 and figures["waiting"] == 0
    assert max(figures["reactions_s"]) <= 1.0
    port = ask(path, {"op": "status"})["daemon"]["metrics_port"]
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        metrics = page.read().decode()
    assert 'gpushare_queue_started_total{Hostname="gs-h3"} 1.0' in metrics, metrics[-2000:]
    assert 'gpushare_queue_length{Hostname="gs-h3"} 0.0' in metrics
    assert 'gpushare_queue_wait_seconds_count{Hostname="gs-h3"} 1.0' in metrics


def test_the_queue_survives_a_restart_drops_the_dead_and_cancels(agent, holder) -> None:
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a: Agent = agent()
    path = str(a.socket)
    held = run_as(alice, place, path, 1.0, None, holder(alice))[1]["allocation"]
    bobs = holder(bob)
    doomed = subprocess.Popen(["sleep", "600"], user=bob.pw_uid, group=bob.pw_gid, cwd="/")
    first = run_as(bob, enqueue, path, 0.5, bobs)[1]
    second = run_as(bob, enqueue, path, 0.25, doomed.pid)[1]
    third = run_as(bob, enqueue, path, 0.25, bobs)[1]
    assert first["queued"] and second["queued"] and third["queued"], (first, second, third)
    assert [e["id"] for e in queue_as_admin(path)] == [
        first["entry"]["id"],
        second["entry"]["id"],
        third["entry"]["id"],
    ]
    # alice may not cancel bob's start; bob may
    refused = run_as(alice, ask, path, {"op": "ledger.queue.cancel", "entry": third["entry"]["id"]})
    assert refused[1]["ok"] is False and refused[1]["error"] == "unknown_entry"
    cancelled = run_as(bob, ask, path, {"op": "ledger.queue.cancel", "entry": third["entry"]["id"]})
    assert cancelled[1]["entry"]["state"] == "cancelled"

    # alice names bob's first entry on her own share: it is not taken as started (before the
    # fix the next pass marked it started with alice's share)
    assert (
        run_as(alice, name_entry, path, held["id"], first["entry"]["id"])[1] == first["entry"]["id"]
    )
    time.sleep(0.6)  # a few passes of the queue
    assert first["entry"]["id"] in [e["id"] for e in queue_as_admin(path)]

    a.stop()  # the agent restarts: the waiting starts are kept
    a.__init__(a.dir)
    assert [e["id"] for e in queue_as_admin(path)] == [first["entry"]["id"], second["entry"]["id"]]
    doomed.kill()
    doomed.wait()
    assert wait_until(lambda: len(queue_as_admin(path)) == 1, 5.0)  # its requester is gone
    gone = run_as(bob, ask, path, {"op": "ledger.queue.wait", "entry": second["entry"]["id"]})
    assert gone[1]["entry"]["state"] == "dropped"

    run_as(alice, release, path, held["id"])
    assert wait_until(
        lambda: [
            r
            for r in asyncio.run(snapshot(path))
            if r["extra"].get("queue_entry") == first["entry"]["id"]
        ],
        5.0,
    )
    done = run_as(bob, ask, path, {"op": "ledger.queue.wait", "entry": first["entry"]["id"]})
    assert done[1]["entry"]["state"] == "started"
    assert done[1]["entry"]["allocation"]["user"] == BOB


def test_what_can_never_fit_is_refused_at_once(agent, holder) -> None:
    bob = unix_user(BOB)
    alice = unix_user(ALICE)
    a: Agent = agent(
        "--max-share", '{"gpu_request": 0.5, "gpu_limit": 0.5}', "--queue-max-per-user", "1"
    )
    path = str(a.socket)
    run_as(alice, place, path, 0.5, None, holder(alice))
    run_as(alice, place, path, 0.5, None, holder(alice))  # the GPU is full
    bobs = holder(bob)
    began = time.monotonic()
    too_big = run_as(bob, enqueue, path, 0.5, bobs, gpu_memory="100GiB")[1]
    assert too_big["ok"] is False and too_big["field"] == "gpu_memory", too_big
    too_many = run_as(bob, enqueue, path, 0.5, bobs, gpu_count=2)[1]
    assert too_many["ok"] is False and "gpu_count" in json.dumps(too_many), too_many
    over_bound = run_as(bob, enqueue, path, 0.75, bobs)[1]
    assert over_bound["ok"] is False and over_bound.get("field") == "gpu_request", over_bound
    assert time.monotonic() - began < 10  # at once, not after a wait
    assert run_as(bob, enqueue, path, 0.5, bobs)[1]["queued"]
    capped = run_as(bob, enqueue, path, 0.5, bobs)[1]
    assert capped["ok"] is False and capped["error"] == "queue_full", capped
    assert "at most 1" in capped["message"]


def test_gpushare_run_wait_waits_then_runs_and_ctrl_c_cancels(agent, holder) -> None:
    alice = unix_user(ALICE)
    a: Agent = agent()
    path = str(a.socket)
    held = run_as(alice, place, path, 1.0, None, holder(alice))[1]["allocation"]
    env = {**os.environ, "GPUSHARE_SOCKET": path, "GPUSHARE_NODE_NAME": NODE}
    argv = [sys.executable, "-m", "jupyter_gpushare.cli", "run", "--gpu-request", "0.5"]
    # Ctrl-C while waiting: the entry is cancelled, nothing is held
    proc = subprocess.Popen(
        [*argv, "--wait", "--", "true"], env=env, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    first = ""
    while "in line" not in first:  # the command says where it waits before it is stopped
        first = proc.stderr.readline()
        assert first, "gpushare run ended without saying where it waits"
    assert "gpushare run: waiting: 1st in line for 0.5 of an A100" in first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert "cancelled" in err
    assert queue_as_admin(path) == []
    # a timeout that passes: refused with the queue's reason
    out = subprocess.run(
        [*argv, "--wait=1", "--", "true"], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 3, out.stderr
    assert "waited 1 s in the queue" in out.stderr
    # a wait that ends in a start: the command runs, its share is released after
    proc = subprocess.Popen(
        [*argv, "--wait=60", "--", "sh", "-c", "echo ran $GPUSHARE_ALLOCATION_ID"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_until(lambda: queue_as_admin(path), 20)
    run_as(alice, release, path, held["id"])
    out_text, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out_text.startswith("ran a-") and "started" in err
    assert asyncio.run(snapshot(path)) == []


def test_a_servers_kernel_start_waits_in_the_queue_and_starts_by_itself(
    gpushare_env: dict[str, str], jupyter_server: Any, holder: Any
) -> None:
    """POST /gpushare/api/kernels with the GPU full: the start waits (the provisioner's
    queue_wait), /gpushare/api/starts and /gpushare/api/queue say where it is in line, and it
    starts by itself once alice releases; a second start waited for 1 s is refused 409
    no_fit with the queue's reason."""
    import threading

    from support import wait_for

    alice = unix_user(ALICE)
    path = Path(gpushare_env["GPUSHARE_SOCKET"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    agent_proc = subprocess.Popen(
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
    try:
        wait_for(lambda: os.path.exists(path) and bool(ask(str(path), {"op": "ping"})), 30)
        held = run_as(alice, place, str(path), 1.0, None, holder(alice))[1]["allocation"]
        server = jupyter_server("1xA100", "--GpushareProvisioner.queue_wait=60")
        answer: dict[str, Any] = {}

        def start() -> None:
            answer["reply"] = server.request(
                "POST", "/gpushare/api/kernels", json={"name": "gpushare-python"}
            )

        starting = threading.Thread(target=start)
        starting.start()
        queued = wait_for(lambda: server.get("/gpushare/api/queue").json()["entries"], 30)
        assert queued[0]["position"] == 1 and queued[0]["kernel_id"]
        board = server.get("/gpushare/api/dashboard").json()  # the admin's view has it too
        assert [e["id"] for e in board["queue"]] == [queued[0]["id"]]
        phases = wait_for(
            lambda: [
                s
                for s in server.get("/gpushare/api/starts").json()["starts"]
                if "in line" in s["message"]
            ],
            10,
        )
        assert phases[0]["message"].startswith("waiting: 1st in line for ")
        run_as(alice, release, str(path), held["id"])
        starting.join(60)
        reply = answer["reply"]
        assert reply.status_code == 201, reply.text
        assert reply.json()["allocation"]["extra"]["queue_entry"] == queued[0]["id"]
        assert server.get("/gpushare/api/queue").json()["entries"] == []
        # 0.9 does not fit beside the kernel just started: waited for 1 s, then refused
        server2 = jupyter_server("1xA100", "--GpushareProvisioner.queue_wait=1")
        refused = server2.request(
            "POST",
            "/gpushare/api/kernels",
            json={"name": "gpushare-python", "share": {"gpu_request": 0.9, "gpu_limit": 0.9}},
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"] == "no_fit"
        assert "waited 1 s in the queue" in refused.json()["message"]
    finally:
        agent_proc.send_signal(signal.SIGTERM)
        agent_proc.wait(10)
