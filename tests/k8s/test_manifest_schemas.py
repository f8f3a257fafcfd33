"""Every manifest gpushare ships or generates validates strictly (unknown fields are errors)
against the Kubernetes 1.30 and 1.34 OpenAPI schemas (``kubernetes-validate``, offline: it
bundles them): the chart rendered with default and non-default values (the controller and
NetworkPolicies included), deploy/*.yaml (RBAC, DaemonSet, CRD, NetworkPolicies), the z2jh
examples, and the kernel pods and Secrets of ``k8s/manifests.py``;
and ``jupyter gpushare k8s kernel-pod`` prints a kernel pod that passes Pod Security
"restricted" (issue 15).

Where it runs: no cluster: OpenAPI schemas of Kubernetes 1.30/1.34 (what 1.20 lacks: Pod Security
admission, CDI in device-plugin replies).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_helm import DEPLOY, deploy_objects, helm, render  # noqa: F401 - helm is a fixture
from test_manifests import OWNER, request

from jupyter_gpushare.cli import main
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.podsecurity import restricted_violations

VERSIONS = ("1.30", "1.34")
NON_DEFAULT = {
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
        "metrics": {"port": 9400},
        "runtimeClassName": "nvidia",
        "devicePlugin": {"enabled": False},
        "logLevel": "DEBUG",
        "extraArgs": ["--idle-timeout=30"],
    },
    "reconciler": {"enabled": False},
    "controller": {"enabled": True},
    "networkPolicy": {
        "servers": {
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a", "b"]}
                ]
            },
            "podSelector": {"matchLabels": {"app": "jupyter-server"}},
        },
        "metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
    },
}


def invalid(obj: dict[str, Any]) -> list[str]:
    """Validation errors of ``obj`` against each version (empty: valid everywhere)."""
    errors = []
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(
                f"{version} {obj['kind']}/{obj['metadata'].get('name')}: {path}: {exc.message}"
            )
    return errors


def test_the_validator_refuses_what_kubernetes_refuses() -> None:
    """Not a test that cannot fail: an unknown field, a wrong type and a missing name are
    errors in both versions."""
    pod = manifests.kernel_pod(request(), manifests.PodSettings(image="i"))
    assert invalid(pod) == []
    typo = yaml.safe_load(yaml.safe_dump(pod))
    typo["spec"]["securityContext"]["runAsNonroot"] = True
    wrong = yaml.safe_load(yaml.safe_dump(pod))
    wrong["spec"]["containers"][0]["securityContext"]["runAsUser"] = "1000"
    nameless = yaml.safe_load(yaml.safe_dump(pod))
    del nameless["spec"]["containers"][0]["name"]
    for bad in (typo, wrong, nameless):
        assert len(invalid(bad)) == len(VERSIONS), invalid(bad)


def test_deploy_files_and_z2jh_examples_validate() -> None:
    objs = deploy_objects()
    for path in sorted((DEPLOY / "z2jh").glob("*.yaml")):
        objs += [
            d
            for d in yaml.safe_load_all(path.read_text())
            if d and "apiVersion" in d and "kind" in d
        ]
    assert {
        "DaemonSet",
        "CustomResourceDefinition",
        "Role",
        "ServiceAccount",
        "NetworkPolicy",
        "ClusterRoleBinding",
    } <= {o["kind"] for o in objs}
    assert [e for o in objs for e in invalid(o)] == []


def test_z2jh_network_rules_validate() -> None:
    """The NetworkPolicy rules of deploy/z2jh/values.yaml, as z2jh renders them (its user pods'
    egress, the hub's ingress), are valid NetworkPolicy rules."""
    values = yaml.safe_load((DEPLOY / "z2jh" / "values.yaml").read_text())
    rules = {
        ("singleuser", "egress"): values["singleuser"]["networkPolicy"]["egress"],
        ("hub", "ingress"): values["hub"]["networkPolicy"]["ingress"],
    }
    for (component, direction), items in rules.items():
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": component, "namespace": "jhub"},
            "spec": {
                "podSelector": {"matchLabels": {"component": component}},
                "policyTypes": [direction.capitalize()],
                direction: items,
            },
        }
        assert items and invalid(policy) == [], (component, invalid(policy))
    broken = copy.deepcopy(rules[("singleuser", "egress")])
    broken[0]["from"] = broken[0].pop("to")  # an egress rule has no "from": refused
    policy["spec"] = {"podSelector": {}, "egress": broken}
    assert invalid(policy) != []


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["default", "non-default"])
def test_chart_renders_valid_objects(
    helm: str,  # noqa: F811
    tmp_path: Path,
    values: dict[str, Any] | None,
) -> None:
    objs = render(helm, tmp_path, values)
    assert {"DaemonSet", "CustomResourceDefinition", "NetworkPolicy"} <= {o["kind"] for o in objs}
    if values is NON_DEFAULT:
        assert {"Deployment", "Service", "ConfigMap"} <= {o["kind"] for o in objs}
    assert [e for o in objs for e in invalid(o)] == []


def test_kernel_pods_and_secrets_validate() -> None:
    settings = [
        manifests.PodSettings(image="img:1"),
        manifests.PodSettings(
            image="img:1",
            device_plugin=False,
            runtime_class="nvidia",
            tolerations=[{"key": "gpu", "operator": "Exists"}],
            volumes=[{"name": "home", "emptyDir": {}}],
            volume_mounts=[{"name": "home", "mountPath": "/home/jovyan"}],
            pod_template={"spec": {"priorityClassName": "interactive"}},
        ),
    ]
    requests = [
        request(),
        request(gpu_request=0.3, gpu_memory=1 << 30, gpus=("G1", "G2")),
        request(simulated_devices="A100|GPU-1|1|108"),
    ]
    objs = [manifests.kernel_pod(r, s) for r in requests for s in settings]
    objs.append(manifests.connection_secret("k", "ns", {"key": "x", "shell_port": 1}, OWNER, "k-1"))
    assert [e for o in objs for e in invalid(o)] == []


def test_kernel_pod_command_prints_a_restricted_valid_pod(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "jupyter_server_config.py"
    config.write_text(
        'c.KubernetesBackendConfig.image = "registry.example.org/kernel:1"\n'
        'c.KubernetesBackendConfig.namespace = "science"\n'
        "c.KubernetesBackendConfig.run_as_user = 1234\n"
    )
    code = main(
        [
            "k8s",
            "kernel-pod",
            "--gpu-request",
            "0.3",
            "--gpu-limit",
            "0.6",
            "--gpu-memory",
            "10GiB",
            "--config",
            str(config),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "# Pod Security 'restricted': passes." in out
    pod, secret = list(yaml.safe_load_all(out))
    assert restricted_violations(pod) == [] and invalid(pod) == [] and invalid(secret) == []
    [container] = pod["spec"]["containers"]
    assert container["image"] == "registry.example.org/kernel:1"
    assert pod["metadata"]["namespace"] == secret["metadata"]["namespace"] == "science"
    assert pod["spec"]["securityContext"]["runAsUser"] == 1234
    assert container["resources"]["limits"][manifests.SHARE_RESOURCE] == "30"
    assert {"name": "GPUSHARE_GPU_MEMORY", "value": str(10 << 30)} in container["env"]
    assert "data" not in secret and secret["kind"] == "Secret"  # no key, no ports


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--gpu-request", "2"], "--gpu-request 2 is not allowed"),
        (["--gpu-memory", "lots"], "--gpu-memory lots is not allowed"),
        (["--config", "/nonexistent/cfg.py"], "--config /nonexistent/cfg.py: no such file"),
    ],
)
def test_kernel_pod_command_names_bad_input(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["k8s", "kernel-pod", *argv]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "Traceback" not in captured.err, captured.err
    assert captured.out == ""
