"""The ledger on the Kubernetes API server: one ``GpuLedger`` object per node.

Decision (see ``deploy/crds/gpuledgers.yaml``): a namespaced custom resource ``GpuLedger`` named
after the node, whose ``spec.allocations`` lists the node's allocation records
(``Allocation.to_json()``). One object per node because the :class:`~jupyter_gpushare.ledger.Ledger`
primitive is a compare-and-swap of one node's allocations, and the API server gives exactly that
for one object: an update carrying the ``resourceVersion`` that was read succeeds only if nobody
wrote in between (409 Conflict otherwise). A CRD rather than ConfigMaps: its own RBAC (no access
to every ConfigMap), a schema, ``kubectl get gpuledgers``, and watches scoped to it.

- version: the object's ``resourceVersion`` (an etcd revision, an integer); 0 = no object yet,
  and the first write is a create (409 AlreadyExists = lost the race);
- snapshot: one LIST of the namespace's GpuLedgers — one consistent read;
- each object is owned by its Node, so the garbage collector removes it with the node;
- inventory: Node objects (``gpushare.jupyter.org/gpus`` annotation, else GPU feature discovery
  labels), see :func:`.manifests.gpus_from_node`;
- the node daemon follows its node's records with :meth:`KubernetesLedger.watch_node`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ..inventory import Gpu, TypeAliases
from ..ledger import Allocation, Ledger, Snapshot
from . import manifests
from .client import ApiException, Kube


class KubernetesLedger(Ledger):
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        aliases: TypeAliases | None = None,
        inventory_ttl: float = 0.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.aliases = aliases or TypeAliases()
        self.inventory_ttl = inventory_ttl
        self._nodes: tuple[float, list[dict[str, Any]]] | None = None
        self._node_uids: dict[str, str] = {}
        self._streak: dict[str, int] = {}

    # -- primitives ----------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        listing = await self.kube.list_ledgers(self.namespace)
        allocations: list[Allocation] = []
        versions: dict[str, int] = {}
        for obj in listing.get("items") or []:
            node, found = _read_ledger(obj)
            versions[node] = int(obj["metadata"]["resourceVersion"])
            allocations.extend(found)
        return Snapshot(allocations=tuple(allocations), versions=versions)

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        records = [a.to_json() for a in allocations]
        started = time.monotonic()
        try:
            if expected_version == 0:
                owner = await self._node_owner(node)
                await self.kube.create_ledger(
                    self.namespace, manifests.ledger_object(node, self.namespace, records, owner)
                )
            else:
                await self.kube.replace_ledger(
                    self.namespace,
                    manifests.ledger_object(
                        node,
                        self.namespace,
                        records,
                        await self._node_owner(node),
                        resource_version=str(expected_version),
                    ),
                )
        except ApiException as exc:
            if exc.status == 409 or (exc.status == 404 and expected_version):
                # 409: Conflict (stale resourceVersion) or AlreadyExists; 404: the object went
                # with its node meanwhile. Lost the race: back off before the caller re-reads.
                await self._back_off(node, time.monotonic() - started)
                return False
            raise
        self._streak.pop(node, None)
        return True

    async def _back_off(self, node: str, round_trip: float) -> None:
        """Randomised exponential backoff in units of the API round trip, per node: placers
        that keep losing on a hot node spread out instead of re-reading in lockstep."""
        streak = self._streak[node] = self._streak.get(node, 0) + 1
        await asyncio.sleep(random.uniform(0, min(0.5, round_trip * 2 ** min(streak, 6))))

    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        await self.kube.patch_node(node, manifests.node_gpu_patch(list(gpus)))
        self._nodes = None

    async def gpus(self) -> list[Gpu]:
        gpus: list[Gpu] = []
        for node in await self._list_nodes():
            gpus.extend(manifests.gpus_from_node(node, self.aliases))
        return sorted(gpus, key=lambda g: (g.node, g.index))

    # -- helpers -------------------------------------------------------------------------------

    async def _list_nodes(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        if self._nodes is not None and now - self._nodes[0] < self.inventory_ttl:
            return self._nodes[1]
        nodes = await self.kube.list_nodes()
        self._nodes = (now, nodes)
        self._node_uids = {n["metadata"]["name"]: n["metadata"]["uid"] for n in nodes}
        return nodes

    async def _node_owner(self, node: str) -> dict[str, Any] | None:
        if node not in self._node_uids:
            self._nodes = None
            await self._list_nodes()
        uid = self._node_uids.get(node)
        if uid is None:
            return None
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "name": node,
            "uid": uid,
            "blockOwnerDeletion": False,
        }

    async def watch_node(self, node: str) -> AsyncIterator[list[Allocation]]:
        """The allocations on ``node``, now and after every change (for the node daemon: shares
        can change live). Runs until cancelled; re-lists when the watch expires."""
        while True:
            listing = await self.kube.list_ledgers(self.namespace)
            version = listing["metadata"]["resourceVersion"]
            current: list[Allocation] = []
            for obj in listing.get("items") or []:
                name, found = _read_ledger(obj)
                if name == node:
                    current = found
            yield current
            try:
                async for event in self.kube.watch(
                    "gpuledgers",
                    self.namespace,
                    version,
                    field_selector=f"metadata.name={node}",
                ):
                    if event["type"] == "BOOKMARK":
                        continue
                    found = [] if event["type"] == "DELETED" else _read_ledger(event["object"])[1]
                    yield found
            except ApiException as exc:
                if exc.status != 410:
                    raise
            except (asyncio.TimeoutError, ConnectionError):
                await asyncio.sleep(1.0)


def _read_ledger(obj: dict[str, Any]) -> tuple[str, list[Allocation]]:
    spec = obj.get("spec") or {}
    node = spec.get("node") or obj["metadata"]["name"]
    return node, [Allocation.from_json(a) for a in spec.get("allocations") or []]


__all__ = ["KubernetesLedger"]
