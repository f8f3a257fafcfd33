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
import builtins
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from ..inventory import Gpu, TypeAliases
from ..ledger import Allocation, AllocationNotFound, Ledger, LedgerConflict, PlaceFunction, Snapshot
from ..placement import Placement, Placer, Policy
from ..share import ShareSpec
from . import manifests
from .client import GROUP, LEDGER_PLURAL, VERSION, ApiException, Kube, connect


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
        return await self._write(node, expected_version, allocations) is not None

    async def _write(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> dict[str, Any] | None:
        """The compare-and-swap: the object written, or None when the race was lost."""
        records = [self._encode(a) for a in allocations]
        started = time.monotonic()
        try:
            if expected_version == 0:
                owner = await self._node_owner(node)
                written = await self.kube.create_ledger(
                    self.namespace, manifests.ledger_object(node, self.namespace, records, owner)
                )
            else:
                written = await self.kube.replace_ledger(
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
                return None
            raise
        self._streak.pop(node, None)
        return written

    def _encode(self, allocation: Allocation) -> dict[str, Any]:
        return allocation.to_json()

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
        return manifests.node_owner(node, uid) if uid is not None else None

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


class WatchedLedger(KubernetesLedger):
    """The controller's ledger: reads from informers, placement on an index they keep current.

    The GpuLedgers and the Nodes are each listed once and then followed by one watch
    (:class:`~.watch.Informer`: bookmarks, resumed from the last ``resourceVersion`` after a
    dropped watch, re-listed only on 410 Gone). Every read (:meth:`list`, :meth:`get`,
    :meth:`snapshot`, :meth:`gpus`) is answered from memory, with no API request. Placement runs
    on one long-lived :class:`~jupyter_gpushare.placement.Placer` that the watch keeps current
    (:meth:`indexed` gives the ``place_fn`` for :func:`~jupyter_gpushare.placement.allocate`);
    a change touches the index for that one node's records only.

    The API server stays the source of truth: every write is still a compare-and-swap on the
    node's GpuLedger ``resourceVersion`` (as :class:`KubernetesLedger`). The object a write
    returns goes into the cache at once; a lost race (409) waits for the watch to bring the
    winner's version (a GET of that one object if it has not come within ``catch_up`` seconds),
    never a LIST.
    """

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        aliases: TypeAliases | None = None,
        catch_up: float = 2.0,
    ) -> None:
        super().__init__(kube, namespace, aliases)
        from .watch import Informer

        self.catch_up = catch_up
        self.ledgers = Informer(kube, "gpuledgers", namespace)
        self.nodes = Informer(kube, "nodes")
        self.conflicts = 0
        #: node -> (its GpuLedger's resourceVersion, its allocations)
        self._records: dict[str, tuple[int, tuple[Allocation, ...]]] = {}
        self._ids: dict[str, Allocation] = {}
        self._node_gpus: dict[str, tuple[Gpu, ...]] = {}
        self._inventory: list[Gpu] | None = None
        self._placer: Placer | None = None
        self._snap: Snapshot | None = None
        #: id -> (the allocation, its JSON): a node's write encodes only what changed, and the
        #: echo of our own write decodes only what changed
        self._json: dict[str, tuple[Allocation, dict[str, Any]]] = {}
        self.ledgers.subscribe(self._ledger_changed)
        self.nodes.subscribe(self._node_changed)

    async def start(self, timeout: float | None = None) -> None:
        await self.nodes.start(timeout)
        await self.ledgers.start(timeout)

    async def stop(self) -> None:
        await self.ledgers.stop()
        await self.nodes.stop()

    # -- the cache, kept by the informers ---------------------------------------------------

    def _encode(self, allocation: Allocation) -> dict[str, Any]:
        cached = self._json.get(allocation.id)
        if cached is not None and cached[0] is allocation:
            return cached[1]
        data = allocation.to_json()
        self._json[allocation.id] = (allocation, data)
        return data

    def _decode(self, data: dict[str, Any]) -> Allocation:
        cached = self._json.get(data.get("id", ""))
        if cached is not None and cached[1] == data:
            return cached[0]
        allocation = Allocation.from_json(data)
        self._json[allocation.id] = (allocation, data)
        return allocation

    def _ledger_changed(self, kind: str, obj: dict[str, Any], _before: Any) -> None:
        spec = obj.get("spec") or {}
        node = spec.get("node") or obj["metadata"]["name"]
        old = self._records.get(node, (0, ()))[1]
        new: tuple[Allocation, ...] = ()
        if kind != "DELETED":
            new = tuple(self._decode(a) for a in spec.get("allocations") or [])
        if kind == "DELETED":
            self._records.pop(node, None)
        else:
            self._records[node] = (int(obj["metadata"]["resourceVersion"]), new)
        kept = {a.id for a in new}
        placer = self._placer
        for a in old:
            if a.id not in kept and self._ids.get(a.id) is a:
                del self._ids[a.id]
                self._json.pop(a.id, None)
                if placer is not None:
                    placer.remove(a.id)
        for a in new:
            self._ids[a.id] = a
            if placer is not None and placer.allocations.get(a.id) != a:
                placer.add(a)
        self._snap = None

    def _node_changed(self, kind: str, obj: dict[str, Any], _before: Any) -> None:
        name = obj["metadata"]["name"]
        gpus: tuple[Gpu, ...] = ()
        if kind == "DELETED":
            self._node_uids.pop(name, None)
        else:
            self._node_uids[name] = obj["metadata"]["uid"]
            gpus = tuple(sorted(manifests.gpus_from_node(obj, self.aliases), key=lambda g: g.index))
        if self._node_gpus.get(name, ()) != gpus:
            if gpus:
                self._node_gpus[name] = gpus
            else:
                self._node_gpus.pop(name, None)
            self._inventory = None  # the index is built again on the next placement
            self._placer = None

    def _index(self) -> Placer:
        if self._placer is None:
            self._placer = Placer(self._gpu_list(), self._ids.values())
        return self._placer

    def _gpu_list(self) -> builtins.list[Gpu]:
        if self._inventory is None:
            self._inventory = [g for node in sorted(self._node_gpus) for g in self._node_gpus[node]]
        return self._inventory

    def indexed(self, policy: Policy) -> Callable[..., Placement]:
        """The ``place_fn`` that places on this ledger's index (the arguments' GPUs and
        allocations are this cache's own; they are not scanned)."""

        def place_fn(
            _gpus: Sequence[Gpu], _allocations: Sequence[Allocation], spec: ShareSpec
        ) -> Placement:
            return self._index().place(spec, policy)

        place_fn.ledger = self  # type: ignore[attr-defined]
        return place_fn

    # -- reads: from memory -----------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        if self._snap is None:
            self._snap = Snapshot(
                allocations=tuple(self._ids.values()),
                versions={node: rv for node, (rv, _) in self._records.items()},
            )
        return self._snap

    async def list(self, node: str | None = None) -> builtins.list[Allocation]:
        if node is not None:
            return builtins.list(self._records.get(node, (0, ()))[1])
        return builtins.list(self._ids.values())

    async def get(self, allocation_id: str) -> Allocation:
        found = self._ids.get(allocation_id)
        if found is None:
            raise AllocationNotFound(allocation_id)
        return found

    async def gpus(self) -> builtins.list[Gpu]:
        return builtins.list(self._gpu_list())

    def node_of(self, allocation_id: str) -> str | None:
        """The node the cache records ``allocation_id`` on (None: no such allocation)."""
        found = self._ids.get(allocation_id)
        return found.node if found is not None else None

    async def _node_owner(self, node: str) -> dict[str, Any] | None:
        uid = self._node_uids.get(node)
        return manifests.node_owner(node, uid) if uid is not None else None

    # -- writes: compare-and-swap, then the cache -------------------------------------------

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        written = await self._write(node, expected_version, allocations)
        if written is None:
            self.conflicts += 1
            await self._catch_up(node, expected_version)
            return False
        await self.ledgers.note(written)
        return True

    async def _catch_up(self, node: str, version: int) -> None:
        """After a lost race: until the cache holds a version of ``node``'s ledger other than
        ``version`` (the winner's), from the watch; one GET if it has not come in time."""

        def moved(obj: dict[str, Any] | None) -> bool:
            if obj is None:
                return version != 0  # deleted (with its node) since we read it
            return int(obj["metadata"].get("resourceVersion") or 0) != version

        try:
            await self.ledgers.wait_for(node, moved, self.catch_up)
        except (asyncio.TimeoutError, TimeoutError):
            custom: Any = self.kube.custom
            try:
                obj = await self.kube._json(
                    custom.get_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, LEDGER_PLURAL, node, _preload_content=False
                    )
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                return
            await self.ledgers.note(obj)

    async def allocate(
        self, spec: ShareSpec, inventory: Sequence[Gpu], place: PlaceFunction, **fields: Any
    ) -> Allocation:
        """As :meth:`Ledger.allocate`, on the index and one node's cached records when ``place``
        is :meth:`indexed`'s (no snapshot of every allocation is built)."""
        if getattr(place, "ledger", None) is not self:
            return await super().allocate(spec, inventory, place, **fields)
        allocation_id = fields.pop("id", None) or Allocation.new_id()
        for _attempt in range(self.max_attempts):
            placement = place(inventory, (), spec)
            chosen = self._index().gpus[placement.gpus[0]].gpu
            allocation = Allocation(
                id=allocation_id,
                node=placement.node,
                gpus=tuple(placement.gpus),
                spec=replace(
                    spec, gpu_type=spec.gpu_type or chosen.type, gpu_memory=placement.memory
                ),
                memory=placement.memory,
                **fields,
            )
            version, current = self._records.get(placement.node, (0, ()))
            if await self.compare_and_swap(placement.node, version, [*current, allocation]):
                return allocation
        raise LedgerConflict(f"could not record the allocation after {self.max_attempts} tries")

    async def release(
        self, allocation_id: str, if_unchanged: Allocation | None = None
    ) -> Allocation | None:
        for _attempt in range(self.max_attempts):
            found = self._ids.get(allocation_id)
            if found is None or (if_unchanged is not None and found != if_unchanged):
                return None
            version, current = self._records.get(found.node, (0, ()))
            rest = [a for a in current if a.id != allocation_id]
            if await self.compare_and_swap(found.node, version, rest):
                return found
        raise LedgerConflict(f"could not release {allocation_id} after {self.max_attempts} tries")

    async def update(
        self,
        allocation_id: str,
        change: Callable[[Allocation, builtins.list[Allocation]], Allocation],
    ) -> Allocation:
        for _attempt in range(self.max_attempts):
            found = self._ids.get(allocation_id)
            if found is None:
                raise AllocationNotFound(allocation_id)
            version, current = self._records.get(found.node, (0, ()))
            others = [a for a in current if a.id != allocation_id]
            changed = change(found, others)
            if await self.compare_and_swap(found.node, version, [*others, changed]):
                return changed
        raise LedgerConflict(f"could not update {allocation_id} after {self.max_attempts} tries")


def _read_ledger(obj: dict[str, Any]) -> tuple[str, list[Allocation]]:
    spec = obj.get("spec") or {}
    node = spec.get("node") or obj["metadata"]["name"]
    return node, [Allocation.from_json(a) for a in spec.get("allocations") or []]


async def connect_ledger(
    namespace: str,
    kubeconfig: str = "",
    context: str = "",
    aliases: TypeAliases | None = None,
) -> KubernetesLedger:
    """The cluster's ledger in ``namespace`` on an API client of its own (``kubeconfig``, else
    in-cluster, else the default kubeconfig: :func:`.client.connect`), for a process outside a
    Jupyter server (the CLI, the Hub, a node agent). Close it with ``await ledger.kube.close()``,
    or use :func:`cluster_ledger`."""
    return KubernetesLedger(await connect(kubeconfig, context), namespace, aliases)


@contextlib.asynccontextmanager
async def cluster_ledger(
    namespace: str, kubeconfig: str = "", context: str = ""
) -> AsyncIterator[KubernetesLedger]:
    """:func:`connect_ledger` for one use: the client is closed on the way out."""
    ledger = await connect_ledger(namespace, kubeconfig, context)
    try:
        yield ledger
    finally:
        await ledger.kube.close()


__all__ = ["KubernetesLedger", "WatchedLedger", "cluster_ledger", "connect_ledger"]
