"""A DaemonSet rollout under a running kernel pod keeps it launching (issue 15, "Upgrades").

The node DaemonSet's template changes (here as ``kubectl rollout restart`` changes it: the
``kubectl.kubernetes.io/restartedAt`` annotation); the real DaemonSet controller replaces each
node's daemon pod (RollingUpdate: delete the old pod, SIGTERM and its grace period through the
kubelet double, then create the new pod from the new template). Meanwhile a kernel pod with a
0.3 share saturates its T4 with a driver-API program. The kernel must keep launching through
the rollout (no launch fails; a gap while no agent exists is allowed, measured and printed),
the new agent must take the share back and hold its limit, the new pod's device plugin must
register with the kubelet again with the Node's share resource advertised throughout, and the
node's GpuLedger must hold the same records before and after (none lost, none doubled).

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because the rollout is timed against a kernel pod's launch with the double's start-after hook (a
real kubelet cannot be slowed on purpose).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from cluster import NAMESPACE, ControlPlane, node_daemon_socket
from kubernetes_asyncio import client
from test_kernels import admin, eventually, execute, kernel_records, shut_down

import jupyter_gpushare
from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.ledger import KubernetesLedger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "enforcement"))
from enforcement_support import Tenant, build_c, shares

pytestmark = pytest.mark.timeout(300)

DAEMONSET = "gpushare-node"
NODE = "gpu-node-2"  # 1xT4: the kernel is alone on its GPU
SHARE = 0.3  # request = limit: alone on the GPU the kernel gets exactly this much
RES = manifests.SHARE_RESOURCE
RESTARTED_AT = "kubectl.kubernetes.io/restartedAt"
REGISTERED = f"{NODE}: device plugin for {RES} registered"

START_TENANT = """
import os, subprocess
home = os.environ["HOME"]
tenant = subprocess.Popen([{tenant!r}, "spin", "240", "1000", "8"],
                          stdout=open(os.path.join(home, "rollout.out"), "wb"),
                          stderr=open(os.path.join(home, "rollout.err"), "wb"))
print(tenant.pid)
"""
TENANT_STATE = """
import json, os
home = os.environ["HOME"]
print(json.dumps({"rc": tenant.poll(), "out": open(os.path.join(home, "rollout.out")).read(),
                  "err": open(os.path.join(home, "rollout.err")).read()}))
"""
STOP_TENANT = "tenant.terminate(); print(tenant.wait())"


def progress(out: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def daemon_pods(listing: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        p
        for p in listing.get("items") or []
        if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "node-daemon"
    ]


def rolled_out(ds: dict[str, Any]) -> bool:
    """The controller saw the new template and every node runs an available pod of it."""
    status = ds.get("status") or {}
    desired = status.get("desiredNumberScheduled", -1)
    return (
        status.get("observedGeneration", 0) >= ds["metadata"]["generation"]
        and status.get("updatedNumberScheduled") == desired
        and status.get("numberAvailable") == desired
        and not status.get("numberUnavailable")
    )


def ledger_view(records: list[Any]) -> list[tuple[Any, ...]]:
    return sorted((r.id, r.gpus, r.spec, r.memory, r.kernel_id) for r in records)


async def test_a_daemonset_rollout_under_a_running_kernel_pod_keeps_it_launching(
    control_plane: ControlPlane, node_agent: Path, jupyter_server_factory: Any
) -> None:
    tenant_bin = Path(jupyter_gpushare.__file__).parent / "_lib" / "test" / "gs_tenant"
    if not tenant_bin.exists():
        build_c()
    server = jupyter_server_factory()
    reply = server.request(
        "POST",
        "/gpushare/api/kernels",
        json={"name": "gpushare-k8s-t4", "share": {"gpu_request": SHARE, "gpu_limit": SHARE}},
    )
    assert reply.status_code == 201, reply.text
    kernel = reply.json()["id"]
    kube = await admin(control_plane)
    apps = client.AppsV1Api(kube.api)
    ledger = KubernetesLedger(kube, NAMESPACE)
    daemon = DaemonClient(node_daemon_socket(node_agent, NODE), timeout=1.0)
    agent_log = control_plane.workdir / "node-agent.log"
    tenant_started = False
    try:
        [record] = await kernel_records(kube, kernel)
        assert record.node == NODE
        on_node = ledger_view(await ledger.list(NODE))
        assert [r[0] for r in on_node].count(record.id) == 1

        await execute(server, kernel, START_TENANT.format(tenant=str(tenant_bin)))
        tenant_started = True

        def connected() -> dict[str, Any] | None:
            try:
                now = daemon.status(record.id)
            except OSError:  # nothing answers on the socket (a ConnectionError)
                return None
            mine = (now.get("allocations") or [{}])[0]
            return now if mine.get("connected") else None

        before = await eventually(
            lambda: asyncio.to_thread(connected), 30, "the kernel's tenant to connect"
        )
        old_pid = before["daemon"]["pid"]
        old_pods = {p["metadata"]["uid"] for p in daemon_pods(await kube.list_pods(NAMESPACE))}
        registered_before = agent_log.read_text(errors="replace").count(REGISTERED)
        await asyncio.sleep(3.0)  # enforced by the old agent meanwhile (the baseline window)

        # the rollout: what `kubectl rollout restart daemonset/gpushare-node` patches
        rollout_ns = time.monotonic_ns()
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        await apps.patch_namespaced_daemon_set(
            DAEMONSET,
            NAMESPACE,
            {"spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: stamp}}}}},
        )

        # watch the node's agent and its Node while the controller rolls the pods
        last_old = first_new = taken_back = None
        unadvertised: list[Any] = []
        deadline = time.monotonic() + 120

        async def daemonset() -> dict[str, Any]:
            return await kube._json(
                apps.read_namespaced_daemon_set(DAEMONSET, NAMESPACE, _preload_content=False)
            )

        while taken_back is None or not rolled_out(await daemonset()):
            assert time.monotonic() < deadline, "the rollout did not finish in 120 s"
            try:
                now = await asyncio.to_thread(daemon.status, record.id)
            except OSError:  # nothing answers on the socket (a ConnectionError)
                now = None
            t = time.monotonic_ns()
            if now is not None and now.get("daemon", {}).get("pid") == old_pid:
                last_old = t
            elif now is not None:
                first_new = first_new or t
                mine = (now.get("allocations") or [{}])[0]
                if taken_back is None and mine.get("connected"):
                    taken_back = t
            allocatable = ((await kube.read_node(NODE)).get("status") or {}).get("allocatable")
            if (allocatable or {}).get(RES) != "100":
                unadvertised.append((allocatable or {}).get(RES))
            await asyncio.sleep(0.1)
        assert last_old is not None and first_new is not None and taken_back is not None

        # the new pods are the new template's, on every node
        new_pods = daemon_pods(await kube.list_pods(NAMESPACE))
        assert new_pods and not old_pods & {p["metadata"]["uid"] for p in new_pods}
        assert all(p["metadata"]["annotations"].get(RESTARTED_AT) == stamp for p in new_pods)

        # enforced by the new agent: a window of 5 s from 1 s after it took the share back
        await asyncio.sleep(6.0)
        state = json.loads(await execute(server, kernel, TENANT_STATE))
        assert state["rc"] is None, state  # still running: no launch failed (exit 2/3)
        lines = progress(state["out"])
        assert not [x for x in lines if "error" in x], state["out"][-2000:]
        assert "NOT_PERMITTED" not in state["err"], state["err"][-2000:]
        run = Tenant(proc=None, allocation=None, lines=lines)  # type: ignore[arg-type]
        points = [x["t"] for x in lines if "t" in x]
        launch_gap = max(b - a for a, b in itertools.pairwise(points)) / 1e9
        no_agent = (first_new - last_old) / 1e9
        lo, end = taken_back + int(1.0e9), points[-1]
        assert end - lo >= int(4.0e9), "too short a window after the new agent took over"
        (after,) = shares([run], lo, end)
        (baseline,) = shares([run], rollout_ns - int(2.0e9), rollout_ns)
        (alone,) = shares([run], last_old, first_new)  # fail static: at its request share
        print(
            f"DaemonSet rollout under a kernel pod at {SHARE} of a T4: no agent on the node for "
            f"<= {no_agent:.2f} s (polled every 0.1 s), share taken back "
            f"{(taken_back - first_new) / 1e9:.2f} s after the new agent answered; the longest "
            f"pause between the kernel's progress reports {launch_gap:.2f} s; share "
            f"{baseline:.3f} before, {alone:.3f} with no agent, {after:.3f} after"
        )
        assert launch_gap < 5.0, launch_gap  # it kept launching while no agent existed
        if no_agent >= 1.5:  # long enough to measure: at its request share (fail static)
            assert SHARE - 0.1 <= alone <= SHARE + 0.05, alone
        assert after <= SHARE + 0.05, after  # the limit holds under the new agent
        assert after >= SHARE - 0.1, after  # ... and the kernel still gets its share

        # the device plugin registered again and the Node kept advertising its shares
        assert agent_log.read_text(errors="replace").count(REGISTERED) > registered_before
        assert unadvertised == [], unadvertised
        node = await kube.read_node(NODE)
        assert node["status"]["allocatable"][RES] == "100"

        # the node's GpuLedger: the same records (none lost, none doubled)
        assert ledger_view(await ledger.list(NODE)) == on_node
        assert [r.id for r in await kernel_records(kube, kernel)] == [record.id]
    finally:
        if tenant_started:
            await execute(server, kernel, STOP_TENANT)
        await shut_down(server, kube, kernel)


def test_the_node_fixture_names_a_share_resource_the_nodes_lack(
    control_plane: ControlPlane, node_agent: Path, share_resources_wait: Any
) -> None:
    """The ``node_agent`` fixture waits for the device plugin's resource on the Nodes (not only
    for the daemons to answer); a count never reached times out naming node, resource, values."""
    wait_share_resources, nodes = share_resources_wait
    wait_share_resources(control_plane, nodes, deadline=time.monotonic() + 30)  # as they are
    with pytest.raises(AssertionError) as missing:
        wait_share_resources(control_plane, {NODE: "3xT4"}, deadline=time.monotonic() + 1)
    assert str(missing.value) == (
        f"the device plugin's {RES} never reached the Nodes' status.allocatable: "
        f"{NODE} shows '100', expected '300'"
    )
