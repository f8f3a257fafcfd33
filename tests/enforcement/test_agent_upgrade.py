"""Agent upgrades under running kernels (issue 15, "Upgrades"; the rule: daemon/wire.py,
"Versions and upgrades").

A DaemonSet rollout (or a package upgrade of the system service) stops a node's agent with
SIGTERM and starts a new agent process on the same socket while kernels keep running with the
interposer they started with. The kernels must keep launching (no ``CUDA_ERROR_NOT_PERMITTED``)
and their shares must be enforced again by the new agent; a ``hello`` at any control version
in the agent's range is served, one outside it is refused with words naming both sides.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from enforcement_support import (
    _spawn_daemon,
    add_allocation,
    restart_daemon,
    shares,
    spawn_tenant,
)

from jupyter_gpushare.daemon import wire

REQUEST = 0.3  # the tenant's request = limit: alone on the GPU it gets exactly this much


def _wait_connected(daemon, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    status: dict = {}
    while time.monotonic() < deadline:
        status = daemon.client.status()
        if status.get("allocations") and all(x["connected"] for x in status["allocations"]):
            return status
        time.sleep(0.1)
    raise AssertionError(f"the tenant did not reconnect: {status}")


def test_a_rollout_under_a_running_kernel_keeps_it_launching_and_enforced(
    daemon, ledger, gpus, tmp_path
):
    a = add_allocation(ledger, gpus[0], REQUEST, REQUEST)
    t = spawn_tenant(daemon, ledger, a, gpus, ["spin", "9", "1000", "4"], tmp_path)
    _wait_connected(daemon)
    time.sleep(1.0)
    daemon.stop()  # SIGTERM, as the kubelet stops the old pod
    assert daemon.proc.returncode == 0, daemon.log.read_text()[-2000:]
    new = restart_daemon(daemon)  # the new pod's agent, on the same socket and state
    try:
        _wait_connected(new)
        restarted = time.monotonic_ns()
        lines = t.finish()
        assert t.proc.returncode == 0, (lines[-3:], t.stderr)
        assert not any(x.get("error") for x in lines), [x for x in lines if x.get("error")]
        assert "NOT_PERMITTED" not in t.stderr, t.stderr
        # enforced by the new agent: from 1 s after it took over to the end of the run
        end = max(x["t"] for x in lines if "t" in x) - int(0.2e9)
        lo = restarted + int(1.0e9)
        assert end - lo >= int(1.5e9), "the takeover took too long to measure after it"
        (share,) = shares([t], lo, end)
        # held to its limit (0.3) by the new agent; below it only by what a loaded 2-core
        # machine costs the tenant's own launches
        assert REQUEST - 0.1 <= share <= REQUEST + 0.05, share
    finally:
        new.stop()


def _hello(path: Path, message: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk, fds, _flags, _addr = socket.recv_fds(sock, 65536, 16)
            for fd in fds:  # the lease memory of a served hello
                os.close(fd)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def test_hello_versions_in_the_range_are_served_and_others_refused_in_words(daemon, ledger, gpus):
    a = add_allocation(ledger, gpus[0], 0.1, 0.1, pid=os.getpid())
    hello = {"op": "hello", "allocation": a.id, "pid": os.getpid()}
    assert wire.OLDEST_VERSION < wire.VERSION  # a previous version is served

    previous = _hello(daemon.socket, {**hello, "v": wire.VERSION - 1})  # an older interposer
    assert previous["ok"] and previous["v"] == wire.VERSION - 1, previous
    assert previous["gpus"][0]["uuid"] == gpus[0].uuid

    current = _hello(daemon.socket, {**hello, "v": wire.VERSION, "v_min": wire.OLDEST_VERSION})
    assert current["ok"] and current["v"] == wire.VERSION, current

    newer = _hello(daemon.socket, {**hello, "v": wire.VERSION + 1, "v_min": wire.OLDEST_VERSION})
    assert newer["ok"] and newer["v"] == wire.VERSION, newer  # the newest both speak

    old = wire.OLDEST_VERSION - 1
    below = _hello(daemon.socket, {**hello, "v": old})
    assert not below["ok"] and below["error"] == "bad_version", below
    assert (below["oldest"], below["current"]) == (wire.OLDEST_VERSION, wire.VERSION)
    served = f"versions {wire.OLDEST_VERSION} to {wire.VERSION}"
    assert f"wire version {old}" in below["message"] and served in below["message"], below
    assert "restart the kernel" in below["message"]
    assert len(below["message"]) < 200  # the interposer prints up to 199 characters of it

    above = _hello(daemon.socket, {**hello, "v": wire.VERSION + 2, "v_min": wire.VERSION + 1})
    assert not above["ok"] and above["error"] == "bad_version", above
    assert served in above["message"] and "upgrade the agent" in above["message"], above

    for bad in ({"v": "4"}, {"v": True}, {"v": 4, "v_min": 5}, {}):
        refused = _hello(daemon.socket, {**hello, **bad})
        assert refused["error"] == "bad_version" and served in refused["message"], refused
    assert daemon.client.status()["daemon"]["wire_oldest_version"] == wire.OLDEST_VERSION


#: an agent as released before version ranges: it serves exactly one version and refuses any
#: other ``hello`` (what ``Daemon._hello`` did at wire version 3)
OLD_AGENT = """
import sys
from jupyter_gpushare.daemon import wire
def negotiate(message):
    if message.get("v") == 3:
        return 3, None
    return None, wire.refusal(wire.E_BAD_VERSION, f"wire version {message.get('v')} (daemon "
                              "speaks 3)")
wire.negotiate = negotiate
from jupyter_gpushare.daemon.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_new_interposer_falls_back_to_its_oldest_version_with_an_older_agent(
    daemon, ledger, gpus, tmp_path
):
    daemon.stop()
    module = daemon.args.index("-m")
    args = [sys.executable, "-c", OLD_AGENT, *daemon.args[module + 2 :]]
    old = _spawn_daemon(args, daemon.socket, daemon.ledger_path, daemon.state_dir, daemon.log)
    try:
        a = add_allocation(ledger, gpus[0], REQUEST, REQUEST)
        t = spawn_tenant(old, ledger, a, gpus, ["spin", "3", "1000", "4"], tmp_path)
        status = _wait_connected(old)
        lines = t.finish()
        assert t.proc.returncode == 0, (lines[-3:], t.stderr)
        assert not any(x.get("error") for x in lines)
        assert status["allocations"][0]["id"] == a.id
        # it said hello at its own version first, was refused, and came back at its oldest
        assert f"wire version {wire.VERSION} (daemon speaks 3)" in old.log.read_text()
        # and it was held to its share by that agent (the whole run, less its first second)
        times = [x["t"] for x in lines if "t" in x]
        (share,) = shares([t], times[0] + int(1e9), times[-1])
        assert share <= REQUEST + 0.05, share
    finally:
        old.stop()


#: an agent two versions ahead: it no longer serves anything this interposer speaks
NEWER_AGENT = """
import sys
from jupyter_gpushare.daemon import wire
wire.OLDEST_VERSION, wire.VERSION = wire.VERSION + 1, wire.VERSION + 2
from jupyter_gpushare.daemon.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_agent_that_no_longer_serves_the_interposer_refuses_it_in_words(
    daemon, ledger, gpus, tmp_path
):
    daemon.stop()
    module = daemon.args.index("-m")
    args = [sys.executable, "-c", NEWER_AGENT, *daemon.args[module + 2 :]]
    newer = _spawn_daemon(args, daemon.socket, daemon.ledger_path, daemon.state_dir, daemon.log)
    try:
        a = add_allocation(ledger, gpus[0], REQUEST, REQUEST)
        t = spawn_tenant(newer, ledger, a, gpus, ["spin", "2", "1000", "4"], tmp_path)
        lines = t.finish()
        assert t.proc.returncode != 0, lines[-3:]
        assert any(x.get("error") == 800 for x in lines), lines[-3:]  # NOT_PERMITTED ...
        # ... with words: the interposer's versions, the agent's range and what to do
        spoken = f"wire versions {wire.OLDEST_VERSION} to {wire.VERSION}"
        served = f"serves versions {wire.VERSION + 1} to {wire.VERSION + 2}"
        assert spoken in t.stderr and served in t.stderr, t.stderr
        assert "restart the kernel" in t.stderr, t.stderr
    finally:
        newer.stop()
