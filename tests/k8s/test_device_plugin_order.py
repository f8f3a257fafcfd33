"""Which pod an ``Allocate`` is for (the device plugin's guess, since the kubelet does not say):
the waiting kernel pod bound to the node first, by the time the API server stamped its binding,
not by creation. A pod created earlier, held back, and given a newer kernel's labels before it is
bound must not count as the older one: the plugin would refuse the kernel's own admission
(issue 15, the Allocate denial-of-service gap).

Where it runs: the real API server alone (no node): the tests bind pods themselves, in the orders
they need.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.device_plugin import plugin
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec

RES = manifests.SHARE_RESOURCE
ALLOCATION = "a-" + "1" * 16


def kernel_like(name: str, created: str, scheduled: str | None) -> dict[str, Any]:
    conditions = []
    if scheduled is not None:
        conditions.append(
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": scheduled}
        )
    return {
        "metadata": {
            "name": name,
            "namespace": "gpushare",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
            "labels": {
                manifests.LABEL_COMPONENT: manifests.KERNEL_COMPONENT,
                manifests.LABEL_ALLOCATION: ALLOCATION,
            },
        },
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "k", "resources": {"limits": {RES: "25"}}}],
        },
        "status": {"phase": "Pending", "conditions": conditions},
    }


def test_a_held_back_older_pod_bound_later_comes_after_the_kernel() -> None:
    # the attacker's pod: created first, gated, relabelled with the kernel's allocation once
    # the kernel pod appeared, then released and bound after it
    forged = kernel_like("aaa-forged", "2026-01-01T00:00:00Z", "2026-01-01T00:00:09Z")
    kernel = kernel_like("gpushare-kernel-k-1", "2026-01-01T00:00:05Z", "2026-01-01T00:00:06Z")
    order = plugin.pending_pods([forged, kernel], "n1", RES, 25)
    assert [p["metadata"]["name"] for p in order] == ["gpushare-kernel-k-1", "aaa-forged"]
    # by creation alone (what the plugin did before), the forged pod came first
    assert forged["metadata"]["creationTimestamp"] < kernel["metadata"]["creationTimestamp"]


def test_bound_at_reads_the_binding_or_the_creation() -> None:
    created_on_node = kernel_like("direct", "2026-01-01T00:00:03Z", None)  # nodeName at create
    assert plugin.bound_at(created_on_node) == "2026-01-01T00:00:03Z"
    scheduled = kernel_like("s", "2026-01-01T00:00:03Z", "2026-01-01T00:00:04Z")
    assert plugin.bound_at(scheduled) == "2026-01-01T00:00:04Z"
    not_yet = kernel_like("u", "2026-01-01T00:00:03Z", None)
    not_yet["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "lastTransitionTime": "2026-01-01T00:01:00Z"}
    ]
    assert plugin.bound_at(not_yet) == "2026-01-01T00:00:03Z"
    # a condition older than the pod (clock skew) never moves it before its creation
    skewed = kernel_like("k", "2026-01-01T00:00:03Z", "2026-01-01T00:00:01Z")
    assert plugin.bound_at(skewed) == "2026-01-01T00:00:03Z"
    # within one second, creation then name decide (the residual gap the module names)
    a = kernel_like("b-kernel", "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z")
    b = kernel_like("a-other", "2026-01-01T00:00:02Z", "2026-01-01T00:00:02Z")
    order = plugin.pending_pods([b, a], "n1", RES, 25)
    assert [p["metadata"]["name"] for p in order] == ["b-kernel", "a-other"]


def test_the_api_server_stamps_binding_and_ignores_a_creators_status(control_plane: Any) -> None:
    """What ``bound_at`` relies on, asked of the real API server: binding a pod (what the
    scheduler does) sets ``PodScheduled=True`` with its time, and conditions a pod's creator
    writes into the pod are dropped on create."""
    from kubernetes import client, config

    api = config.new_client_from_config(str(control_plane.kubeconfig("admin")))
    core = client.CoreV1Api(api)
    namespace = "gpushare-bind-order"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        forged_status = {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "True",
                    "lastTransitionTime": "2000-01-01T00:00:00Z",
                }
            ]
        }
        body = {
            "metadata": {"name": "held"},
            "spec": {
                "schedulerName": "nobody",  # the test binds it, as a scheduler would
                "containers": [{"name": "c", "image": "does-not-matter"}],
            },
            "status": forged_status,
        }
        created = core.create_namespaced_pod(namespace, body)
        assert not (created.status.conditions or [])  # the creator's status is dropped
        time.sleep(1.1)  # a binding a second later than the creation
        core.create_namespaced_binding(
            namespace,
            {
                "metadata": {"name": "held"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": "no-such-node-order"},
            },
            _preload_content=False,
        )
        pod = api.sanitize_for_serialization(core.read_namespaced_pod("held", namespace))
        assert pod["spec"]["nodeName"] == "no-such-node-order"
        [scheduled] = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert scheduled["status"] == "True", scheduled
        assert plugin.bound_at(pod) > pod["metadata"]["creationTimestamp"], pod["status"]
    finally:
        with contextlib.suppress(client.ApiException):
            core.delete_namespace(namespace)


def test_within_one_second_the_ledgers_pod_comes_first_and_other_namespaces_never() -> None:
    """A forged pod bound in the kernel pod's second, named to sort first: the pod the ledger
    names (its name, namespace and UID, which the API server assigned) comes first; a pod in
    another namespace is no candidate at all."""
    kernel = kernel_like("zz-kernel", "2026-01-01T00:00:06Z", "2026-01-01T00:00:06Z")
    forged = kernel_like("aa-forged", "2026-01-01T00:00:06Z", None)  # nodeName at creation
    elsewhere = kernel_like("aa-elsewhere", "2026-01-01T00:00:01Z", None)
    elsewhere["metadata"]["namespace"] = "forger"
    pods = [forged, elsewhere, kernel]
    record = Allocation(
        id=ALLOCATION,
        node="n1",
        gpus=("GPU-1",),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.25),
        memory=1 << 30,
        backend="kubernetes",
        extra={"k8s_pod": "zz-kernel", "k8s_namespace": "gpushare", "k8s_pod_uid": "uid-zz-kernel"},
    )

    def named(pod: dict[str, Any]) -> bool:
        return plugin.allocation_is_the_pods(record, pod)

    order = plugin.pending_pods(pods, "n1", RES, 25, "gpushare", named)
    assert [p["metadata"]["name"] for p in order] == ["zz-kernel", "aa-forged"]
    # without the ledger's word (what the plugin did before) the forgery came first
    unnamed = plugin.pending_pods(pods, "n1", RES, 25, "gpushare")
    assert unnamed[0]["metadata"]["name"] == "aa-forged"
    # a bound pod of an earlier second still comes first: the kubelet admits it first
    early = kernel_like("aa-early", "2026-01-01T00:00:05Z", None)
    order = plugin.pending_pods([*pods, early], "n1", RES, 25, "gpushare", named)
    assert [p["metadata"]["name"] for p in order][:2] == ["aa-early", "zz-kernel"]
    # a recreated pod of the same name (another UID) is not the ledger's
    impostor = kernel_like("zz-kernel", "2026-01-01T00:00:06Z", None)
    impostor["metadata"]["uid"] = "uid-other"
    assert not named(impostor)


def test_with_the_kubelets_word_admitted_pods_are_those_holding_devices() -> None:
    """With PodResources (``admitted``: the pods holding devices), a pod marked by a wrong
    guess but holding none is waiting still, and a refused forgery holding its devices is no
    candidate; without it, the marks decide."""
    t = "2026-01-01T00:00:06Z"
    kernel = kernel_like("zz-kernel", t, t)
    kernel["metadata"]["annotations"] = {manifests.ALLOCATED_ANNOTATION: "n1"}  # a wrong guess
    forged = kernel_like("aa-forged", t, None)
    held = {("gpushare", "aa-forged")}
    order = plugin.pending_pods([forged, kernel], "n1", RES, 25, "gpushare", admitted=held)
    assert [p["metadata"]["name"] for p in order] == ["zz-kernel"]
    by_marks = plugin.pending_pods([forged, kernel], "n1", RES, 25, "gpushare")
    assert [p["metadata"]["name"] for p in by_marks] == ["aa-forged"]
