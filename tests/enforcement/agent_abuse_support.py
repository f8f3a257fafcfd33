"""Real Unix users and the client programs they run against the node agent's socket, for
tests/enforcement/test_agent_socket.py and benchmarks/agent_abuse.py.

Every client is a small stdlib-only Python program started as a real user (``useradd``; the tests
run as root), so the agent sees that user's uid in ``SO_PEERCRED`` and its caps apply. Each prints
one JSON line when it is done.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from enforcement_support import NODE, DaemonProc, _spawn_daemon
from support import python_for

from jupyter_gpushare.daemon import wire
from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.share import ShareSpec

GiB = 2**30

#: one round trip on a socket (shared by the programs below)
_ROUND_TRIP = r"""
import json, os, socket, sys, time, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
WIRE_VERSION = int(os.environ["GS_WIRE_VERSION"])

def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s

def round_trip(s, message):
    s.sendall((json.dumps(message) + "\n").encode())
    data = b""
    while b"\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("the agent closed the connection")
        data += chunk
    return json.loads(data[: data.index(b"\n")])
"""

#: an honest kernel: reads its allocation id on stdin (once the ledger records this process as
#: the allocation's), says hello on a kept connection, then for ``seconds``: a status of its own
#: allocation on a new connection (as the panel does) and a ping on the kept one
HONEST = (
    _ROUND_TRIP
    + r"""
path, seconds = sys.argv[1], float(sys.argv[2])
allocation = sys.stdin.readline().strip()
kept = connect(path)
t = time.perf_counter()
hello = round_trip(kept, {"op": "hello", "v": WIRE_VERSION, "allocation": allocation,
                         "pid": os.getpid()})
hello_ms = (time.perf_counter() - t) * 1e3
status_ms, ping_ms, errors = [], [], []
end = time.monotonic() + seconds
while time.monotonic() < end:
    t = time.perf_counter()
    try:
        with connect(path) as s:
            reply = round_trip(s, {"op": "status", "allocation": allocation})
        if not reply.get("ok") or reply["allocations"][0]["id"] != allocation:
            errors.append(reply)
    except OSError as exc:
        errors.append(repr(exc))
    status_ms.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    try:
        if not round_trip(kept, {"op": "ping"}).get("ok"):
            errors.append("ping refused")
    except OSError as exc:
        errors.append(repr(exc))
    ping_ms.append((time.perf_counter() - t) * 1e3)
    time.sleep(0.002)
print(json.dumps({"hello": hello.get("ok"), "hello_ms": hello_ms,
                  "status_ms": status_ms, "ping_ms": ping_ms,
                  "errors": errors[:5], "n_errors": len(errors)}), flush=True)
"""
)

#: opens ``n`` connections and sends nothing; says how many opened, then (stdin closed) how many
#: the agent has not closed
IDLE = (
    _ROUND_TRIP
    + r"""
path, n = sys.argv[1], int(sys.argv[2])
held, failed = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)  # blocking: waits while the agent's backlog is full
        held.append(s)
    except OSError:
        s.close()
        failed += 1
print(json.dumps({"connected": len(held), "failed": failed}), flush=True)
sys.stdin.read()
def open_(s):  # not closed by the agent (it may have said why first)
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
print(json.dumps({"still_open": sum(open_(s) for s in held)}), flush=True)
"""
)

#: a ping flood that never reads a reply: writes up to ``n`` pings until the agent stops reading
#: (a send blocks for 2 s), holds the connection until stdin closes
FLOOD = (
    _ROUND_TRIP
    + r"""
path, n = sys.argv[1], int(sys.argv[2])
s = connect(path)
s.settimeout(2.0)
line = b'{"op":"ping"}\n'
chunk = line * 4096
sent = 0
try:
    while sent < n * len(line):
        sent += s.send(chunk[: min(len(chunk), n * len(line) - sent)])
except (TimeoutError, socket.timeout):
    pass
except OSError as exc:
    print(json.dumps({"error": repr(exc)}), flush=True)
print(json.dumps({"sent_requests": sent // len(line), "asked": n}), flush=True)
sys.stdin.read()
"""
)

#: a process holding a share: hello (allocation id on stdin), then on another connection one
#: ping; sleeps ``argv[2]`` s; then: is the hello connection still served, is the other closed?
HOLD = (
    _ROUND_TRIP
    + r"""
path, wait = sys.argv[1], float(sys.argv[2])
allocation = sys.stdin.readline().strip()
kept = connect(path)
hello = round_trip(kept, {"op": "hello", "v": WIRE_VERSION, "allocation": allocation,
                         "pid": os.getpid()})
other = connect(path)
pinged = round_trip(other, {"op": "ping"}).get("ok")
time.sleep(wait)
try:
    kept_served = bool(round_trip(kept, {"op": "ping"}).get("ok"))
except OSError:
    kept_served = False
try:
    other_closed = other.recv(65536) == b""
except OSError:
    other_closed = True
print(json.dumps({"hello": hello.get("ok") or hello, "pinged": pinged, "kept_served": kept_served,
                  "other_closed": other_closed}), flush=True)
"""
)

#: garbage frames until stdin closes: on each connection 100 unreadable lines, then reads what the
#: agent answers until it closes the connection
GARBAGE = (
    _ROUND_TRIP
    + r"""
import threading
path = sys.argv[1]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
answers, connections, unclosed = [], 0, 0
while not stop.is_set():
    try:
        s = connect(path)
        s.sendall(b"\x00garbage{]\n" * 100)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        answers.append(data.count(b"\n"))
        connections += 1
        s.close()
    except socket.timeout:
        unclosed += 1
    except OSError:
        connections += 1
print(json.dumps({"connections": connections, "max_answers": max(answers, default=0),
                  "unclosed": unclosed}), flush=True)
"""
)

#: ``hello`` for allocations that are not its own, on ``argv[2]`` connections at once (16 each,
#: then the agent closes it and it connects again), until stdin closes
HELLO_FLOOD = (
    _ROUND_TRIP
    + r"""
import selectors, threading
path, n = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
hellos = b"".join((json.dumps({"op": "hello", "v": WIRE_VERSION, "allocation": f"a-{i:016x}",
                               "pid": os.getpid()}) + "\n").encode() for i in range(16))
answered = 0
def worker():
    global answered
    while not stop.is_set():
        try:
            with connect(path) as s:
                s.settimeout(10)
                s.sendall(hellos)
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    answered += chunk.count(b"\n")
        except OSError:
            time.sleep(0.01)
threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
for t in threads:
    t.start()
stop.wait()
print(json.dumps({"answered": answered}), flush=True)
"""
)

#: one request when a line comes on stdin, its reply as JSON: the line is the request (JSON), or
#: ``status`` of an allocation id, or of all when it is empty
STATUS = (
    _ROUND_TRIP
    + r"""
path = sys.argv[1]
line = sys.stdin.readline().strip()
with connect(path) as s:
    if line.startswith("{"):
        message = json.loads(line)
    else:
        message = {"op": "status"}
        if line:
            message["allocation"] = line
    print(json.dumps(round_trip(s, message)), flush=True)
"""
)


def unix_user(name: str, groups: tuple[str, ...] = ()) -> pwd.struct_passwd:
    """A real system user (made with ``useradd`` when missing; the tests run as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (useradd, other users' processes)")
    for group in groups:
        try:
            grp.getgrnam(group)
        except KeyError:
            subprocess.run(["groupadd", "--system", group], check=False, stderr=subprocess.DEVNULL)
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                *(["--groups", ",".join(groups)] if groups else []),
                name,
            ],
            check=False,
            stderr=subprocess.DEVNULL,
        )
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.skip(f"could not create the user {name} (useradd)")


def run_as(user: pwd.struct_passwd, program: str, *args: str) -> subprocess.Popen[str]:
    groups = os.getgrouplist(user.pw_name, user.pw_gid)
    return subprocess.Popen(
        [python_for(user), "-c", program, *args],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=groups,
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "GS_WIRE_VERSION": str(wire.VERSION)},
    )


def read_json(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the client exited ({proc.poll()}) without a result")
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("no result from the client")


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdin is not None
    proc.stdin.close()
    result = read_json(proc)
    proc.wait(30)
    return result


def shared_dir() -> Path:
    """A directory other users may enter (not write): the agent's socket, ledger and log."""
    path = Path(tempfile.mkdtemp(prefix="gs-agent-"))
    path.chmod(0o755)
    return path


def start_agent(directory: Path, *extra: str, nofile: int | None = None) -> DaemonProc:
    """The agent on one simulated A100, its files in ``directory``; ``nofile``: its descriptor
    limit (soft and hard)."""
    socket_path = directory / "daemon.sock"
    ledger_path = directory / "ledger.sqlite"
    state_dir = directory / "shm"
    args = [
        sys.executable,
        "-m",
        "jupyter_gpushare.daemon",
        "--socket",
        str(socket_path),
        "--ledger",
        str(ledger_path),
        "--node",
        NODE,
        "--simulate-devices",
        "1xA100",
        "--state-dir",
        str(state_dir),
        "--poll-ms",
        "100",
        *extra,
    ]
    if nofile is not None:
        args = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *args]
    return _spawn_daemon(args, socket_path, ledger_path, state_dir, directory / "daemon.log")


def record(
    ledger: SQLiteLedger,
    gpu: Gpu,
    *,
    pid: int | None,
    uid: int | None = None,
    user: str | None = None,
    kernel_id: str | None = None,
    request: float = 0.2,
) -> Allocation:
    """An allocation on ``gpu`` in the ledger, as a local server would write it."""
    spec = ShareSpec(gpu_request=request, gpu_limit=request, gpu_memory=GiB, gpu_type=gpu.type)
    extra: dict[str, Any] = {} if uid is None else {"uid": uid}
    allocation = Allocation(
        id=Allocation.new_id(),
        node=NODE,
        gpus=(gpu.uuid,),
        spec=spec,
        memory=GiB,
        pid=pid,
        kernel_id=kernel_id,
        user=user or "",
        extra=extra,
        state="active",
        pid_start=psutil.Process(pid).create_time() if pid else None,
    )
    for _ in range(200):
        snap = ledger.snapshot_sync()
        if ledger.compare_and_swap_sync(
            NODE, snap.versions.get(NODE, 0), [*snap.on_node(NODE), replace(allocation)]
        ):
            return allocation
    raise RuntimeError("ledger contention")


def raise_own_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]
