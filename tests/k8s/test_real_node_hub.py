"""JupyterHub with KubeSpawner and the project's GPU form (``jupyter_gpushare.hub.GpuProfiles``)
on the REAL node, the chart in controller mode beside it.

The Hub runs on this host (dummy authenticator) and spawns the user's server as a pod of the
kernel image (``jupyterhub-singleuser``, uid 1000, no service-account token) on the real kubelet;
the server reaches the Hub's API at the bridge's address and the controller by its Service DNS
name (``real_node.ServiceDNS``). There is no configurable-http-proxy and no browser here: the
form is submitted over HTTP as a browser would (login, the spawn form's fields), and the user's
server is reached at its pod IP, where a gpushare kernel is started through its REST API (a pod
through the controller) and run over its websocket; Chromium driving Lab on this Hub is not done.
The server's gpushare settings are the file deploy/z2jh/values.yaml mounts (its mountPath and
data, read from there).

Where it runs: the real node (``real_node.py``).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import secrets
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from cluster import free_port
from real_node import GATEWAY, KERNEL_IMAGE, NODE_IMAGE, RealNode, product_images
from servers import spawn, stop_process
from test_real_node_chart import NS, helm, install_chart, unavailable, wait

pytestmark = pytest.mark.timeout(600)

HUB_NS = "jhub"
Z2JH_VALUES = Path(__file__).resolve().parents[2] / "deploy" / "z2jh" / "values.yaml"

CONFIG = """
from jupyterhub.proxy import Proxy
from jupyter_gpushare.hub import GpuProfiles, ledger_inventory


class NoProxy(Proxy):
    should_start = False

    async def add_route(self, routespec, target, data):
        pass

    async def delete_route(self, routespec):
        pass

    async def get_all_routes(self):
        return {{}}


async def inventory(spawner):
    from jupyter_gpushare.k8s.ledger import cluster_ledger

    async with cluster_ledger({ns!r}) as ledger:
        return await ledger_inventory(ledger)(spawner)


c.JupyterHub.proxy_class = NoProxy
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {{"alice"}}
c.JupyterHub.hub_bind_url = "http://{gateway}:{port}"
c.JupyterHub.hub_connect_url = "http://{gateway}:{port}"
c.JupyterHub.bind_url = "http://127.0.0.1:{proxy_port}"
c.JupyterHub.db_url = "sqlite:///{root}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{root}/cookie_secret"
c.JupyterHub.pid_file = "{root}/hub.pid"
c.JupyterHub.services = [{{"name": "tests", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "tests", "scopes": ["admin:users", "tokens", "admin:servers"],
                            "services": ["tests"]}}]
c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
c.KubeSpawner.namespace = {hub_ns!r}
c.KubeSpawner.image = {image!r}
c.KubeSpawner.image_pull_policy = "IfNotPresent"
c.KubeSpawner.cmd = ["jupyterhub-singleuser"]
c.KubeSpawner.uid = 1000
c.KubeSpawner.gid = 100
c.KubeSpawner.fs_gid = 100
c.KubeSpawner.start_timeout = 120
c.KubeSpawner.http_timeout = 120
c.KubeSpawner.automount_service_account_token = False
c.KubeSpawner.cpu_guarantee = 0.05
c.KubeSpawner.mem_guarantee = "64M"
c.KubeSpawner.environment = {{
    "GPUSHARE_CONTROLLER_URL": "http://gpushare-controller.{ns}.svc:8081",
}}
c.KubeSpawner.volumes = [{{"name": "gs", "configMap": {{"name": "gpushare-server-config"}}}}]
c.KubeSpawner.volume_mounts = [{{"name": "gs", "subPath": "config", "mountPath": {mount_path!r}}}]
gpu = GpuProfiles(config=c)
gpu.inventory = inventory
c.KubeSpawner.profile_list = gpu.profile_list
c.KubeSpawner.options_from_form = gpu.options_from_form
"""


class SpawningHub:
    def __init__(self, url: str, token: str, log: Path, node: RealNode) -> None:
        self.url = url
        self.token = token
        self.log = log
        self.node = node

    def api(self, method: str, path: str, **kw: Any) -> requests.Response:
        return requests.request(
            method,
            f"{self.url}/hub/api{path}",
            headers={"Authorization": f"token {self.token}"},
            timeout=60,
            **kw,
        )


@pytest.fixture(scope="module")
def spawning_hub(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if set(product_images()) != {NODE_IMAGE, KERNEL_IMAGE}:
        unavailable(f"no product images: found {sorted(product_images())}")
    root = tmp_path_factory.mktemp("hubk8s")
    port, token = free_port(), secrets.token_hex(16)
    hub_url = f"http://{GATEWAY}:{port}"
    try:
        install_chart(real_node, hub_url, root / "chart")
    except AssertionError as exc:
        pytest.fail(str(exc))
    real_node.create_namespace(HUB_NS)
    # the users' servers' config file exactly as deploy/z2jh/values.yaml mounts it (z2jh's
    # singleuser.extraFiles: data written as JSON to a Secret, a ConfigMap here, at mountPath)
    values = yaml.safe_load(Z2JH_VALUES.read_text())
    server_config = values["singleuser"]["extraFiles"]["gpushare-server-config"]
    from kubernetes import client, config

    assert real_node.plane is not None
    core = client.CoreV1Api(config.new_client_from_config(str(real_node.plane.kubeconfig())))
    core.create_namespaced_config_map(
        HUB_NS,
        {
            "metadata": {"name": "gpushare-server-config"},
            "data": {"config": json.dumps(server_config["data"])},
        },
    )
    (root / "jupyterhub_config.py").write_text(
        CONFIG.format(
            ns=NS,
            gateway=GATEWAY,
            port=port,
            proxy_port=free_port(),
            root=root,
            token=token,
            hub_ns=HUB_NS,
            image=KERNEL_IMAGE,
            mount_path=server_config["mountPath"],
        )
    )
    log = root / "hub.log"
    env = {
        **dict(__import__("os").environ),
        "KUBECONFIG": str(real_node.plane.kubeconfig()),
    }
    proc = spawn(
        [sys.executable, "-m", "jupyterhub", "-f", str(root / "jupyterhub_config.py")], log, env
    )
    hub = SpawningHub(hub_url, token, log, real_node)
    try:
        wait(
            lambda: requests.get(f"{hub_url}/hub/api/", timeout=3).status_code == 200,
            60,
            "JupyterHub",
        )
    except AssertionError:
        stop_process(proc)
        pytest.fail("JupyterHub did not start:\n" + log.read_text()[-4000:])
    yield hub
    hub.api("DELETE", "/users/alice/server")
    stop_process(proc)
    try:
        helm(real_node, "uninstall", "gpushare", "-n", NS)
    except AssertionError:
        pass


def test_a_user_spawns_on_the_real_node_with_the_gpu_form(spawning_hub: SpawningHub) -> None:
    """Real node: alice logs in, the spawn form offers the node's simulated A100s (from the
    cluster ledger), she submits a 0.25 share; KubeSpawner starts her server pod on the real
    kubelet (the kernel image, uid 1000) with that share as its default; her server answers at
    its pod IP; from it a gpushare kernel starts as a pod on the node (its ``GpuShare.backend``
    from the config file that deploy/z2jh/values.yaml mounts, read from that file) with her
    0.25 share, a cell runs over the pod network, ``%gpushare status`` names the share,
    ``%gpushare release`` frees it, shutdown removes the pod; stopping the server removes its
    pod."""
    hub = spawning_hub
    s = requests.Session()
    login = s.get(f"{hub.url}/hub/login", timeout=30)
    xsrf = s.cookies.get("_xsrf") or re.search(r'name="_xsrf" value="([^"]+)"', login.text)[1]
    reply = s.post(
        f"{hub.url}/hub/login",
        data={"username": "alice", "password": "x", "_xsrf": xsrf},
        timeout=30,
        allow_redirects=False,
    )
    assert reply.status_code in (302, 303), reply.text[-2000:]
    form = s.get(f"{hub.url}/hub/spawn", timeout=60)
    assert form.status_code == 200, form.text[-2000:]
    assert "A100" in form.text, form.text[-3000:]
    action = html.unescape(re.search(r'<form[^>]*action="([^"]+)"', form.text)[1])  # type: ignore[index]
    xsrf = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(action).query)).get("_xsrf", xsrf)
    fields = form_choices(form.text)
    share = next(v for v in fields["profile-option-gpu--gpu_share"] if "0.25" in v)
    gpu_type = next(v for v in fields["profile-option-gpu--gpu_type"] if "A100" in v)
    memory = fields["profile-option-gpu--gpu_memory"][0]
    spawned = s.post(
        urllib.parse.urljoin(f"{hub.url}/hub/spawn", action),
        data={
            "_xsrf": xsrf,
            "profile": "gpu",
            "profile-option-gpu--gpu_type": gpu_type,
            "profile-option-gpu--gpu_share": share,
            "profile-option-gpu--gpu_memory": memory,
        },
        timeout=120,
        allow_redirects=False,
    )
    assert spawned.status_code in (200, 302, 303), spawned.text[-3000:]

    def ready() -> Any:
        user = hub.api("GET", "/users/alice").json()
        server = (user.get("servers") or {}).get("")
        return server if server and server.get("ready") else None

    try:
        server = wait(ready, 180, "alice's server pod")
    except AssertionError as exc:
        logs = "\n".join(
            hub.node.pod_logs(HUB_NS, p.name.split("_")[1], "notebook")[-4000:]
            for p in Path("/var/log/pods").glob(f"{HUB_NS}_*")
        )
        raise AssertionError(f"{exc}\n{logs}\n{hub.log.read_text()[-1500:]}") from None
    from kubernetes import client, config

    assert hub.node.plane is not None
    core = client.CoreV1Api(config.new_client_from_config(str(hub.node.plane.kubeconfig())))
    [pod] = core.list_namespaced_pod(HUB_NS, label_selector="component=singleuser-server").items
    assert pod.spec.node_name == hub.node.name and pod.status.phase == "Running"
    assert pod.spec.containers[0].security_context.run_as_user == 1000
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert json.loads(env["GPUSHARE_DEFAULT_SHARE"])["gpu_request"] == 0.25, env
    # the user's server answers at its pod IP (the Hub's API reached from the pod)
    token = hub.api("POST", "/users/alice/tokens", json={"note": "test"}).json()["token"]
    status = requests.get(
        f"http://{pod.status.pod_ip}:8888{server['url'].rstrip('/')}/api/status",
        headers={"Authorization": f"token {token}"},
        timeout=60,
    )
    assert status.status_code == 200, status.text
    # a gpushare kernel from her server: a pod through the controller (GpuShare.backend from
    # the config file mounted as deploy/z2jh mounts it; with the file under
    # jupyter_server_config.d/ the backend stayed 'local' and the start was refused: no GPU in
    # the server's pod), a cell over the pod network, the share named and released, shutdown
    user_server = UserServer(
        f"http://{pod.status.pod_ip}:8888{server['url'].rstrip('/')}", token, hub, pod
    )
    reply = user_server.request("POST", "/api/kernels", json={"name": "gpushare-python"})
    assert reply.status_code == 201, reply.text + "\n" + user_server.log()
    kernel = str(reply.json()["id"])
    try:
        [kernel_pod] = wait(lambda: kernel_pods(core, kernel), 60, "the kernel's pod")
        assert kernel_pod.spec.node_name == hub.node.name, kernel_pod.spec
        [record] = [
            a
            for a in user_server.request("GET", "/gpushare/api/allocations").json()["allocations"]
            if a["kernel_id"] == kernel
        ]
        assert record["gpu_request"] == 0.25 and record["backend"] == "kubernetes", record
        assert run_cell(user_server, kernel, "print(6 * 7)").strip() == "42"
        text = run_cell(user_server, kernel, "%gpushare status")
        assert record["id"] in text, text
        text = run_cell(user_server, kernel, "%gpushare release")
        assert "Released" in text and record["id"] in text, text
        allocations = user_server.request("GET", "/gpushare/api/allocations").json()
        assert [a for a in allocations["allocations"] if a["kernel_id"] == kernel] == []
    finally:
        user_server.request("DELETE", f"/api/kernels/{kernel}")
    wait(lambda: not kernel_pods(core, kernel), 90, "the kernel's pod to go")
    allocations = user_server.request("GET", "/gpushare/api/allocations").json()["allocations"]
    assert [a for a in allocations if a["kernel_id"] == kernel] == []
    hub.api("DELETE", "/users/alice/server")
    wait(
        lambda: (
            not core.list_namespaced_pod(HUB_NS, label_selector="component=singleuser-server").items
        ),
        90,
        "alice's server pod to go",
    )


class UserServer:
    """The user's server at its pod IP, with a token of hers (what ``execute`` needs)."""

    def __init__(self, url: str, token: str, hub: SpawningHub, pod: Any) -> None:
        self.url, self.token, self.hub, self.pod = url, token, hub, pod

    def request(self, method: str, path: str, **kw: Any) -> requests.Response:
        return requests.request(
            method,
            self.url + path,
            headers={"Authorization": f"token {self.token}"},
            timeout=120,
            **kw,
        )

    def log(self) -> str:
        return self.hub.node.pod_logs(HUB_NS, self.pod.metadata.name, "notebook")[-4000:]


def kernel_pods(core: Any, kernel_id: str) -> list[Any]:
    from jupyter_gpushare.k8s import manifests

    return list(
        core.list_namespaced_pod(NS, label_selector=f"{manifests.LABEL_KERNEL}={kernel_id}").items
    )


def run_cell(server: UserServer, kernel_id: str, code: str, timeout: float = 90) -> str:
    from test_kernels import execute

    return asyncio.run(execute(server, kernel_id, code, timeout=timeout))


def form_choices(html: str) -> dict[str, list[str]]:
    """The values of each select/radio field of the spawn form, in order."""
    found: dict[str, list[str]] = {}
    for select in re.finditer(r'<select[^>]*name="([^"]+)"[^>]*>(.*?)</select>', html, re.S):
        found[select[1]] = re.findall(r'<option[^>]*value="([^"]*)"', select[2])
    for radio in re.finditer(r'<input[^>]*type="radio"[^>]*>', html):
        name = re.search(r'name="([^"]+)"', radio[0])
        value = re.search(r'value="([^"]*)"', radio[0])
        if name and value:
            found.setdefault(name[1], []).append(value[1])
    return found
