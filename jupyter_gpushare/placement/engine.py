"""The placement engine: an index over GPUs and live allocations that answers "where does this
share go?" without scanning the cluster.

Rules (the same in :mod:`.naive`, the reference full-scan placer the tests compare against):

* A GPU can be chosen when it is healthy, not cordoned (``Gpu.cordoned``, ``Policy.cordoned_gpus``,
  ``Policy.cordoned_nodes``), of an admitted type, has the compute and memory the share needs
  free, holds fewer than :data:`~.state.MAX_SHARES_PER_GPU` shares (its lease board's slots),
  and the locality labels allow it. Compute used on a GPU is the sum of the *requests* of
  the allocations listing it (limits are burst, work-conserving); memory used is the sum of their
  memory caps. Compute is counted in integer millionths of a GPU, so sums are exact.
* Labels (after KubeShare): ``affinity`` L — every share labelled L is on one GPU, the group's
  *anchor*: the GPU of its earliest settled member, or of its earliest member while none has
  settled (by ``created``, then id; placers that raced to start a group on two nodes sort it
  out before any of them returns, see :mod:`.concurrent`);
  ``anti_affinity`` L — no two shares labelled L on one GPU; ``exclusive`` E — a
  GPU holding a share labelled E holds only shares labelled E (and a share labelled E only goes
  where every holder is labelled E, or nobody is).
* ``gpu_count > 1`` asks for that many whole GPUs (nothing else on them) of one type on one node:
  on the first node in policy order that has them, the lowest-indexed ones of the first type (by
  name) with enough. Affinity makes no sense there (a :class:`ShareError`).
* Among the GPUs that can be chosen, the policy orders nodes first, then GPUs, each by the sort
  key of the :class:`~.orders.Order` it names (:mod:`.orders`). ``binpack`` prefers the node with
  the least free compute (sum over its healthy, uncordoned GPUs) and the GPU with the least free
  compute, then least free memory; ``spread`` the most. Ties go to the node name, then the GPU
  index, in ascending order, so a decision is deterministic.

The index keeps, per node, its free compute and the best free compute per GPU type, and keeps nodes
sorted by each order's node key once that order is used; a placement walks nodes in that order,
skips a node in O(1) when no GPU there can fit, and looks at the (few) GPUs of the first node that
can. :meth:`Placer.add` / :meth:`Placer.remove` / :meth:`Placer.sync` keep it current cheaply, so a
long-lived placer (a Kubernetes watch, a benchmark) pays O(GPUs + allocations) once.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..inventory import Gpu
from ..share import ShareError, ShareSpec, format_bytes
from .explain import refusal
from .orders import Order
from .policy import Kind, Policy, TypeFilter, resolve_types
from .state import (
    MAX_SHARES_PER_GPU,
    SETTLED,
    UNITS,
    GpuState,
    NodeState,
    Placement,
    PlacementRefused,
    from_units,
    to_units,
)

if TYPE_CHECKING:
    from ..ledger import Allocation

#: what other modules read from here (defined in :mod:`.state`, the box's data)
__all__ = [
    "SETTLED",
    "UNITS",
    "Limits",
    "Placement",
    "PlacementRefused",
    "Placer",
    "anchor_order",
    "check_labels",
    "check_request",
    "from_units",
    "place",
    "to_units",
]


class Placer:
    """An index over ``gpus`` and live ``allocations`` that places shares quickly.

    ``place(spec)`` is pure with respect to the index (it records nothing); record a decision
    with :meth:`add` once the ledger accepted it, or :meth:`sync` with the next snapshot.
    """

    def __init__(
        self,
        gpus: Iterable[Gpu],
        allocations: Iterable[Allocation] = (),
        policy: Policy | None = None,
    ) -> None:
        self.policy = policy if policy is not None else Policy()
        self.inventory = tuple(gpus)
        self.gpus: dict[str, GpuState] = {}
        self.nodes: dict[str, NodeState] = {}
        self._index_inventory()
        self.allocations: dict[str, Allocation] = {}
        self.groups: dict[str, dict[str, Allocation]] = {}  # affinity label -> its members
        #: anti-affinity label -> GPU UUID -> holders with that label (GPUs not in inventory too)
        self.anti: dict[str, dict[str, int]] = {}
        self._filters: dict[tuple[str | None, Policy, int], TypeFilter] = {}
        self._limits: dict[TypeFilter, Limits] = {}
        for allocation in {a.id: a for a in allocations}.values():  # an id counts once
            self._apply(allocation, +1, None)
        for node in self.nodes.values():
            node.refresh()
        #: order -> the nodes sorted by its key, as (key, node name); built for an order on its
        #: first use and kept sorted as nodes' free compute changes
        self._sorted: dict[Order, list[tuple[Any, str]]] = {}
        self._keys = {n.name: n.free for n in self.nodes.values()}  # free compute when sorted

    def _index_inventory(self) -> None:
        for gpu in self.inventory:
            state = GpuState(gpu)
            if gpu.uuid in self.gpus:  # a UUID published twice: the last one wins
                self.nodes[self.gpus[gpu.uuid].node].gpus.remove(self.gpus[gpu.uuid])
            self.gpus[gpu.uuid] = state
            node = self.nodes.get(gpu.node)
            if node is None:
                node = self.nodes[gpu.node] = NodeState(gpu.node)
            node.gpus.append(state)
        for node in self.nodes.values():
            node.gpus.sort(key=lambda g: (g.index, g.uuid))
        self.kinds = frozenset(g.kind for g in self.gpus.values())
        self.types = frozenset(g.type for g in self.gpus.values())
        #: (node, kind) -> (how many GPUs, the most memory of one): what exists, used or not
        self._census: dict[tuple[str, Kind], tuple[int, int]] = {}
        for g in self.gpus.values():
            n, memory = self._census.get((g.node, g.kind), (0, 0))
            self._census[(g.node, g.kind)] = (n + 1, max(memory, g.gpu.memory))

    # -- keeping the index current -----------------------------------------------------------

    def add(self, allocation: Allocation) -> None:
        """Count a new live allocation (replacing one with the same id)."""
        if allocation.id in self.allocations:
            self.remove(allocation.id)
        dirty: set[str] = set()
        self._apply(allocation, +1, dirty)
        self._reorder(dirty)

    def remove(self, allocation_id: str) -> Allocation | None:
        """Forget a released allocation; returns it (None when unknown)."""
        allocation = self.allocations.get(allocation_id)
        if allocation is None:
            return None
        dirty: set[str] = set()
        self._apply(allocation, -1, dirty)
        self._reorder(dirty)
        return allocation

    def sync(self, allocations: Iterable[Allocation]) -> None:
        """Make the index hold exactly ``allocations`` (a fresh ledger snapshot), touching only
        what changed since the last sync."""
        current = {a.id: a for a in allocations}
        for allocation_id in [i for i in self.allocations if i not in current]:
            self.remove(allocation_id)
        for allocation_id, allocation in current.items():
            known = self.allocations.get(allocation_id)
            if known is None or (known is not allocation and not _same_usage(known, allocation)):
                self.add(allocation)
            elif known is not allocation:
                self.allocations[allocation_id] = allocation

    def _apply(self, allocation: Allocation, sign: int, dirty: set[str] | None) -> None:
        spec = allocation.spec
        units = to_units(spec.gpu_request) * sign
        memory = allocation.memory * sign
        exclusive = spec.gpu_labels.exclusive
        if sign > 0:
            self.allocations[allocation.id] = allocation
        else:
            del self.allocations[allocation.id]
        group = spec.gpu_labels.affinity
        if group:
            members = self.groups.setdefault(group, {})
            if sign > 0:
                members[allocation.id] = allocation
            else:
                members.pop(allocation.id, None)
                if not members:
                    del self.groups[group]
        for uuid in dict.fromkeys(allocation.gpus):
            _count(self.anti, spec.gpu_labels.anti_affinity, uuid, sign)
            state = self.gpus.get(uuid)
            if state is None:
                continue
            state.free -= units
            state.mem_free -= memory
            left = state.exclusive.get(exclusive, 0) + sign
            if left:
                state.exclusive[exclusive] = left
            else:
                state.exclusive.pop(exclusive, None)
            if sign > 0:
                state.holders[allocation.id] = allocation
            else:
                state.holders.pop(allocation.id, None)
            if dirty is not None:
                dirty.add(state.node)

    def _reorder(self, dirty: Iterable[str]) -> None:
        for name in dirty:
            node = self.nodes[name]
            old = self._keys[name]
            node.refresh()
            if node.free == old:
                continue
            for order, nodes in self._sorted.items():
                key = order.node_key
                del nodes[bisect_left(nodes, (key(old, name), name))]
                insort(nodes, (key(node.free, name), name))
            self._keys[name] = node.free

    def node_order(self, order: Order) -> list[tuple[Any, str]]:
        """The nodes as ``order`` ranks them: (key, name), best first."""
        nodes = self._sorted.get(order)
        if nodes is None:
            key = order.node_key
            nodes = sorted((key(n.free, n.name), n.name) for n in self.nodes.values())
            self._sorted[order] = nodes
        return nodes

    # -- deciding ----------------------------------------------------------------------------

    def type_filter(self, spec: ShareSpec, policy: Policy) -> TypeFilter:
        key = (spec.gpu_type, policy, id(policy.aliases))
        found = self._filters.get(key)
        if found is None:
            found = self._filters[key] = resolve_types(spec, policy, self.kinds)
        return found

    def place(self, spec: ShareSpec, policy: Policy | None = None) -> Placement:
        """Where ``spec`` goes now; raises :class:`PlacementRefused` (nothing fits now, with the
        reason and what would fit) or :class:`ShareError` (the request can never be valid)."""
        policy = policy if policy is not None else self.policy
        types = self.check(spec, policy)
        if spec.gpu_count > 1:
            found = self._place_whole(spec, policy, types)
        else:
            found = self._place_share(spec, policy, types)
        if found is None:
            raise refusal(self, spec, policy, types)
        return found

    def check(self, spec: ShareSpec, policy: Policy) -> TypeFilter:
        """Refuse (:class:`ShareError`) what no state of this cluster could ever hold."""
        types = self.type_filter(spec, policy)
        limits = self._limits.get(types)
        if limits is None:
            limits = self._limits[types] = Limits.of(self._census, types)
        limits.check(spec, types)
        return types

    def _place_share(self, spec: ShareSpec, policy: Policy, types: TypeFilter) -> Placement | None:
        request = to_units(spec.gpu_request)
        labels = spec.gpu_labels
        anchor = self.anchor(labels.affinity)
        if anchor is not None:
            # The group already has its GPU: only there (whatever the policy would prefer).
            g = self.gpus.get(anchor)
            if g is None or not self.fits(g, spec, request, policy, types):
                return None
            return Placement(g.node, (g.uuid,), spec.resolved_memory(g.gpu.memory))
        cordoned = policy.cordoned_nodes
        gpu_key = policy.gpu_order.gpu_key
        for _, name in self.node_order(policy.node_order):
            node = self.nodes[name]
            if _most_free(node.best, types) < request or name in cordoned:
                continue
            best: GpuState | None = None
            best_key: tuple[Any, ...] | None = None
            for g in node.gpus:
                if not self.fits(g, spec, request, policy, types):
                    continue
                key = gpu_key(g.free, g.mem_free, g.index)
                if best_key is None or key < best_key:
                    best, best_key = g, key
            if best is not None:
                return Placement(name, (best.uuid,), spec.resolved_memory(best.gpu.memory))
        return None

    def anchor(self, label: str | None) -> str | None:
        """The GPU (UUID) of affinity group ``label``: its earliest member's; None when empty."""
        members = self.groups.get(label) if label else None
        if not members:
            return None
        return min(members.values(), key=anchor_order).gpus[0]

    def fits(
        self, g: GpuState, spec: ShareSpec, request: int, policy: Policy, types: TypeFilter
    ) -> bool:
        """Can ``spec`` (``request`` units) go on ``g`` now?"""
        if not g.usable or g.free < request or not types.admits(g.kind):
            return False
        if len(g.holders) >= MAX_SHARES_PER_GPU:
            return False
        if g.mem_free < spec.resolved_memory(g.gpu.memory):
            return False
        if g.uuid in policy.cordoned_gpus or g.node in policy.cordoned_nodes:
            return False
        labels = spec.gpu_labels
        if labels.anti_affinity and self.anti.get(labels.anti_affinity, {}).get(g.uuid):
            return False
        return g.exclusive_ok(labels.exclusive)

    def whole_candidates(
        self, node: NodeState, spec: ShareSpec, policy: Policy, types: TypeFilter
    ) -> dict[str, list[GpuState]]:
        """The GPUs of ``node`` a whole-GPU request may take, by type."""
        found: dict[str, list[GpuState]] = {}
        if node.name in policy.cordoned_nodes:
            return found
        for g in node.gpus:
            if (
                g.usable
                and not g.holders
                and types.admits(g.kind)
                and g.uuid not in policy.cordoned_gpus
                and spec.resolved_memory(g.gpu.memory) <= g.gpu.memory
            ):
                found.setdefault(g.type, []).append(g)
        return found

    def _place_whole(self, spec: ShareSpec, policy: Policy, types: TypeFilter) -> Placement | None:
        count = spec.gpu_count
        for _, name in self.node_order(policy.node_order):
            node = self.nodes[name]
            if sum(n for kind, n in node.whole.items() if types.admits(kind)) < count:
                continue
            by_type = self.whole_candidates(node, spec, policy, types)
            for gpu_type in sorted(by_type):
                chosen = by_type[gpu_type][:count]  # lowest indices: neighbours share links
                if len(chosen) == count:
                    memory = min(spec.resolved_memory(g.gpu.memory) for g in chosen)
                    return Placement(name, tuple(g.uuid for g in chosen), memory)
        return None


@dataclass(frozen=True)
class Limits:
    """What the admitted GPUs of an inventory allow at most, whatever is running on them."""

    gpus: int
    most_on_one_node: int  # admitted GPUs of one type on one node
    largest_memory: int

    @classmethod
    def of(cls, census: dict[tuple[str, Kind], tuple[int, int]], types: TypeFilter) -> Limits:
        """From a census: (node, kind) -> (GPUs, most memory of one)."""
        per_node: dict[tuple[str, str], int] = {}
        largest = 0
        for (node, kind), (n, memory) in census.items():
            if types.admits(kind):
                per_node[(node, kind[0])] = per_node.get((node, kind[0]), 0) + n
                largest = max(largest, memory)
        total = sum(n for n, _ in census.values())
        return cls(total, max(per_node.values(), default=0), largest)

    def check(self, spec: ShareSpec, types: TypeFilter) -> None:
        """:class:`ShareError` for a request no state of this inventory could ever satisfy."""
        if not self.gpus:
            raise ShareError("gpu_type", spec.gpu_type, "a GPU in the inventory; there are none")
        check_labels(spec)
        if spec.gpu_count > self.most_on_one_node and spec.gpu_count > 1:
            raise ShareError(
                "gpu_count",
                spec.gpu_count,
                f"at most {self.most_on_one_node} (the most {types.label}s of one type on one "
                "node)",
            )
        if spec.gpu_memory is not None and spec.gpu_memory > self.largest_memory:
            raise ShareError(
                "gpu_memory",
                format_bytes(spec.gpu_memory),
                f"at most {format_bytes(self.largest_memory)} (the memory of the largest "
                f"{types.label})",
            )


def check_request(spec: ShareSpec, types: TypeFilter, gpus: Sequence[Gpu]) -> None:
    """:class:`ShareError` for a request no state of ``gpus`` could ever satisfy."""
    census: dict[tuple[str, Kind], tuple[int, int]] = {}
    for g in gpus:
        n, memory = census.get((g.node, (g.type, g.name)), (0, 0))
        census[(g.node, (g.type, g.name))] = (n + 1, max(memory, g.memory))
    Limits.of(census, types).check(spec, types)


def check_labels(spec: ShareSpec) -> None:
    """:class:`ShareError` for labels that contradict each other or the request."""
    labels = spec.gpu_labels
    if labels.affinity and labels.affinity == labels.anti_affinity:
        raise ShareError(
            "gpu_labels.anti_affinity",
            labels.anti_affinity,
            "a label other than the affinity label (a share cannot be with and apart from the "
            "same group)",
        )
    if spec.gpu_count > 1 and labels.affinity:
        raise ShareError(
            "gpu_labels.affinity",
            labels.affinity,
            f"no affinity label with gpu_count={spec.gpu_count}: whole GPUs are shared with "
            "nobody, so they cannot join a group on one GPU",
        )


def _most_free(best: dict[Kind, int], types: TypeFilter) -> int:
    if types.allowed is None and not types.excluded:
        return max(best.values(), default=-1)
    return max((free for t, free in best.items() if types.admits(t)), default=-1)


def _count(index: dict[str, dict[str, int]], label: str | None, uuid: str, sign: int) -> None:
    """Count one holder labelled ``label`` on GPU ``uuid`` in or out of ``index``."""
    if not label:
        return
    by_gpu = index.setdefault(label, {})
    left = by_gpu.get(uuid, 0) + sign
    if left:
        by_gpu[uuid] = left
    else:
        by_gpu.pop(uuid, None)
        if not by_gpu:
            del index[label]


def anchor_order(a: Allocation) -> tuple[bool, float, str]:
    """Sort key of affinity group members: the first one's GPU is the group's."""
    return (not a.extra.get(SETTLED), a.created, a.id)


def _same_usage(a: Allocation, b: Allocation) -> bool:
    """Do ``a`` and ``b`` weigh the same in the index (a change of anything else, such as the
    state or the pid, does not touch it)?"""
    return (
        a.gpus == b.gpus
        and a.memory == b.memory
        and a.created == b.created
        and a.spec.gpu_request == b.spec.gpu_request
        and a.spec.gpu_labels == b.spec.gpu_labels
        and a.extra.get(SETTLED) == b.extra.get(SETTLED)
    )


#: The last index each thread built for :func:`place`, reused when the next call has the same
#: inventory (the ledger's retry loop, a server placing kernel after kernel).
_recent = threading.local()


def place(
    gpus: Sequence[Gpu],
    allocations: Sequence[Allocation],
    spec: ShareSpec,
    policy: Policy = Policy(),  # noqa: B008 - frozen, immutable default
) -> Placement:
    """Where ``spec`` goes given ``gpus`` and the live ``allocations``.

    Pure: the answer depends on the arguments only. To stay fast on big clusters it reuses the
    index this thread built on its previous call when the inventory is the same (compared in
    full) and brings it up to date with :meth:`Placer.sync` (only allocations that changed are
    touched); otherwise it builds a fresh one (O(GPUs + allocations))."""
    inventory = tuple(gpus)
    placer: Placer | None = getattr(_recent, "placer", None)
    if placer is None or placer.inventory != inventory:
        placer = Placer(inventory, allocations)
        _recent.placer = placer
    else:
        placer.sync(allocations)
    return placer.place(spec, policy)
