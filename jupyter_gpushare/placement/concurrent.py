"""Placing through the ledger, safely when many placers run at once.

``Ledger.allocate`` places on a snapshot and records the result with a compare-and-swap on the
chosen *node*, retrying when another placer changed that node first. That alone keeps compute,
memory, anti-affinity and exclusive labels right: they are rules about one GPU, so two decisions
that could break them touch the same node and one of them is retried.

Affinity is the one rule that spans nodes: two placers that each start group L at the same time,
on different nodes, both succeed, and no single compare-and-swap can see both. :func:`allocate`
settles that before returning, so no two members of a group that were handed out (whose kernels
may run) are ever on different GPUs:

1. record the member (``Ledger.allocate``);
2. mark it *settled* (``extra["affinity_settled"]``, a compare-and-swap on its node);
3. read the ledger again: if another settled member of the group is on another GPU, give the
   place up (release) and go back to 1 after a random pause; else return it.

Of two members settled on different GPUs, the one marked second reads after both marks, so it
sees the other and gives up; if each sees the other, both give up and retry (the random pause
breaks the tie). A member placed again goes to the group's anchor, the GPU of its earliest
settled member (see :mod:`.engine`), or is refused with the reason. Backends should reserve through
:func:`allocate` rather than call ``Ledger.allocate`` directly.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..inventory import Gpu
from ..ledger import Allocation, Ledger, LedgerConflict
from ..share import ShareSpec
from .engine import SETTLED, Placement, place
from .policy import Policy

#: How many times a member that lost a race to start its affinity group is placed again.
SETTLE_ATTEMPTS = 50


def bind(policy: Policy | None = None) -> Any:
    """``place`` with ``policy`` bound, in the shape ``Ledger.allocate`` calls."""
    chosen = policy if policy is not None else Policy()

    def placer(
        gpus: Sequence[Gpu], allocations: Sequence[Allocation], spec: ShareSpec
    ) -> Placement:
        return place(gpus, allocations, spec, chosen)

    placer.policy = chosen  # type: ignore[attr-defined]  # an agent places with it itself
    return placer


async def allocate(
    ledger: Ledger,
    spec: ShareSpec,
    inventory: Sequence[Gpu],
    policy: Policy | None = None,
    *,
    place_fn: Any = None,
    **fields: Any,
) -> Allocation:
    """Place ``spec`` and record it in ``ledger`` (raises ``PlacementRefused`` / ``ShareError``
    like :func:`.place`, holding nothing); ``fields`` fill the allocation (owner, kernel_id, ...).
    ``place_fn`` replaces ``place`` with ``policy`` (``(gpus, allocations, spec) -> Placement``,
    for example a long-lived :class:`.Placer`'s method behind a watch)."""
    placer = place_fn if place_fn is not None else bind(policy)
    if not spec.gpu_labels.affinity:
        return await ledger.allocate(spec, inventory, placer, **fields)
    allocation_id = fields.pop("id", None) or Allocation.new_id()
    for attempt in range(SETTLE_ATTEMPTS):
        allocation = await ledger.allocate(spec, inventory, placer, id=allocation_id, **fields)
        settled = await settle_affinity(ledger, allocation)
        if settled is not None:
            return settled
        await asyncio.sleep(random.uniform(0, min(0.1, 0.002 * (attempt + 1))))
    raise LedgerConflict(
        f"affinity group {spec.gpu_labels.affinity!r} kept being started on several GPUs at "
        f"once; gave up after {SETTLE_ATTEMPTS} tries"
    )


async def settle_affinity(ledger: Ledger, allocation: Allocation) -> Allocation | None:
    """Steps 2 and 3 above: the allocation marked settled, or None when it had to be released
    because another settled member of its group holds another GPU."""
    label = allocation.spec.gpu_labels.affinity

    def mark(current: Allocation, _others: list[Allocation]) -> Allocation:
        return replace(current, extra={**current.extra, SETTLED: True})

    marked = await ledger.update(allocation.id, mark)
    snap = await ledger.snapshot()
    rivals = [
        a
        for a in snap.allocations
        if a.id != marked.id
        and a.spec.gpu_labels.affinity == label
        and a.extra.get(SETTLED)
        and a.gpus[0] != marked.gpus[0]
    ]
    if not rivals:
        return marked
    await ledger.release(marked.id)
    return None
