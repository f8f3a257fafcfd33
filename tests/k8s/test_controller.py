"""The cluster controller (issue 16) on the real control plane, with a real JupyterHub.

Two controller replicas (``python -m jupyter_gpushare.controller``) run with the controller's
service account; users' servers are represented by their Hub API tokens (the scopes a real
``JUPYTERHUB_API_TOKEN`` has) and, in one test, by a real Jupyter server in controller mode that
holds no kubeconfig at all. Users: alice (no bound), bob (group ``students``: at most 0.25 / 0.5
of a GPU), carol (Hub admin).

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because these tests need two GPU nodes of two types (placement, bounds, quotas) and controller
replicas on this host to kill; the controller in a pod, through the chart, with kernel pods on a
real kubelet: test_real_node_chart.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from cluster import NAMESPACE, ControlPlane, free_port
from hub import Hub, start_hub
from servers import spawn, start_jupyter_server, stop_process
from test_admission_gate import PodHistory

from jupyter_gpushare.controller.client import ControllerClient
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.client import connect
from jupyter_gpushare.ledger import Allocation

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
STUDENT_BOUND = {"gpu_request": 0.25, "gpu_limit": 0.5}


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    hub = start_hub(
        tmp_path_factory.mktemp("hub"),
        users={"alice", "bob"},
        admins={"carol"},
        groups={"students": ["bob"]},
    )
    yield hub
    stop_process(hub.proc)


class Controller:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def health(self) -> int:
        try:
            return requests.get(self.url + "/api/health", timeout=5).status_code
        except requests.ConnectionError:
            return 0


@pytest.fixture(scope="module")
def controllers(
    control_plane: ControlPlane,
    node_agent: Path,
    hub: Hub,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[Controller]]:
    """Two replicas on one leader Lease (3 s, renewed every 1 s)."""
    root = tmp_path_factory.mktemp("controller")
    config = root / "controller_config.py"
    config.write_text(f"""
c.GpushareController.hub_url = {hub.url!r}
c.GpushareController.group_bounds = {{"students": {STUDENT_BOUND!r}}}
c.GpushareController.group_quotas = {{"students": 0.5}}
c.GpushareController.lease_duration = 3
c.GpushareController.renew_interval = 1
c.GpushareController.retry_interval = 0.5
c.GpushareController.server_lease_duration = 10
c.GpushareController.reconcile_interval = 1
c.GpushareController.reconcile_grace = 4
c.GpushareController.network_policy_grace = 2
c.KubernetesBackendConfig.kubeconfig = {str(control_plane.kubeconfig("controller"))!r}
c.KubernetesBackendConfig.namespace = {NAMESPACE!r}
c.KubernetesBackendConfig.image = "gpushare-test:local"
c.KubernetesBackendConfig.start_timeout = 60
c.KubernetesBackendConfig.resources = {{"requests": {{"cpu": "100m", "memory": "64Mi"}}}}
""")
    started: list[Controller] = []

    def start(index: int) -> Controller:
        port = free_port()
        log = root / f"controller-{index}-{len(started)}.log"
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
            {**os.environ, "POD_NAME": f"controller-{index}-{len(started)}"},
        )
        controller = Controller(proc, f"http://127.0.0.1:{port}", log)
        started.append(controller)
        return controller

    replicas = [start(0), start(1)]
    deadline = time.monotonic() + 60
    while sorted(c.health() for c in replicas) != [200, 503]:
        if time.monotonic() > deadline or any(c.proc.poll() is not None for c in replicas):
            pytest.fail(
                "no controller became leader:\n"
                + "\n".join(c.log.read_text()[-3000:] for c in replicas)
            )
        time.sleep(0.3)
    replicas.append(start(2))  # spare for the failover test (after the standby takes over)
    yield replicas
    for c in started:
        stop_process(c.proc)


def leader(replicas: list[Controller]) -> Controller:
    return next(c for c in replicas if c.proc.poll() is None and c.health() == 200)


def call(
    replicas: list[Controller], token: str, method: str, path: str, body: Any = None
) -> requests.Response:
    return requests.request(
        method,
        leader(replicas).url + path,
        json=body,
        timeout=120,
        headers={"Authorization": f"token {token}"},
    )


def start_body(kernel: str, server: str, share: dict[str, Any]) -> dict[str, Any]:
    return {
        "kernel_id": kernel,
        "server_id": server,
        "share": share,
        "launch_id": uuid.uuid4().hex[:10],
        "command": SLEEPER,
        "env": {"A": "1"},
        "connection": {
            "shell_port": 1,
            "iopub_port": 2,
            "stdin_port": 3,
            "control_port": 4,
            "hb_port": 5,
            "key": uuid.uuid4().hex,
        },
    }


def kernel_name() -> str:
    return "k" + uuid.uuid4().hex[:11]


# -- RBAC: users' servers hold no rights ---------------------------------------------------------


def review(api: Any, user: str, groups: list[str], group: str, resource: str, verb: str) -> bool:
    from kubernetes import client

    answer = client.AuthorizationV1Api(api).create_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": groups,
                "resourceAttributes": {
                    "namespace": NAMESPACE,
                    "group": group,
                    "resource": resource,
                    "verb": verb,
                },
            },
        }
    )
    return bool(answer.status.allowed)


def test_user_servers_hold_no_rights_the_controller_does(control_plane: ControlPlane) -> None:
    """SubjectAccessReviews on the API server: the identity a user's server runs as in
    controller mode (the namespace's default service account; z2jh mounts no token at all)
    may not create pods, read or write Secrets, or write GpuLedgers; the controller's may."""
    from kubernetes import config

    api = config.new_client_from_config(str(control_plane.kubeconfig("admin")))
    sa_groups = [
        "system:serviceaccounts",
        f"system:serviceaccounts:{NAMESPACE}",
        "system:authenticated",
    ]
    user_server = f"system:serviceaccount:{NAMESPACE}:default"
    controller = f"system:serviceaccount:{NAMESPACE}:gpushare-controller"
    denied = [
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "secrets", "get"),
        ("", "secrets", "list"),
        ("", "secrets", "create"),
        ("", "secrets", "patch"),
        ("gpushare.jupyter.org", "gpuledgers", "update"),
        ("gpushare.jupyter.org", "gpuledgers", "create"),
        ("gpushare.jupyter.org", "gpuledgers", "patch"),
        ("coordination.k8s.io", "leases", "update"),
        ("coordination.k8s.io", "leases", "patch"),
    ]
    for group, resource, verb in denied:
        assert not review(api, user_server, sa_groups, group, resource, verb), (resource, verb)
    for group, resource, verb in [
        ("", "pods", "create"),
        ("", "secrets", "create"),
        ("", "secrets", "patch"),
        ("gpushare.jupyter.org", "gpuledgers", "update"),
        ("gpushare.jupyter.org", "gpuledgers", "create"),
        ("coordination.k8s.io", "leases", "update"),
        ("coordination.k8s.io", "leases", "patch"),  # a server's Lease renewal
        ("authentication.k8s.io", "tokenreviews", "create"),  # who reports node usage
        ("networking.k8s.io", "networkpolicies", "create"),  # each user's kernel policy
        ("networking.k8s.io", "networkpolicies", "delete"),
    ]:
        assert review(api, controller, sa_groups, group, resource, verb), (resource, verb)
    # a user's server may not touch NetworkPolicies; the controller may not rewrite one
    for verb in ("create", "delete", "update", "patch"):
        assert not review(api, user_server, sa_groups, "networking.k8s.io", "networkpolicies", verb)
    assert not review(api, controller, sa_groups, "networking.k8s.io", "networkpolicies", "update")
    assert not review(api, controller, sa_groups, "networking.k8s.io", "networkpolicies", "patch")
    # nor does the controller read Secrets back (it writes connection files only)
    assert not review(api, controller, sa_groups, "", "secrets", "get")

    values = yaml.safe_load((ROOT / "deploy" / "z2jh" / "values.yaml").read_text())
    single = values["singleuser"]
    assert not single.get("serviceAccountName")
    assert single["extraPodConfig"]["automountServiceAccountToken"] is False
    assert single["extraEnv"]["GPUSHARE_CONTROLLER_URL"].startswith("http")
    # z2jh blocks private IPs: users' pods may reach the controller's port and kernel pods (their
    # ZMQ ports are per kernel), both in namespace gpushare, and nothing else there
    egress = single["networkPolicy"]["egress"]
    by_component = {}
    for rule in egress:
        for to in rule["to"]:
            assert to["namespaceSelector"]["matchLabels"] == {
                "kubernetes.io/metadata.name": "gpushare"
            }, to
            by_component[to["podSelector"]["matchLabels"]["app.kubernetes.io/component"]] = rule
    assert sorted(by_component) == ["controller", "gpushare-kernel"], egress
    assert [p["port"] for p in by_component["controller"]["ports"]] == [8081]


# -- two Hub users through the controller --------------------------------------------------------


def test_two_users_see_and_change_only_their_own_kernels(
    controllers: list[Controller], hub: Hub, control_plane: ControlPlane
) -> None:
    alice, bob, carol = (hub.tokens[u] for u in ("alice", "bob", "carol"))
    a_kernel, b_kernel = kernel_name(), kernel_name()
    a_server, b_server = "srv-" + uuid.uuid4().hex[:8], "srv-" + uuid.uuid4().hex[:8]

    reply = call(
        controllers,
        alice,
        "POST",
        "/api/kernels",
        start_body(a_kernel, a_server, {"gpu_request": 0.5, "gpu_limit": 1.0, "gpu_type": "A100"}),
    )
    assert reply.status_code == 201, reply.text
    a_alloc = reply.json()["allocation"]
    assert reply.json()["connection"]["ip"] == "127.0.0.1"  # the pod's IP (the node agent's)
    assert a_alloc["user"] == "alice" and a_alloc["state"] == "active"

    # bob's bound (group students) holds on start: refused by name, nothing placed
    reply = call(
        controllers,
        bob,
        "POST",
        "/api/kernels",
        start_body(b_kernel, b_server, {"gpu_request": 0.5, "gpu_limit": 0.5}),
    )
    assert reply.status_code == 400 and reply.json()["field"] == "gpu_request", reply.text
    reply = call(
        controllers,
        bob,
        "POST",
        "/api/kernels",
        start_body(b_kernel, b_server, {"gpu_request": 0.25, "gpu_limit": 0.5}),
    )
    assert reply.status_code == 201, reply.text
    b_alloc = reply.json()["allocation"]
    assert b_alloc["user"] == "bob"

    def ids(token: str, what: str = "allocations") -> set[str]:
        reply = call(controllers, token, "GET", f"/api/{what}")
        assert reply.status_code == 200, reply.text
        return {a.get("id") or a.get("allocation") for a in reply.json()[what]}

    assert a_alloc["id"] in ids(alice) and b_alloc["id"] not in ids(alice)
    assert b_alloc["id"] in ids(bob) and a_alloc["id"] not in ids(bob)
    assert {a_alloc["id"], b_alloc["id"]} <= ids(carol)  # a Hub admin sees all
    assert ids(bob, "kernels") == {b_alloc["id"]}
    assert ids(alice, "kernels") == {a_alloc["id"]}

    # the other's kernel: 403 for every verb, and it is untouched
    for method, path, body in [
        ("GET", f"/api/allocations/{a_alloc['id']}", None),
        ("PATCH", f"/api/allocations/{a_alloc['id']}", {"gpu_request": 0.1}),
        ("DELETE", f"/api/allocations/{a_alloc['id']}", None),
        ("GET", f"/api/kernels/{a_alloc['id']}", None),
        ("DELETE", f"/api/kernels/{a_alloc['id']}", None),
        ("PUT", f"/api/servers/{a_server}", None),
    ]:
        reply = call(controllers, bob, method, path, body)
        assert reply.status_code == 403, (method, path, reply.text)
        assert reply.json()["error"] == "forbidden"
    # nor can bob start a kernel under alice's server (its Lease would own the pod)
    reply = call(
        controllers,
        bob,
        "POST",
        "/api/kernels",
        start_body(kernel_name(), a_server, {"gpu_request": 0.1, "gpu_limit": 0.1}),
    )
    assert reply.status_code == 403, reply.text
    status = call(controllers, alice, "GET", f"/api/kernels/{a_alloc['id']}").json()
    assert status["phase"] == "Running" and status["exit_code"] is None

    # resize: the bound holds (recorded on the allocation), within it works
    reply = call(
        controllers, bob, "PATCH", f"/api/allocations/{b_alloc['id']}", {"gpu_limit": 0.75}
    )
    assert reply.status_code == 400 and reply.json()["field"] == "gpu_limit", reply.text
    reply = call(
        controllers, bob, "PATCH", f"/api/allocations/{b_alloc['id']}", {"gpu_request": 0.2}
    )
    assert reply.status_code == 200 and reply.json()["gpu_request"] == 0.2, reply.text
    reply = call(
        controllers, alice, "PATCH", f"/api/allocations/{a_alloc['id']}", {"gpu_request": 0.75}
    )
    assert reply.status_code == 200, reply.text

    # bob's quota (group students: 0.5 GPU in all) holds on placing and on resizing
    share = {
        "kernel_id": kernel_name(),
        "server_id": b_server,
        "share": {"gpu_request": 0.25, "gpu_limit": 0.25},
    }
    second = call(controllers, bob, "POST", "/api/allocations", share)
    assert second.status_code == 201, second.text  # 0.2 + 0.25
    reply = call(
        controllers,
        bob,
        "POST",
        "/api/allocations",
        {**share, "kernel_id": kernel_name(), "share": {"gpu_request": 0.1}},
    )
    assert reply.status_code == 409 and reply.json()["error"] == "over_quota", reply.text
    assert reply.json()["quota"] == 0.5 and reply.json()["held"] == 0.45
    third = call(
        controllers,
        bob,
        "POST",
        "/api/allocations",
        {**share, "kernel_id": kernel_name(), "share": {"gpu_request": 0.05}},
    )
    assert third.status_code == 201, third.text  # exactly the quota
    reply = call(
        controllers, bob, "PATCH", f"/api/allocations/{b_alloc['id']}", {"gpu_request": 0.25}
    )
    assert reply.status_code == 409 and reply.json()["error"] == "over_quota", reply.text
    assert (
        call(controllers, bob, "DELETE", f"/api/allocations/{third.json()['id']}").status_code
        == 200
    )
    reply = call(
        controllers, bob, "PATCH", f"/api/allocations/{b_alloc['id']}", {"gpu_request": 0.25}
    )
    assert reply.status_code == 200, reply.text  # 0.25 + 0.25: exactly the quota again
    assert (
        call(controllers, bob, "DELETE", f"/api/allocations/{second.json()['id']}").status_code
        == 200
    )

    # bad and missing tokens: 401 with the reason; a standby: 503 naming the leader
    assert call(controllers, "not-a-token", "GET", "/api/allocations").status_code == 401
    assert requests.get(leader(controllers).url + "/api/allocations", timeout=10).status_code == 401
    standby = next(c for c in controllers[:2] if c.health() == 503)
    reply = requests.get(
        standby.url + "/api/gpus", timeout=10, headers={"Authorization": f"token {alice}"}
    )
    assert reply.status_code == 503 and reply.json()["error"] == "not_leader"
    assert reply.json()["leader"], reply.text

    # release: each their own; the pod and the record go
    for token, alloc in ((bob, b_alloc), (alice, a_alloc)):
        reply = call(controllers, token, "DELETE", f"/api/allocations/{alloc['id']}")
        assert reply.status_code == 200, reply.text
        assert call(controllers, token, "GET", f"/api/allocations/{alloc['id']}").status_code == 404

    async def pods_gone() -> None:
        kube = await connect(str(control_plane.kubeconfig("admin")))
        try:
            deadline = time.monotonic() + 30
            while True:
                pods = (await kube.list_pods(NAMESPACE, manifests.LABEL_KERNEL))["items"]
                left = {p["metadata"]["labels"][manifests.LABEL_KERNEL] for p in pods}
                if not left & {a_kernel, b_kernel}:
                    return
                assert time.monotonic() < deadline, left
                await asyncio.sleep(0.3)
        finally:
            await kube.close()

    asyncio.run(pods_gone())


# -- who reaches a kernel: each user's NetworkPolicy ---------------------------------------------


def test_each_users_server_reaches_only_their_own_kernels(
    controllers: list[Controller], hub: Hub, control_plane: ControlPlane, tmp_path: Path
) -> None:
    """Two Hub users start a kernel each through the controller; with the chart's controller-
    mode policies in the namespace, netpol.py's evaluation of EVERY NetworkPolicy of the
    cluster says: alice's server reaches alice's kernel and not bob's, bob's server bob's
    only, any other pod of jhub (the hub, a server without the Hub's owner label) neither. A
    policy deleted by hand comes back; a user's policy goes once their kernels are gone."""
    from kubernetes import client, config
    from netpol import Pod, allowed
    from test_helm import helm_binary

    from jupyter_gpushare.controller.network import policy_name

    binary = helm_binary()
    if binary is None:
        pytest.skip("no helm binary (.ci/setup.d/helm.sh)")
    rendered = subprocess.run(
        [
            binary,
            "template",
            "x",
            str(ROOT / "deploy/helm/jupyter-gpushare"),
            "--namespace",
            NAMESPACE,
            "--set",
            "controller.enabled=true",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objs = [d for d in yaml.safe_load_all(rendered) if d]
    chart = [o for o in objs if o["kind"] == "NetworkPolicy"]
    controller_labels = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"][
        "metadata"
    ]["labels"]
    api = config.new_client_from_config(str(control_plane.kubeconfig("admin")))
    net = client.NetworkingV1Api(api)
    for policy in chart:
        net.create_namespaced_network_policy(NAMESPACE, policy)
    users = ("alice", "bob")
    owners = {u: manifests.owner_label(u) for u in users}
    try:
        started = {}
        for user in users:
            share = {"gpu_request": 0.1, "gpu_limit": 0.1}
            body = start_body(kernel_name(), "srv-" + uuid.uuid4().hex[:8], share)
            reply = call(controllers, hub.tokens[user], "POST", "/api/kernels", body)
            assert reply.status_code == 201, reply.text
            started[user] = reply.json()["allocation"]["id"]
        pods = {
            p["metadata"]["labels"][manifests.LABEL_ALLOCATION]: p
            for p in api.sanitize_for_serialization(
                client.CoreV1Api(api).list_namespaced_pod(NAMESPACE).items
            )
            if p["metadata"].get("labels", {}).get(manifests.LABEL_ALLOCATION)
        }
        kernels = {u: Pod.of(pods[started[u]]) for u in users}
        assert {u: k.labels[manifests.LABEL_OWNER] for u, k in kernels.items()} == owners
        policies = api.sanitize_for_serialization(
            net.list_network_policy_for_all_namespaces().items
        )
        names = {p["metadata"]["name"] for p in policies}
        assert {policy_name(owners[u]) for u in users} <= names
        server = {"app": "jupyterhub", "component": "singleuser-server", "release": "jhub"}
        sources = {
            "alice's server": (
                Pod("jhub", {**server, manifests.LABEL_OWNER: owners["alice"]}),
                {"alice"},
            ),
            "bob's server": (
                Pod("jhub", {**server, manifests.LABEL_OWNER: owners["bob"]}),
                {"bob"},
            ),
            "the controller": (Pod(NAMESPACE, controller_labels), {"alice", "bob"}),
            "a server without the owner label": (Pod("jhub", server), set()),
            "the hub": (Pod("jhub", {"app": "jupyterhub", "component": "hub"}), set()),
            "bob's kernel": (kernels["bob"], set()),
        }
        for what, (source, reaches) in sources.items():
            got = {u for u in users if allowed(policies, source, kernels[u], 50000)}
            assert got == reaches, (what, got)

        def policy_names() -> set[str]:
            return {p.metadata.name for p in net.list_namespaced_network_policy(NAMESPACE).items}

        # deleted by hand (or lost): the controller's next pass puts it back
        net.delete_namespaced_network_policy(policy_name(owners["alice"]), NAMESPACE)
        deadline = time.monotonic() + 30
        while policy_name(owners["alice"]) not in policy_names():
            assert time.monotonic() < deadline, "alice's policy did not come back"
            time.sleep(0.3)
        # kernels gone: their users' policies go (after network_policy_grace)
        for user in users:
            reply = call(
                controllers, hub.tokens[user], "DELETE", f"/api/allocations/{started[user]}"
            )
            assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 40
        while {policy_name(owners[u]) for u in users} & policy_names():
            assert time.monotonic() < deadline, policy_names()
            time.sleep(0.5)
        assert {p["metadata"]["name"] for p in chart} <= policy_names()  # the chart's stay
    finally:
        for policy in chart:
            with contextlib.suppress(client.ApiException):
                net.delete_namespaced_network_policy(policy["metadata"]["name"], NAMESPACE)


# -- hostile input from a user's server ------------------------------------------------------------


async def test_a_kernel_whose_share_was_released_inside_it_is_still_its_users_to_stop(
    controllers: list[Controller], hub: Hub, control_plane: ControlPlane
) -> None:
    """On the double (the real-node run found it: test_real_node_chart). The node agent's
    Release removes the record and keeps the pod; GET and DELETE /api/kernels/{id} then
    answered 404, so the server took the kernel for dead and its shutdown left the pod. Now the
    owner still sees the pod (released: true) and stops it; another user still gets 404."""
    alice, bob = hub.tokens["alice"], hub.tokens["bob"]
    kernel, server = kernel_name(), "srv-" + uuid.uuid4().hex[:8]
    reply = await asyncio.to_thread(
        call,
        controllers,
        alice,
        "POST",
        "/api/kernels",
        start_body(kernel, server, {"gpu_request": 0.1, "gpu_limit": 0.1}),
    )
    assert reply.status_code == 201, reply.text
    allocation = reply.json()["allocation"]["id"]
    kube = await connect(str(control_plane.kubeconfig("admin")))
    try:
        from jupyter_gpushare.k8s.ledger import KubernetesLedger

        assert await KubernetesLedger(kube, NAMESPACE).release(allocation) is not None
        path = f"/api/kernels/{allocation}"
        seen = await asyncio.to_thread(call, controllers, alice, "GET", path)
        assert seen.status_code == 200, seen.text
        assert seen.json()["released"] is True and seen.json()["exit_code"] is None
        for method in ("GET", "DELETE"):
            other = await asyncio.to_thread(call, controllers, bob, method, path)
            assert other.status_code == 404, (method, other.text)
        stopped = await asyncio.to_thread(call, controllers, alice, "DELETE", path)
        assert stopped.status_code == 200, stopped.text
        pods = await kube.list_pods(NAMESPACE, f"{manifests.LABEL_ALLOCATION}={allocation}")
        assert pods["items"] == []
    finally:
        await kube.close()


def test_hostile_requests_are_refused_by_name(controllers: list[Controller], hub: Hub) -> None:
    """Every field a user's server sends is checked before the cluster is touched: 400 naming
    the field (never a 500 or a traceback), nothing placed, no pod."""
    bob = hub.tokens["bob"]
    kernel, server = kernel_name(), "srv-" + uuid.uuid4().hex[:8]
    good = start_body(kernel, server, {"gpu_request": 0.1, "gpu_limit": 0.1})
    cases: list[tuple[dict[str, Any], str]] = [
        ({**good, "kernel_id": "../../etc"}, "kernel_id"),
        ({**good, "server_id": "UPPER/slash"}, "server_id"),
        ({**good, "launch_id": "x"}, "launch_id"),
        ({**good, "command": "rm -rf /"}, "command"),
        ({**good, "command": ["x"] * 1000}, "command"),
        ({**good, "env": {"BAD NAME": "1"}}, "env"),
        ({**good, "env": {"A": 1}}, "env"),
        (
            {**good, "connection": {**good["connection"], "shell_port": 70000}},
            "connection.shell_port",
        ),
        (
            {**good, "connection": {**good["connection"], "transport": "ipc"}},
            "connection.transport",
        ),
        ({**good, "share": {"gpu_request": "lots"}}, "gpu_request"),
        ({**good, "share": {"gpu_request": 0.1, "gpu_owner": "alice"}}, "gpu_owner"),
        ({**good, "owner": "root"}, "owner"),
        ({**good, "allocation_id": 5}, "allocation_id"),
    ]
    for body, field in cases:
        reply = call(controllers, bob, "POST", "/api/kernels", body)
        assert reply.status_code == 400, (field, reply.status_code, reply.text)
        assert reply.json()["field"] == field, (field, reply.text)
    for raw in (b"not json", b"[1, 2]", b"{" * 5000, "\u00ff".encode("latin-1")):
        reply = requests.post(
            leader(controllers).url + "/api/kernels",
            data=raw,
            timeout=30,
            headers={"Authorization": f"token {bob}"},
        )
        assert reply.status_code == 400 and reply.json()["field"] == "body", reply.text
    reply = call(controllers, bob, "PATCH", "/api/allocations/nonexistent", {"gpu_request": 0.1})
    assert reply.status_code == 404, reply.text
    reply = call(controllers, bob, "GET", "/api/../../etc/passwd")
    assert reply.status_code == 404 and reply.json()["error"] == "not_found"
    reply = call(controllers, bob, "DELETE", "/api/kernels/x?grace=99999999999")
    assert reply.status_code == 400 and reply.json()["field"] == "grace"
    mine = call(controllers, bob, "GET", "/api/allocations").json()["allocations"]
    assert not [a for a in mine if a["kernel_id"] == kernel]
    # a kernel that cannot run: 503 in the cluster's words, and the share it placed goes back
    dying = {**good, "command": ["/nonexistent/gpushare-test-binary"]}  # CreateContainerError
    reply = call(controllers, bob, "POST", "/api/kernels", dying)
    assert reply.status_code == 503 and reply.json()["error"] == "kernel_pod_failed", reply.text
    mine = call(controllers, bob, "GET", "/api/allocations").json()["allocations"]
    assert not [a for a in mine if a["kernel_id"] == kernel]


# -- a real Jupyter server in controller mode: no Kubernetes credentials at all ------------------


async def test_jupyter_server_without_credentials_runs_kernels_through_the_controller(
    controllers: list[Controller], hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_kernels import execute

    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub.tokens["alice"])
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("GPUSHARE_KUBECONFIG", raising=False)
    urls = ",".join(c.url for c in controllers)
    server = await asyncio.to_thread(
        start_jupyter_server,
        tmp_path / "server",
        None,
        "kubernetes",
        extra=f"""
c.KubernetesBackendConfig.controller_url = {urls!r}
c.KubernetesBackendConfig.kubeconfig = "/nonexistent/kubeconfig"
c.KubernetesBackendConfig.lease_renew_interval = 2
""",
    )
    try:
        reply = await asyncio.to_thread(
            server.request, "POST", "/api/kernels", json={"name": "gpushare-k8s"}
        )
        assert reply.status_code == 201, reply.text + server.log_text()[-3000:]
        kernel_id = reply.json()["id"]
        assert (await execute(server, kernel_id, "print(6 * 7)")).strip() == "42"
        mine = await asyncio.to_thread(server.request, "GET", "/gpushare/api/allocations")
        assert mine.status_code == 200, mine.text
        records = [a for a in mine.json()["allocations"] if a["kernel_id"] == kernel_id]
        assert len(records) == 1 and records[0]["user"] == "alice"
        seen = (
            await asyncio.to_thread(
                call, controllers, hub.tokens["alice"], "GET", "/api/allocations"
            )
        ).json()
        assert [a["id"] for a in seen["allocations"] if a["kernel_id"] == kernel_id] == [
            records[0]["id"]
        ]
        # a live resize through the server's REST goes to the controller
        reply = await asyncio.to_thread(
            server.request,
            "PATCH",
            f"/gpushare/api/allocations/{records[0]['id']}",
            json={"gpu_request": 0.3},
        )
        assert reply.status_code == 200, reply.text
        seen = (
            await asyncio.to_thread(
                call,
                controllers,
                hub.tokens["alice"],
                "GET",
                f"/api/allocations/{records[0]['id']}",
            )
        ).json()
        assert seen["gpu_request"] == 0.3, seen
        # live usage reaches the server through the controller (GET /api/usage: the node
        # daemons here still write their ConfigMaps, which the controller reads for them)
        deadline = time.monotonic() + 30
        while True:
            reply = await asyncio.to_thread(server.request, "GET", "/gpushare/api/usage")
            assert reply.status_code == 200, reply.text
            usage = reply.json()
            if any(u["id"] == records[0]["id"] for u in usage["allocations"]):
                break
            assert time.monotonic() < deadline, usage
            await asyncio.sleep(1.0)
        assert usage["source"] == "kubernetes" and usage["daemon"], usage
        # shutdown releases through the controller: pod, Secret and record go
        reply = await asyncio.to_thread(server.request, "DELETE", f"/api/kernels/{kernel_id}")
        assert reply.status_code == 204, reply.text
        seen = (
            await asyncio.to_thread(
                call, controllers, hub.tokens["alice"], "GET", "/api/allocations"
            )
        ).json()
        assert not [a for a in seen["allocations"] if a["kernel_id"] == kernel_id]
        assert "Traceback" not in server.log_text()

        # a server that dies (kill -9) stops its heartbeats: once its Lease expires the
        # controller's reconciler deletes it and releases its kernel's share (the garbage
        # collector then removes the pod, owned by that Lease, as in direct mode)
        reply = await asyncio.to_thread(
            server.request, "POST", "/api/kernels", json={"name": "gpushare-k8s"}
        )
        assert reply.status_code == 201, reply.text
        orphan = reply.json()["id"]
        stop_process(server.proc, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            seen = (
                await asyncio.to_thread(
                    call, controllers, hub.tokens["alice"], "GET", "/api/kernels"
                )
            ).json()
            if not [k for k in seen["kernels"] if k["kernel_id"] == orphan]:
                break
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.5)
    finally:
        stop_process(server.proc)


# -- concurrent starts of one size on one node: the device plugin's guess is never a tie --------


async def test_starts_of_one_size_on_one_node_are_admitted_one_at_a_time(
    controllers: list[Controller], hub: Hub, control_plane: ControlPlane
) -> None:
    """Six kernels of one size started at once: every start runs its own pod (none is refused
    at PreStartContainer for holding another's allocation), and at no moment of the API
    server's history did two pods of one node and size wait for admission together."""
    kube = await connect(str(control_plane.kubeconfig("admin")))
    history = PodHistory(kube)
    await history.start()
    client = ControllerClient(
        [c.url for c in controllers if c.proc.poll() is None], hub.tokens["alice"], retry_for=60
    )
    kernels = [kernel_name() for _ in range(6)]
    server = "srv-" + uuid.uuid4().hex[:8]
    share = {"gpu_request": 0.1, "gpu_limit": 0.2}
    try:
        began = time.monotonic()
        answers = await asyncio.wait_for(
            asyncio.gather(
                *(
                    client.request("POST", "/api/kernels", start_body(k, server, share))
                    for k in kernels
                )
            ),
            150,
        )
        took = time.monotonic() - began
        assert sorted(a["allocation"]["kernel_id"] for a in answers) == sorted(kernels)
        nodes = {a["allocation"]["node"] for a in answers}
        print(f"6 starts of one size on {len(nodes)} node(s): {took:.1f} s")
        assert await history.overlaps(kernels) == []
        for answer in answers:
            await client.request("DELETE", f"/api/allocations/{answer['allocation']['id']}")
    finally:
        history.stop()
        await kube.close()


# -- failover: kill -9 of the active controller while kernels start --------------------------------


async def test_kill_9_of_the_leader_during_starts_loses_and_doubles_nothing(
    controllers: list[Controller], hub: Hub, control_plane: ControlPlane
) -> None:
    kube = await connect(str(control_plane.kubeconfig("admin")))
    versions: list[dict[str, Any]] = []
    listing = await kube.list_ledgers(NAMESPACE)
    versions.extend(listing.get("items") or [])

    async def follow() -> None:  # every version of every GpuLedger from now on
        async for event in kube.watch(
            "gpuledgers", NAMESPACE, listing["metadata"]["resourceVersion"]
        ):
            if event["type"] in ("ADDED", "MODIFIED"):
                versions.append(event["object"])

    watcher = asyncio.create_task(follow())
    alive = [c for c in controllers if c.proc.poll() is None]
    first = leader(alive)
    client = ControllerClient([c.url for c in alive], hub.tokens["alice"], retry_for=90)
    kernels = [kernel_name() for _ in range(6)]
    server = "srv-" + uuid.uuid4().hex[:8]

    async def start(kernel: str, delay: float) -> dict[str, Any]:
        await asyncio.sleep(delay)
        return await client.request(
            "POST",
            "/api/kernels",
            start_body(kernel, server, {"gpu_request": 0.1, "gpu_limit": 0.2}),
        )

    try:
        starts = [asyncio.create_task(start(k, 0.1 * i)) for i, k in enumerate(kernels)]

        def placed() -> set[str]:
            return {
                a["kernel_id"]
                for obj in versions
                for a in (obj.get("spec") or {}).get("allocations") or []
            } & set(kernels)

        deadline = time.monotonic() + 60
        while not placed():  # kill as soon as the first share is recorded: the others are
            assert time.monotonic() < deadline, "no share was placed"  # placing or waiting
            await asyncio.sleep(0.01)
        first.proc.send_signal(signal.SIGKILL)
        in_flight = sum(not t.done() for t in starts)
        placed_before = placed()
        assert in_flight >= len(kernels) - 1, "the kill came after starts were answered"
        answers = await asyncio.wait_for(asyncio.gather(*starts), 150)
        assert leader(alive) is not first
        assert placed_before and len(placed_before) < len(kernels)
        assert {a["allocation"]["kernel_id"] for a in answers} == set(kernels)
        await asyncio.sleep(1.0)  # the watch catches up
        final = [
            Allocation.from_json(a)
            for obj in (await kube.list_ledgers(NAMESPACE))["items"]
            for a in (obj.get("spec") or {}).get("allocations") or []
        ]
        ours = [a for a in final if a.kernel_id in kernels]
        # nothing lost, nothing doubled: one share per kernel, the one each start was answered
        assert sorted(a.kernel_id or "" for a in ours) == sorted(kernels)
        assert {a.id for a in ours} == {a["allocation"]["id"] for a in answers}
        # every version of every ledger the API server published: no kernel ever held two
        # shares on a node, no GPU was ever over-committed
        for obj in versions:
            records = [
                Allocation.from_json(a) for a in (obj.get("spec") or {}).get("allocations") or []
            ]
            held = [a.kernel_id for a in records if a.kernel_id in kernels]
            assert len(held) == len(set(held)), (obj["metadata"]["resourceVersion"], held)
            per_gpu: dict[str, float] = {}
            for a in records:
                for gpu in a.gpus:
                    per_gpu[gpu] = per_gpu.get(gpu, 0.0) + a.request
            assert all(v <= 1.0 + 1e-9 for v in per_gpu.values()), per_gpu
        # and across nodes, in the final state
        assert len({a.id for a in final}) == len(final)
        # one running pod per kernel (within a window: a status update may trail the answer)
        deadline = time.monotonic() + 15
        while True:
            pods = [
                p
                for p in (await kube.list_pods(NAMESPACE, manifests.LABEL_KERNEL))["items"]
                if p["metadata"]["labels"][manifests.LABEL_KERNEL] in kernels
            ]
            running = sorted(
                p["metadata"]["labels"][manifests.LABEL_KERNEL]
                for p in pods
                if manifests.pod_running(p)
            )
            if running == sorted(kernels) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert running == sorted(kernels), [
            (p["metadata"]["name"], (p.get("status") or {}).get("phase"), manifests.pod_failure(p))
            for p in pods
        ]
        for answer in answers:
            await client.request("DELETE", f"/api/allocations/{answer['allocation']['id']}")
    finally:
        watcher.cancel()
        await kube.close()


# -- authentication against the real Hub -----------------------------------------------------------


async def test_hub_tokens_resolve_to_users_cached_and_bounded(hub: Hub) -> None:
    from jupyter_gpushare.controller.auth import HubAuth
    from jupyter_gpushare.controller.errors import ControllerError

    auth = HubAuth(hub.url, ttl=60, max_entries=2)
    bob = await auth.user(hub.tokens["bob"])
    assert (bob.name, bob.admin, bob.groups) == ("bob", False, ("students",))
    carol = await auth.user(hub.tokens["carol"])
    assert carol.admin and carol.name == "carol"
    asked = auth.hub_requests
    assert await auth.user(hub.tokens["bob"]) == bob and auth.hub_requests == asked  # cached
    with pytest.raises(ControllerError) as refused:
        await auth.user("not-a-token")
    assert refused.value.status == 401
    assert len(auth._cache) <= 2  # bounded: the least recently used went
    await auth.user(hub.tokens["carol"])
    assert auth.hub_requests == asked + 2  # carol was evicted by the bad token, asked again
    # a Hub that cannot be reached is a 503 with the reason, not a refusal of the user
    away = HubAuth(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(ControllerError) as down:
        await away.user(hub.tokens["bob"])
    assert down.value.status == 503 and "cannot be reached" in down.value.message


# -- the chart's controller ------------------------------------------------------------------------


def test_chart_controller_config_is_what_the_controller_reads(tmp_path: Path) -> None:
    """``controller.enabled``: the chart's ConfigMap is a config file the real ControllerApp
    loads, the command parses, the Deployment runs as the controller's service account and its
    readiness is the leader's health (a standby is not routed to)."""
    from test_helm import helm_binary

    from jupyter_gpushare.controller.app import ControllerApp
    from jupyter_gpushare.controller.config import GpushareController
    from jupyter_gpushare.controller.network import NetworkSettings
    from jupyter_gpushare.k8s.config import KubernetesBackendConfig

    binary = helm_binary()
    if binary is None:
        pytest.skip("no helm binary (.ci/setup.d/helm.sh)")
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "controller": {
                    "enabled": True,
                    "hubUrl": "http://hub.jhub.svc:8081",
                    "groupBounds": {"students": STUDENT_BOUND},
                    "groupQuotas": {"students": 0.5},
                    "kernelPods": {"image": "img:2", "preload_interposer": False},
                }
            }
        )
    )
    out = subprocess.run(
        [
            binary,
            "template",
            "x",
            str(ROOT / "deploy/helm/jupyter-gpushare"),
            "--namespace",
            "gpushare",
            "-f",
            str(values),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    objs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    config = tmp_path / "controller_config.json"
    config.write_text(objs[("ConfigMap", "gpushare-controller")]["data"][config.name])
    deployment = objs[("Deployment", "gpushare-controller")]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpushare-controller"
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/api/health"
    # a standby is never ready: a rolling update would wait for it forever
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert container["command"][:3] == ["jupyter", "gpushare", "controller"]
    args = [a.replace("/etc/gpushare/", f"{tmp_path}/") for a in container["command"][3:]]
    app = ControllerApp()
    app.initialize(args)
    settings = GpushareController(config=app.config)
    assert settings.group_bounds == {"students": STUDENT_BOUND}
    assert settings.group_quotas == {"students": 0.5} and settings.default_quota == 0
    assert settings.hub_url == "http://hub.jhub.svc:8081" and settings.port == 8081
    pods = KubernetesBackendConfig(config=app.config)
    assert (pods.image, pods.preload_interposer, pods.namespace) == ("img:2", False, "gpushare")
    service = objs[("Service", "gpushare-controller")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    # the per-user NetworkPolicies: on (networkPolicy.enabled), servers as the chart says, and
    # the controller admits its own pods by the Deployment's labels
    network = NetworkSettings.from_config(settings)
    assert settings.network_policies is True
    assert network.server_pod_selector == {"matchLabels": {"component": "singleuser-server"}}
    assert network.server_namespace_selector == {
        "matchLabels": {"kubernetes.io/metadata.name": "jhub"}
    }
    assert network.controller_pod_labels.items() <= labels.items()


# -- the controller away (last: it stops every replica) -------------------------------------------


async def test_controller_away_kernels_keep_running_starts_fail_with_the_reason(
    controllers: list[Controller],
    hub: Hub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    control_plane: ControlPlane,
) -> None:
    from test_kernels import execute

    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub.tokens["alice"])
    monkeypatch.delenv("KUBECONFIG", raising=False)
    urls = ",".join(c.url for c in controllers)
    server = await asyncio.to_thread(
        start_jupyter_server,
        tmp_path / "server",
        None,
        "kubernetes",
        extra=f"""
c.KubernetesBackendConfig.controller_url = {urls!r}
c.KubernetesBackendConfig.controller_retry_for = 3
c.KubernetesBackendConfig.lease_renew_interval = 2
""",
    )
    try:
        reply = await asyncio.to_thread(
            server.request, "POST", "/api/kernels", json={"name": "gpushare-k8s"}
        )
        assert reply.status_code == 201, reply.text + server.log_text()[-3000:]
        kernel_id = reply.json()["id"]
        for c in controllers:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGKILL)
                c.proc.wait()
        # the running kernel keeps running (the server talks to its pod directly) ...
        await asyncio.sleep(4)  # several polls of the restarter with no controller
        assert (await execute(server, kernel_id, "print(2 + 3)")).strip() == "5"
        # ... and stays reachable for alice's server: her NetworkPolicy outlives the controller
        from jupyter_gpushare.controller.network import policy_name

        kube = await connect(str(control_plane.kubeconfig("admin")))
        try:
            names = {p["metadata"]["name"] for p in await kube.list_network_policies(NAMESPACE)}
        finally:
            await kube.close()
        assert policy_name(manifests.owner_label("alice")) in names, names
        # ... and a new start fails within controller_retry_for, with the reason
        started = time.monotonic()
        reply = await asyncio.to_thread(
            server.request, "POST", "/api/kernels", json={"name": "gpushare-k8s"}
        )
        assert reply.status_code == 503, reply.text
        assert (
            "controller" in reply.json()["message"]
            and "cannot be reached" in reply.json()["message"]
        ), reply.text
        assert time.monotonic() - started < 30
        status = await asyncio.to_thread(server.request, "GET", f"/api/kernels/{kernel_id}")
        assert status.status_code == 200 and status.json()["execution_state"] != "dead"
    finally:  # a server that dies: the reconcilers reclaim its kernel once its Lease expires
        stop_process(server.proc, signal.SIGKILL)
