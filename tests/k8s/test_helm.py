"""The Helm chart (deploy/helm/jupyter-gpushare) rendered by a real ``helm``: it lints, renders
the objects of the tested plain manifests in deploy/ with its defaults, its values change what
they should, the API server accepts what it renders and authorizes exactly deploy/'s rules, and
its DaemonSet runs a working node daemon on a fake node (the node agent).

``helm`` comes from ``.ci/setup.d/helm.sh`` (cached in ``$GPUSHARE_HELM_CACHE``, default
/var/cache/gpushare-helm), or is ``$GPUSHARE_HELM``, or on PATH. Under CI (``CI=true``) a
missing binary FAILS these tests; elsewhere they skip and say why.

Where it runs: the real API server; the DaemonSet it renders runs on the kubelet double
(``node_agent.py``: pods are local processes, at 127.0.0.1) (two GPU nodes). helm install on the
real node: test_real_node_chart.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from jupyter_gpushare.cli import build_parser
from jupyter_gpushare.daemon.env import sim_state_path
from jupyter_gpushare.k8s.config import KubernetesBackendConfig
from jupyter_gpushare.k8s.device_plugin.plugin import PluginSettings
from jupyter_gpushare.k8s.manifests import KernelPodRequest, PodSettings, kernel_environment

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "jupyter-gpushare"
HELM_CACHE = Path(os.environ.get("GPUSHARE_HELM_CACHE", "/var/cache/gpushare-helm")) / "helm"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
DAEMONSET = DEPLOY / "daemonset.yaml"
Obj = dict[str, Any]


def helm_binary() -> str | None:
    for candidate in (os.environ.get("GPUSHARE_HELM"), str(HELM_CACHE), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="module")
def helm() -> str:
    binary = helm_binary()
    if binary is None:
        reason = f"no helm binary (run .ci/setup.d/helm.sh as root to cache it in {HELM_CACHE})"
        if IN_CI:
            pytest.fail(f"{reason} (CI)")
        pytest.skip(reason)
    version = subprocess.run(
        [binary, "version", "--short"], capture_output=True, text=True, check=True
    ).stdout
    assert version.startswith("v3."), version
    return binary


def render(
    helm: str,
    tmp_path: Path,
    values: dict[str, Any] | None = None,
    namespace: str = "gpushare",
    extra: Sequence[str] = (),
) -> list[Obj]:
    """``helm template`` (CRDs included) with ``values`` as a values file; parsed objects."""
    args = [helm, "template", "gs", str(CHART), "--namespace", namespace, "--include-crds", *extra]
    if values is not None:
        path = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["--values", str(path)]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def deploy_objects() -> list[Obj]:
    files = [*sorted((DEPLOY / "crds").glob("*.yaml")), *sorted(DEPLOY.glob("*.yaml"))]
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


def key(obj: Obj) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def by_key(objs: list[Obj]) -> dict[tuple[str, str, str], Obj]:
    return {key(o): o for o in objs}


def one(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, [key(o) for o in found]
    return found[0]


def container(pod_spec: Obj, name: str) -> Obj:
    return next(
        c
        for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
        if c["name"] == name
    )


def daemon_args(ds: Obj) -> argparse.Namespace:
    """The daemon container's command, parsed by the real ``jupyter gpushare`` parser (an
    unknown flag fails here as it would in the pod)."""
    command = container(ds["spec"]["template"]["spec"], "daemon")["command"]
    assert command[:2] == ["jupyter", "gpushare"], command
    return build_parser().parse_args(command[2:])


def flags(command: list[str]) -> list[str]:
    """``--flag=value`` and ``--flag value`` as one form."""
    return [
        part for arg in command for part in (arg.split("=", 1) if arg.startswith("--") else [arg])
    ]


def substance(obj: Obj) -> Obj:
    """What an object does, without the chart's bookkeeping labels: metadata is reduced to kind,
    name and namespace; a DaemonSet's pod template keeps its spec with commands in one form
    (the daemon's parsed by its real parser) and env as a mapping."""
    obj = copy.deepcopy(obj)
    obj["metadata"] = {k: v for k, v in obj["metadata"].items() if k in ("name", "namespace")}
    if obj["kind"] != "DaemonSet":
        return obj
    args = daemon_args(obj)
    spec = obj["spec"]
    selector = spec["selector"]["matchLabels"]
    labels = spec["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), (selector, labels)
    spec["template"]["metadata"] = {}
    pod = spec["template"]["spec"]
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        c["command"] = vars(args) if c["name"] == "daemon" else flags(c["command"])
        c["env"] = {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}
    return obj


# -- lint and defaults ----------------------------------------------------------------------------


def test_helm_lint(helm: str, tmp_path: Path) -> None:
    for extra in ([], ["--set", "daemon.simulate=2xA100,namespace=demo,daemon.metrics.port=9400"]):
        out = subprocess.run(
            [helm, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_defaults_render_deploy(helm: str, tmp_path: Path) -> None:
    """Default values, namespace gpushare: the objects of deploy/ (CRD, RBAC, DaemonSet), equal
    in substance, and nothing else."""
    plain = by_key(deploy_objects())
    chart = by_key(render(helm, tmp_path))
    assert DAEMONSET.exists(), "deploy/daemonset.yaml is missing"
    assert sorted(chart) == sorted(plain)
    for k, obj in plain.items():
        assert substance(chart[k]) == substance(obj), k


def test_rbac_is_least_privilege(helm: str, tmp_path: Path) -> None:
    for namespace in ("gpushare", "other"):
        for doc in render(helm, tmp_path, namespace=namespace):
            for rule in doc.get("rules", []):
                assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
            assert doc.get("roleRef", {}).get("name") not in ("cluster-admin", "admin", "edit")


def test_kernel_pods_and_daemon_agree_on_paths(helm: str, tmp_path: Path) -> None:
    """What the server puts in kernel pods (KubernetesBackendConfig defaults → manifests) meets
    what the chart's daemon serves: the socket, the shared-memory files the daemon hands out,
    the simulator's state, the interposer's host directory."""
    ds = one(render(helm, tmp_path), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    args = daemon_args(ds)
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for m in container(pod, "daemon")["volumeMounts"]}
    # the hostPath mode (device_plugin=False) mounts these directories itself
    settings = PodSettings.from_config(
        KubernetesBackendConfig(namespace="gpushare", device_plugin=False)
    )
    # the device plugin (default): the kubelet's directory mounted, the interposer directory
    # it hands kernel pods is the one the init container fills
    assert args.device_plugin and args.share_resource == "gpushare.jupyter.org/gpu-share"
    assert volumes[mounts[str(args.kubelet_socket.parent)]] == "/var/lib/kubelet/device-plugins"
    # the kubelet's PodResources socket, which the plugin asks before a container starts,
    # beside it and read-only
    pod_resources = PluginSettings("n", "gpushare", args.kubelet_socket).pod_resources_socket
    assert volumes[mounts[str(pod_resources.parent)]] == "/var/lib/kubelet/pod-resources"
    [ro] = [m for m in container(pod, "daemon")["volumeMounts"] if m["name"] == "pod-resources"]
    assert ro.get("readOnly") is True
    assert str(args.interposer_dir) == settings.interposer_host_path

    mount = Path(settings.socket_mount_path)
    assert str(args.socket) == settings.socket_path
    assert volumes[mounts[str(mount)]] == settings.socket_host_path
    # the lease memory is the daemon's alone: outside every directory a kernel pod mounts (the
    # pod gets its own share's memory as descriptors over the socket)
    assert not args.state_dir.is_relative_to(mount)
    state_mount = next(m for m in mounts if args.state_dir.is_relative_to(m))
    state_host = Path(volumes[mounts[state_mount]])
    assert not state_host.is_relative_to(settings.socket_host_path)
    assert not Path(settings.socket_host_path).is_relative_to(state_host)
    installer = container(pod, "install-interposer")
    lib_volume = next(
        m["name"] for m in installer["volumeMounts"] if m["mountPath"] == installer["command"][-1]
    )
    assert volumes[lib_volume] == settings.interposer_host_path

    request = KernelPodRequest(
        name="k",
        namespace="gpushare",
        kernel_id="k",
        allocation_id="a-0",
        node="n",
        gpus=["GPU-0"],
        command=["python"],
        env={},
        server_id="s",
        owner={},
        simulated_devices="A100|GPU-0|1|1",
    )
    kernel_env = kernel_environment(request, settings)
    daemon_env = {e["name"]: e.get("value") for e in container(pod, "daemon").get("env", [])}
    assert "GPUSHARE_SIM_STATE" not in daemon_env
    assert kernel_env["GPUSHARE_SIM_STATE"] == str(sim_state_path(args.socket))
    assert kernel_env["LD_PRELOAD"].startswith(settings.interposer_mount_path)


# -- values ---------------------------------------------------------------------------------------


def test_values_change_what_they_should(helm: str, tmp_path: Path) -> None:
    default = render(helm, tmp_path)
    values = {
        "namespace": "science",
        "image": {
            "repository": "registry.example.org/gpushare",
            "tag": "9.9.9",
            "pullPolicy": "Always",
        },
        "daemon": {
            "simulate": "2xT4",
            "nodeSelector": {"pool": "demo"},
            "quantumMs": 10,
            "windowMs": 2000,
            "metrics": {"port": 9500},
            "socketHostPath": "/var/gs",
        },
    }
    objs = render(helm, tmp_path, values, namespace="ignored-release-ns")

    # namespace: every namespaced object and every subject; cluster-wide names get a prefix
    assert {k[1] for k in map(key, objs) if k[1]} == {"science"}
    cluster = [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert cluster and all(o["metadata"]["name"].startswith("science-") for o in cluster)
    rendered = {(o["kind"], o["metadata"]["name"]) for o in objs}
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    for binding in (o for o in objs if o["kind"].endswith("Binding")):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in rendered
        assert all(
            s["namespace"] == "science" and s["name"] in accounts for s in binding["subjects"]
        )
    rules = {
        o["metadata"]["name"].removeprefix("science-"): o["rules"] for o in objs if "rules" in o
    }
    assert rules == {o["metadata"]["name"]: o["rules"] for o in default if "rules" in o}

    ds = one(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    images = {c["image"] for c in [*pod["initContainers"], *pod["containers"]]}
    assert images == {"registry.example.org/gpushare:9.9.9"}
    assert {c["imagePullPolicy"] for c in pod["containers"]} == {"Always"}

    args = daemon_args(ds)
    assert args.simulate == "2xT4" and not args.simulate_from_node_label
    assert (args.quantum_ms, args.window_ms, args.metrics_port) == (10, 2000, 9500)
    assert args.metrics_host == "0.0.0.0"
    assert container(pod, "daemon")["ports"] == [{"name": "metrics", "containerPort": 9500}]
    env = {e["name"] for e in container(pod, "daemon")["env"]}
    assert "NVIDIA_VISIBLE_DEVICES" not in env  # no NVML on a simulated cluster
    assert pod["nodeSelector"] == {"pool": "demo"}
    assert "affinity" not in pod  # simulate: no GPU-node placement
    hosts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert hosts["socket"] == "/var/gs"

    default_pod = one(default, "DaemonSet")["spec"]["template"]["spec"]
    default_args = daemon_args(one(default, "DaemonSet"))
    assert default_args.simulate is None and default_args.simulate_from_node_label
    # metrics on by default (issue 15); port 0 turns them off, and nothing may connect then
    assert default_args.metrics_port == 9401
    ports = container(default_pod, "daemon")["ports"]
    assert ports == [{"name": "metrics", "containerPort": 9401}]
    off = render(helm, tmp_path, {"daemon": {"metrics": {"port": 0}}})
    assert daemon_args(one(off, "DaemonSet")).metrics_port == 0  # the daemon's default: off
    assert "ports" not in container(one(off, "DaemonSet")["spec"]["template"]["spec"], "daemon")
    node_policy = by_key(off)[("NetworkPolicy", "gpushare", "gpushare-node")]
    assert node_policy["spec"]["ingress"] == []
    assert not by_key(render(helm, tmp_path, {"networkPolicy": {"enabled": False}})).keys() & {
        ("NetworkPolicy", "gpushare", "gpushare-node"),
        ("NetworkPolicy", "gpushare", "gpushare-kernels"),
    }
    assert "nodeSelector" not in default_pod and "affinity" in default_pod
    assert one(default, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(
        ":" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    )


def test_metrics_scrapers_and_the_controller_token(helm: str, tmp_path: Path) -> None:
    """Trust (issue 15): by default only Prometheus pods in the namespace the admin names (the
    API server's kubernetes.io/metadata.name label, which no user can set) reach the daemons'
    metrics, never a pod labelled prometheus in any namespace; an empty metricsFrom admits
    nobody (a rule without ``from`` would admit everyone). The daemon's token for the controller
    is a projected one made for the controller's audience, short-lived, mounted read-only where
    GPUSHARE_CONTROLLER_TOKEN_FILE says."""
    from jupyter_gpushare.controller.usage import AUDIENCE
    from jupyter_gpushare.k8s.usage import CONTROLLER_TOKEN_ENV

    policy = by_key(render(helm, tmp_path))[("NetworkPolicy", "gpushare", "gpushare-node")]
    peers = [p for rule in policy["spec"]["ingress"] for p in rule["from"]]
    assert peers, policy
    for peer in peers:  # every peer pins a namespace by its name label
        names = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        assert names == "monitoring", peer
    mine = render(
        helm,
        tmp_path,
        {
            "networkPolicy": {
                "metricsFrom": [
                    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}
                ]
            }
        },
    )
    policy = by_key(mine)[("NetworkPolicy", "gpushare", "gpushare-node")]
    assert policy["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}
    ]
    closed = render(helm, tmp_path, {"networkPolicy": {"metricsFrom": []}})
    assert by_key(closed)[("NetworkPolicy", "gpushare", "gpushare-node")]["spec"]["ingress"] == []

    for values, expiry in (
        (None, 600),
        ({"daemon": {"controllerTokenExpirationSeconds": 900}}, 900),
    ):
        pod = one(render(helm, tmp_path, values), "DaemonSet")["spec"]["template"]["spec"]
        daemon = container(pod, "daemon")
        path = Path({e["name"]: e.get("value") for e in daemon["env"]}[CONTROLLER_TOKEN_ENV])
        mount = next(m for m in daemon["volumeMounts"] if m["mountPath"] == str(path.parent))
        assert mount["readOnly"] is True
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        sources = volume["projected"]["sources"]
        assert sources == [
            {
                "serviceAccountToken": {
                    "audience": AUDIENCE,
                    "expirationSeconds": expiry,
                    "path": path.name,
                }
            }
        ]


def test_placement_values(helm: str, tmp_path: Path) -> None:
    """affinity: null keeps the GPU-node default, {} removes it, anything else replaces it;
    without simulateFromNodeLabel the demo-node term and flag are gone."""
    own = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["yes"]}]}
                ]
            }
        }
    }
    replaced = one(render(helm, tmp_path, {"daemon": {"affinity": own}}), "DaemonSet")
    assert replaced["spec"]["template"]["spec"]["affinity"] == own
    removed = one(render(helm, tmp_path, {"daemon": {"affinity": {}}}), "DaemonSet")
    assert "affinity" not in removed["spec"]["template"]["spec"]
    real_only = one(
        render(helm, tmp_path, {"daemon": {"simulateFromNodeLabel": False}}), "DaemonSet"
    )
    terms = real_only["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
            ]
        }
    ]
    assert not daemon_args(real_only).simulate_from_node_label
    no_reconciler = render(helm, tmp_path, {"reconciler": {"enabled": False}})
    names = [
        c["name"] for c in one(no_reconciler, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    ]
    assert names == ["daemon"]


# -- the API server -------------------------------------------------------------------------------

NAMESPACE = "gpushare-helm"
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")


@pytest.fixture(scope="module")
def installed(
    helm: str, tmp_path_factory: pytest.TempPathFactory, control_plane: Any
) -> Iterator[tuple[Any, list[Obj]]]:
    """The chart rendered for namespace gpushare-helm, created through the admin's client. The
    DaemonSet is created with dryRun=All (validated and admitted, never stored): the test that
    runs the daemon creates its own, pinned to its own node."""
    from kubernetes import client, config, utils

    api = config.new_client_from_config(str(control_plane.kubeconfig("admin")))
    objs = render(helm, tmp_path_factory.mktemp("helm"), namespace=NAMESPACE)
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    try:
        for obj in objs:
            dry = {"dry_run": "All"} if obj["kind"] == "DaemonSet" else {}
            try:
                utils.create_from_dict(api, obj, namespace=NAMESPACE, **dry)
            except utils.FailToCreateError as exc:
                # the CRD is cluster-wide and deploy/ created it already
                if obj["kind"] != "CustomResourceDefinition" or any(
                    e.status != 409 for e in exc.api_exceptions
                ):
                    raise
        yield api, objs
    finally:
        rbac = client.RbacAuthorizationV1Api(api)
        for obj in objs:
            with contextlib.suppress(client.ApiException):
                if obj["kind"] == "ClusterRole":
                    rbac.delete_cluster_role(obj["metadata"]["name"])
                elif obj["kind"] == "ClusterRoleBinding":
                    rbac.delete_cluster_role_binding(obj["metadata"]["name"])
        core.delete_namespace(NAMESPACE)


def test_api_server_accepts_the_chart(installed: tuple[Any, list[Obj]]) -> None:
    from kubernetes import client

    api, objs = installed
    ds = one(objs, "DaemonSet")
    # the daemon's pod as the DaemonSet controller would create it, through pod admission
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "gpushare-node-",
            "namespace": NAMESPACE,
            "labels": ds["spec"]["template"]["metadata"]["labels"],
        },
        "spec": ds["spec"]["template"]["spec"],
    }
    with pytest.raises(client.ApiException) as stored_ds:  # dry run: validated, not stored
        client.AppsV1Api(api).read_namespaced_daemon_set("gpushare-node", NAMESPACE)
    assert stored_ds.value.status == 404
    admitted = client.CoreV1Api(api).create_namespaced_pod(NAMESPACE, pod, dry_run="All")
    assert admitted.spec.host_pid is True
    assert admitted.spec.service_account_name == "gpushare-daemon"
    rbac = client.RbacAuthorizationV1Api(api)
    stored = rbac.read_namespaced_role("jupyter-gpushare", NAMESPACE)
    assert [sorted(r.verbs) for r in stored.rules] == [
        sorted(r["verbs"]) for r in by_key(objs)[("Role", NAMESPACE, "jupyter-gpushare")]["rules"]
    ]


def allowed(api: Any, account: str, namespace: str, group: str, resource: str, verb: str) -> bool:
    from kubernetes import client

    review = client.AuthorizationV1Api(api).create_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:{NAMESPACE}:{account}",
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{NAMESPACE}",
                    "system:authenticated",
                ],
                "resourceAttributes": {
                    "namespace": namespace,
                    "group": group,
                    "resource": resource,
                    "verb": verb,
                },
            },
        }
    )
    return bool(review.status.allowed)


def granted(plain: list[Obj], account: str) -> dict[tuple[str, str], set[str]]:
    """(group, resource) → verbs that deploy/rbac.yaml grants ``account``, through any binding."""
    roles = {(o["kind"], o["metadata"]["name"]): o["rules"] for o in plain if "rules" in o}
    verbs: dict[tuple[str, str], set[str]] = {}
    for binding in (o for o in plain if o["kind"].endswith("Binding")):
        if any(s["name"] == account for s in binding["subjects"]):
            for rule in roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        verbs.setdefault((group, resource), set()).update(rule["verbs"])
    return verbs


def test_installed_rbac_grants_exactly_deploys_rules(installed: tuple[Any, list[Obj]]) -> None:
    """The API server's own answer (SubjectAccessReview) for the chart's service accounts, verb
    by verb, equals what deploy/rbac.yaml grants — in the chart's namespace and nowhere else."""
    api, _ = installed
    plain = deploy_objects()
    deadline = time.monotonic() + 10  # the RBAC authorizer's cache follows the new objects
    for account in ("jupyter-gpushare", "gpushare-daemon"):
        rules = granted(plain, account)
        resources = {
            ("", "pods"),
            ("", "secrets"),
            ("", "nodes"),
            ("coordination.k8s.io", "leases"),
            ("gpushare.jupyter.org", "gpuledgers"),
            ("", "configmaps"),
        }
        assert set(rules) <= resources
        for group, resource in sorted(resources):
            scope = "" if resource == "nodes" else NAMESPACE
            for verb in VERBS:
                want = verb in rules.get((group, resource), set())
                while (
                    got := allowed(api, account, scope, group, resource, verb)
                ) != want and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert got == want, (account, group, resource, verb)
            if scope and rules.get((group, resource)):
                # namespaced rights stay in the chart's namespace
                verb = sorted(rules[(group, resource)])[0]
                assert not allowed(api, account, "default", group, resource, verb)


def test_helm_install_and_uninstall(helm: str, control_plane: Any) -> None:
    """``helm install`` itself against the API server (the chart's CRD is already there: helm
    skips it), its NOTES, and ``helm uninstall`` removing the cluster-wide objects. The
    DaemonSet's nodeSelector matches no node, so no daemon pod is scheduled."""
    from kubernetes import client, config

    namespace = "gpushare-helm-install"
    home = control_plane.workdir / "helm"
    env = {
        **os.environ,
        "KUBECONFIG": str(control_plane.kubeconfig("admin")),
        **{f"HELM_{d}_HOME": str(home / d.lower()) for d in ("CACHE", "CONFIG", "DATA")},
    }
    api = config.new_client_from_config(str(control_plane.kubeconfig("admin")))
    rbac = client.RbacAuthorizationV1Api(api)
    try:
        install = subprocess.run(
            [
                helm,
                "install",
                "gs",
                str(CHART),
                "--namespace",
                namespace,
                "--create-namespace",
                "--set",
                "daemon.nodeSelector.gpushare-test/no-such-node=true",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert install.returncode == 0, install.stdout + install.stderr
        assert f'c.KubernetesBackendConfig.namespace = "{namespace}"' in install.stdout
        notes = " ".join(install.stdout.split())
        assert "serves Prometheus metrics on port 9401" in notes, install.stdout
        assert "Scrape with honor_labels: true" in notes
        assert 'kernel pods admit only the Jupyter server pods {"namespaceSelector"' in notes
        ds = client.AppsV1Api(api).read_namespaced_daemon_set("gpushare-node", namespace)
        assert ds.spec.template.spec.host_pid is True
        assert ds.spec.template.spec.node_selector == {"gpushare-test/no-such-node": "true"}
        assert rbac.read_cluster_role(f"{namespace}-gpushare-node-reader").rules[0].verbs == [
            "get",
            "list",
            "watch",
        ]
    finally:
        uninstall = subprocess.run(
            [helm, "uninstall", "gs", "--namespace", namespace],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(api).delete_namespace(namespace)
    assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr
    with pytest.raises(client.ApiException) as gone:
        rbac.read_cluster_role(f"{namespace}-gpushare-node-reader")
    assert gone.value.status == 404


# -- the chart's daemon on a node -----------------------------------------------------------------

NODE = "helm-node-1"


def daemon_kubeconfig(api: Any, control_plane: Any, path: Path) -> Path:
    """A kubeconfig with a token of the chart's daemon service account (TokenRequest): what
    the kubelet projects into the pod."""
    from kubernetes import client

    request = client.CoreV1Api(api).create_namespaced_service_account_token(
        "gpushare-daemon",
        NAMESPACE,
        {"spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}},
    )
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "daemon",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {
                            "server": control_plane.server_url,
                            "certificate-authority": str(control_plane.ca_file),
                        },
                    }
                ],
                "users": [{"name": "daemon", "user": {"token": request.status.token}}],
                "contexts": [{"name": "daemon", "context": {"cluster": "local", "user": "daemon"}}],
            }
        )
    )
    path.chmod(0o600)
    return path


def until(what: str, predicate: Any, log: Path, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(
                f"{what} not within {timeout:.0f} s; node agent log:\n"
                + log.read_text(errors="replace")[-4000:]
            )
        time.sleep(0.2)
    return value


@pytest.mark.timeout(180)
def test_chart_daemon_runs_on_a_node(
    helm: str, tmp_path: Path, control_plane: Any, installed: tuple[Any, list[Obj]]
) -> None:
    """The chart's DaemonSet (simulate 1xT4, pinned to a node of its own) run by the node
    agent under the chart's daemon service account: the init container installs the interposer
    into the host path, the daemon serves its socket in the socket host path, publishes the
    node's GPUs on the Node (the chart's ClusterRole) and follows the namespace's GpuLedger (the
    chart's Role); both containers run."""
    import asyncio

    from kubernetes import client
    from servers import spawn, stop_process

    from jupyter_gpushare.daemon.client import DaemonClient
    from jupyter_gpushare.inventory import TypeAliases
    from jupyter_gpushare.k8s.client import connect
    from jupyter_gpushare.k8s.ledger import KubernetesLedger
    from jupyter_gpushare.k8s.manifests import gpus_from_node
    from jupyter_gpushare.ledger import Allocation
    from jupyter_gpushare.share import ShareSpec

    api, _ = installed
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    ds = one(
        render(
            helm,
            tmp_path,
            {"daemon": {"simulate": "1xT4", "nodeSelector": {"kubernetes.io/hostname": NODE}}},
            namespace=NAMESPACE,
        ),
        "DaemonSet",
    )
    kubeconfig = daemon_kubeconfig(api, control_plane, tmp_path / "kubeconfig-daemon")
    # short: the socket's path must fit a sockaddr_un (108 bytes)
    workdir = Path(tempfile.mkdtemp(prefix="gs-helm-", dir="/tmp"))
    log = tmp_path / "node-agent.log"
    lib_on_host = not Path("/opt/gpushare/lib").exists()
    agent = spawn(
        [
            sys.executable,
            str(Path(__file__).with_name("node_agent.py")),
            "--kubeconfig",
            str(control_plane.kubeconfig("admin")),
            "--namespace",
            NAMESPACE,
            "--workdir",
            str(workdir),
            f"--node={NODE}",
            f"--service-account={NAMESPACE}/gpushare-daemon={kubeconfig}",
        ],
        log,
    )
    try:
        until("node agent", lambda: "node agent ready" in log.read_text(errors="replace"), log)
        client.AppsV1Api(api).create_namespaced_daemon_set(NAMESPACE, ds)
        host = workdir / NODE / "host"
        daemon = DaemonClient(host / "run" / "gpushare" / "daemon.sock")
        until("the daemon's socket", daemon.alive, log)
        if lib_on_host:  # else the node agent maps the real /opt/gpushare/lib
            assert (host / "opt" / "gpushare" / "lib" / "libgpushare.so").is_file()
            assert (host / "opt" / "gpushare" / "lib" / "sim" / "libcuda.so.1").is_file()

        def published() -> list[Any]:
            node = api.sanitize_for_serialization(core.read_node(NODE))
            return gpus_from_node(node, TypeAliases())

        gpus = until("the node's GPUs", published, log)
        assert [(g.type, g.simulated) for g in gpus] == [("T4", True)]

        def running() -> bool:
            pods = core.list_namespaced_pod(NAMESPACE, field_selector=f"spec.nodeName={NODE}")
            return any(
                p.status.phase == "Running"
                and all(c.state.running for c in p.status.container_statuses or [])
                and len(p.status.container_statuses or []) == 2
                for p in pods.items
            )

        until("the daemon pod running", running, log)

        allocation = Allocation(
            id=Allocation.new_id(),
            node=NODE,
            gpus=(gpus[0].uuid,),
            memory=2**30,
            spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5, gpu_memory=2**30, gpu_type="T4"),
            backend="kubernetes",
        )

        async def record() -> None:
            kube = await connect(str(control_plane.kubeconfig("admin")))
            try:
                ledger = KubernetesLedger(kube, NAMESPACE)
                snap = await ledger.snapshot()
                assert await ledger.compare_and_swap(
                    NODE, snap.versions.get(NODE, 0), [*snap.on_node(NODE), allocation]
                )
            finally:
                await kube.close()

        asyncio.run(record())
        seen = until(
            "the record at the daemon", lambda: daemon.status(allocation.id).get("ok"), log
        )
        assert seen
        assert daemon.status(allocation.id)["allocations"][0]["limit"] == 0.5
    finally:
        with contextlib.suppress(client.ApiException):
            apps.delete_namespaced_daemon_set("gpushare-node", NAMESPACE)
        stop_process(agent)
        for pod in core.list_namespaced_pod(NAMESPACE).items:
            with contextlib.suppress(client.ApiException):
                core.delete_namespaced_pod(pod.metadata.name, NAMESPACE, grace_period_seconds=0)
        with contextlib.suppress(client.ApiException):
            core.delete_node(NODE)
        shutil.rmtree(workdir, ignore_errors=True)
