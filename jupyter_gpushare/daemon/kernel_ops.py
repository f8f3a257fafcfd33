"""Requests a kernel makes about its *own* share on the daemon's socket (box 9 uses them):
``release``, ``resize``, ``reserve`` and ``gpus``. Each checks the peer's credentials the way
``hello`` does (:meth:`.server.Daemon._check_peer`): a process may act only on the allocation
its process tree holds. The daemon holds the ledger, so these work the same for the local and the
Kubernetes backend.

``release`` ``{"op": "release", "allocation": id}`` → the allocation leaves the ledger, the
daemon forgets it and marks its slots *released* (the interposer then refuses every launch and
allocation and frees the process's GPU memory) → ``{"ok": true, "released": Allocation}``.

``resize`` ``{"op": "resize", "allocation": id, "share": {gpu_request, gpu_limit, gpu_memory}}``
→ a live change on the same GPU(s), refused with the reason when it does not fit there (or when
the new memory cap is below what the kernel uses now) → ``{"ok": true, "allocation": …}``.

``reserve`` ``{"op": "reserve", "share": {…}}`` → after a ``release`` by this process: a new share
on this node for the same kernel, placed by :func:`jupyter_gpushare.placement.allocate` with the
deployment's policy and type aliases (the agent's ``--config``: cordons, exclusions, affinity).
The process itself cannot use it (its CUDA context is gone); a restart of the kernel does.
→ ``{"ok": true, "allocation": …}``.

Bounds: ``resize`` and ``reserve`` are checked against the bound recorded on the allocation when
it was created (:mod:`jupyter_gpushare.bound`: JupyterHub's ``GPUSHARE_MAX_SHARE`` and the
agent's ``--max-share``), so a kernel cannot lift its own bound by asking again.

``gpus`` → ``{"ok": true, "gpus": [Gpu + free capacity], "simulated": bool}`` for every node in
the ledger.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .. import bound as bounds
from ..inventory import check_spec
from ..ledger import Allocation, AllocationNotFound
from ..placement import PlacementRefused, allocate
from ..placement.engine import SETTLED
from ..share import ShareError, ShareSpec
from . import wire
from .ledger_ops import access_of

if TYPE_CHECKING:
    from .server import Client, Daemon

E_NO_FIT = "no_fit"
E_NOTHING_RELEASED = "nothing_released"
#: what a reserved share does not inherit from the released one (placement and reclaim state)
_NOT_CARRIED = (SETTLED, "reclaim_warning")


async def release(daemon: Daemon, client: Client, message: dict[str, Any]) -> dict[str, Any]:
    allocation, refusal = await daemon.peer_allocation(client, str(message.get("allocation")))
    if refusal is not None:
        return refusal
    assert allocation is not None
    await daemon.ledger.release(allocation.id)
    daemon.released[allocation.id] = allocation
    await daemon.refresh()  # forgets it: its slots read "released"
    return {"ok": True, "released": allocation.to_json()}


def _share_error(exc: ShareError) -> dict[str, Any]:
    return {"ok": False, **exc.to_json()}


async def resize(daemon: Daemon, client: Client, message: dict[str, Any]) -> dict[str, Any]:
    """The rules are :func:`jupyter_gpushare.resize.resized`'s (as for ``PATCH`` over REST)."""
    from ..resize import BelowUse, resized

    allocation, refusal = await daemon.peer_allocation(client, str(message.get("allocation")))
    if refusal is not None:
        return refusal
    assert allocation is not None
    change = dict(message.get("share") or {})
    gpus = await daemon.ledger.gpus()
    used = _memory_used(daemon, allocation)

    def within_bound(current: Allocation, others: list[Allocation]) -> Allocation:
        after = resized(current, others, gpus, change, used)
        bounds.check_within(after.spec, after.memory, bounds.recorded(current.extra))
        return after

    try:
        changed = await daemon.ledger.update(allocation.id, within_bound)
    except ShareError as exc:
        return _share_error(exc)
    except (PlacementRefused, BelowUse) as exc:
        return {"ok": False, **exc.to_json()}
    except AllocationNotFound:
        return wire.refusal(wire.E_UNKNOWN_ALLOCATION, f"no allocation {allocation.id!r}")
    await daemon.refresh()
    return {"ok": True, "allocation": changed.to_json()}


def _memory_used(daemon: Daemon, allocation: Allocation) -> int:
    used = 0
    for uuid in allocation.gpus:
        gpu = daemon.gpus.get(uuid)
        tenant = gpu.tenants.get(allocation.id) if gpu else None
        if gpu is not None and tenant is not None:
            used = max(used, int(gpu.shm.account(tenant.slot).mem_used))
    return used


async def reserve(daemon: Daemon, client: Client, message: dict[str, Any]) -> dict[str, Any]:
    """A new share for a kernel whose process released its share through this daemon."""
    previous = next(
        (a for a in reversed(daemon.released.values()) if daemon._check_peer(client, a) is None),
        None,
    )
    if previous is None:
        return wire.refusal(
            E_NOTHING_RELEASED,
            "this process released no GPU share here (a share held now is changed with a resize)",
        )
    share = dict(message.get("share") or {})
    node = daemon.settings.node
    inventory = [g for g in await daemon.ledger.gpus() if g.node == node]
    access = access_of(daemon)
    try:
        bound = bounds.recorded(previous.extra)
        defaults = replace(previous.spec, gpu_memory=None, gpu_type=None)
        spec = bounds.narrowed(ShareSpec.from_mapping(share, defaults=defaults), bound)
        spec = check_spec(spec, inventory, access.aliases)
        allocation = await allocate(
            daemon.ledger,
            spec,
            inventory,
            access.policy,
            owner=previous.owner,
            kernel_id=previous.kernel_id,
            backend=previous.backend,
            state="active",
            pid=previous.pid,
            pid_start=previous.pid_start,
            server_pid=previous.server_pid,
            user=previous.user,
            extra={k: v for k, v in previous.extra.items() if k not in _NOT_CARRIED},
        )
    except ShareError as exc:
        return _share_error(exc)
    except PlacementRefused as exc:
        return {"ok": False, **exc.to_json()}
    daemon.released.pop(previous.id, None)
    await daemon.refresh()
    return {"ok": True, "allocation": allocation.to_json()}


async def gpus(daemon: Daemon) -> dict[str, Any]:
    """Every GPU in the ledger with what is reserved on it and what is free."""
    snap = await daemon.ledger.snapshot()
    held: dict[str, list[Allocation]] = defaultdict(list)
    for a in snap.allocations:
        for uuid in a.gpus:
            held[uuid].append(a)
    rows = []
    inventory = await daemon.ledger.gpus()
    for g in inventory:
        mine = held.get(g.uuid, [])
        used = sum(a.request for a in mine)
        rows.append(
            {
                **g.to_json(),
                "free_request": round(max(0.0, 1.0 - used), 6),
                "free_memory": max(0, g.memory - sum(a.memory for a in mine)),
                "allocations": [a.id for a in mine],
            }
        )
    return {"ok": True, "simulated": any(g.simulated for g in inventory), "gpus": rows}
