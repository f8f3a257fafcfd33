"""Kernel start through the Kubernetes pod path vs the local path, and the API-server ledger.

Starts a real control plane (``tests/k8s/cluster.py``; binaries from ``.ci/setup.d/k8s.sh``), the
node agent (the kubelet test double: pods run as local processes, so the pod path's figure is the
control-plane overhead — API writes, scheduling, watches — without image pulls or a container
runtime), and Jupyter servers with backend ``kubernetes`` and ``local`` (simulated GPUs).

Figures:
1. kernel ready time: ``POST /api/kernels`` until the first ``execute_request`` has answered,
   pod path vs local path (median of ``--kernels`` starts each);
2. placement + record latency of one placer against the real API server (``Ledger.allocate``:
   snapshot LIST + placement + CAS update), vs the local SQLite ledger;
3. ``--placers`` concurrent placers x ``--requests`` each through the API-server ledger, with an
   auditor watching every version: over-allocations (must be 0), throughput, CAS conflicts.

Ends with one JSON line. ``--quick`` runs a smaller version.

``--real-node`` measures on the real node instead (``tests/k8s/real_node.py``: kubelet 1.20,
containerd, CNI bridge, kube-proxy; the chart in controller mode with the images of
``deploy/images/build-offline.sh``, run as root), side by side in one run:

1. kernel ready from the REST call (``POST /api/kernels`` of a Jupyter server in controller mode
   until ``print(6 * 7)`` has answered) for a gpushare kernel pod, against a plain pod of the
   same image started the same way (the same command, user and connection Secret, created
   through the API: no share, no device plugin, no controller), from its create until the same
   cell has answered over ZMQ at its pod IP; the ratio (target <= 1.3);
2. a warm-pool claim: ``POST /api/kernels`` until that cell answered, when a warm kernel pod
   of the pool (``PoolKernelManager``) is ready (target <= 100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

from cluster import (  # noqa: E402
    ControlPlane,
    apply_deploy,
    node_agent_argv,
    node_daemon_socket,
)
from servers import spawn, start_jupyter_server, stop_process  # noqa: E402
from stress import run_stress, stress_inventory  # noqa: E402
from test_kernels import execute  # noqa: E402

from jupyter_gpushare.daemon.client import DaemonClient  # noqa: E402
from jupyter_gpushare.k8s.client import ApiException, connect  # noqa: E402
from jupyter_gpushare.k8s.ledger import KubernetesLedger  # noqa: E402
from jupyter_gpushare.ledger.sqlite import SQLiteLedger  # noqa: E402
from jupyter_gpushare.placement import place  # noqa: E402
from jupyter_gpushare.share import ShareSpec  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def kernel_ready_times(server: object, kernels: int, name: str) -> list[float]:
    times = []
    for _ in range(kernels):
        start = time.perf_counter()
        reply = server.request("POST", "/api/kernels", json={"name": name})  # type: ignore
        assert reply.status_code == 201, reply.text
        kernel_id = reply.json()["id"]
        out = await execute(server, kernel_id, "print(6 * 7)")
        assert out.strip() == "42"
        times.append(time.perf_counter() - start)
        server.request("DELETE", f"/api/kernels/{kernel_id}")  # type: ignore
    return times


async def placement_latency(ledger: object, n: int, node_prefix: str) -> list[float]:
    inventory = [
        g.__class__(**{**g.to_json(), "node": f"{node_prefix}-{g.node}"})
        for g in stress_inventory(2, 2)
    ]
    spec = ShareSpec(gpu_request=0.25, gpu_limit=0.5)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        a = await ledger.allocate(
            spec,
            inventory,
            place,
            kernel_id=uuid.uuid4().hex,  # type: ignore
            backend="bench",
        )
        times.append(time.perf_counter() - start)
        await ledger.release(a.id)  # type: ignore
    return times


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="gpushare-k8s-bench-"))
    # kernel pods run as uid 1000 (restricted pods) and must reach their files
    os.chmod(work, 0o755)
    plane = ControlPlane(work).start()
    agent = None
    servers = []
    try:
        apply_deploy(plane.kubeconfig("admin"))
        kube = await connect(str(plane.kubeconfig("admin")))
        try:
            for ns in ("gpushare-bench", "gpushare-stress"):
                try:
                    await kube.core.create_namespace({"metadata": {"name": ns}})
                except ApiException:
                    pass
            k8s_ledger = KubernetesLedger(kube, "gpushare-bench")
            lat_k8s = await placement_latency(k8s_ledger, args.placements, "bench")
        finally:
            await kube.close()
        lat_local = await placement_latency(
            SQLiteLedger(work / "bench.sqlite"), args.placements, "bench"
        )
        print(
            f"placement+record (1 placer, n={args.placements}): "
            f"API server p50 {1000 * statistics.median(lat_k8s):.2f} ms, "
            f"p99 {1000 * pct(lat_k8s, 0.99):.2f} ms | SQLite p50 "
            f"{1000 * statistics.median(lat_local):.2f} ms | ratio "
            f"{statistics.median(lat_k8s) / statistics.median(lat_local):.1f}x",
            flush=True,
        )

        nodes = {"gpu-node-1": "2xA100", "gpu-node-2": "1xT4"}
        agent = spawn(node_agent_argv(plane, work / "nodes", nodes), work / "node-agent.log")
        sockets = [DaemonClient(node_daemon_socket(work / "nodes", n), 1.0) for n in nodes]
        # the DaemonSet's node daemons enforce the kernel pods, as on a cluster
        while not all(d.alive() for d in sockets):
            if agent.poll() is not None:
                raise RuntimeError((work / "node-agent.log").read_text())
            await asyncio.sleep(0.2)
        pod_server = start_jupyter_server(work / "k8s-server", plane)
        local_server = start_jupyter_server(
            work / "local-server", None, backend="local", simulate="2xA100"
        )
        servers = [pod_server, local_server]
        await kernel_ready_times(pod_server, 1, "gpushare-k8s")  # warm the caches
        await kernel_ready_times(local_server, 1, "gpushare-k8s")
        pod_times = await kernel_ready_times(pod_server, args.kernels, "gpushare-k8s")
        local_times = await kernel_ready_times(local_server, args.kernels, "gpushare-k8s")
        pod_med, local_med = statistics.median(pod_times), statistics.median(local_times)
        print(
            f"kernel ready (n={args.kernels}): pod path {pod_med:.2f} s | local path "
            f"{local_med:.2f} s | ratio {pod_med / local_med:.2f}x",
            flush=True,
        )

        stress = await run_stress(
            str(plane.kubeconfig("admin")), "gpushare-stress", args.placers, args.requests
        )
        summary = stress.summary()
        print(
            f"{args.placers} placers x {args.requests} requests through the API-server "
            f"ledger: {summary['allocated']} allocated, {summary['refused']} refused, "
            f"{summary['cas_conflicts']} CAS conflicts, {summary['versions_audited']} "
            f"versions audited, over-allocations {summary['over_allocations']}, "
            f"{summary['allocations_per_s']} allocations/s, {summary['seconds']} s",
            flush=True,
        )
        return {
            "benchmark": "k8s_start",
            "control_plane": "kube-apiserver 1.20.2 (Debian), etcd 3.4, 127.0.0.1",
            "kernel_ready_pod_s": round(pod_med, 3),
            "kernel_ready_local_s": round(local_med, 3),
            "kernel_ready_ratio": round(pod_med / local_med, 2),
            "placement_record_k8s_p50_ms": round(1000 * statistics.median(lat_k8s), 2),
            "placement_record_k8s_p99_ms": round(1000 * pct(lat_k8s, 0.99), 2),
            "placement_record_sqlite_p50_ms": round(1000 * statistics.median(lat_local), 2),
            "stress": summary,
        }
    finally:
        for server in servers:
            stop_process(server.proc)
        if agent is not None:
            stop_process(agent)
        plane.stop()


def plain_pod(name: str, image: str, secret: str) -> dict[str, object]:
    """A pod of the kernel image running ipykernel as the image's user, its connection file
    from a Secret: what a kernel pod is without gpushare."""
    return {
        "metadata": {"name": name, "labels": {"app": "plain-kernel"}},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100},
            "containers": [
                {
                    "name": "kernel",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-m", "ipykernel_launcher", "-f", "/conn/c.json"],
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                    "volumeMounts": [{"name": "conn", "mountPath": "/conn", "readOnly": True}],
                }
            ],
            "volumes": [{"name": "conn", "secret": {"secretName": secret, "defaultMode": 0o440}}],
        },
    }


def plain_ready_time(core: object, namespace: str, image: str) -> float:
    """Create a plain kernel pod and time it until ``print(6 * 7)`` answered at its pod IP."""
    import base64
    import secrets as pysecrets

    from jupyter_client import BlockingKernelClient

    name = "plain-" + uuid.uuid4().hex[:8]
    ports = {k: 50000 + i for i, k in enumerate(("shell", "iopub", "stdin", "control", "hb"))}
    info = {f"{k}_port": v for k, v in ports.items()}
    info.update(
        ip="0.0.0.0",
        key=pysecrets.token_hex(16),
        transport="tcp",
        signature_scheme="hmac-sha256",
        kernel_name="python3",
    )
    core.create_namespaced_secret(  # type: ignore[attr-defined]
        namespace,
        {
            "metadata": {"name": name},
            "data": {"c.json": base64.b64encode(json.dumps(info).encode()).decode()},
        },
    )
    start = time.perf_counter()
    core.create_namespaced_pod(namespace, plain_pod(name, image, name))  # type: ignore[attr-defined]
    try:
        while True:
            pod = core.read_namespaced_pod(name, namespace)  # type: ignore[attr-defined]
            if pod.status.phase == "Running" and pod.status.pod_ip:
                break
            if time.perf_counter() - start > 120:
                raise RuntimeError(f"plain pod {name} not running: {pod.status}")
            time.sleep(0.05)
        client = BlockingKernelClient()
        client.load_connection_info({**info, "ip": pod.status.pod_ip})
        client.start_channels()
        try:
            while True:  # the kernel may not listen yet
                try:
                    client.wait_for_ready(timeout=1)
                    break
                except RuntimeError:
                    if time.perf_counter() - start > 120:
                        raise
            client.execute("print(6 * 7)")
            while True:
                msg = client.get_iopub_msg(timeout=30)
                if msg["msg_type"] == "stream" and msg["content"]["text"].strip() == "42":
                    break
        finally:
            client.stop_channels()
        return time.perf_counter() - start
    finally:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)  # type: ignore[attr-defined]
        core.delete_namespaced_secret(name, namespace)  # type: ignore[attr-defined]


async def real_node_main(args: argparse.Namespace) -> dict[str, object]:
    from hub import start_hub
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config
    from real_node import GATEWAY, KERNEL_IMAGE, NODE_NAME, start_real_node
    from test_real_node_chart import NS, install_chart

    root = Path(tempfile.mkdtemp(prefix="gsb-"))
    os.chmod(root, 0o755)
    plane, node = start_real_node(root, labels={"gpushare.jupyter.org/simulate": "2xA100"})
    hub = None
    servers = []
    old = {k: os.environ.get(k) for k in ("JUPYTERHUB_API_TOKEN", "KUBECONFIG")}
    try:
        hub = start_hub(root / "hub", users={"alice"}, admins=set(), groups={}, host=GATEWAY)
        url = install_chart(node, hub.url, root / "chart")
        core = k8s_client.CoreV1Api(k8s_config.new_client_from_config(str(plane.kubeconfig())))
        os.environ["JUPYTERHUB_API_TOKEN"] = hub.tokens["alice"]
        os.environ.pop("KUBECONFIG", None)
        extra = f"""
c.KubernetesBackendConfig.controller_url = {url!r}
c.KubernetesBackendConfig.kubeconfig = "/nonexistent/kubeconfig"
"""
        server = start_jupyter_server(root / "server", None, "kubernetes", extra=extra)
        pooled = start_jupyter_server(
            root / "pooled",
            None,
            "kubernetes",
            extra=extra
            + """
c.ServerApp.kernel_manager_class = "jupyter_gpushare.pools.PoolKernelManager"
c.GpuShare.pools = [{"name": "pods", "kernelspec": "gpushare-k8s",
                     "share": {"gpu_request": 0.25, "gpu_limit": 0.5}, "size": 1}]
c.GpuShare.reclaim_idle_after = 0
""",
        )
        servers = [server, pooled]
        await kernel_ready_times(server, 1, "gpushare-k8s")  # warm the caches
        plain_ready_time(core, NS, KERNEL_IMAGE)
        gs_times, plain_times = [], []
        for _ in range(args.kernels):  # alternate: load hits both alike
            gs_times += await kernel_ready_times(server, 1, "gpushare-k8s")
            plain_times.append(plain_ready_time(core, NS, KERNEL_IMAGE))
        gs_med, plain_med = statistics.median(gs_times), statistics.median(plain_times)
        print(
            f"kernel ready on the real node (n={args.kernels}, {NODE_NAME}): gpushare kernel pod "
            f"{gs_med:.2f} s | plain pod of the same image {plain_med:.2f} s | ratio "
            f"{gs_med / plain_med:.2f}x",
            flush=True,
        )
        claims = []
        for _ in range(args.kernels):
            deadline = time.monotonic() + 120
            while True:
                reply = pooled.request("GET", "/gpushare/api/pools")
                if reply.status_code == 200 and reply.json()["pools"][0]["ready"] >= 1:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no warm kernel pod: {reply.text}")
                await asyncio.sleep(0.3)
            claims += await kernel_ready_times(pooled, 1, "gpushare-k8s")
        claim_med = statistics.median(claims)
        print(
            f"warm-pool claim to first reply (n={args.kernels}): p50 {1000 * claim_med:.0f} ms, "
            f"max {1000 * max(claims):.0f} ms",
            flush=True,
        )
        return {
            "benchmark": "k8s_start",
            "node": "real: kubelet 1.20.2, containerd 1.6 (Debian), CNI bridge, kube-proxy",
            "kernel_ready_gpushare_pod_s": round(gs_med, 3),
            "kernel_ready_plain_pod_s": round(plain_med, 3),
            "kernel_ready_ratio": round(gs_med / plain_med, 2),
            "warm_claim_p50_ms": round(1000 * claim_med, 1),
            "warm_claim_max_ms": round(1000 * max(claims), 1),
            "gpushare_s": [round(t, 3) for t in gs_times],
            "plain_s": [round(t, 3) for t in plain_times],
        }
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for srv in servers:
            stop_process(srv.proc)
        if hub is not None:
            stop_process(hub.proc)
        node.stop()
        plane.stop()
        node.release_host()
        left = node.leftovers()
        if left:
            print("the real node left behind:", *left, sep="\n  ", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=5)
    parser.add_argument("--placements", type=int, default=200)
    parser.add_argument("--placers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="3 kernels, 16 x 50 requests")
    parser.add_argument(
        "--real-node", action="store_true", help="on the real node (root; see above)"
    )
    args = parser.parse_args()
    if args.quick:
        args.kernels, args.placements, args.requests = 3, 50, 50
    figures = asyncio.run(real_node_main(args) if args.real_node else main_async(args))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
