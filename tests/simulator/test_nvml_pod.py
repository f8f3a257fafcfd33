"""A kernel pod's own processes in NVML, played without Kubernetes: the tenant runs in a pid
namespace of its own with its own /proc (``unshare --pid --fork --mount-proc``), as in a pod,
while the simulated driver reports host pids (as a real one does; ``GPUSHARE_SIM_HOST_PROC``
tells it the host's view) and the node agent sees them through ``SO_PEERCRED``. The interposer's
NVML hooks learn the share's processes from the agent's ``pids`` request (wire.py); the agent
answers it for the caller's own allocation only."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import textwrap
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from simmachine import gpushare_run, other_share_holding

pytestmark = [
    pytest.mark.skipif(
        find_spec("gpustat") is None or find_spec("pynvml") is None,
        reason="needs gpustat and nvidia-ml-py (the test extras)",
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="needs root and unshare(1) for pid and mount namespaces",
    ),
]

GiB = 1 << 30

#: Runs as pid 1 of the "pod": a process of the share holding 1 GiB, then what nvitop and
#: gpustat ask NVML (the process list and memory of GPU 0), then gpustat itself.
IN_POD = textwrap.dedent("""
    import json, os, subprocess, sys, time
    import pynvml

    host_proc = os.environ["GPUSHARE_SIM_HOST_PROC"]
    holder = subprocess.Popen([sys.argv[1], "hold", str(1 << 30), "600000", "0"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"

    def host_pid(ns_pid):  # the holder's pid in the host's namespace (what the driver reports)
        ours = os.readlink("/proc/self/ns/pid")
        for entry in filter(str.isdigit, os.listdir(host_proc)):
            try:
                if os.readlink(f"{host_proc}/{entry}/ns/pid") != ours:
                    continue
                status = open(f"{host_proc}/{entry}/status").read()
            except OSError:
                continue
            nspid = [l.split()[1:] for l in status.splitlines() if l.startswith("NSpid:")][0]
            if nspid[-1] == str(ns_pid):
                return int(nspid[0])

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    deadline = time.monotonic() + 20  # the agent's list is asked about once a second; a loaded
    while True:                       # machine may take a while to connect the holder
        procs = [(p.pid, p.usedGpuMemory)
                 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)]
        if procs or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    memory = pynvml.nvmlDeviceGetMemoryInfo(gpu)
    gpustat = subprocess.run([sys.executable, "-m", "gpustat", "--json"], capture_output=True,
                             text=True)
    nvitop = subprocess.run([sys.executable, "-m", "nvitop", "--once"], capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "79", "TERM": "xterm"})
    holder_host = host_pid(holder.pid)
    holder.kill()
    print(json.dumps({
        "me": os.getpid(), "holder": holder.pid, "holder_host": holder_host,
        "visible_here": os.path.exists(f"/proc/{holder_host}"),
        "procs": procs, "memory": [memory.total, memory.used], "gpustat": gpustat.stdout,
        "nvitop": nvitop.stdout, "errors": gpustat.stderr + nvitop.stderr,
    }))
""")


@pytest.fixture
def machine(gpushare_env: dict[str, str], sim_program: Path, tmp_path: Path) -> dict[str, str]:
    """One simulated A100 behind a node agent."""
    return {
        **gpushare_env,
        "GPUSHARE_SIMULATE": "1xA100",
        "GPUSHARE_SIM_STATE": str(tmp_path / "sim" / "sim.state"),
    }


@pytest.fixture
def other_tenant(machine: dict[str, str], sim_program: Path) -> Iterator[tuple[int, str]]:
    """Another share holding 3 GiB of the GPU, on the host: (its holder's pid, its allocation)."""
    with other_share_holding(machine, sim_program, 3 * GiB) as holder:
        yield holder.pid, holder.environ()["GPUSHARE_ALLOCATION_ID"]


def in_pod(*command: str) -> list[str]:
    """``command`` as in a pod: a private mount namespace with a procfs of the host's pid
    namespace at $GPUSHARE_SIM_HOST_PROC (for the simulated driver only), then its own pid
    namespace and its own /proc."""
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-c",
        'mount -t proc proc "$GPUSHARE_SIM_HOST_PROC" && exec "$@"', "pod",
        "unshare", "--pid", "--fork", "--mount-proc", *command,
    ]  # fmt: skip


def test_a_pod_tenant_sees_its_own_processes_by_host_pid(
    machine: dict[str, str],
    sim_program: Path,
    other_tenant: tuple[int, str],
    tmp_path: Path,
) -> None:
    """Inside the pod, NVML reports the share's process by its host pid, which the pod's /proc
    does not have: it is listed (the agent says it is ours) with its 1 GiB, memory agrees with
    it, and the other tenant (3 GiB) is not listed."""
    other_pid, _ = other_tenant
    host_proc = tmp_path / "hostproc"
    host_proc.mkdir()
    pod = in_pod(sys.executable, "-c", IN_POD, str(sim_program))
    mine = gpushare_run(
        {**machine, "GPUSHARE_SIM_HOST_PROC": str(host_proc)},
        "--gpu-request", "0.2", "--gpu-memory", "2GiB", "--", *pod,
    )  # fmt: skip
    out, err = mine.communicate(timeout=180)
    assert mine.returncode == 0, err
    seen = json.loads(out)
    # the pod case: pid 1, and a holder whose host pid its /proc does not show
    assert seen["me"] == 1
    assert seen["holder_host"] not in (None, seen["holder"]) and not seen["visible_here"], seen
    assert seen["procs"] == [[seen["holder_host"], GiB]], seen
    assert seen["memory"] == [2 * GiB, GiB]
    assert "Traceback" not in seen["errors"] and "ERROR" not in seen["errors"], seen["errors"]
    # nvitop lists it by host pid with its memory (host details "No Such Process", as in any
    # container), not the other tenant
    row = seen["nvitop"].split(f" {seen['holder_host']} ")
    assert len(row) == 2 and "1024MiB" in row[1].splitlines()[0], seen["nvitop"]
    assert f" {other_pid} " not in seen["nvitop"] and "3072MiB" not in seen["nvitop"]
    assert "1024MiB / 2048MiB" in seen["nvitop"], seen["nvitop"]
    # gpustat: the share's memory; its process list drops pids psutil cannot find (here the
    # host pid, as in any container) and must not show the other tenant's either
    (gpu,) = json.loads(seen["gpustat"])["gpus"]
    assert (gpu["memory.total"], gpu["memory.used"]) == (2048, 1024)
    assert gpu["processes"] == []
    assert other_pid not in [pid for pid, _ in seen["procs"]]


#: Asks the agent for pids: on fresh connections, for its own allocation and for another one
#: (argv[1]); then on a connection that said hello for its own allocation, both again.
PROBE = textwrap.dedent("""
    import json, os, socket, sys

    def connect():
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.environ["GPUSHARE_SOCKET"])
        return s

    def ask(s, message):
        s.sendall(json.dumps(message).encode() + b"\\n")
        line = b""
        while not line.endswith(b"\\n"):
            chunk = s.recv(65536)  # a hello reply's descriptors are dropped here
            assert chunk, "the agent closed the connection"
            line += chunk
        return json.loads(line)

    mine, theirs = os.environ["GPUSHARE_ALLOCATION_ID"], sys.argv[1]
    out = {
        "pid": os.getpid(),
        "theirs": ask(connect(), {"op": "pids", "allocation": theirs}),
        "mine": ask(connect(), {"op": "pids", "allocation": mine}),
        "bad": ask(connect(), {"op": "pids", "allocation": ["x" * 500]}),
    }
    s = connect()
    out["hello"] = ask(s, {"op": "hello", "v": 4, "v_min": 3, "allocation": mine,
                           "pid": os.getpid()})
    out["hello_theirs"] = ask(s, {"op": "pids", "allocation": theirs})
    out["hello_mine"] = ask(s, {"op": "pids", "allocation": mine})
    print(json.dumps(out))
""")


def test_pids_answers_only_the_callers_own_allocation(
    machine: dict[str, str], other_tenant: tuple[int, str]
) -> None:
    """A process of share A asking for share B's pids is refused, on a fresh connection and on
    one that said hello for A; asking for A answers A's connected processes and the caller's own
    pid as the agent sees it. A value that is not an allocation id is refused naming the field.
    The test process itself (no share's process) is refused B's pids too."""
    other_pid, theirs = other_tenant
    probe = gpushare_run(machine, "--gpu-memory", "1GiB", "--", sys.executable, "-c", PROBE, theirs)
    out, err = probe.communicate(timeout=120)
    assert probe.returncode == 0, err
    seen = json.loads(out)
    for refused in (seen["theirs"], seen["hello_theirs"]):
        assert refused["ok"] is False and refused["error"] == "not_permitted", refused
        assert "pids" not in refused and str(other_pid) not in json.dumps(refused)
    assert seen["mine"] == {"ok": True, "pids": [], "pid": seen["pid"]}
    assert seen["hello"]["ok"] is True, seen["hello"]
    assert seen["hello_mine"] == {"ok": True, "pids": [seen["pid"]], "pid": seen["pid"]}
    bad = seen["bad"]
    assert bad["ok"] is False and bad["error"] == "bad_request", bad
    assert "allocation" in bad["message"] and len(bad["message"]) < 200, bad

    # and a process of no share at all (this test) is refused B's pids
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(machine["GPUSHARE_SOCKET"])
        s.sendall(json.dumps({"op": "pids", "allocation": theirs}).encode() + b"\n")
        reply: Any = json.loads(s.makefile("rb").readline())
    assert reply["ok"] is False and reply["error"] == "not_permitted", reply


#: In the pod with no agent answering (its socket gone): a process of the share whose pod pid is
#: the other tenant's host pid (argv[2]; pids are reused, and a long-lived pod reaches any
#: number), then what nvitop asks NVML.
NO_AGENT_IN_POD = textwrap.dedent("""
    import json, os, subprocess, sys
    import pynvml

    other_host = int(sys.argv[1])
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(other_host - 1))
    twin = subprocess.Popen(["sleep", "600"])  # our allocation's environment
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)]
    memory = pynvml.nvmlDeviceGetMemoryInfo(gpu)
    twin.kill()
    print(json.dumps({"me": os.getpid(), "twin": twin.pid, "procs": procs,
                      "memory": [memory.total, memory.used]}))
""")


#: The same with no agent outside a pod: a holder of the share (1 GiB, fail static), then NVML.
NO_AGENT_ON_HOST = textwrap.dedent("""
    import json, subprocess, sys
    import pynvml

    holder = subprocess.Popen([sys.argv[1], "hold", str(1 << 30), "600000", "0"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    procs = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)]
    holder.kill()
    print(json.dumps({"holder": holder.pid, "procs": procs}))
""")


@pytest.fixture
def gone_socket(tmp_path: Path) -> Iterator[Path]:
    """A socket path no agent serves to begin with; ``gpushare run`` on the host starts one
    there on demand, detached, so it is ended here (it would outlive the test)."""
    import psutil

    path = tmp_path / "gone.sock"
    yield path
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "jupyter_gpushare.daemon" in cmdline and str(path) in cmdline:
            proc.terminate()
            try:
                proc.wait(5)
            except psutil.TimeoutExpired:
                proc.kill()


def test_with_no_agent_a_pod_tenant_sees_no_other_tenants_process_and_is_told_why(
    machine: dict[str, str],
    sim_program: Path,
    other_tenant: tuple[int, str],
    tmp_path: Path,
    gone_socket: Path,
) -> None:
    """The agent gone, a pod cannot match the driver's host pids to its own processes: its /proc
    has other processes under those numbers. A process of the share that happens to have the
    other tenant's host pid inside the pod must not make NVML list the other tenant's process
    (3 GiB) as the share's, nor count its memory as the share's use: the lists are empty, memory
    is the share's own account, and stderr says once that NVML is degraded and why."""
    other_pid, _ = other_tenant
    host_proc = tmp_path / "hostproc"
    host_proc.mkdir()
    pod = in_pod(
        "env", f"GPUSHARE_SOCKET={gone_socket}",
        sys.executable, "-c", NO_AGENT_IN_POD, str(other_pid),
    )  # fmt: skip
    mine = gpushare_run(
        {**machine, "GPUSHARE_SIM_HOST_PROC": str(host_proc)},
        "--gpu-request", "0.2", "--gpu-memory", "2GiB", "--", *pod,
    )  # fmt: skip
    out, err = mine.communicate(timeout=120)
    assert mine.returncode == 0, err
    seen = json.loads(out)
    assert seen["me"] == 1 and seen["twin"] == other_pid, seen  # the pid collision is there
    assert seen["procs"] == [], seen
    assert seen["memory"] == [2 * GiB, 0], seen
    said = [line for line in err.splitlines() if "NVML" in line]
    assert len(said) == 1 and "node agent" in said[0] and "degraded" in said[0], err

    # outside a pod (the driver's pid namespace, the initial one) /proc still tells: the share's
    # holder is listed with its 1 GiB, the other tenant is not, and nothing is said
    host = gpushare_run(
        {**machine, "GPUSHARE_SOCKET": str(gone_socket)},
        "--gpu-request", "0.2", "--gpu-memory", "2GiB", "--",
        sys.executable, "-c", NO_AGENT_ON_HOST, str(sim_program),
    )  # fmt: skip
    out, err = host.communicate(timeout=120)
    assert host.returncode == 0, err
    seen = json.loads(out)
    if os.readlink("/proc/self/ns/pid") != "pid:[4026531836]":  # this machine is a container:
        assert seen["procs"] == [] and "NVML is degraded" in err, (seen, err)  # cannot tell
        return
    assert seen["procs"] == [[seen["holder"], GiB]], seen
    assert "NVML is degraded" not in err, err
