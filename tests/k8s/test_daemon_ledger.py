"""The node daemon follows its node's records in the API-server ledger (shares change live).

Where it runs: the real API server alone (no node): the daemon runs on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import ControlPlane

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.k8s.client import ApiException, connect
from jupyter_gpushare.k8s.ledger import KubernetesLedger
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec

NAMESPACE = "gpushare-daemon"
NODE = "daemon-node"


async def _until(predicate, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


def _mine(client: DaemonClient, allocation_id: str) -> dict | None:
    status = client.status(allocation_id)
    return status["allocations"][0] if status.get("ok") else None


def _start_daemon(workdir: Path, socket: Path, kubeconfig: str) -> subprocess.Popen[bytes]:
    with open(workdir / "daemon.log", "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare.daemon",
                "--socket",
                str(socket),
                "--node",
                NODE,
                "--simulate-devices",
                "1xA100",
                "--poll-ms",
                "100",
                "--kubernetes-namespace",
                NAMESPACE,
                "--kubeconfig",
                kubeconfig,
                "--state-dir",
                str(workdir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


async def test_daemon_follows_the_kubernetes_ledger(control_plane: ControlPlane) -> None:
    kubeconfig = str(control_plane.kubeconfig("admin"))
    kube = await connect(kubeconfig)
    with contextlib.suppress(ApiException):
        await kube.core.create_namespace({"metadata": {"name": NAMESPACE}})
    ledger = KubernetesLedger(kube, NAMESPACE)
    workdir = Path(tempfile.mkdtemp(prefix="gs-kd-", dir="/tmp"))
    socket = workdir / "d.sock"
    daemon = _start_daemon(workdir, socket, kubeconfig)
    client = DaemonClient(socket)
    try:
        await _until(client.alive)
        gpu = simulated_gpus("1xA100", NODE)[0]
        spec = ShareSpec(gpu_request=0.25, gpu_limit=0.5, gpu_memory=2**30, gpu_type="A100")
        allocation = Allocation(
            id=Allocation.new_id(),
            node=NODE,
            gpus=(gpu.uuid,),
            spec=spec,
            memory=2**30,
            backend="kubernetes",
        )
        snap = await ledger.snapshot()
        assert await ledger.compare_and_swap(
            NODE, snap.versions.get(NODE, 0), [*snap.on_node(NODE), allocation]
        )
        seen = await _until(lambda: _mine(client, allocation.id))
        assert (seen["request"], seen["limit"], seen["memory_cap"]) == (0.25, 0.5, 2**30)

        def wider(current: Allocation, _others: list[Allocation]) -> Allocation:
            return replace(current, spec=replace(current.spec, gpu_limit=1.0))

        await ledger.update(allocation.id, wider)  # a live resize, made in the API server
        await _until(lambda: (_mine(client, allocation.id) or {}).get("limit") == 1.0)
        await ledger.release(allocation.id)
        await _until(lambda: _mine(client, allocation.id) is None)
    finally:
        daemon.terminate()
        daemon.wait(10)
        await kube.close()
