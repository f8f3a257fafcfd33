"""Live resize of a running share: new request, limit or memory cap on the GPU(s) it holds.

The decision is pure (:func:`resized`): the new share must pass the share validator, fit on the
allocation's *current* GPUs next to everyone else there (placement rules: the others' requests
plus the new request at most 1, memory within the GPU), and its memory cap must not be below
what the kernel uses now (refused with both numbers). :func:`resize` applies it with a
compare-and-swap (``Ledger.update``, so a racing placement can never over-allocate the GPU); the
node daemon sees the changed record (locally it is asked to re-read the ledger at once; on
Kubernetes it watches its node's GpuLedger) and republishes request, limit and memory cap into
the allocation's shared-memory slot, where the interposer and the scheduler pick them up on the
next lease — the kernel is not restarted. The memory in use for the below-use check comes from
:mod:`jupyter_gpushare.usage` (the daemon's status locally, its usage ConfigMap on Kubernetes).

Used by ``PATCH /gpushare/api/allocations/{id}``; a kernel changing its own share goes through
the daemon's ``resize`` op (:mod:`jupyter_gpushare.daemon.kernel_ops`), which applies the same
rules.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from .errors import GpushareError
from .inventory import Gpu
from .ledger import Allocation, Ledger
from .placement import place
from .share import ShareError, ShareSpec, format_bytes
from .usage import UsageSource

log = logging.getLogger("jupyter_gpushare.resize")

#: What a live change may set; the GPU type, count and labels need a new share.
RESIZABLE = ("gpu_request", "gpu_limit", "gpu_memory")


class BelowUse(GpushareError):
    """A memory cap below what the kernel uses now."""

    code = "below_use"
    status = 409

    def __init__(self, cap: int, used: int) -> None:
        super().__init__(
            f"gpu_memory {format_bytes(cap)} is below the {format_bytes(used)} "
            "the kernel uses on its GPU now; free memory first or ask for at least "
            f"{format_bytes(used)}",
            field="gpu_memory",
            value=cap,
            allowed=f"at least {format_bytes(used)} (in use now)",
            memory_used=used,
        )
        self.cap = cap
        self.used = used


def parse_change(current: ShareSpec, change: Mapping[str, Any]) -> ShareSpec:
    """The share after ``change``; keys other than :data:`RESIZABLE` are refused by name."""
    unknown = sorted(set(change) - set(RESIZABLE))
    if unknown:
        raise ShareError(
            unknown[0],
            change[unknown[0]],
            "a live resize may change " + ", ".join(RESIZABLE) + "; other keys need a new share",
        )
    if current.gpu_count > 1:
        raise ShareError("gpu_count", current.gpu_count, "whole GPUs cannot be resized")
    return ShareSpec.from_mapping(change, defaults=current)


def resized(
    current: Allocation,
    others: Sequence[Allocation],
    gpus: Sequence[Gpu],
    change: Mapping[str, Any],
    memory_used: int | None,
) -> Allocation:
    """``current`` with ``change`` applied, or a refusal (ShareError, PlacementRefused,
    BelowUse). Pure; ``gpus`` is the inventory (only the allocation's own GPUs are used)."""
    spec = parse_change(current.spec, change)
    own = [g for g in gpus if g.uuid in current.gpus]
    placement = place(own, others, spec)  # refuses with the reason when it does not fit there
    if memory_used is not None and placement.memory < memory_used:
        raise BelowUse(placement.memory, memory_used)
    return replace(
        current, spec=replace(spec, gpu_memory=placement.memory), memory=placement.memory
    )


class UsageUnknown(GpushareError):
    """A lower memory cap asked for while the node's usage report is too old to check it."""

    code = "usage_unknown"
    status = 503

    def __init__(self, node: str, age: float) -> None:
        super().__init__(
            f"the memory in use on node {node} is not known now (its daemon's last "
            f"usage report is {age:.0f} s old), so a lower gpu_memory cannot be "
            "checked against it; try again, or change only request and limit",
            node=node,
            age_s=age,
        )
        self.node = node
        self.age = age


async def resize(
    ledger: Ledger,
    allocation_id: str,
    change: Mapping[str, Any],
    usage: UsageSource,
    actor: str = "",
    logger: Any = log,
) -> tuple[Allocation, Allocation]:
    """Apply ``change`` to a live allocation; returns ``(before, after)``. Raises ShareError,
    PlacementRefused, BelowUse, UsageUnknown or AllocationNotFound.

    The memory in use comes from ``usage`` read fresh: locally the daemon's answer of this
    instant; on Kubernetes the node's last usage report, at most one ``--usage-interval``
    (2 s) old. Memory the kernel allocates after that reading is not part of the check; if it
    takes the kernel over the new cap, nothing is taken away from it: every further allocation
    fails with CUDA_ERROR_OUT_OF_MEMORY (the interposer reserves against the cap atomically)
    until the kernel is back under it. With no report at all from the node (enforcement off
    there) there is nothing to check and nothing enforced."""
    before = await ledger.get(allocation_id)
    view = await usage.read(fresh=True)
    used = view.memory_used(allocation_id)
    if used is None and "gpu_memory" in change and before.node in view.stale:
        raise UsageUnknown(before.node, view.stale[before.node])
    gpus = await ledger.gpus()
    after = await ledger.update(
        allocation_id, lambda current, others: resized(current, others, gpus, change, used)
    )
    await usage.changed()
    logger.info(
        "gpushare: resized %s (kernel %s) from %s, %s to %s, %s%s",
        allocation_id,
        after.kernel_id,
        before.spec.describe(),
        format_bytes(before.memory),
        after.spec.describe(),
        format_bytes(after.memory),
        f" by {actor}" if actor else "",
    )
    return before, after
