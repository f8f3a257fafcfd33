"""Direct mode's admission gate (jupyter_gpushare.k8s.admission.LeaseGate) against the real API
server, as the servers' service account (``jupyter-gpushare``, deploy/rbac.yaml): two users'
servers, each seeing only its own kernel pods, never have a pod of one node and size waiting for
admission at the same time; the Lease is removed by its holder only, and a dead holder's Lease
is taken over once expired.

The pods are fed to each server's informer as its watch would feed them (``note``); the kubelet's
admission is the device plugin's annotation. The controller's gate end to end:
``test_controller.py::test_starts_of_one_size_on_one_node_are_admitted_one_at_a_time``.

Where it runs: the real API server alone (no node): Leases only.
"""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from cluster import NAMESPACE, ControlPlane
from test_admission_gate import changed, created, kernel_pod

from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.admission import LeaseGate
from jupyter_gpushare.k8s.client import Kube, connect
from jupyter_gpushare.k8s.watch import PodWatcher

RES = manifests.SHARE_RESOURCE
pytestmark = pytest.mark.timeout(120)


async def no_owner() -> dict[str, Any] | None:
    return None


def server(kube: Kube, holder: str, timeout: float = 20) -> tuple[LeaseGate, PodWatcher]:
    pods = PodWatcher(kube, NAMESPACE, f"{manifests.LABEL_SERVER}={holder}")  # fed by note()
    return LeaseGate(kube, NAMESPACE, pods, RES, holder, no_owner, timeout), pods


async def admission_leases(plane: ControlPlane) -> list[dict[str, Any]]:
    """The admission Leases, as an admin sees them (servers may not list Leases)."""
    admin = await connect(str(plane.kubeconfig("admin")))
    try:
        selector = f"{manifests.LABEL_COMPONENT}={manifests.ADMISSION_COMPONENT}"
        return await admin.list_leases(NAMESPACE, selector)
    finally:
        await admin.close()


async def test_two_servers_pods_of_one_node_and_size_wait_for_admission_one_at_a_time(
    control_plane: ControlPlane,
) -> None:
    kube = await connect(str(control_plane.kubeconfig("server")))
    try:
        (alice, alice_pods), (bob, bob_pods) = server(kube, "alice-1"), server(kube, "bob-1")
        log: list[str] = []
        entered = {name: asyncio.Event() for name in ("la", "lb", "lc")}
        first = kernel_pod("la", node="n-lease")

        async def create(gate: LeaseGate, pods: PodWatcher, pod: dict[str, Any]) -> None:
            async with gate.turn(pod):
                log.append(pod["metadata"]["name"])
                entered[pod["metadata"]["name"]].set()
                await pods.note(created(pod))

        a = asyncio.create_task(create(alice, alice_pods, first))
        await asyncio.wait_for(entered["la"].wait(), 10)
        [held] = await admission_leases(control_plane)
        assert held["spec"]["holderIdentity"] == "alice-1"
        assert held["metadata"]["annotations"][f"{manifests.GROUP}/node"] == "n-lease"
        b = asyncio.create_task(create(bob, bob_pods, kernel_pod("lb", node="n-lease")))
        other = asyncio.create_task(
            create(bob, bob_pods, kernel_pod("lc", node="n-lease", units=50))
        )
        await asyncio.wait_for(entered["lc"].wait(), 10)  # another size: its own Lease
        await bob_pods.note(changed(kernel_pod("lc", node="n-lease", units=50), allocated=True))
        await asyncio.wait_for(other, 10)
        await asyncio.sleep(1.0)
        assert log == ["la", "lc"]  # bob's pod of alice's size waits while alice's is not admitted
        await alice_pods.note(changed(first, allocated=True))  # the node's plugin marked it
        await asyncio.wait_for(a, 10)
        await asyncio.wait_for(entered["lb"].wait(), 10)
        [held] = await admission_leases(control_plane)
        assert held["spec"]["holderIdentity"] == "bob-1"
        await bob_pods.note_deleted(created(kernel_pod("lb", node="n-lease")))  # gone: done
        await asyncio.wait_for(b, 10)
        assert await admission_leases(control_plane) == []  # each holder removed its own
        assert alice.timeouts == bob.timeouts == 0
    finally:
        await kube.close()


async def test_a_dead_servers_lease_is_taken_over_once_expired_and_never_deleted_by_another(
    control_plane: ControlPlane,
) -> None:
    kube = await connect(str(control_plane.kubeconfig("server")))
    try:
        long_ago = datetime.now(timezone.utc) - timedelta(seconds=120)
        dead = manifests.admission_lease("n-dead", 25, NAMESPACE, "dead-1", 30, None, long_ago)
        await kube.create_lease(NAMESPACE, dead)
        gate, pods = server(kube, "carol-1")
        pod = kernel_pod("ld", node="n-dead")
        async with gate.turn(pod):
            [held] = await admission_leases(control_plane)
            assert held["spec"]["holderIdentity"] == "carol-1"  # taken over, not waited for
            await pods.note(changed(pod, allocated=True))
        assert await admission_leases(control_plane) == []
        # a Lease held by a live server now: a stale holder's delete (by its old UID) leaves it
        live = await kube.create_lease(
            NAMESPACE, manifests.admission_lease("n-live", 25, NAMESPACE, "dave-1", 30)
        )
        stale = copy.deepcopy(live)
        stale["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
        with pytest.raises(Exception) as refused:
            await kube.delete_lease(NAMESPACE, stale["metadata"]["name"], stale["metadata"]["uid"])
        assert getattr(refused.value, "status", None) == 409
        assert [x["spec"]["holderIdentity"] for x in await admission_leases(control_plane)] == [
            "dave-1"
        ]
        # and a start that cannot get it goes ahead after its wait, and says so
        waiting, erin_pods = server(kube, "erin-1", timeout=0.5)
        async with waiting.turn(kernel_pod("le", node="n-live")):
            await erin_pods.note(created(kernel_pod("le", node="n-live")))
        assert waiting.timeouts == 2  # no Lease, then no admission within the wait
        assert await kube.delete_lease(NAMESPACE, live["metadata"]["name"], live["metadata"]["uid"])
    finally:
        await kube.close()
