"""The ledger on the real API server: CAS semantics, inventory from Nodes, watches, concurrency.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1) for
the Nodes' inventory (two GPU nodes); the ledger itself is the real API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import NAMESPACE, ControlPlane
from stress import run_stress, stress_inventory

from jupyter_gpushare.k8s.client import ApiException, connect
from jupyter_gpushare.k8s.ledger import KubernetesLedger
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import place
from jupyter_gpushare.share import ShareSpec


async def _namespace(plane: ControlPlane, name: str) -> None:
    kube = await connect(str(plane.kubeconfig("admin")))
    try:
        with contextlib.suppress(ApiException):
            await kube.core.create_namespace({"metadata": {"name": name}})
    finally:
        await kube.close()


def _alloc(node: str, uuid: str, request: float) -> Allocation:
    spec = ShareSpec(gpu_request=request, gpu_limit=request, gpu_memory=2**30, gpu_type="A100")
    return Allocation(
        id=Allocation.new_id(),
        node=node,
        gpus=(uuid,),
        spec=spec,
        memory=2**30,
        backend="kubernetes",
    )


async def test_compare_and_swap_on_resource_version(control_plane: ControlPlane) -> None:
    await _namespace(control_plane, "gpushare-cas")
    kube = await connect(str(control_plane.kubeconfig("admin")))
    ledger = KubernetesLedger(kube, "gpushare-cas")
    try:
        first = _alloc("cas-node", "GPU-a", 0.5)
        assert await ledger.compare_and_swap("cas-node", 0, [first])
        assert not await ledger.compare_and_swap("cas-node", 0, [first])  # AlreadyExists
        snap = await ledger.snapshot()
        version = snap.versions["cas-node"]
        assert [a.id for a in snap.on_node("cas-node")] == [first.id]
        second = _alloc("cas-node", "GPU-a", 0.25)
        assert await ledger.compare_and_swap("cas-node", version, [first, second])
        # A writer holding the old version loses and changes nothing.
        assert not await ledger.compare_and_swap("cas-node", version, [])
        after = await ledger.snapshot()
        assert {a.id for a in after.on_node("cas-node")} == {first.id, second.id}
        assert after.versions["cas-node"] > version
        assert (await ledger.get(second.id)).to_json() == second.to_json()
    finally:
        await kube.close()


async def test_inventory_comes_from_node_objects(
    control_plane: ControlPlane, node_agent: Path
) -> None:
    kube = await connect(str(control_plane.kubeconfig("server")))
    try:
        gpus = await KubernetesLedger(kube, NAMESPACE).gpus()
    finally:
        await kube.close()
    by_node = {}
    for g in gpus:
        by_node.setdefault(g.node, []).append(g.type)
    assert by_node == {"gpu-node-1": ["A100", "A100"], "gpu-node-2": ["T4"]}
    assert all(g.simulated and g.healthy and g.uuid.startswith("GPU-") for g in gpus)


async def test_server_identity_cannot_publish_inventory(
    control_plane: ControlPlane, node_agent: Path
) -> None:
    """Least privilege: the Jupyter server reads Nodes but may not change them."""
    kube = await connect(str(control_plane.kubeconfig("server")))
    try:
        with pytest.raises(ApiException) as refused:
            await KubernetesLedger(kube, NAMESPACE).put_gpus("gpu-node-1", [])
        assert refused.value.status == 403
        with pytest.raises(ApiException) as secrets:
            await kube.core.list_namespaced_secret(NAMESPACE)
        assert secrets.value.status == 403
    finally:
        await kube.close()


async def test_node_daemon_watch_sees_live_changes(control_plane: ControlPlane) -> None:
    await _namespace(control_plane, "gpushare-watch")
    kube = await connect(str(control_plane.kubeconfig("admin")))
    ledger = KubernetesLedger(kube, "gpushare-watch")
    seen: list[list[str]] = []
    changed = asyncio.Event()

    async def follow() -> None:
        async for allocations in ledger.watch_node("watch-node"):
            seen.append(sorted(a.id for a in allocations))
            changed.set()

    task = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(changed.wait(), 10)
        assert seen[0] == []
        inventory = [replace(g, node="watch-node") for g in stress_inventory(1, 1)]
        spec = ShareSpec(gpu_request=0.3, gpu_limit=0.6)
        a = await ledger.allocate(spec, inventory, place, backend="kubernetes")
        while a.id not in (seen[-1] if seen else []):
            changed.clear()
            await asyncio.wait_for(changed.wait(), 10)

        def grow(current: Allocation, _others: list[Allocation]) -> Allocation:
            return replace(current, spec=current.spec.with_changes(gpu_limit=0.9))

        before = len(seen)
        await ledger.update(a.id, grow)
        while len(seen) == before:  # the event may already have come during the update
            changed.clear()
            if len(seen) == before:
                await asyncio.wait_for(changed.wait(), 10)
        await ledger.release(a.id)
        while seen[-1]:
            changed.clear()
            await asyncio.wait_for(changed.wait(), 10)
        assert len(seen) >= 4  # initial, allocated, resized (live), released
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await kube.close()


@pytest.mark.timeout(600)
async def test_concurrent_placers_never_over_allocate(control_plane: ControlPlane) -> None:
    await _namespace(control_plane, "gpushare-stress")
    result = await run_stress(
        str(control_plane.kubeconfig("admin")), "gpushare-stress", placers=16, requests=32
    )
    summary = result.summary()
    print("stress:", summary)
    assert result.over_allocations == 0
    assert result.allocated + result.refused == 16 * 32
    assert result.allocated > 0 and result.versions_audited >= result.allocated
    assert result.released == result.allocated  # everything given back at the end
    kube = await connect(str(control_plane.kubeconfig("admin")))
    try:
        left = await KubernetesLedger(kube, "gpushare-stress").list()
    finally:
        await kube.close()
    assert left == []
