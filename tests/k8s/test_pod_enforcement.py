"""Kernel pods are enforced by their node's daemon (the DaemonSet of ``deploy/daemonset.yaml``,
run by the node agent on every fake node): the interposer in the pod connects through the
mounted socket, the daemon checks that the process runs in the allocation's pod (its cgroups
name the pod UID the server recorded), and the notebook side (status, ``%gpushare``, Release)
works in a pod as it does locally; two pods get their compute shares of one GPU.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because it needs a T4 node and an A100 node and the daemon's socket on this host; the same checks
on the real node (interposer in the pod, cap, Release, 0.3/0.7, kill -9 of the agent):
test_real_node_chart.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from cluster import ControlPlane, node_daemon_socket
from support import CUDA_PROBE
from test_kernels import (
    admin,
    eventually,
    execute,
    kernel_pods,
    kernel_records,
    shut_down,
    start_kernel,
)

import jupyter_gpushare
from jupyter_gpushare.daemon import wire
from jupyter_gpushare.daemon.client import DaemonClient, DaemonUnreachable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "enforcement"))
from enforcement_support import Tenant, build_c, shares

pytestmark = pytest.mark.timeout(300)

CUDA_ERROR_NOT_PERMITTED = 800
MIB = 1 << 20
STATUS = """
import json, jupyter_gpushare
s = jupyter_gpushare.status()
a = s["allocation"] or {}
print(json.dumps({"state": s["state"], "simulated": s["simulated"], "id": s.get("allocation_id"),
                  "memory_used": a.get("memory_used"), "memory_cap": a.get("memory_cap"),
                  "request": a.get("request"), "kernels": (s["gpu"] or {}).get("kernels")}))
"""

PANEL = """
import json, time, jupyter_gpushare
p = jupyter_gpushare.panel(interval=0.5)
time.sleep(2.5)
print(json.dumps({"updates": p.updates, "state": p.last_status["state"], "info": p.info.value,
                  "title": p.title.value}))
p.close()
"""


def daemon_of(node_agent: Any, node: str) -> DaemonClient:
    return DaemonClient(node_daemon_socket(node_agent, node))


async def test_kernel_pod_is_enforced_and_its_share_is_its_own(
    control_plane: ControlPlane, node_agent: Any, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory(gpu_type="A100", gpu_memory="1GiB")
    first, second = start_kernel(server), start_kernel(server)
    kube = await admin(control_plane)
    try:
        [record] = await kernel_records(kube, first)
        [other] = await kernel_records(kube, second)
        [pod] = await kernel_pods(kube, first)
        assert record.node == other.node == "gpu-node-1"
        assert record.extra["k8s_pod_uid"] == pod["metadata"]["uid"]

        # the interposer in the pod enforces the memory cap through the node's daemon
        seen = json.loads(await execute(server, first, CUDA_PROBE))
        assert seen == {"total": 1 << 30, "small": 0, "big": 2}  # 2: CUDA_ERROR_OUT_OF_MEMORY
        daemon = daemon_of(node_agent, record.node)
        [mine] = daemon.status(record.id)["allocations"]
        assert mine["connected"] is True and mine["memory_used"] == 256 * MIB
        assert (mine["request"], mine["memory_cap"]) == (0.25, 1 << 30)

        # the notebook side in the pod reads the same daemon
        status = json.loads(await execute(server, first, STATUS))
        assert status == {
            "state": "active",
            "simulated": True,
            "id": record.id,
            "memory_used": 256 * MIB,
            "memory_cap": 1 << 30,
            "request": 0.25,
            "kernels": 2,
        }
        shown = json.loads(await execute(server, first, PANEL))
        assert shown["updates"] >= 3 and shown["state"] == "active"  # the thread kept going
        assert record.gpus[0] in shown["info"] and "1GiB" in shown["info"]
        assert "256MiB" in shown["info"] and "simulated GPU" in shown["title"]
        # a live resize from inside the pod: the daemon updates the cluster ledger
        text = await execute(server, first, "%gpushare request --gpu-limit 1.0")
        [resized] = await kernel_records(kube, first)
        assert resized.limit == 1.0 and daemon.status(record.id)["allocations"][0]["limit"] == 1.0
        text = await execute(server, first, "%gpushare gpus")
        assert "gpu-node-1" in text and "gpu-node-2" in text, text

        # a process outside the pod, or in another kernel's pod, cannot use or release it
        refused = daemon.request({"op": "hello", "v": wire.VERSION, "allocation": record.id})
        assert refused["error"] == wire.E_NOT_PERMITTED
        assert "runs in no pod" in refused["message"], refused
        stolen = json.loads(
            await execute(
                server,
                second,
                (
                    "import json, os; from jupyter_gpushare.daemon.client import DaemonClient; "
                    f"print(json.dumps(DaemonClient(os.environ['GPUSHARE_SOCKET']).release({record.id!r})))"
                ),
            )
        )
        assert stolen["error"] == wire.E_NOT_PERMITTED
        assert f"not in allocation {record.id}'s pod" in stolen["message"], stolen

        # Release from inside the kernel: the record and the daemon forget it, the memory is
        # freed, the pod and its Python state live on, CUDA refuses with the reason
        text = await execute(server, first, "%gpushare release")
        assert f"Released 25–100 % of an A100 ({record.id}" in text, text
        assert "256MiB of GPU memory freed" in text, text
        assert await kernel_records(kube, first) == []
        assert daemon.status(record.id).get("error") == wire.E_UNKNOWN_ALLOCATION
        assert (await execute(server, first, "print(small, 1 + 1)")).split() == ["0", "2"]
        code = await execute(server, first, "print(cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))")
        # the refused call, then the note of why (a cell's first refusal explains itself)
        assert code.strip().splitlines()[0] == str(CUDA_ERROR_NOT_PERMITTED), code
        assert "The GPU share of this kernel was released" in code, code
        assert [p["metadata"]["uid"] for p in await kernel_pods(kube, first)] == [
            pod["metadata"]["uid"]
        ]
        assert daemon.status(other.id)["allocations"][0]["id"] == other.id  # untouched
    finally:
        await shut_down(server, kube, first, second)


async def test_kernel_pod_survives_its_node_daemon_being_killed(
    control_plane: ControlPlane, node_agent: Any, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory(gpu_type="T4", gpu_memory="1GiB")
    kernel = start_kernel(server)
    kube = await admin(control_plane)
    try:
        [record] = await kernel_records(kube, kernel)
        await execute(server, kernel, CUDA_PROBE)
        daemon = daemon_of(node_agent, record.node)
        before = daemon.status(record.id)
        assert before["allocations"][0]["connected"] is True
        os.kill(before["daemon"]["pid"], signal.SIGKILL)
        # the kernel keeps running meanwhile (fail static) ...
        assert (await execute(server, kernel, "print(1 + 1)")).strip() == "2"

        # ... the DaemonSet's container is restarted, and the pod's process reconnects to it
        def reconnected() -> dict[str, Any] | None:
            try:
                now = daemon.status(record.id)
            except (DaemonUnreachable, OSError):
                return None
            mine = (now.get("allocations") or [{}])[0]
            restarted = now.get("daemon", {}).get("pid") != before["daemon"]["pid"]
            return now if restarted and mine.get("connected") else None

        after = await eventually(
            lambda: asyncio.to_thread(reconnected),
            30,
            "the restarted daemon to take the kernel back",
        )
        assert after["allocations"][0]["memory_used"] == 256 * MIB  # rebuilt from the slots
        assert after["daemon"]["refused"] == 0
    finally:
        await shut_down(server, kube, kernel)


TENANT_RUN = """
import subprocess
done = subprocess.run([{tenant!r}, "spin", "{seconds}", "1000", "8"], capture_output=True,
                      text=True, timeout=120)
print(done.stdout)
"""


async def test_two_kernel_pods_get_their_shares_of_one_gpu(
    control_plane: ControlPlane, node_agent: Any, jupyter_server_factory: Any
) -> None:
    """Compute shares in pods: 0.3 and 0.7 (request = limit) of the node's one T4, each pod
    saturating it with a driver-API program it runs (a child of the kernel: same pod)."""
    tenant = Path(jupyter_gpushare.__file__).parent / "_lib" / "test" / "gs_tenant"
    if not tenant.exists():
        build_c()
    server = jupyter_server_factory()
    kernels = []
    for share in (0.3, 0.7):
        reply = server.request(
            "POST",
            "/gpushare/api/kernels",
            json={"name": "gpushare-k8s-t4", "share": {"gpu_request": share, "gpu_limit": share}},
        )
        assert reply.status_code == 201, reply.text
        kernels.append(reply.json()["id"])
    kube = await admin(control_plane)
    try:
        seconds = 7
        code = TENANT_RUN.format(tenant=str(tenant), seconds=seconds)
        outputs = await asyncio.gather(*(execute(server, k, code, timeout=120) for k in kernels))
        runs = []
        for out in outputs:
            lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            assert lines, out
            runs.append(Tenant(proc=None, allocation=None, lines=lines))  # type: ignore[arg-type]
        t0 = max(r.lines[0]["start"] for r in runs) + 2_000_000_000  # both running, settled
        got = shares(runs, t0, t0 + 4_000_000_000)
        print(f"kernel pods at 0.3 / 0.7 of a T4: {got[0]:.3f} / {got[1]:.3f}")
        assert abs(got[0] - 0.3) < 0.05 and abs(got[1] - 0.7) < 0.05, got
    finally:
        await shut_down(server, kube, *kernels)
