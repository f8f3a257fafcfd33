"""The admission gate (jupyter_gpushare.k8s.admission) on its own: a start of a node and size
waits while another pod of that node and size waits for the kubelet's admission, and only then.

The informer is fed as its watch would feed it (``note``: what the API server returned); the
end-to-end check, with the real API server, scheduler and device plugin, is
``tests/k8s/test_controller.py::test_starts_of_one_size_on_one_node_are_admitted_one_at_a_time``.

Where it runs: no node: the gate's informer is fed directly; the end-to-end check of the gate runs
on the kubelet double (test_kernels), whose admit-after hook makes the kubelet's admissions slow on
purpose, which a real kubelet cannot be told to do.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Collection
from typing import Any

import pytest
from cluster import NAMESPACE

from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.admission import AdmissionGate, awaiting_admission, pod_node
from jupyter_gpushare.k8s.client import Kube
from jupyter_gpushare.k8s.watch import PodWatcher

RES = manifests.SHARE_RESOURCE
_versions = itertools.count(1)


def kernel_pod(name: str, node: str = "n1", units: int = 25) -> dict[str, Any]:
    request = manifests.KernelPodRequest(
        name=name,
        namespace="gpushare",
        kernel_id="k" + name,
        allocation_id="a-" + "1" * 16,
        node=node,
        gpus=("GPU-1",),
        command=["python"],
        env={},
        server_id="s1",
        owner={"apiVersion": "v1", "kind": "Pod", "name": "x", "uid": "u"},
        gpu_request=units / manifests.SHARE_UNITS_PER_GPU,
    )
    return manifests.kernel_pod(request, manifests.PodSettings(image="img"))


def created(pod: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns for a create (a new resourceVersion)."""
    made = copy.deepcopy(pod)
    made["metadata"]["resourceVersion"] = str(next(_versions))
    return made


def changed(pod: dict[str, Any], **how: Any) -> dict[str, Any]:
    made = created(pod)
    if how.get("allocated"):
        made["metadata"].setdefault("annotations", {})[manifests.ALLOCATED_ANNOTATION] = "n1"
    if how.get("failed"):
        made["status"] = {"phase": "Failed", "reason": "UnexpectedAdmissionError"}
    return made


def overlapping_waits(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """Replay pod events in the API server's order: each pair of kernel pods of one node and size
    that were both waiting for admission at once (the tie the device plugin cannot break)."""
    waiting: dict[str, tuple[str | None, int]] = {}
    pairs = []
    for kind, pod in events:
        name = pod["metadata"]["name"]
        key = (pod_node(pod), manifests.requested_units(pod, manifests.SHARE_RESOURCE))
        if kind != "DELETED" and awaiting_admission(pod):
            pairs += [(other, name) for other, k in waiting.items() if k == key and other != name]
            waiting[name] = key
        else:
            waiting.pop(name, None)
    return pairs


class PodHistory:
    """Every pod event of the kernel namespace from :meth:`start` on, in the API server's order
    (one watch from a LIST's resourceVersion): which pods waited for admission together."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        listing = await self.kube.list_pods(NAMESPACE)
        self._task = asyncio.create_task(self._follow(listing["metadata"]["resourceVersion"]))

    async def _follow(self, version: str) -> None:
        async for event in self.kube.watch("pods", NAMESPACE, version):
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self.events.append((event["type"], event["object"]))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def overlaps(self, kernels: Collection[str]) -> list[tuple[str, str]]:
        """:func:`overlapping_waits` among the pods of ``kernels`` (after the watch caught up)."""
        await asyncio.sleep(1.0)
        ours = [
            (kind, pod)
            for kind, pod in self.events
            if (pod["metadata"].get("labels") or {}).get(manifests.LABEL_KERNEL) in kernels
        ]
        assert ours, "no event of these kernels' pods was seen"
        return overlapping_waits(ours)


async def start(gate: AdmissionGate, pods: PodWatcher, pod: dict[str, Any], log: list[str]) -> None:
    async with gate.turn(pod):
        log.append(pod["metadata"]["name"])
        await pods.note(created(pod))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_the_pods_node_is_its_binding_or_its_affinity() -> None:
    pod = kernel_pod("a", node="gpu-7")
    assert pod_node(pod) == "gpu-7"  # not yet bound: the affinity the controller wrote
    pod["spec"]["nodeName"] = "gpu-8"
    assert pod_node(pod) == "gpu-8"
    del pod["spec"]["nodeName"]
    del pod["spec"]["affinity"]
    assert pod_node(pod) is None
    assert awaiting_admission(kernel_pod("a"))
    assert not awaiting_admission(changed(kernel_pod("a"), allocated=True))
    assert not awaiting_admission(changed(kernel_pod("a"), failed=True))
    assert not awaiting_admission(None)


async def test_a_start_of_one_size_waits_for_the_admission_of_the_pod_ahead() -> None:
    pods = PodWatcher(None, "gpushare", "")  # type: ignore[arg-type]  # fed by note()
    gate = AdmissionGate(pods, RES, timeout=30)
    log: list[str] = []
    first, second = kernel_pod("a"), kernel_pod("b")
    await start(gate, pods, first, log)
    waiting = asyncio.create_task(start(gate, pods, second, log))
    other_size = asyncio.create_task(start(gate, pods, kernel_pod("c", units=50), log))
    other_node = asyncio.create_task(start(gate, pods, kernel_pod("d", node="n2"), log))
    await settle()
    assert log == ["a", "c", "d"]  # b waits for a; other sizes and nodes do not
    third = asyncio.create_task(start(gate, pods, kernel_pod("e"), log))
    await settle()
    assert log == ["a", "c", "d"]
    await pods.note(changed(first, allocated=True))  # the node's plugin marked a: b goes
    await settle()
    assert log == ["a", "c", "d", "b"]  # and e waits for b, created meanwhile
    await pods.note(changed(second, failed=True))  # a pod the kubelet failed waits no more
    await asyncio.wait_for(asyncio.gather(waiting, other_size, other_node, third), 5)
    assert log == ["a", "c", "d", "b", "e"]
    assert gate.timeouts == 0


async def test_a_deleted_pod_ahead_lets_the_next_start_go() -> None:
    pods = PodWatcher(None, "gpushare", "")  # type: ignore[arg-type]
    gate = AdmissionGate(pods, RES, timeout=30)
    log: list[str] = []
    first = kernel_pod("a")
    await start(gate, pods, first, log)
    waiting = asyncio.create_task(start(gate, pods, kernel_pod("b"), log))
    await settle()
    assert log == ["a"]
    await pods.note_deleted(created(first))
    await asyncio.wait_for(waiting, 5)
    assert log == ["a", "b"]


async def test_a_pod_the_kubelet_never_admits_holds_a_start_only_for_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pods = PodWatcher(None, "gpushare", "")  # type: ignore[arg-type]
    gate = AdmissionGate(pods, RES, timeout=0.3)
    log: list[str] = []
    await pods.note(created(kernel_pod("stuck")))  # e.g. a predecessor's, on a node gone
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(start(gate, pods, kernel_pod("b"), log), 5)
    assert log == ["b"] and loop.time() - began >= 0.3
    assert gate.timeouts == 1
    assert "waited 0 s for the admission of stuck on n1 (25 units)" in caplog.text
    assert not gate._turns  # nothing kept per (node, size) once no start holds it


async def test_a_pod_without_share_units_never_waits() -> None:
    pods = PodWatcher(None, "gpushare", "")  # type: ignore[arg-type]
    gate = AdmissionGate(pods, RES, timeout=30)
    log: list[str] = []
    await pods.note(created(kernel_pod("a")))
    plain = kernel_pod("b")
    for resources in (c["resources"] for c in plain["spec"]["containers"]):
        resources.get("limits", {}).pop(RES, None)
        resources.get("requests", {}).pop(RES, None)
    await asyncio.wait_for(start(gate, pods, plain, log), 5)
    assert log == ["b"]
