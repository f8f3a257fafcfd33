"""Warm kernel pools with the Kubernetes backend: warm kernels are pods holding shares in the
cluster ledger; matching starts are served warm, the next one falls back to a cold pod start,
the pool refills, and the server's shutdown leaves no pod or record behind.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1): warm
pods of the checkout's code (no image rebuild); the warm-claim figure on the real node is
benchmarks/k8s_start.py --real-node.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from cluster import NAMESPACE, ControlPlane
from servers import stop_process
from test_kernels import admin, execute, kernel_records, nothing_left

pytestmark = pytest.mark.timeout(300)

POOLS = """
c.ServerApp.kernel_manager_class = "jupyter_gpushare.pools.PoolKernelManager"
c.GpuShare.pools = [{"name": "pods", "kernelspec": "gpushare-k8s",
                     "share": {"gpu_request": 0.25, "gpu_limit": 0.5}, "size": 2}]
c.GpuShare.reclaim_idle_after = 0
# A claimed warm kernel moves into the session's directory, a path of this machine under
# pytest's private (0700) tmp: restricted pods run as uid 1000 and could not enter it, so this
# test runs kernel pods in the hostPath mode, as root (the restricted path: test_device_plugin).
c.KubernetesBackendConfig.device_plugin = False
"""


async def pool_view(server: Any, ready: int | None = None, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        reply = await asyncio.to_thread(server.request, "GET", "/gpushare/api/pools")
        assert reply.status_code == 200, reply.text
        [pool] = reply.json()["pools"]
        if ready is None or pool["ready"] == ready:
            return pool
        assert time.monotonic() < deadline, f"pool never had {ready} ready: {pool}"
        await asyncio.sleep(0.5)


async def timed_start(server: Any, path: str | None = None) -> tuple[str, float]:
    started = time.perf_counter()
    if path is None:
        reply = await asyncio.to_thread(
            server.request, "POST", "/api/kernels", json={"name": "gpushare-k8s"}
        )
        kernel_id = reply.json()["id"] if reply.status_code == 201 else None
    else:
        reply = await asyncio.to_thread(
            server.request,
            "POST",
            "/api/sessions",
            json={
                "path": path,
                "type": "notebook",
                "name": path.rsplit("/", 1)[-1],
                "kernel": {"name": "gpushare-k8s"},
            },
        )
        kernel_id = reply.json()["kernel"]["id"] if reply.status_code == 201 else None
    assert kernel_id, reply.text
    assert (await execute(server, kernel_id, "print(1)")).strip() == "1"
    return kernel_id, time.perf_counter() - started  # start to first reply


async def test_pool_of_kernel_pods_serves_warm_then_cold_and_refills(
    control_plane: ControlPlane, jupyter_server_factory: Any, tmp_path: Any
) -> None:
    server = jupyter_server_factory(extra=POOLS)
    kube = await admin(control_plane)
    handed: list[str] = []
    try:
        warm = [k["kernel_id"] for k in (await pool_view(server, ready=2))["kernels"]]
        for kernel_id in warm:  # warm pods hold real shares in the cluster ledger, as pool
            [record] = await kernel_records(kube, kernel_id)
            assert record.owner == "pool" and record.extra["pool"] == "pods"
        status = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "jupyter_gpushare",
                "status",
                "--kubernetes-namespace",
                NAMESPACE,
                "--kubeconfig",
                str(control_plane.kubeconfig("server")),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "300"},  # one table row per share, not folded
        )
        assert status.stdout.count("warm pool kernel") == 2, status.stdout + status.stderr
        # the GPUs table comes first: its T4 row counts both warm pods' shares
        gpu_row = next(line for line in status.stdout.splitlines() if "gpu-node-2:0" in line)
        assert "T4" in gpu_row and " 2 " in gpu_row, status.stdout
        assert "gpu-node-1:1" in status.stdout, status.stdout
        root = next(p for p in tmp_path.iterdir() if (p / "server.log").exists())
        (root / "work").mkdir()
        first, first_s = await timed_start(server, "work/analysis.ipynb")
        second, second_s = await timed_start(server)
        third, third_s = await timed_start(server)
        handed = [first, second, third]
        assert first in warm and second in warm and third not in warm
        [cold] = await kernel_records(kube, third)
        assert "claimed_from_pool" not in cold.extra and cold.owner == "kernel"
        print(
            f"start to first reply: warm pod {first_s * 1000:.0f} / {second_s * 1000:.0f} ms, "
            f"cold pod {third_s * 1000:.0f} ms"
        )
        assert max(first_s, second_s) < third_s  # a cold pod still has to boot its kernel

        seen = json.loads(
            await execute(
                server,
                first,
                (
                    "import os, json; print(json.dumps([os.getcwd(), __session__, "
                    "os.environ['GPUSHARE_ALLOCATION_ID']]))"
                ),
            )
        )
        [record] = await kernel_records(kube, first)
        assert seen == [str(root / "work"), str(root / "work" / "analysis.ipynb"), record.id]
        assert record.owner == "kernel" and record.extra["claimed_from_pool"] == "pods"

        refilled = [k["kernel_id"] for k in (await pool_view(server, ready=2))["kernels"]]
        assert not set(refilled) & set(handed)
        view = await pool_view(server)
        assert view["claimed"] == 2 and view["started"] == 4 and view["refill_errors"] == []

        stop_process(server.proc)  # shutdown: handed-out and warm kernel pods all go
        for kernel_id in [*handed, *refilled]:
            await nothing_left(kube, kernel_id, timeout=30)
    finally:
        await kube.close()
