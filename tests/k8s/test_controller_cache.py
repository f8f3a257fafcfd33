"""The controller's caches on a real API server (issue 16, "caches, not LISTs").

A control plane of its own (etcd + kube-apiserver, no scheduler or controller manager), so that
``apiserver_request_total`` in the API server's ``/metrics`` counts only what these tests and the
controller ask: the other tests' reconcilers and node daemons would LIST GpuLedgers too.

Where it runs: the real API server alone (no node): request counts.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from cluster import NAMESPACE, ControlPlane, apply_deploy, free_port, register_gpu_nodes
from hub import Hub, start_hub
from servers import spawn, stop_process

from jupyter_gpushare.inventory import GiB, Gpu
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.client import connect
from jupyter_gpushare.k8s.ledger import WatchedLedger
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import Policy, allocate
from jupyter_gpushare.share import ShareSpec

pytestmark = [pytest.mark.timeout(120), pytest.mark.k8s]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
NODES = {
    f"cache-node-{n}": [
        Gpu(
            node=f"cache-node-{n}",
            uuid=f"GPU-cache-{n}-{i}",
            index=i,
            name="NVIDIA A100-SXM4-80GB",
            type="A100",
            memory=80 * GiB,
            simulated=True,
        )
        for i in range(2)
    ]
    for n in range(3)
}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(tmp_path_factory.mktemp("k8s-cache"))
    try:
        plane.start(components=False)
        apply_deploy(plane.kubeconfig("admin"))
        register_gpu_nodes(plane.kubeconfig("admin"), NODES)
    except Exception as exc:
        plane.stop()
        if IN_CI:
            pytest.fail(f"the Kubernetes control plane did not start (CI): {exc}")
        pytest.skip(f"no Kubernetes control plane: {exc}")
    yield plane
    plane.stop()


def delta(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int]) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_cache_resumes_a_dropped_watch_without_listing(plane: ControlPlane) -> None:
    """The GpuLedger informer lists once; a dropped watch resumes from the last
    resourceVersion (no LIST on the API server), and the change made while it was away
    arrives."""

    async def scenario() -> tuple[dict, dict, WatchedLedger]:
        kube = await connect(str(plane.kubeconfig("controller")))
        admin = await connect(str(plane.kubeconfig("admin")))
        ledger = WatchedLedger(kube, NAMESPACE)
        try:
            await ledger.start(30)
            assert ledger.ledgers.lists == 1 and ledger.nodes.lists == 1
            assert len(await ledger.gpus()) == 6
            before = await asyncio.to_thread(plane.metrics)
            for round_ in range(3):
                ledger.ledgers.drop_watch()
                record = Allocation(
                    id=f"resume-{round_}",
                    node="cache-node-0",
                    gpus=("GPU-cache-0-0",),
                    spec=ShareSpec(gpu_request=0.1, gpu_limit=0.1),
                    memory=GiB,
                )
                current = [a.to_json() for a in await ledger.list("cache-node-0")]
                body = manifests.ledger_object(
                    "cache-node-0", NAMESPACE, [*current, record.to_json()]
                )
                if round_ == 0:
                    await admin.create_ledger(NAMESPACE, body)
                else:
                    body["metadata"]["resourceVersion"] = ledger.ledgers.get("cache-node-0")[
                        "metadata"
                    ]["resourceVersion"]
                    await admin.replace_ledger(NAMESPACE, body)
                deadline = time.monotonic() + 20
                while record.id not in {a.id for a in await ledger.list("cache-node-0")}:
                    assert time.monotonic() < deadline, "the change never reached the cache"
                    await asyncio.sleep(0.05)
            after = await asyncio.to_thread(plane.metrics)
            return before, after, ledger
        finally:
            await ledger.stop()
            await kube.close()
            await admin.close()

    before, after, ledger = run(scenario())
    changes = delta(before, after)
    print("API requests while the watch was dropped 3 times:", changes)
    assert ledger.ledgers.lists == 1, "the informer listed again"
    assert ledger.ledgers.watches >= 4, ledger.ledgers.watches  # 1 + 3 resumes
    assert changes.get(("LIST", "gpuledgers"), 0) == 0, changes


def test_cache_lists_again_only_when_its_version_is_gone(plane: ControlPlane) -> None:
    """A watch from a version the API server no longer has answers 410 Gone: then, and only
    then, the informer lists again (one LIST), and what changed meanwhile is in the cache."""

    async def scenario() -> tuple[dict, WatchedLedger]:
        kube = await connect(str(plane.kubeconfig("controller")))
        admin = await connect(str(plane.kubeconfig("admin")))
        ledger = WatchedLedger(kube, NAMESPACE)
        try:
            await ledger.start(30)
            before = await asyncio.to_thread(plane.metrics)
            ledger.ledgers.resource_version = "1"  # long compacted away: the resume gets 410
            ledger.ledgers.drop_watch()
            record = Allocation(
                id="after-gone",
                node="cache-node-2",
                gpus=("GPU-cache-2-1",),
                spec=ShareSpec(gpu_request=0.1, gpu_limit=0.1),
                memory=GiB,
            )
            existing = ledger.ledgers.get("cache-node-2")
            body = manifests.ledger_object(
                "cache-node-2",
                NAMESPACE,
                [*(a.to_json() for a in await ledger.list("cache-node-2")), record.to_json()],
            )
            if existing is None:
                await admin.create_ledger(NAMESPACE, body)
            else:
                body["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
                await admin.replace_ledger(NAMESPACE, body)
            deadline = time.monotonic() + 20
            while record.id not in {a.id for a in await ledger.list("cache-node-2")}:
                assert time.monotonic() < deadline, "the change never reached the cache"
                await asyncio.sleep(0.05)
            after = await asyncio.to_thread(plane.metrics)
            await ledger.release(record.id)
            return delta(before, after), ledger
        finally:
            await ledger.stop()
            await kube.close()
            await admin.close()

    changes, ledger = run(scenario())
    print("API requests around a 410:", changes)
    assert ledger.ledgers.lists == 2, ledger.ledgers.lists
    assert changes.get(("LIST", "gpuledgers"), 0) == 1, changes


def test_conflicts_refresh_from_the_watch_not_a_list(plane: ControlPlane) -> None:
    """Two controllers' ledgers place 24 shares at once on the same 6 GPUs: their CAS writes
    collide, each loser catches up from its watch, none of them LISTs, and the GPUs hold
    exactly what was placed (no share lost or doubled)."""

    async def scenario() -> tuple[dict, list[Allocation], list[WatchedLedger]]:
        kubes = [await connect(str(plane.kubeconfig("controller"))) for _ in range(2)]
        ledgers = [WatchedLedger(k, f"{NAMESPACE}") for k in kubes]
        try:
            for ledger in ledgers:
                await ledger.start(30)
            for node in NODES:  # start from empty ledgers
                while await ledgers[0].list(node):
                    for a in await ledgers[0].list(node):
                        await ledgers[0].release(a.id)
            before = await asyncio.to_thread(plane.metrics)
            policy = Policy(node="binpack", gpu="binpack")
            spec = ShareSpec(gpu_request=0.25, gpu_limit=0.25, gpu_memory=GiB)

            async def place(i: int) -> Allocation:
                ledger = ledgers[i % 2]
                return await allocate(
                    ledger,
                    spec,
                    await ledger.gpus(),
                    policy,
                    place_fn=ledger.indexed(policy),
                    owner="kernel",
                    kernel_id=f"k{i}",
                )

            placed = await asyncio.gather(*(place(i) for i in range(24)))
            after = await asyncio.to_thread(plane.metrics)
            deadline = time.monotonic() + 20
            while {a.id for a in await ledgers[1].list()} != {a.id for a in placed}:
                assert time.monotonic() < deadline, "the second cache never caught up"
                await asyncio.sleep(0.05)
            for a in placed:
                await ledgers[0].release(a.id)
            return delta(before, after), list(placed), ledgers
        finally:
            for ledger in ledgers:
                await ledger.stop()
            for kube in kubes:
                await kube.close()

    changes, placed, ledgers = run(scenario())
    print("API requests for 24 placements from 2 controllers:", changes)
    print("conflicts:", [ledger.conflicts for ledger in ledgers])
    assert changes.get(("LIST", "gpuledgers"), 0) == 0, changes
    assert changes.get(("LIST", "nodes"), 0) == 0, changes
    per_gpu: dict[str, float] = {}
    for a in placed:
        per_gpu[a.gpus[0]] = per_gpu.get(a.gpus[0], 0.0) + a.request
    assert len(placed) == 24 and all(abs(v - 1.0) < 1e-9 for v in per_gpu.values()), per_gpu
    # the writes: 24 records; a conflict costs one more PUT and at most one GET
    writes = changes.get(("PUT", "gpuledgers"), 0) + changes.get(("POST", "gpuledgers"), 0)
    assert writes >= 24, changes
    assert changes.get(("GET", "gpuledgers"), 0) <= sum(ledger.conflicts for ledger in ledgers)


def test_server_lease_is_renewed_with_one_patch(plane: ControlPlane) -> None:
    """A heartbeat older than 0.6 of the Lease renews it with one PATCH (no GET, no PUT); a
    Lease of another user is refused without a write."""
    from jupyter_gpushare.controller.auth import HubUser
    from jupyter_gpushare.controller.errors import ControllerError
    from jupyter_gpushare.controller.servers import ServerLeases

    async def scenario() -> dict:
        kube = await connect(str(plane.kubeconfig("controller")))
        leases = ServerLeases(kube, NAMESPACE, duration=8.0, holder="test")
        try:
            await leases.start(30)
            alice, bob = HubUser("alice"), HubUser("bob")
            await leases.touch(alice, "renew-server")  # created
            before = await asyncio.to_thread(plane.metrics)
            await leases.touch(alice, "renew-server")  # fresh: nothing to do
            with pytest.raises(ControllerError) as refused:
                await leases.touch(bob, "renew-server")
            assert refused.value.status == 403
            await asyncio.sleep(5.0)  # over 0.6 of 8 s
            await leases.touch(alice, "renew-server")
            after = await asyncio.to_thread(plane.metrics)
            lease = leases.leases.get(manifests.lease_name("renew-server"))
            assert lease is not None
            renewed = manifests.parse_time(lease["spec"]["renewTime"])
            assert renewed is not None and time.time() - renewed.timestamp() < 4.0
            return delta(before, after)
        finally:
            await leases.stop()
            await kube.close()

    changes = run(scenario())
    print("API requests for 3 heartbeats:", changes)
    # (the API server's own loopback client reads namespaces and services now and then)
    assert {k: v for k, v in changes.items() if k[1] == "leases"} == {("PATCH", "leases"): 1}


# -- the controller process: REST from the caches ------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    hub = start_hub(tmp_path_factory.mktemp("hub"), users={"alice", "bob"}, admins=set(), groups={})
    yield hub
    stop_process(hub.proc)


@pytest.fixture(scope="module")
def controller_url(
    plane: ControlPlane, hub: Hub, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    root = tmp_path_factory.mktemp("controller-cache")
    config = root / "controller_config.py"
    config.write_text(f"""
c.GpushareController.hub_url = {hub.url!r}
c.GpushareController.server_lease_duration = 600  # renewed after 300 s: not in a test
c.KubernetesBackendConfig.kubeconfig = {str(plane.kubeconfig("controller"))!r}
c.KubernetesBackendConfig.namespace = {NAMESPACE!r}
""")
    port = free_port()
    log = root / "controller.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare.controller",
            f"--config={config}",
            f"--port={port}",
            "--ip=127.0.0.1",
        ],
        log,
        {**os.environ, "POD_NAME": "cache-controller"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(url + "/api/health", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            pytest.fail("the controller did not become leader:\n" + log.read_text()[-4000:])
        time.sleep(0.3)
    yield url
    stop_process(proc)


def test_rest_reads_from_a_warm_cache_make_no_api_requests(
    plane: ControlPlane, hub: Hub, controller_url: str
) -> None:
    """Once the controller's caches are warm, allocations, GPUs, usage, one allocation and its
    kernel's status, and server heartbeats within 0.6 of a Lease, cost the API server nothing
    (the leader's own Lease renewal is the only traffic)."""
    token = hub.user_token("alice")
    session = requests.Session()
    session.headers["Authorization"] = f"token {token}"

    def call(method: str, path: str, body: Any = None) -> Any:
        reply = session.request(method, controller_url + path, json=body, timeout=60)
        assert reply.status_code < 300, reply.text
        return reply.json()

    placed = call(
        "POST",
        "/api/allocations",
        {
            "kernel_id": "cachekernel1",
            "server_id": "cache-server",
            "share": {"gpu_request": 0.5, "gpu_limit": 0.5, "gpu_memory": "1GiB"},
        },
    )
    from jupyter_gpushare.k8s.usage import usage_document

    report = usage_document(  # the node daemon's report (its token is reviewed once)
        daemon_status(placed["id"], 2**20), {}, placed["node"], 2.0, time.time()
    )
    from kubernetes import client, config

    from jupyter_gpushare.controller.usage import AUDIENCE

    api = config.new_client_from_config(str(plane.kubeconfig("admin")))
    daemon_token = mint(client.CoreV1Api(api), "gpushare-daemon", AUDIENCE)
    api.close()
    reply = requests.put(
        f"{controller_url}/api/usage/{placed['node']}",
        json=report,
        headers={"Authorization": f"Bearer {daemon_token}"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    paths = [
        "/api/allocations",
        "/api/gpus",
        "/api/usage",
        f"/api/allocations/{placed['id']}",
        "/api/kernels",
        f"/api/kernels/{placed['id']}",
    ]
    for path in paths:  # warm: the Hub token is resolved once
        call("GET", path)
    before = plane.metrics()
    for _ in range(10):
        for path in paths:
            call("GET", path)
        call("PUT", "/api/servers/cache-server")
    after = plane.metrics()
    changes = delta(before, after)
    print("API requests for 60 REST reads and 10 heartbeats:", changes)
    mine = ("gpuledgers", "pods", "nodes", "secrets", "configmaps", "pods/status")
    ours = {k: v for k, v in changes.items() if k[1] in mine}
    assert ours == {}, ours
    # leader election reads and renews its own Lease (GET + PUT every 5 s); the server's Lease
    # was made with the placement and is not renewed again within 0.6 of its duration
    assert changes.get(("PATCH", "leases"), 0) == 0, changes
    answer = call("GET", "/api/allocations")
    assert [a["id"] for a in answer["allocations"]] == [placed["id"]]
    assert next(g for g in call("GET", "/api/gpus")["gpus"] if g["uuid"] == placed["gpus"][0])[
        "allocated"
    ] == pytest.approx(0.5)
    call("DELETE", f"/api/allocations/{placed['id']}")
    assert call("GET", "/api/allocations")["allocations"] == []


# -- usage: node daemons report to the controller -------------------------------------------------


def daemon_status(allocation_id: str, memory_used: int) -> dict[str, Any]:
    """A node daemon's status, as its ``status()`` answers (the parts a report carries)."""
    return {
        "daemon": {"pid": 1, "epoch": 1, "uptime_s": 5.0},
        "allocations": [
            {"id": allocation_id, "achieved_share": 0.31, "memory_used": memory_used, "idle_s": 0}
        ],
        "gpus": [],
    }


def mint(core: Any, account: str, audience: str, pod: Any = None, seconds: int = 600) -> str:
    """A token of ``account`` from the TokenRequest API (as the kubelet mints a projected one),
    for ``audience``, bound to ``pod`` when given."""
    spec: dict[str, Any] = {"audiences": [audience], "expirationSeconds": seconds}
    if pod is not None:
        spec["boundObjectRef"] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": pod.metadata.name,
            "uid": pod.metadata.uid,
        }
    return str(
        core.create_namespaced_service_account_token(
            account, NAMESPACE, {"spec": spec}
        ).status.token
    )


def test_node_usage_reaches_users_through_the_controller_and_forgeries_are_refused(
    plane: ControlPlane, hub: Hub, controller_url: str, tmp_path: Any
) -> None:
    """The node daemon's reporter (its token for the controller's audience, read from its token
    file) reports to the controller; the user reads her allocation's usage with GET /api/usage
    (nobody else's). Reports with no token, a Hub user's token, a token made for the API
    server (the daemon's own included: audience), another service account's token, a body
    about another node, or a daemon token bound to a pod on another node are refused and change
    nothing; a node's report about an allocation the ledger places elsewhere is ignored. The
    API server refuses the controller-audience token: sniffed, it is useless there."""
    from kubernetes import client, config

    from jupyter_gpushare.controller.usage import AUDIENCE
    from jupyter_gpushare.k8s.usage import ControllerReporter, usage_document

    api = config.new_client_from_config(str(plane.kubeconfig("admin")))
    core = client.CoreV1Api(api)
    daemon_token = mint(core, "gpushare-daemon", AUDIENCE)
    token_file = tmp_path / "token"
    token_file.write_text(daemon_token + "\n")

    token = hub.user_token("alice")
    headers = {"Authorization": f"token {token}"}
    placed = requests.post(
        controller_url + "/api/allocations",
        json={
            "kernel_id": "usagekernel1",
            "server_id": "usage-server",
            "share": {"gpu_request": 0.25, "gpu_limit": 0.5, "gpu_memory": "1GiB"},
        },
        headers=headers,
        timeout=60,
    ).json()
    node = placed["node"]
    other = next(n for n in NODES if n != node)

    async def report() -> int:
        kube = await connect(str(plane.kubeconfig("daemon")))
        try:
            reporter = ControllerReporter(
                [controller_url],
                kube,
                node,
                lambda: daemon_status(placed["id"], 3 * 2**20),
                lambda: {placed["id"]: "usage-server"},
                token_file=str(token_file),
            )
            await reporter.publish_once()
            return reporter.published
        finally:
            await kube.close()

    run(report())
    usage = requests.get(controller_url + "/api/usage", headers=headers, timeout=30).json()
    mine = usage["allocations"][placed["id"]]
    assert mine["memory_used"] == 3 * 2**20 and mine["node"] == node, usage
    assert node in usage["nodes"]

    def forged(bearer: str | None, path_node: str, body_node: str) -> requests.Response:
        document = usage_document(
            daemon_status(placed["id"], 70 * 2**30), {}, body_node, 2.0, time.time()
        )
        return requests.put(
            f"{controller_url}/api/usage/{path_node}",
            json=document,
            headers={"Authorization": f"Bearer {bearer}"} if bearer else {},
            timeout=30,
        )

    assert forged(None, node, node).status_code == 401
    assert forged(token, node, node).status_code == 401  # a Hub token is no cluster identity
    # tokens for the API server, the daemon's included: refused, naming the audience
    api_audience = "https://kubernetes.default.svc"
    for bearer in (plane.tokens["daemon"], mint(core, "gpushare-daemon", api_audience)):
        reply = forged(bearer, node, node)
        assert reply.status_code == 401 and AUDIENCE in reply.json()["message"], reply.text
    # other accounts' tokens for the controller: known, but not the daemon
    for account in ("jupyter-gpushare", "gpushare-controller"):
        reply = forged(mint(core, account, AUDIENCE), node, node)
        assert reply.status_code == 403, (account, reply.text)
        assert "may not report" in reply.json()["message"]
    reply = forged(daemon_token, node, other)  # body about another node
    assert reply.status_code == 400 and reply.json()["field"] == "node", reply.text
    # the API server refuses the controller's token: a copy sniffed off the network is useless
    # there (the API server's own audience token is authenticated: the request is right)
    for bearer, refused in (
        (daemon_token, True),
        (mint(core, "gpushare-daemon", api_audience), False),
    ):
        answer = requests.get(
            f"{plane.server_url}/api/v1/nodes/{node}",
            headers={"Authorization": f"Bearer {bearer}"},
            verify=str(plane.ca_file),
            timeout=30,
        )
        assert (answer.status_code == 401) is refused, answer.text

    # a pod-bound token of the daemon's account (as the DaemonSet mounts it), for a pod on
    # `other`: it reports for `other`, never for `node`
    pod = core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": f"daemon-{other}"},
            "spec": {
                "nodeName": other,
                "serviceAccountName": "gpushare-daemon",
                "containers": [{"name": "daemon", "image": "gpushare:local"}],
            },
        },
    )
    try:
        bound = mint(core, "gpushare-daemon", AUDIENCE, pod)
        reply = forged(bound, node, node)
        assert reply.status_code == 403 and f"bound to pod {pod.metadata.name}" in reply.text
        reply = forged(bound, other, other)  # accepted, but it cannot speak for alice's share
        assert reply.status_code == 200 and reply.json()["ignored"] == 1, reply.text
    finally:
        core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
        api.close()

    usage = requests.get(controller_url + "/api/usage", headers=headers, timeout=30).json()
    assert usage["allocations"][placed["id"]]["memory_used"] == 3 * 2**20, usage  # unchanged
    bob = requests.get(
        controller_url + "/api/usage",
        headers={"Authorization": f"token {hub.user_token('bob')}"},
        timeout=30,
    ).json()
    assert bob["allocations"] == {}, bob  # another user sees none of alice's
    requests.delete(f"{controller_url}/api/allocations/{placed['id']}", headers=headers, timeout=60)
