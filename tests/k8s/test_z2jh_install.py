"""The Zero-to-JupyterHub install of deploy/z2jh/README.md works as written (issue 15): one
namespace story — gpushare's objects in ``gpushare``, JupyterHub in ``jhub`` — that every file
agrees with. The commands are read from the README itself; the chart is rendered with their
flags and applied (server-side dry run) to the real API server in the documented namespace,
``hub-rbac.yaml`` is applied as documented and the hub's service account then reads the ledger
with the values' own ``hub.extraConfig``; every URL, namespace, port and label selector of the
NetworkPolicies and z2jh values is checked against the object it must meet (the chart's
controller, z2jh's user pods, the kernel pods of ``k8s/manifests.py``).

Where it runs: the real API server alone (no node): the README's objects are applied and
authorized.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_helm import DEPLOY, by_key, deploy_objects, one, render
from test_helm import helm as helm
from test_manifests import request
from traitlets.config import Config

from jupyter_gpushare.controller.config import GpushareController
from jupyter_gpushare.controller.network import NetworkSettings, user_policy
from jupyter_gpushare.k8s import manifests

Z2JH = DEPLOY / "z2jh"
README = Z2JH / "README.md"
Obj = dict[str, Any]
#: z2jh (KubeSpawner) labels of a user's server pod, and of the hub's pod
USER_POD = {"app": "jupyterhub", "component": "singleuser-server", "release": "jhub"}
HUB_POD = {"app": "jupyterhub", "component": "hub", "release": "jhub"}


def documented_commands() -> list[list[str]]:
    """The shell commands of the README's install block (indented, ``\\`` continuations)."""
    text = README.read_text()
    block = text[text.index("## Install") :].split("\n## ", 1)[0]
    lines = [ln[4:] for ln in block.splitlines() if ln.startswith("    ")]
    joined = " ".join(ln.rstrip("\\").strip() for ln in lines if not ln.startswith("#"))
    commands = re.split(r"\s(?=helm |kubectl )", joined)
    return [shlex.split(c) for c in commands]


def option(argv: list[str], *names: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a in names]


class Story:
    """The README's three steps, parsed."""

    def __init__(self) -> None:
        commands = documented_commands()
        assert [c[:3] for c in commands] == [
            ["helm", "install", "gpushare"],
            ["kubectl", "apply", "-f"],
            ["helm", "upgrade", "--install"],
        ], commands
        chart, rbac, hub = commands
        assert chart[3] == "deploy/helm/jupyter-gpushare" and "--create-namespace" in chart
        [self.namespace] = option(chart, "-n", "--namespace")
        self.chart_values: dict[str, Any] = {}
        for setting in option(chart, "--set"):
            path, value = setting.split("=", 1)
            node = self.chart_values
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = yaml.safe_load(value)
        assert option(rbac, "-f") == ["deploy/z2jh/hub-rbac.yaml"]
        assert not option(rbac, "-n", "--namespace"), "hub-rbac.yaml names its namespaces"
        [self.hub_namespace] = option(hub, "-n", "--namespace")
        assert option(hub, "-f") == ["deploy/z2jh/values.yaml"]
        self.z2jh = yaml.safe_load((Z2JH / "values.yaml").read_text())
        self.hub_rbac = [d for d in yaml.safe_load_all((Z2JH / "hub-rbac.yaml").read_text()) if d]


@pytest.fixture(scope="module")
def story() -> Story:
    return Story()


# -- label selectors, as the API server evaluates them -------------------------------------------


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_admits(peer: Obj, policy_namespace: str, namespace: str, labels: dict[str, str]) -> bool:
    """A NetworkPolicy peer (``from``/``to`` entry) matches a pod: no namespaceSelector means
    the policy's own namespace; namespaces carry ``kubernetes.io/metadata.name``."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector"), labels)


def rules_admit(
    rules: list[Obj], key: str, policy_ns: str, ns: str, labels: dict[str, str], port: int
) -> bool:
    for rule in rules:
        ports = rule.get("ports")
        if ports and not any(p.get("port") in (None, port) for p in ports):
            continue
        peers = rule.get(key)
        if not peers or any(peer_admits(p, policy_ns, ns, labels) for p in peers):
            return True
    return False


def test_the_selector_check_can_refuse() -> None:
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "jhub"}},
        "podSelector": {"matchLabels": {"component": "singleuser-server"}},
    }
    assert peer_admits(peer, "gpushare", "jhub", USER_POD)
    assert not peer_admits(peer, "gpushare", "jhub", HUB_POD)
    assert not peer_admits(peer, "gpushare", "other", USER_POD)
    assert not peer_admits({"podSelector": {}}, "gpushare", "jhub", USER_POD)
    assert not rules_admit(
        [{"from": [peer], "ports": [{"port": 8081}]}], "from", "g", "jhub", USER_POD, 9
    )


# -- the files agree -----------------------------------------------------------------------------


def kernel_pod_in(namespace: str) -> Obj:
    return manifests.kernel_pod(
        request(namespace=namespace), manifests.PodSettings(image="quay.io/jupyter/scipy-notebook")
    )


def test_urls_namespaces_and_rbac_agree(story: Story, helm: str, tmp_path: Path) -> None:
    objs = render(helm, tmp_path, story.chart_values, namespace=story.namespace)
    service = one(objs, "Service")
    [port] = service["spec"]["ports"]
    assert service["metadata"]["namespace"] == story.namespace
    url = f"http://{service['metadata']['name']}.{story.namespace}.svc:{port['port']}"
    assert story.z2jh["singleuser"]["extraEnv"]["GPUSHARE_CONTROLLER_URL"] == url
    config = one(objs, "ConfigMap")["data"]["controller_config.json"]
    assert f'"hub_url":"http://hub.{story.hub_namespace}.svc:8081"' in config
    assert f'"namespace":"{story.namespace}"' in config  # kernel pods go there
    # users' servers run with no Kubernetes rights (controller mode)
    single = story.z2jh["singleuser"]
    assert single["extraPodConfig"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in single
    # the hub reads Nodes and the GpuLedgers where the chart keeps them
    for doc in story.hub_rbac:
        if doc["kind"] in ("Role", "RoleBinding"):
            assert doc["metadata"]["namespace"] == story.namespace, doc
        for subject in doc.get("subjects", []):
            assert (subject["name"], subject["namespace"]) == ("hub", story.hub_namespace)
    extra = story.z2jh["hub"]["extraConfig"]["gpushare"]
    assert f'GPUSHARE_NAMESPACE = "{story.namespace}"' in extra
    # deploy/'s plain manifests are the chart's default rendering in this namespace
    assert {o["metadata"].get("namespace", story.namespace) for o in deploy_objects()} == {
        story.namespace
    }


def test_network_policies_let_exactly_the_right_pods_in(
    story: Story,
    helm: str,
    tmp_path: Path,
) -> None:
    objs = render(helm, tmp_path, story.chart_values, namespace=story.namespace)
    policies = by_key([o for o in objs if o["kind"] == "NetworkPolicy"])
    kernels = policies[("NetworkPolicy", story.namespace, "gpushare-kernels")]
    kernel = kernel_pod_in(story.namespace)
    other_kernel = kernel_pod_in(story.namespace)["metadata"]["labels"]
    labels = kernel["metadata"]["labels"]
    # the policy selects every kernel pod manifests.py builds, and nothing of the chart's own
    assert selects(kernels["spec"]["podSelector"], labels)
    controller = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    daemon = one(objs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert not selects(kernels["spec"]["podSelector"], controller)
    assert not selects(kernels["spec"]["podSelector"], daemon)
    assert kernels["spec"]["policyTypes"] == ["Ingress"]
    ingress = kernels["spec"]["ingress"]
    ns, hub_ns = story.namespace, story.hub_namespace
    port = 51234  # any of the kernel's ZMQ ports
    # controller mode: the chart's policy admits the controller only; the controller's policy
    # of each user (built from the chart's ConfigMap) admits that user's server pods: z2jh's
    # labels plus the owner label the Hub's GpuProfiles sets (netpol.py evaluates all of them
    # together: test_network_policies.py, test_controller.py)
    assert rules_admit(ingress, "from", ns, ns, controller, port)  # the controller
    assert not rules_admit(ingress, "from", ns, hub_ns, USER_POD, port)
    loaded = json.loads(one(objs, "ConfigMap")["data"]["controller_config.json"])
    settings = NetworkSettings.from_config(
        GpushareController(config=Config({"GpushareController": loaded["GpushareController"]}))
    )
    alice = manifests.owner_label("alice")
    mine = user_policy(alice, ns, settings)["spec"]
    assert selects(mine["podSelector"], {**labels, manifests.LABEL_OWNER: alice})
    assert not selects(mine["podSelector"], labels)  # another user's (or unlabelled) kernel
    alice_server = {**USER_POD, manifests.LABEL_OWNER: alice}
    assert rules_admit(mine["ingress"], "from", ns, hub_ns, alice_server, port)
    assert rules_admit(mine["ingress"], "from", ns, ns, controller, port)
    for namespace, pod in [
        (hub_ns, USER_POD),  # a server without the owner label
        (hub_ns, {**USER_POD, manifests.LABEL_OWNER: manifests.owner_label("bob")}),
        (hub_ns, HUB_POD),  # the hub
        (ns, other_kernel),  # another kernel
        (ns, daemon),
        ("default", alice_server),  # a lookalike elsewhere
        (ns, alice_server),
    ]:
        assert not rules_admit(ingress, "from", ns, namespace, pod, port), (namespace, pod)
        assert not rules_admit(mine["ingress"], "from", ns, namespace, pod, port), (namespace, pod)
    # z2jh lets users' servers out to the kernels (any port) and the controller's port only
    egress = story.z2jh["singleuser"]["networkPolicy"]["egress"]
    assert rules_admit(egress, "to", hub_ns, ns, labels, port)
    container_port = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert rules_admit(egress, "to", hub_ns, ns, controller, container_port[0]["containerPort"])
    assert not rules_admit(egress, "to", hub_ns, ns, controller, 22)
    assert not rules_admit(egress, "to", hub_ns, ns, daemon, 9401)
    # the controller may call the hub's API (z2jh's hub policy admits only its own namespace)
    hub_ingress = story.z2jh["hub"]["networkPolicy"]["ingress"]
    assert rules_admit(hub_ingress, "from", hub_ns, ns, controller, 8081)
    assert not rules_admit(hub_ingress, "from", hub_ns, ns, labels, 8081)  # not a kernel
    # the daemon: its metrics port, from Prometheus only
    node = policies[("NetworkPolicy", ns, "gpushare-node")]
    assert selects(node["spec"]["podSelector"], daemon)
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert rules_admit(node["spec"]["ingress"], "from", ns, "monitoring", prometheus, 9401)
    assert not rules_admit(node["spec"]["ingress"], "from", ns, "monitoring", prometheus, 22)
    assert not rules_admit(node["spec"]["ingress"], "from", ns, hub_ns, USER_POD, 9401)


# -- applied to the real API server ------------------------------------------------------------


def test_documented_install_on_the_api_server(
    story: Story,
    helm: str,
    tmp_path: Path,
    control_plane: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Step 1 (the chart, server-side dry run: the suite's fixture has already applied deploy/
    in this namespace, which the chart's defaults equal) and step 2 (hub-rbac.yaml, for real),
    then the hub's own identity reads the ledger through the values' ``hub.extraConfig``."""
    from cluster import NAMESPACE
    from kubernetes import client, config, utils

    assert story.namespace == NAMESPACE  # the suite's deploy/ is the documented story
    api = config.new_client_from_config(str(control_plane.kubeconfig("admin")))
    core = client.CoreV1Api(api)
    plain = by_key(deploy_objects())
    for obj in render(helm, tmp_path, story.chart_values, namespace=story.namespace):
        try:
            utils.create_from_dict(api, obj, namespace=story.namespace, dry_run="All")
        except utils.FailToCreateError as exc:
            key = (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
            # already there: what the fixture applied from deploy/ (equal: test_helm)
            assert key in plain and all(e.status == 409 for e in exc.api_exceptions), key
    with contextlib.suppress(client.ApiException):
        core.create_namespace({"metadata": {"name": story.hub_namespace}})
    created: list[Obj] = []
    try:
        with contextlib.suppress(client.ApiException):
            core.create_namespaced_service_account(
                story.hub_namespace, {"metadata": {"name": "hub"}}
            )
        for obj in story.hub_rbac:
            with contextlib.suppress(utils.FailToCreateError):
                utils.create_from_dict(api, obj)  # namespaces from the file, as documented
            created.append(obj)
        kubeconfig = hub_kubeconfig(api, control_plane, tmp_path / "hub.kubeconfig", story)
        # in its pod the hub has its account's token in-cluster; here: the default kubeconfig
        monkeypatch.setattr(
            "kubernetes_asyncio.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig)
        )
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        c = Config()
        scope: dict[str, Any] = {"c": c}
        exec(story.z2jh["hub"]["extraConfig"]["gpushare"], scope)
        inventory = c.GpuProfiles.inventory
        assert inventory is scope["gpushare_inventory"]
        deadline = time.monotonic() + 10  # the RBAC authorizer's cache follows new bindings
        while True:
            try:
                offers = asyncio.run(inventory(None))
                break
            except Exception as exc:  # 403 until the binding is seen
                assert time.monotonic() < deadline, f"the hub cannot read the ledger: {exc}"
                time.sleep(0.2)
        assert isinstance(offers, list)
        # and it can read only there: the same read in the hub's own namespace is refused
        scope["GPUSHARE_NAMESPACE"] = story.hub_namespace
        with pytest.raises(Exception, match=r"403|Forbidden"):
            asyncio.run(inventory(None))
    finally:
        rbac = client.RbacAuthorizationV1Api(api)
        for obj in created:
            name, ns = obj["metadata"]["name"], obj["metadata"].get("namespace")
            with contextlib.suppress(client.ApiException):
                if obj["kind"] == "ClusterRole":
                    rbac.delete_cluster_role(name)
                elif obj["kind"] == "ClusterRoleBinding":
                    rbac.delete_cluster_role_binding(name)
                elif obj["kind"] == "Role":
                    rbac.delete_namespaced_role(name, ns)
                else:
                    rbac.delete_namespaced_role_binding(name, ns)
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(story.hub_namespace)


def hub_kubeconfig(api: Any, control_plane: Any, path: Path, story: Story) -> Path:
    """A kubeconfig with a token of z2jh's hub service account (TokenRequest)."""
    from kubernetes import client

    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        "hub",
        story.hub_namespace,
        {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}},
    )
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "hub",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {
                            "server": control_plane.server_url,
                            "certificate-authority": str(control_plane.ca_file),
                        },
                    }
                ],
                "users": [{"name": "hub", "user": {"token": token.status.token}}],
                "contexts": [{"name": "hub", "context": {"cluster": "local", "user": "hub"}}],
            }
        )
    )
    path.chmod(0o600)
    return path
