"""The system agent hands a share's lease memory (``hello``) only to a process it identified
itself (issue 23, item 1): the caller by its socket's credentials and the start time read when
it connected, the share's process by its recorded start time, or, for a record without one, by
its owner's uid (then the start time is stamped). Run as real Unix users (``gsh3alice``,
``gsh3bob``) against ``jupyter gpushare daemon --system`` on a simulated A100, with the
helpers of ``test_system_agent.py``. The users' processes run the system's Python with a few
lines of the standard library (the test's own Python may not be readable by them).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_system_agent as system
from test_system_agent import ALICE, BOB, record_kernel, snapshot, unix_user

from jupyter_gpushare.daemon import wire
from jupyter_gpushare.ledger.reconcile import process_start_time

agent = system.agent

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)"),
    pytest.mark.skipif(
        not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
        reason="no writable /proc/sys/kernel/ns_last_pid",
    ),
]

PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

#: a process that connects to the agent (argv: socket, mode), pings, and then says hello for
#: the allocation id it reads from stdin; "self": it prints its pid first; "handoff": the
#: connecting process prints its pid and exits, and its child says hello on the connection
HELLO = r"""
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rb")
def ask(message):
    s.sendall(json.dumps(message).encode() + b"\n")
    return json.loads(f.readline())
assert ask({"op": "ping"})["ok"]
if sys.argv[2] == "handoff" and os.fork():
    print(os.getpid(), flush=True)
    os._exit(0)
if sys.argv[2] == "self":
    print(os.getpid(), flush=True)
allocation = sys.stdin.readline().strip()
v = int(sys.argv[3])
print(json.dumps(ask({"op": "hello", "v": v, "v_min": v, "allocation": allocation})), flush=True)
"""

#: a "kernel" that forks a child (``sleep``) for each line "fork" and prints its pid, and
#: kills the child named by any other line
FORKER = r"""
import subprocess, sys
kids = {}
for line in sys.stdin:
    if line.strip() == "fork":
        p = subprocess.Popen(["sleep", "600"])
        kids[p.pid] = p
        print(p.pid, flush=True)
    else:
        p = kids.pop(int(line))
        p.kill()
        p.wait()
for p in kids.values():
    p.kill()
"""


def spawn(user: Any, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, *argv],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )


def hello_process(user: Any, socket: str, mode: str) -> subprocess.Popen[str]:
    return spawn(user, "-c", HELLO, socket, mode, str(wire.VERSION))


def say_hello(proc: subprocess.Popen[str], allocation_id: str) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(allocation_id + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, f"the hello process said nothing (exit {proc.wait(10)})"
    return json.loads(line)


def read_pid(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"no pid from the process: {line!r} (exit {proc.poll()})"
    return int(line)


def set_next_pid(pid: int) -> None:
    Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))


async def admin_record(socket: str, pid: int, owner: Any) -> dict[str, Any]:
    """A kernel share of ``owner``'s naming ``pid`` without a start time, as an admin (or an
    agent from before start times were stamped) may have recorded it."""
    made = await record_kernel(socket, pid, user=owner.pw_name, extra={"uid": owner.pw_uid})
    assert made["pid_start"] is None
    return made


def record_of(socket: str, allocation_id: str) -> dict[str, Any]:
    return next(a for a in asyncio.run(snapshot(socket)) if a["id"] == allocation_id)


def stop(*procs: subprocess.Popen[str] | None) -> None:
    """Close their input (a process reading it ends, a handed-on child too), then kill."""
    for proc in procs:
        if proc is None:
            continue
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_a_record_without_a_start_time_is_trusted_only_for_its_owners_process(agent) -> None:
    """An admin-made (or old) record of alice's names its process by PID alone; that PID is now
    bob's process (alice's exited, bob's next process got its PID). Bob's hello for alice's
    share is refused (old code: accepted, bob held alice's lease memory). Alice's own process
    named that way passes, and the agent stamps its start time in the record."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)

    gone = hello_process(alice, socket, "self")
    freed = read_pid(gone)
    stop(gone)
    intruder = None
    for _ in range(200):  # bob's next process on alice's freed PID
        set_next_pid(freed)
        intruder = hello_process(bob, socket, "self")
        if read_pid(intruder) == freed:
            break
        stop(intruder)
        intruder = None
    if intruder is None:
        pytest.skip(f"could not get PID {freed} again (a busy machine)")
    try:
        made = asyncio.run(admin_record(socket, freed, alice))
        refused = say_hello(intruder, made["id"])
        assert refused["ok"] is False and refused["error"] == "not_permitted", refused
        assert "by PID alone" in refused["message"], refused
        assert record_of(socket, made["id"])["pid_start"] is None
    finally:
        stop(intruder)

    own = hello_process(alice, socket, "self")
    try:
        pid = read_pid(own)
        made = asyncio.run(admin_record(socket, pid, alice))
        served = say_hello(own, made["id"])
        assert served["ok"] is True, served
        stamped = record_of(socket, made["id"])["pid_start"]
        assert stamped == pytest.approx(process_start_time(pid), abs=0.05)
    finally:
        stop(own)


def test_a_connection_handed_on_holds_nothing_once_its_pid_is_reused(agent) -> None:
    """Bob connects, hands the connection to his child and exits; alice's kernel forks a
    worker that gets bob's freed PID. Bob's child then says hello for alice's share on the
    connection: the agent sees the worker (a descendant of alice's kernel) on the connection's
    PID, but not the process that connected, and refuses (old code: accepted, by PID)."""
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)
    kernel = spawn(alice, "-c", FORKER)
    handed = worker = None
    try:
        made = system.run_as(alice, record_kernel, socket, kernel.pid, kernel.pid)
        assert made[0] == "ok", made
        allocation = made[1]
        assert allocation["pid_start"] is not None

        handed = hello_process(bob, socket, "handoff")
        freed = read_pid(handed)
        assert handed.wait(10) == 0  # the connecting process is gone; its child holds on
        assert kernel.stdin is not None and kernel.stdout is not None
        for _ in range(200):  # alice's kernel forks until a worker gets bob's freed PID
            set_next_pid(freed)
            kernel.stdin.write("fork\n")
            kernel.stdin.flush()
            got = int(kernel.stdout.readline())
            if got == freed:
                worker = got
                break
            kernel.stdin.write(f"{got}\n")
            kernel.stdin.flush()
        if worker is None:
            pytest.skip(f"could not get PID {freed} again (a busy machine)")
        refused = say_hello(handed, allocation["id"])
        assert refused["ok"] is False and refused["error"] == "not_permitted", refused
        assert "is gone" in refused["message"], refused
    finally:
        stop(handed, kernel)
