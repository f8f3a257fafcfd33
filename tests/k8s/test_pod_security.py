"""Kernel pods pass Pod Security "restricted" (issue 15): the pure checker of
``jupyter_gpushare.k8s.podsecurity`` against known-good and known-bad pods, then against the
kernel pods ``manifests.kernel_pod`` builds (with the device plugin: no hostPath, non-root, no
privilege, capabilities dropped, seccomp RuntimeDefault, the Secret readable by fsGroup).

Where it runs: no cluster: the restricted profile checked by podsecurity.py (Kubernetes 1.20 has no
Pod Security admission).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_manifests import request

from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.podsecurity import baseline_violations, restricted_violations

# The restricted example of the Pod Security Standards documentation (passes every rule).
GOOD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "ok"},
    "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "c",
                "image": "i",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "volumes": [{"name": "s", "secret": {"secretName": "x"}}, {"name": "e", "emptyDir": {}}],
    },
}


def changed(path: str, value: Any) -> dict[str, Any]:
    """GOOD with one field set (``spec.containers.0.securityContext.privileged``)."""
    pod = copy.deepcopy(GOOD)
    node: Any = pod
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return pod


DELETE = object()
C = "spec.containers.0.securityContext"

BAD = [
    ("spec.hostPID", True, "host namespaces", True),
    ("spec.hostNetwork", True, "host namespaces", True),
    (f"{C}.privileged", True, "privileged", True),
    (f"{C}.capabilities.add", ["SYS_ADMIN"], "capabilities", True),
    ("spec.volumes", [{"name": "h", "hostPath": {"path": "/run"}}], "hostPath", True),
    ("spec.containers.0.ports", [{"containerPort": 80, "hostPort": 80}], "host ports", True),
    (f"{C}.seccompProfile", {"type": "Unconfined"}, "seccomp", True),
    (f"{C}.procMount", "Unmasked", "/proc mount", True),
    (f"{C}.seLinuxOptions", {"type": "spc_t"}, "SELinux", True),
    ("spec.securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "sysctls", True),
    (f"{C}.allowPrivilegeEscalation", DELETE, "privilege escalation", False),
    ("spec.securityContext.runAsNonRoot", DELETE, "non-root", False),
    (f"{C}.runAsUser", 0, "non-root user", False),
    ("spec.securityContext.seccompProfile", DELETE, "seccomp", False),
    (f"{C}.capabilities", {"drop": ["NET_RAW"]}, "drop must include ALL", False),
    (f"{C}.capabilities.add", ["CHOWN"], "only NET_BIND_SERVICE", False),
    ("spec.volumes", [{"name": "n", "nfs": {"server": "s", "path": "/"}}], "volume types", False),
]


def test_the_checker_passes_the_standard_example() -> None:
    assert restricted_violations(GOOD) == [] and baseline_violations(GOOD) == []
    # a container may set what the pod does not, and may add NET_BIND_SERVICE
    pod = changed("spec.securityContext", {})
    pod["spec"]["containers"][0]["securityContext"].update(
        runAsNonRoot=True,
        seccompProfile={"type": "Localhost", "localhostProfile": "p.json"},
        capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
    )
    assert restricted_violations(pod) == []


@pytest.mark.parametrize(
    ("path", "value", "words", "baseline"), BAD, ids=[b[0] + ":" + b[2] for b in BAD]
)
def test_the_checker_refuses_each_rule(path: str, value: Any, words: str, baseline: bool) -> None:
    pod = changed(path, value)
    found = restricted_violations(pod)
    assert any(words in v for v in found), found
    assert bool(baseline_violations(pod)) is baseline, baseline_violations(pod)


def test_init_and_ephemeral_containers_are_checked() -> None:
    pod = copy.deepcopy(GOOD)
    pod["spec"]["initContainers"] = [{"name": "init", "image": "i"}]
    found = restricted_violations(pod)
    assert any("initContainers[init]" in v and "escalation" in v for v in found), found


def test_kernel_pods_pass_restricted() -> None:
    settings = manifests.PodSettings(image="img:1")
    for req in (
        request(),
        request(simulated_devices="A100|GPU-1|1|108", gpu_memory=1 << 30, gpu_request=0.25),
    ):
        pod = manifests.kernel_pod(req, settings)
        assert restricted_violations(pod) == [], restricted_violations(pod)


def test_restricted_kernel_pod_asks_its_share_and_reads_its_secret() -> None:
    settings = manifests.PodSettings(
        image="img:1",
        resources={"requests": {"cpu": "1"}},
        run_as_user=1234,
        run_as_group=55,
        fs_group=66,
    )
    pod = manifests.kernel_pod(request(gpu_request=0.25, gpus=("GPU-1", "GPU-2")), settings)
    spec = pod["spec"]
    [container] = spec["containers"]
    res = container["resources"]
    assert res["requests"] == {"cpu": "1", manifests.SHARE_RESOURCE: "50"}  # 0.25 x 2 GPUs
    assert res["limits"] == {manifests.SHARE_RESOURCE: "50"}
    assert spec["securityContext"]["fsGroup"] == 66
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (
        1234,
        55,
    )
    [secret] = [v for v in spec["volumes"] if v["name"] == "connection"]
    assert secret["secret"]["defaultMode"] == 0o440  # group-readable: fsGroup
    assert not any("hostPath" in v for v in spec["volumes"])
    env = {e["name"] for e in container["env"]}
    # the socket, GPU and interposer come from the device plugin's Allocate, not the spec
    assert not env & {"GPUSHARE_SOCKET", "LD_PRELOAD", "NVIDIA_VISIBLE_DEVICES"}
    assert pod["metadata"]["labels"][manifests.LABEL_ALLOCATION] == "a-1"
    # a limit-only share (request 0) still goes through the plugin: one unit
    zero = manifests.kernel_pod(request(gpu_request=0.0), settings)
    assert zero["spec"]["containers"][0]["resources"]["limits"] == {manifests.SHARE_RESOURCE: "1"}


def test_runtime_class_only_where_real_gpus_are_injected() -> None:
    settings = manifests.PodSettings(image="img:1", runtime_class="nvidia")
    assert manifests.kernel_pod(request(), settings)["spec"]["runtimeClassName"] == "nvidia"
    simulated = manifests.kernel_pod(request(simulated_devices="A100|GPU-1|1|108"), settings)
    assert "runtimeClassName" not in simulated["spec"]
    none = manifests.PodSettings(image="img:1", runtime_class="")
    assert "runtimeClassName" not in manifests.kernel_pod(request(), none)["spec"]


def test_the_host_path_mode_is_what_the_checker_refuses() -> None:
    pod = manifests.kernel_pod(request(), manifests.PodSettings(image="i", device_plugin=False))
    found = restricted_violations(pod)
    assert any("hostPath" in v for v in found) and baseline_violations(pod), found


def test_pod_user_settings_are_checked() -> None:
    from traitlets import TraitError

    from jupyter_gpushare.k8s.config import KubernetesBackendConfig

    for name, value in (("run_as_user", 0), ("run_as_group", -1), ("fs_group", 2**31)):
        with pytest.raises(TraitError, match=f"{name}={value!r} is not allowed"):
            KubernetesBackendConfig(**{name: value})
    assert KubernetesBackendConfig(run_as_group=0).run_as_group == 0
