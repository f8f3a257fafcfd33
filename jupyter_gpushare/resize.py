"""Live resize of a running share: new request, limit or memory cap on the GPU(s) it holds.

The decision is pure (:func:`resized`): the new share must pass the share validator, fit on the
allocation's *current* GPUs next to everyone else there (placement rules: the others' requests
plus the new request at most 1, memory within the GPU), and its memory cap must not be below
what the kernel uses now (refused with both numbers). :func:`resize` applies it with a
compare-and-swap (``Ledger.update``, so a racing placement can never over-allocate the GPU) and
then asks the node daemon to re-read the ledger; the daemon republishes request, limit and memory
cap into the allocation's shared-memory slot, where the interposer and the scheduler pick them up
on the next lease — the kernel is not restarted.

Used by ``PATCH /gpushare/api/allocations/{id}``; a kernel changing its own share goes through
the daemon's ``resize`` op (:mod:`jupyter_gpushare.daemon.kernel_ops`), which applies the same
rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .daemon.client import DaemonClient, DaemonUnavailable
from .inventory import Gpu
from .ledger import Allocation, Ledger
from .placement import place
from .share import ShareError, ShareSpec, format_bytes

log = logging.getLogger("jupyter_gpushare.resize")

#: What a live change may set; the GPU type, count and labels need a new share.
RESIZABLE = ("gpu_request", "gpu_limit", "gpu_memory")


class BelowUse(Exception):
    """A memory cap below what the kernel uses now."""

    def __init__(self, cap: int, used: int) -> None:
        super().__init__(f"gpu_memory {format_bytes(cap)} is below the {format_bytes(used)} "
                         "the kernel uses on its GPU now; free memory first or ask for at least "
                         f"{format_bytes(used)}")
        self.cap = cap
        self.used = used

    def to_json(self) -> dict[str, Any]:
        return {"error": "below_use", "message": str(self), "field": "gpu_memory",
                "value": self.cap, "memory_used": self.used}


def parse_change(current: ShareSpec, change: Mapping[str, Any]) -> ShareSpec:
    """The share after ``change``; keys other than :data:`RESIZABLE` are refused by name."""
    unknown = sorted(set(change) - set(RESIZABLE))
    if unknown:
        raise ShareError(unknown[0], change[unknown[0]],
                         "a live resize may change " + ", ".join(RESIZABLE)
                         + "; other keys need a new share")
    if current.gpu_count > 1:
        raise ShareError("gpu_count", current.gpu_count, "whole GPUs cannot be resized")
    return ShareSpec.from_mapping(change, defaults=current)


def resized(current: Allocation, others: Sequence[Allocation], gpus: Sequence[Gpu],
            change: Mapping[str, Any], memory_used: int | None) -> Allocation:
    """``current`` with ``change`` applied, or a refusal (ShareError, PlacementRefused,
    BelowUse). Pure; ``gpus`` is the inventory (only the allocation's own GPUs are used)."""
    spec = parse_change(current.spec, change)
    own = [g for g in gpus if g.uuid in current.gpus]
    placement = place(own, others, spec)  # refuses with the reason when it does not fit there
    if memory_used is not None and placement.memory < memory_used:
        raise BelowUse(placement.memory, memory_used)
    return replace(current, spec=replace(spec, gpu_memory=placement.memory),
                   memory=placement.memory)


def daemon_memory_used(socket_path: str | Path, allocation_id: str) -> int | None:
    """GPU memory the allocation's processes hold now, from the node daemon (blocking); None
    when no daemon on this machine knows it (enforcement off, or a remote node)."""
    try:
        status = DaemonClient(socket_path, timeout=2.0).status(allocation_id)
    except (DaemonUnavailable, OSError, ValueError):
        return None
    found = status.get("allocations") or []
    return int(found[0]["memory_used"]) if status.get("ok") and found else None


def notify_daemon(socket_path: str | Path) -> bool:
    """Ask the node daemon to re-read the ledger now (blocking); False when none answers (it
    re-reads every ~250 ms anyway)."""
    try:
        DaemonClient(socket_path, timeout=2.0).refresh()
    except (DaemonUnavailable, OSError, ValueError):
        return False
    return True


async def resize(ledger: Ledger, allocation_id: str, change: Mapping[str, Any],
                 socket_path: str | Path, actor: str = "", logger: Any = log
                 ) -> tuple[Allocation, Allocation]:
    """Apply ``change`` to a live allocation; returns ``(before, after)``. Raises ShareError,
    PlacementRefused, BelowUse or AllocationNotFound."""
    used = await asyncio.to_thread(daemon_memory_used, socket_path, allocation_id)
    gpus = await ledger.gpus()
    before = await ledger.get(allocation_id)
    after = await ledger.update(
        allocation_id, lambda current, others: resized(current, others, gpus, change, used)
    )
    await asyncio.to_thread(notify_daemon, socket_path)
    logger.info("gpushare: resized %s (kernel %s) from %s, %s to %s, %s%s", allocation_id,
             after.kernel_id, before.spec.describe(), format_bytes(before.memory),
             after.spec.describe(), format_bytes(after.memory), f" by {actor}" if actor else "")
    return before, after
