"""Ledger: the single source of truth for allocations (DEVELOPING.md, box 3).

One primitive carries every change: :meth:`Ledger.compare_and_swap` replaces the allocations of
one node if, and only if, that node's version is still the one the caller read. Reserving,
releasing and updating are read-modify-CAS loops over it (:meth:`Ledger.allocate`,
:meth:`Ledger.release`, :meth:`Ledger.update`), so any number of placers — threads, processes,
Jupyter servers — can work at once and never over-allocate. Backends: :mod:`.sqlite` (local), and
the Kubernetes API server (``resourceVersion`` preconditions).

The ledger also holds the inventory each node published (:meth:`Ledger.put_gpus`), so that every
reader (server, ``jupyter gpushare status``, ``run``, the node daemon) sees one picture.
"""

from __future__ import annotations

import asyncio
import builtins
import random
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import GpushareError
from ..inventory import Gpu
from ..share import GpuLabels, ShareSpec

#: How a placement is decided: (gpus, live allocations, spec) -> Placement, a function (e.g.
#: :func:`jupyter_gpushare.placement.place`; not the indexed ``placement.Placer`` class).
PlaceFunction = Callable[[Sequence[Gpu], Sequence["Allocation"], ShareSpec], "PlacementLike"]


class PlacementLike:  # the shape the ledger needs from a placement result
    node: str
    gpus: tuple[str, ...]
    memory: int


class LedgerConflict(GpushareError, RuntimeError):
    """A compare-and-swap kept losing (very heavy contention); nothing was changed."""

    code = "busy"
    status = 503


class LedgerUnavailable(GpushareError, RuntimeError):
    """The ledger cannot be read or written (a full disk, a read-only or corrupt file); nothing
    was changed. REST answers 503 ``ledger_unavailable``, the CLI prints one line."""

    code = "ledger_unavailable"
    status = 503

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(
            f"the ledger {where} is unavailable: {reason}", ledger=where, reason=reason
        )
        self.where = where
        self.reason = reason


class AllocationNotFound(GpushareError, KeyError):
    code = "not_found"
    status = 404

    def __init__(self, allocation_id: str) -> None:
        super().__init__(allocation_id)  # args[0]: the id, as for a KeyError
        self.allocation_id = allocation_id
        self.message = f"no allocation {allocation_id!r}"

    def __str__(self) -> str:
        return f"no allocation {self.allocation_id!r}"


@dataclass(frozen=True)
class Allocation:
    """One share held on one node: ``spec`` as asked (type resolved), ``memory`` the cap in bytes
    per GPU, ``gpus`` the UUIDs. ``pid``/``pid_start`` identify the holding process (for
    reconciliation and the daemon's peer check); ``state`` is ``reserved`` until it runs."""

    id: str
    node: str
    gpus: tuple[str, ...]
    spec: ShareSpec
    memory: int
    owner: str = "kernel"  # kernel | run | pool
    kernel_id: str | None = None
    backend: str = "local"
    state: str = "reserved"  # reserved | active
    pid: int | None = None
    pid_start: float | None = None
    server_pid: int | None = None
    user: str = ""
    created: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @staticmethod
    def new_id() -> str:
        return "a-" + uuid.uuid4().hex[:16]

    @property
    def request(self) -> float:
        return self.spec.gpu_request

    @property
    def limit(self) -> float:
        return self.spec.gpu_limit

    @property
    def labels(self) -> GpuLabels:
        return self.spec.gpu_labels

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "gpus": list(self.gpus),
            "gpu_type": self.spec.gpu_type,
            "gpu_request": self.spec.gpu_request,
            "gpu_limit": self.spec.gpu_limit,
            "gpu_memory": self.memory,
            "gpu_count": self.spec.gpu_count,
            "gpu_labels": self.spec.gpu_labels.to_json(),
            "owner": self.owner,
            "kernel_id": self.kernel_id,
            "backend": self.backend,
            "state": self.state,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "server_pid": self.server_pid,
            "user": self.user,
            "created": self.created,
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Allocation:
        spec = ShareSpec(
            gpu_request=float(data["gpu_request"]),
            gpu_limit=float(data["gpu_limit"]),
            gpu_memory=int(data["gpu_memory"]),
            gpu_type=data.get("gpu_type"),
            gpu_count=int(data.get("gpu_count", 1)),
            gpu_labels=GpuLabels.parse(data.get("gpu_labels") or None),
        )
        return cls(
            id=data["id"],
            node=data["node"],
            gpus=tuple(data["gpus"]),
            spec=spec,
            memory=int(data["gpu_memory"]),
            owner=data.get("owner", "kernel"),
            kernel_id=data.get("kernel_id"),
            backend=data.get("backend", "local"),
            state=data.get("state", "reserved"),
            pid=data.get("pid"),
            pid_start=data.get("pid_start"),
            server_pid=data.get("server_pid"),
            user=data.get("user", ""),
            created=float(data.get("created", 0.0)),
            extra=dict(data.get("extra") or {}),
        )


@dataclass(frozen=True)
class Snapshot:
    """All live allocations and each node's version, read at one instant."""

    allocations: tuple[Allocation, ...]
    versions: Mapping[str, int]

    def on_node(self, node: str) -> list[Allocation]:
        return [a for a in self.allocations if a.node == node]

    def find(self, allocation_id: str) -> Allocation | None:
        return next((a for a in self.allocations if a.id == allocation_id), None)


class Ledger(ABC):
    """The allocation store. Subclasses implement four primitives; the rest is built here."""

    #: how many times a losing compare-and-swap is retried before :class:`LedgerConflict`
    max_attempts = 200

    @abstractmethod
    async def snapshot(self) -> Snapshot:
        """Every live allocation, and each node's version."""

    @abstractmethod
    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        """Replace ``node``'s allocations if its version is still ``expected_version``
        (0 for a node never written); True when it took effect."""

    @abstractmethod
    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        """Publish ``node``'s inventory (replacing what it published before)."""

    @abstractmethod
    async def gpus(self) -> list[Gpu]:
        """The published inventory of every node."""

    async def snapshot_to_change(self) -> tuple[Snapshot, bool]:
        """The snapshot a read-modify-CAS loop below starts from, and whether it may be stale.

        A backend that learns the ledger's state from its own compare-and-swap replies
        (:class:`~jupyter_gpushare.ledger.agent.AgentLedger`) hands that out to save a round
        trip: the compare-and-swap still checks the node's version, so a stale view only makes
        it lose and retry on a fresh one, and the loops re-read before any answer a stale view
        could make wrong (nothing fits, not found, changed meanwhile). Default: a fresh
        :meth:`snapshot`."""
        return await self.snapshot(), False

    def forget_snapshot(self) -> None:  # noqa: B027 - optional hook
        """Drop what :meth:`snapshot_to_change` would hand out (a decision on it was negative)."""

    # -- built on the primitives -------------------------------------------------------------

    async def list(self, node: str | None = None) -> list[Allocation]:
        snap = await self.snapshot()
        return [a for a in snap.allocations if node is None or a.node == node]

    async def get(self, allocation_id: str) -> Allocation:
        found = (await self.snapshot()).find(allocation_id)
        if found is None:
            raise AllocationNotFound(allocation_id)
        return found

    async def allocate(
        self,
        spec: ShareSpec,
        inventory: Sequence[Gpu],
        place: PlaceFunction,
        **fields: Any,
    ) -> Allocation:
        """Place ``spec`` and record it atomically; retried while other placers win the race.

        ``place`` raises its refusal (e.g. ``PlacementRefused``) when nothing fits; ``fields``
        fill the :class:`Allocation` (owner, kernel_id, pid, …)."""
        allocation_id = fields.pop("id", None) or Allocation.new_id()
        for attempt in range(self.max_attempts):
            snap, maybe_stale = await self.snapshot_to_change()
            try:
                placement = place(inventory, snap.allocations, spec)
            except Exception:
                if not maybe_stale:
                    raise
                self.forget_snapshot()  # a refusal is only given on a fresh view
                continue
            chosen = {g.uuid: g for g in inventory}
            gpu_type = spec.gpu_type or chosen[placement.gpus[0]].type
            allocation = Allocation(
                id=allocation_id,
                node=placement.node,
                gpus=tuple(placement.gpus),
                spec=replace(spec, gpu_type=gpu_type, gpu_memory=placement.memory),
                memory=placement.memory,
                **fields,
            )
            current = snap.on_node(placement.node)
            version = snap.versions.get(placement.node, 0)
            if await self.compare_and_swap(placement.node, version, [*current, allocation]):
                return allocation
            await _backoff(attempt)
        raise LedgerConflict(f"could not record the allocation after {self.max_attempts} tries")

    async def release(
        self, allocation_id: str, if_unchanged: Allocation | None = None
    ) -> Allocation | None:
        """Remove an allocation; returns it, or None when it was already gone. With
        ``if_unchanged``, only while the record still equals it (a reconciler judged that
        record stale; a kernel restart may have re-pointed it since)."""
        for attempt in range(self.max_attempts):
            snap, maybe_stale = await self.snapshot_to_change()
            found = snap.find(allocation_id)
            if found is None or (if_unchanged is not None and found != if_unchanged):
                if maybe_stale:
                    self.forget_snapshot()
                    continue
                return None
            rest = [a for a in snap.on_node(found.node) if a.id != allocation_id]
            if await self.compare_and_swap(found.node, snap.versions.get(found.node, 0), rest):
                return found
            await _backoff(attempt)
        raise LedgerConflict(f"could not release {allocation_id} after {self.max_attempts} tries")

    async def update(
        self,
        allocation_id: str,
        change: Callable[[Allocation, builtins.list[Allocation]], Allocation],
    ) -> Allocation:
        """Apply ``change(allocation, others_on_its_node)`` atomically; it may raise to refuse
        (for example a resize that no longer fits). Raises :class:`AllocationNotFound`."""
        for attempt in range(self.max_attempts):
            snap, maybe_stale = await self.snapshot_to_change()
            found = snap.find(allocation_id)
            others = []
            if found is not None:
                others = [a for a in snap.on_node(found.node) if a.id != allocation_id]
            try:
                if found is None:
                    raise AllocationNotFound(allocation_id)
                changed = change(found, others)
            except Exception:
                if not maybe_stale:
                    raise
                self.forget_snapshot()
                continue
            if await self.compare_and_swap(
                found.node, snap.versions.get(found.node, 0), [*others, changed]
            ):
                return changed
            await _backoff(attempt)
        raise LedgerConflict(f"could not update {allocation_id} after {self.max_attempts} tries")

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections (optional)."""


async def _backoff(attempt: int) -> None:
    await asyncio.sleep(random.uniform(0, min(0.05, 0.0005 * (attempt + 1))))
