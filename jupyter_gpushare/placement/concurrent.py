"""Placing through the ledger, safely when many placers run at once.

``Ledger.allocate`` places on a snapshot and records the result with a compare-and-swap on the
chosen *node*, retrying when another placer changed that node first. That alone keeps compute,
memory, anti-affinity and exclusive labels right: they are rules about one GPU, so two decisions
that could break them touch the same node and one of them is retried.

Affinity is the one rule that spans nodes: two placers that each start group L at the same time,
on different nodes, both succeed. :func:`allocate` settles that after the fact, before any kernel
runs: every member agrees the group's GPU is its earliest member's (by ``created``, then id, the
same rule the engine uses), and a member that lost the race is released and placed again, which
now puts it on the group's GPU or refuses it with the reason. Backends should reserve through
:func:`allocate` rather than call ``Ledger.allocate`` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..inventory import Gpu
from ..ledger import Allocation, Ledger, LedgerConflict
from ..share import ShareSpec
from .engine import Placement, place
from .policy import Policy

#: How many times a member that lost a race to start its affinity group is moved.
SETTLE_ATTEMPTS = 20


def bind(policy: Policy | None = None) -> Any:
    """``place`` with ``policy`` bound, in the shape ``Ledger.allocate`` calls."""
    chosen = policy if policy is not None else Policy()

    def placer(
        gpus: Sequence[Gpu], allocations: Sequence[Allocation], spec: ShareSpec
    ) -> Placement:
        return place(gpus, allocations, spec, chosen)

    return placer


async def allocate(
    ledger: Ledger,
    spec: ShareSpec,
    inventory: Sequence[Gpu],
    policy: Policy | None = None,
    **fields: Any,
) -> Allocation:
    """Place ``spec`` and record it in ``ledger`` (raises ``PlacementRefused`` / ``ShareError``
    like :func:`.place`); ``fields`` fill the allocation (owner, kernel_id, ...)."""
    placer = bind(policy)
    allocation = await ledger.allocate(spec, inventory, placer, **fields)
    if spec.gpu_labels.affinity:
        allocation = await settle_affinity(ledger, allocation, spec, inventory, placer, fields)
    return allocation


async def settle_affinity(
    ledger: Ledger,
    allocation: Allocation,
    spec: ShareSpec,
    inventory: Sequence[Gpu],
    placer: Any,
    fields: dict[str, Any],
) -> Allocation:
    """Move ``allocation`` onto its affinity group's GPU if a racing placer started the group
    elsewhere first. Returns the allocation as it stands (the same id throughout)."""
    label = spec.gpu_labels.affinity
    for _ in range(SETTLE_ATTEMPTS):
        snap = await ledger.snapshot()
        members = [a for a in snap.allocations if a.spec.gpu_labels.affinity == label]
        if all(a.id != allocation.id for a in members):
            return allocation  # released meanwhile (by its kernel): nothing to settle
        first = min(members, key=lambda a: (a.created, a.id))
        if first.gpus[0] == allocation.gpus[0]:
            return allocation
        await ledger.release(allocation.id)
        fields = {k: v for k, v in fields.items() if k not in ("id", "created")}
        allocation = await ledger.allocate(spec, inventory, placer, id=allocation.id, **fields)
    raise LedgerConflict(f"affinity group {label!r} kept moving; {allocation.id} not settled")
