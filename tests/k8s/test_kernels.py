"""End to end on the real control plane: jupyter_server (backend ``kubernetes``) starts kernels
over REST, each kernel is a pod on the node and GPU the ledger chose, the node agent runs it, code
executes, and every way a kernel ends leaves no pod, Secret, Lease or record behind.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because it injects what cannot be caused here: eviction, OOM kills, slow admissions (the double's
hooks), on two GPU nodes. A kernel pod end to end on the real kubelet: test_real_node_chart.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from cluster import NAMESPACE, ControlPlane, free_port
from servers import stop_process
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.client import Kube, connect
from jupyter_gpushare.k8s.ledger import KubernetesLedger
from jupyter_gpushare.ledger import Allocation

pytestmark = pytest.mark.timeout(240)


# -- helpers -------------------------------------------------------------------------------------


async def admin(plane: ControlPlane) -> Kube:
    return await connect(str(plane.kubeconfig("admin")))


async def kernel_pods(kube: Kube, kernel_id: str) -> list[dict[str, Any]]:
    listing = await kube.list_pods(NAMESPACE, f"{manifests.LABEL_KERNEL}={kernel_id}")
    return listing["items"]


async def kernel_records(kube: Kube, kernel_id: str) -> list[Allocation]:
    return [a for a in await KubernetesLedger(kube, NAMESPACE).list() if a.kernel_id == kernel_id]


async def kernel_secrets(kube: Kube, kernel_id: str) -> list[dict[str, Any]]:
    listing = await kube._json(
        kube.core.list_namespaced_secret(
            NAMESPACE,
            label_selector=f"{manifests.LABEL_KERNEL}={kernel_id}",
            _preload_content=False,
        )
    )
    return listing["items"]


async def eventually(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.3)


async def nothing_left(kube: Kube, kernel_id: str, timeout: float = 30.0) -> None:
    async def clean() -> bool:
        return not (
            await kernel_pods(kube, kernel_id)
            or await kernel_secrets(kube, kernel_id)
            or await kernel_records(kube, kernel_id)
        )

    await eventually(clean, timeout, f"kernel {kernel_id}'s pod, Secret and record to go")


async def execute(
    server: Any, kernel_id: str, code: str, timeout: float = 60.0, expect_error: bool = False
) -> str:
    """Run ``code`` in the kernel through the server's websocket; returns its stdout."""
    url = server.url.replace("http", "ws") + f"/api/kernels/{kernel_id}/channels"
    request = HTTPRequest(url, headers={"Authorization": f"token {server.token}"})
    ws = await websocket_connect(request)
    msg_id = uuid.uuid4().hex
    ws.write_message(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": "test",
                    "session": uuid.uuid4().hex,
                    "version": "5.3",
                    "date": "",
                },
                "parent_header": {},
                "metadata": {},
                "channel": "shell",
                "buffers": [],
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": False,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
            }
        )
    )
    out: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            raw = await asyncio.wait_for(ws.read_message(), max(0.1, deadline - time.monotonic()))
            assert raw is not None, "websocket closed"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                if expect_error:
                    out.append(msg["content"]["ename"])
                    continue
                raise AssertionError("kernel error: " + "\n".join(msg["content"]["traceback"]))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
    finally:
        ws.close()


async def shut_down(server: Any, kube: Kube, *kernel_ids: str) -> None:
    """Shut the kernels down over REST, wait until none left anything behind, close ``kube``."""
    try:
        for kernel_id in kernel_ids:
            await asyncio.to_thread(server.request, "DELETE", f"/api/kernels/{kernel_id}")
        for kernel_id in kernel_ids:
            await nothing_left(kube, kernel_id)
    finally:
        await kube.close()


def start_kernel(server: Any, name: str = "gpushare-k8s") -> str:
    reply = server.request("POST", "/api/kernels", json={"name": name})
    assert reply.status_code == 201, reply.text + "\n" + server.log_text()[-3000:]
    return reply.json()["id"]


async def running_pod(kube: Kube, kernel_id: str, not_named: str = "") -> dict[str, Any]:
    async def one() -> dict[str, Any] | None:
        pods = [
            p
            for p in await kernel_pods(kube, kernel_id)
            if p["metadata"]["name"] != not_named
            and manifests.pod_running(p)
            and not p["metadata"].get("deletionTimestamp")
        ]
        return pods[0] if pods else None

    return await eventually(one, 90, "a running kernel pod")


# -- the tests -----------------------------------------------------------------------------------


async def test_kernel_pod_runs_code_and_shutdown_removes_everything(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory()
    kernel_id = start_kernel(server)
    kube = await admin(control_plane)
    try:
        [record] = await kernel_records(kube, kernel_id)
        [pod] = await kernel_pods(kube, kernel_id)
        # On the node and GPU the ledger chose, through the scheduler.
        assert pod["spec"]["nodeName"] == record.node
        # its share through the kubelet: the extended resource, allocated by the node's plugin
        # (which gives the GPU and allocation id below, in the kernel's environment)
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"][manifests.SHARE_RESOURCE] == "25"
        assert pod["metadata"]["labels"][manifests.LABEL_ALLOCATION] == record.id
        assert pod["metadata"]["annotations"][manifests.ALLOCATED_ANNOTATION] == record.node
        assert record.state == "active" and record.extra["k8s_pod"] == pod["metadata"]["name"]
        assert record.spec.gpu_request == 0.25 and record.spec.gpu_limit == 0.5
        # Owners: pod <- server Lease, Secret <- pod, GpuLedger <- Node.
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "Lease"
        [secret] = await kernel_secrets(kube, kernel_id)
        assert secret["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
                "controller": False,
                "blockOwnerDeletion": False,
            }
        ]
        ledger_obj = await kube._json(
            kube.custom.get_namespaced_custom_object(
                "gpushare.jupyter.org",
                "v1alpha1",
                NAMESPACE,
                "gpuledgers",
                record.node,
                _preload_content=False,
            )
        )
        assert ledger_obj["metadata"]["ownerReferences"][0]["kind"] == "Node"
        # The key is in the Secret only: not in the pod spec, its env, or the server's log.
        key = json.loads(base64.b64decode(secret["data"]["connection.json"]))["key"]
        assert len(key) >= 32
        assert key not in json.dumps(pod)
        assert key not in server.log_text()

        code = (
            "import os\nprint(os.environ['CUDA_VISIBLE_DEVICES'], "
            "os.environ['GPUSHARE_ALLOCATION_ID'], os.environ['GPUSHARE_NODE'], 6 * 7)"
        )
        out = await execute(server, kernel_id, code)
        assert out.split() == [*record.gpus, record.id, record.node, "42"]

        # Interrupt: no process to signal from the server, so it goes as a message.
        sleeping = asyncio.create_task(
            execute(server, kernel_id, "import time; time.sleep(60)", timeout=30, expect_error=True)
        )
        await asyncio.sleep(2.0)
        assert server.request("POST", f"/api/kernels/{kernel_id}/interrupt").status_code == 204
        assert (await sleeping) == "KeyboardInterrupt"

        assert server.request("DELETE", f"/api/kernels/{kernel_id}").status_code == 204
        await nothing_left(kube, kernel_id, timeout=15)
    finally:
        await kube.close()


async def _restarted(
    control_plane: ControlPlane,
    server: Any,
    kernel_id: str,
    kill: Callable[[Kube, dict[str, Any]], Any],
    expect_in_log: str,
) -> None:
    kube = await admin(control_plane)
    try:
        first = await running_pod(kube, kernel_id)
        [before] = await kernel_records(kube, kernel_id)
        started = time.monotonic()
        await kill(kube, first)
        second = await running_pod(kube, kernel_id, not_named=first["metadata"]["name"])
        took = time.monotonic() - started
        out = await execute(server, kernel_id, "print('alive', 1 + 1)")
        assert out.split() == ["alive", "2"]
        [after] = await kernel_records(kube, kernel_id)
        assert after.spec == before.spec  # restarted with its share
        assert after.extra["k8s_pod"] == second["metadata"]["name"]
        pods = await kernel_pods(kube, kernel_id)
        assert [p["metadata"]["name"] for p in pods] == [second["metadata"]["name"]]
        assert expect_in_log in server.log_text()
        print(f"restarted in {took:.1f} s")
        assert server.request("DELETE", f"/api/kernels/{kernel_id}").status_code == 204
        await nothing_left(kube, kernel_id, timeout=15)
    finally:
        await kube.close()


async def test_kernel_process_dies_and_is_restarted(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory()
    kernel_id = start_kernel(server)

    async def die(_kube: Kube, _pod: dict[str, Any]) -> None:
        # The kernel process exits by itself; the reply never comes.
        with contextlib.suppress(AssertionError, asyncio.TimeoutError, TimeoutError):
            await execute(server, kernel_id, "import os; os._exit(3)", timeout=8)

    await _restarted(control_plane, server, kernel_id, die, "exit code 3")


async def test_pod_deleted_by_hand_is_restarted(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory()
    kernel_id = start_kernel(server)

    async def delete(kube: Kube, pod: dict[str, Any]) -> None:
        await kube.delete_pod(NAMESPACE, pod["metadata"]["name"])

    await _restarted(control_plane, server, kernel_id, delete, "was deleted")


async def test_evicted_kernel_is_restarted_with_its_share(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory()
    kernel_id = start_kernel(server)

    async def evict(kube: Kube, pod: dict[str, Any]) -> None:
        await kube.core.patch_namespaced_pod(
            pod["metadata"]["name"],
            NAMESPACE,
            {
                "metadata": {
                    "annotations": {"test.gpushare/evict": "The node was low on resource: memory."}
                }
            },
        )

    await _restarted(control_plane, server, kernel_id, evict, "Evicted")
    assert "The node was low on resource: memory." in server.log_text()


async def test_killed_server_leaves_nothing_behind(
    control_plane: ControlPlane, jupyter_server_factory: Any, reconciler: Any
) -> None:
    server = jupyter_server_factory(lease_duration=3.0)
    kernel_ids = [start_kernel(server), start_kernel(server, "gpushare-k8s-t4")]
    kube = await admin(control_plane)
    try:
        pods = [await running_pod(kube, k) for k in kernel_ids]
        server_id = pods[0]["metadata"]["labels"][manifests.LABEL_SERVER]
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        started = time.monotonic()
        for kernel_id in kernel_ids:
            await nothing_left(kube, kernel_id, timeout=60)
        assert await kube.get_lease(NAMESPACE, manifests.lease_name(server_id)) is None
        print(f"cleaned up {time.monotonic() - started:.1f} s after the server was killed")
    finally:
        await kube.close()


async def test_stopped_server_shuts_its_kernels_down_and_deletes_its_lease(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory(lease_duration=300.0)  # expiry is not what cleans up here
    kernel_id = start_kernel(server)
    kube = await admin(control_plane)
    try:
        pod = await running_pod(kube, kernel_id)
        server_id = pod["metadata"]["labels"][manifests.LABEL_SERVER]
        assert await kube.get_lease(NAMESPACE, manifests.lease_name(server_id)) is not None
        stop_process(server.proc)  # SIGTERM: jupyter_server's own shutdown
        await nothing_left(kube, kernel_id, timeout=10)
        assert await kube.get_lease(NAMESPACE, manifests.lease_name(server_id)) is None
    finally:
        await kube.close()


async def test_unreachable_api_server_fails_kernel_starts_with_the_reason(
    jupyter_server_factory: Any, tmp_path: Any
) -> None:
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n"
        f"    server: https://127.0.0.1:{free_port()}\n    insecure-skip-tls-verify: true\n"
        "users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n"
        "    cluster: c\n    user: u\ncurrent-context: c\n"
    )
    server = jupyter_server_factory(
        extra=f"c.KubernetesBackendConfig.kubeconfig = {str(dead)!r}"
        "\nc.KubernetesBackendConfig.connect_timeout = 3"
    )
    for _ in range(2):  # and again: a failed first use is not remembered
        started = time.monotonic()
        reply = await asyncio.to_thread(
            server.request, "POST", "/api/kernels", json={"name": "gpushare-k8s"}
        )
        assert reply.status_code == 503, reply.text
        assert "did not answer within 3 s" in reply.text, reply.text
        assert time.monotonic() - started < 15
    listed = await asyncio.to_thread(server.request, "GET", "/gpushare/api/allocations")
    assert listed.status_code == 503 and "did not answer" in listed.text, listed.text


async def test_type_no_node_has_is_refused_at_once(jupyter_server_factory: Any) -> None:
    server = jupyter_server_factory()
    started = time.monotonic()
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s-h100"})
    assert reply.status_code >= 400
    assert "gpu_type" in reply.text and "A100" in reply.text
    assert time.monotonic() - started < 10


async def test_unschedulable_kernel_fails_fast_with_the_schedulers_reason(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory(
        extra='c.KubernetesBackendConfig.resources = {"requests": {"cpu": "64"}}'
    )
    wall, started = time.time(), time.monotonic()
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s"})
    took = time.monotonic() - started
    assert reply.status_code >= 400
    assert "Unschedulable" in reply.text and "Insufficient cpu" in reply.text, reply.text
    assert took < 20, f"took {took:.1f} s"
    kube = await admin(control_plane)
    try:
        records = [
            a for a in await KubernetesLedger(kube, NAMESPACE).list() if a.created >= wall - 1
        ]
        assert records == []  # the reservation was released
        pods = (
            await kube.list_pods(
                NAMESPACE, f"{manifests.LABEL_COMPONENT}={manifests.KERNEL_COMPONENT}"
            )
        )["items"]
        assert [p for p in pods if p["status"].get("phase") == "Pending"] == []
    finally:
        await kube.close()
    print(f"refused in {took:.1f} s")


async def test_image_pull_error_fails_fast(jupyter_server_factory: Any) -> None:
    server = jupyter_server_factory(
        extra='c.KubernetesBackendConfig.image = "registry.invalid/does-not-exist:1"'
    )
    started = time.monotonic()
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s"})
    assert reply.status_code >= 400
    assert "ErrImagePull" in reply.text, reply.text
    assert time.monotonic() - started < 20


async def test_oom_killed_kernel_is_reported_and_restarted(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    server = jupyter_server_factory()
    kernel_id = start_kernel(server)

    async def oom(kube: Kube, pod: dict[str, Any]) -> None:
        await kube.core.patch_namespaced_pod(
            pod["metadata"]["name"],
            NAMESPACE,
            {"metadata": {"annotations": {"test.gpushare/oom": "1"}}},
        )

    await _restarted(control_plane, server, kernel_id, oom, "OOMKilled (exit code 137)")


async def test_two_servers_starting_kernels_of_one_size_at_once_all_run(
    control_plane: ControlPlane, jupyter_server_factory: Any
) -> None:
    """Direct mode, where each server sees only its own pods: two users' servers start three
    kernels of one size each, all at once. Every start runs (none refused at
    PreStartContainer for holding another's allocation), and at no moment of the API server's
    history did two pods of one node and size wait for admission together (the admission
    Lease, jupyter_gpushare.k8s.admission.LeaseGate)."""
    from test_admission_gate import PodHistory

    servers = [jupyter_server_factory(), jupyter_server_factory()]
    kube = await admin(control_plane)
    history = PodHistory(kube)
    await history.start()
    kernel_ids: list[str] = []
    try:
        kernel_ids = list(
            await asyncio.gather(
                *(asyncio.to_thread(start_kernel, s) for s in servers for _ in range(3))
            )
        )
        records = [r for k in kernel_ids for r in await kernel_records(kube, k)]
        nodes = [r.node for r in records]
        assert len(records) == 6 and max(nodes.count(n) for n in nodes) >= 2, nodes
        assert await history.overlaps(kernel_ids) == []
        leases = await kube.list_leases(
            NAMESPACE, f"{manifests.LABEL_COMPONENT}={manifests.ADMISSION_COMPONENT}"
        )
        assert leases == []  # each start removed its admission Lease
        for server in servers:  # and none waited out its bound
            assert "creating it anyway" not in server.log_text()
            assert "letting the next start of that size go" not in server.log_text()
    finally:
        history.stop()
        for server in servers:
            for kernel_id in kernel_ids:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(server.request, "DELETE", f"/api/kernels/{kernel_id}")
        for kernel_id in kernel_ids:
            await nothing_left(kube, kernel_id)
        await kube.close()
