"""The agent applies users' ledger changes as intents, one at a time, in a fair order (issue 23,
item 6).

A compare-and-swap on a whole node (``ledger.cas``) loses whenever anything on the node changed
since the caller read it, so one user who swaps in a loop (even swaps that change nothing) made
every other user's placement lose 200 times and answer ``busy``. The agent owns the ledger, so
users ask it for what they mean and it applies that to the ledger as it is:

Every reply that changed the ledger also says the node's ``version`` after the change: a
caller whose view of the node was the version before patches its view with the one record
(the view its next change starts from, as after a ``ledger.cas`` with ``"snapshot": true``);
a request with ``"view": true`` (a caller with no view yet) gets the ledger as it may see it
(``allocations``, ``versions``).

``ledger.reserve`` ``{"share": ShareSpec JSON, "policy": Policy JSON|null, "fields": {owner,
    kernel_id, backend, state, pid, pid_start, server_pid, extra, id}, "bound": …, "queue":
    bool}`` → the agent places the share itself (its own ``--config`` policy narrowed by the
    caller's orders and types) and records it: ``{"ok", "allocation"}``; nothing fits: ``no_fit``
    (``message``, ``suggestions``), or with ``"queue": true`` a place in the queue
    (:mod:`.queue_ops`).
``ledger.release`` ``{"id", "if_unchanged": Allocation|null}`` → ``{"ok", "released":
    Allocation|null}``.
``ledger.update`` ``{"id", "version", "before": Allocation, "after": Allocation}`` → the record
    is replaced when it still equals ``before`` (a compare-and-swap on the one record, not on
    the node): ``{"ok", "applied": true, "allocation"}``; else ``{"applied": false}`` with the
    ledger as the caller may see it (the caller recomputes its change).

Each is authorized exactly as a ``ledger.cas`` proposing its result would be
(:func:`.ledger_ops.authorize`: owner uid, protected fields, processes, bounds, capacity).

**Fair order** (:class:`FairWriter`): every write of the agent's ledger — these intents,
``ledger.cas``, a kernel's ``release``/``resize``/``reserve`` and the queue's starts — runs
through one writer, one at a time, so an intent never loses a race. Waiting writes are served
round robin between uids (the agent's own first), so a user with many connections and many
requests waiting gets one turn per round like everyone else; each uid's writes are bounded to
:data:`RATE` per second (bursts of :data:`BURST`; admins unbounded) and :data:`MAX_WAITING` may
wait at once (more are refused ``busy``, to that user only).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from ..ledger import Allocation, LedgerUnavailable
from ..placement.engine import SETTLED, PlacementRefused, place
from ..placement.policy import Policy
from ..share import ShareError, ShareSpec
from . import wire
from .ledger_ops import (
    Caller,
    NotPermitted,
    OverCapacity,
    _cas,
    _shown,
    access_of,
    authorize,
    caller,
    may_use,
    owner_uid,
)

if TYPE_CHECKING:
    from .server import Client, Daemon

T = TypeVar("T")

#: writes per second one uid may make (sustained), and its burst
RATE = 500.0
BURST = 1000.0
#: writes one uid may have waiting for their turn
MAX_WAITING = 64
#: the fields of a new record a caller may fill (the rest is the agent's)
FIELDS = ("id", "owner", "kernel_id", "backend", "state", "pid", "pid_start", "server_pid", "extra")


class Busy(Exception):
    """Too many of one user's writes wait already."""


class FairWriter:
    """The one writer of the agent's ledger (see the module's doc)."""

    def __init__(self, rate: float = RATE, burst: float = BURST, waiting: int = MAX_WAITING):
        self.rate = rate
        self.burst = burst
        self.max_waiting = waiting
        #: uid (None: the agent itself) -> writes waiting, in arrival order; ring order
        self._waiting: OrderedDict[int | None, deque[tuple[Any, asyncio.Future[Any], bool]]] = (
            OrderedDict()
        )
        self._tokens: dict[int, tuple[float, float]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: called after each write (the queue tries its waiting starts)
        self.after: list[Callable[[], None]] = []
        self.writes = 0

    async def run(
        self, uid: int | None, job: Callable[[], Awaitable[T]], bounded: bool = True
    ) -> T:
        """Run ``job`` when it is ``uid``'s turn (None: the agent's own, first); ``bounded``:
        counted against the uid's rate."""
        waiting = self._waiting.get(uid)
        if waiting is not None and uid is not None and len(waiting) >= self.max_waiting:
            raise Busy(f"{len(waiting)} ledger changes of this user wait already")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(uid, deque()).append((job, future, bounded))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve())
        self._wake.set()
        return await future

    def _take(self, now: float) -> tuple[Any, asyncio.Future[Any] | None, float]:
        """The next write to run, or (None, None, seconds until one may run)."""
        own = self._waiting.get(None)
        if own:
            job, fut, _ = own.popleft()
            if not own:
                del self._waiting[None]
            return job, fut, 0.0
        soonest = float("inf")
        for uid in list(self._waiting):
            queue = self._waiting[uid]
            assert uid is not None
            job, fut, bounded = queue[0]
            if bounded:
                tokens, at = self._tokens.get(uid, (self.burst, now))
                tokens = min(self.burst, tokens + (now - at) * self.rate)
                if tokens < 1.0:
                    soonest = min(soonest, (1.0 - tokens) / self.rate)
                    self._tokens[uid] = (tokens, now)
                    continue
                self._tokens[uid] = (tokens - 1.0, now)
            queue.popleft()
            del self._waiting[uid]
            if queue:  # the end of the ring: everyone else goes first next time
                self._waiting[uid] = queue
            return job, fut, 0.0
        return None, None, soonest

    async def _serve(self) -> None:
        while True:
            self._wake.clear()
            job, fut, wait = self._take(time.monotonic())
            if job is None:
                if wait == float("inf"):
                    await self._wake.wait()
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                continue
            assert fut is not None
            if fut.cancelled():
                continue
            try:
                result = await job()
            except Exception as exc:
                if not fut.cancelled():
                    fut.set_exception(exc)
            else:
                if not fut.cancelled():
                    fut.set_result(result)
            self.writes += 1
            for hook in list(self.after):
                hook()


_WRITERS: weakref.WeakKeyDictionary[Any, FairWriter] = weakref.WeakKeyDictionary()


def writer_of(daemon: Daemon) -> FairWriter:
    found = _WRITERS.get(daemon)
    if found is None:
        found = _WRITERS[daemon] = FairWriter()
    return found


async def write(
    daemon: Daemon, who: Caller | None, job: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """``job`` (a write of the ledger) in ``who``'s turn (None: the agent's own); a user over
    their bound on waiting writes gets ``busy``."""
    uid = None if who is None else who.uid
    try:
        return await writer_of(daemon).run(uid, job, bounded=who is not None and not who.admin)
    except Busy as exc:
        return wire.refusal("busy", f"{exc}; try again when they are done")


# -- the ops -------------------------------------------------------------------------------------


async def write_in_turn(
    daemon: Daemon, client: Client, job: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """A write a connected client asked for (a kernel's ``release``/``resize``/``reserve``), in
    its uid's turn."""
    return await write(daemon, caller(daemon, client), job)


async def serve(daemon: Daemon, client: Client, message: dict[str, Any]) -> dict[str, Any]:
    """``ledger.cas`` and the ``ledger.release`` / ``ledger.update`` intents."""
    who = caller(daemon, client)
    refusal = may_use(daemon, who)
    if refusal is not None:
        return refusal
    op = message.get("op")
    try:
        if op == "ledger.cas":
            return await write(daemon, who, lambda: _cas(daemon, who, message))
        if op == "ledger.release":
            return await write(daemon, who, lambda: _release(daemon, who, message))
        if op == "ledger.update":
            return await write(daemon, who, lambda: _update(daemon, who, message))
    except ShareError as exc:
        return {"ok": False, **exc.to_json()}
    except NotPermitted as exc:
        return wire.refusal(wire.E_NOT_PERMITTED, str(exc))
    except OverCapacity as exc:
        return {"ok": False, "error": "over_capacity", "message": str(exc)}
    except LedgerUnavailable as exc:
        return {"ok": False, **exc.to_json()}
    return wire.refusal(wire.E_BAD_REQUEST, f"unknown op {op!r}")


def policy_for(daemon: Daemon, raw: object) -> Policy:
    """The deployment's policy (the agent's ``--config``) narrowed by what the caller asked:
    its orders, wanted and excluded types, cordons (which only take GPUs away)."""
    base = access_of(daemon).policy
    if raw is None:
        return base
    if not isinstance(raw, dict):
        raise ShareError("policy", raw, "a placement policy object (node, gpu, gpu_types, …)")
    try:
        asked = Policy(
            node=str(raw.get("node", base.node)),
            gpu=str(raw.get("gpu", base.gpu)),
            gpu_types=tuple(raw.get("gpu_types") or ()),
            exclude_types=tuple(raw.get("exclude_types") or ()),
            cordoned_nodes=frozenset(str(n) for n in raw.get("cordoned_nodes") or ()),
            cordoned_gpus=frozenset(str(g) for g in raw.get("cordoned_gpus") or ()),
        )
    except (TypeError, ValueError) as exc:
        raise ShareError("policy", raw, f"a placement policy ({exc})") from None
    return base.narrowed(
        node=asked.node,
        gpu=asked.gpu,
        gpu_types=asked.gpu_types,
        exclude_types=asked.exclude_types,
        cordoned_nodes=base.cordoned_nodes | asked.cordoned_nodes,
        cordoned_gpus=base.cordoned_gpus | asked.cordoned_gpus,
    )


def parse_reserve(daemon: Daemon, message: dict[str, Any]) -> tuple[ShareSpec, Policy, dict]:
    """The share, the policy and the record's fields of a ``ledger.reserve``, checked."""
    spec = ShareSpec.from_mapping(message.get("share") or {})
    policy = policy_for(daemon, message.get("policy"))
    raw = message.get("fields") or {}
    if not isinstance(raw, dict):
        raise ShareError("fields", raw, "an object with " + ", ".join(FIELDS))
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ShareError(f"fields.{unknown[0]}", raw[unknown[0]], "one of " + ", ".join(FIELDS))
    fields = dict(raw)
    if not isinstance(fields.get("extra", {}), dict):
        raise ShareError("fields.extra", fields.get("extra"), "an object")
    for key in ("pid", "server_pid"):
        value = fields.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ShareError(f"fields.{key}", value, "a process id (an integer)")
    new_id = fields.get("id")
    if new_id is not None and (not isinstance(new_id, str) or not new_id.startswith("a-")):
        raise ShareError("fields.id", new_id, "an allocation id (a- and 16 hex digits)")
    return spec, policy, fields


async def place_and_record(
    daemon: Daemon,
    who: Caller,
    spec: ShareSpec,
    policy: Policy,
    fields: dict[str, Any],
    bound: ShareSpec | None,
    view: bool = False,
) -> dict[str, Any]:
    """Place ``spec`` on the ledger as it is and record it (run in the writer's turn); with
    ``view``, the reply carries the ledger as ``who`` may see it afterwards."""
    node = daemon.settings.node
    inventory = [g for g in await daemon.ledger.gpus() if g.node == node]
    for _ in range(3):  # only a write from outside the writer (none in system mode) loses
        snap = await daemon.ledger.snapshot()
        try:
            placement = place(inventory, snap.allocations, spec, policy)
        except PlacementRefused as exc:
            return {"ok": False, **exc.to_json()}
        chosen = {g.uuid: g for g in inventory}
        extra = dict(fields.get("extra") or {})
        if spec.gpu_labels.affinity:  # placed one at a time: settled as it is made
            extra[SETTLED] = True
        allocation = Allocation(
            id=fields.get("id") or Allocation.new_id(),
            node=placement.node,
            gpus=tuple(placement.gpus),
            spec=replace(
                spec,
                gpu_type=spec.gpu_type or chosen[placement.gpus[0]].type,
                gpu_memory=placement.memory,
            ),
            memory=placement.memory,
            owner=str(fields.get("owner") or "kernel"),
            kernel_id=fields.get("kernel_id"),
            backend=str(fields.get("backend") or "local"),
            state=str(fields.get("state") or "reserved"),
            pid=fields.get("pid"),
            pid_start=fields.get("pid_start"),
            server_pid=fields.get("server_pid"),
            user=who.name,
            extra=extra,
        )
        current = snap.on_node(placement.node)
        if any(a.id == allocation.id for a in current):
            raise ShareError("fields.id", allocation.id, "an id no allocation has")
        access = access_of(daemon)
        result = authorize(
            current,
            [*current, allocation],
            who,
            placement.node,
            inventory,
            bound,
            access.system,
            access.policy,
        )
        version = snap.versions.get(placement.node, 0)
        if await daemon.ledger.compare_and_swap(placement.node, version, result):
            await daemon.refresh()
            made = next(a for a in result if a.id == allocation.id)
            reply = {"ok": True, "allocation": made.to_json(), "version": version + 1}
            return await _with_view(daemon, who, view, reply)
    return wire.refusal("busy", "the ledger kept changing under the agent; try again")


async def _release(daemon: Daemon, who: Caller, message: dict[str, Any]) -> dict[str, Any]:
    allocation_id = message.get("id")
    if not isinstance(allocation_id, str):
        raise ShareError("id", allocation_id, "an allocation id")
    unchanged = message.get("if_unchanged")
    expected = _parse(unchanged, "if_unchanged") if unchanged is not None else None
    snap = await daemon.ledger.snapshot()
    found = snap.find(allocation_id)
    if found is None or (expected is not None and found != expected):
        return {"ok": True, "released": None}
    current = snap.on_node(found.node)
    inventory = [g for g in await daemon.ledger.gpus() if g.node == found.node]
    access = access_of(daemon)
    result = authorize(
        current,
        [a for a in current if a.id != allocation_id],
        who,
        found.node,
        inventory,
        None,
        access.system,
        access.policy,
    )
    if not await daemon.ledger.compare_and_swap(
        found.node, snap.versions.get(found.node, 0), result
    ):
        return wire.refusal("busy", "the ledger changed under the agent; try again")
    if found.node == daemon.settings.node:
        await daemon.refresh()
    version = snap.versions.get(found.node, 0) + 1
    reply = {"ok": True, "released": found.to_json(), "version": version}
    return await _with_view(daemon, who, message.get("view") is True, reply)


async def _update(daemon: Daemon, who: Caller, message: dict[str, Any]) -> dict[str, Any]:
    allocation_id = message.get("id")
    if not isinstance(allocation_id, str):
        raise ShareError("id", allocation_id, "an allocation id")
    before = _parse(message.get("before"), "before")
    after = _parse(message.get("after"), "after")
    if before.id != allocation_id or after.id != allocation_id:
        raise ShareError("after.id", after.id, f"the id {allocation_id!r} of the record changed")
    snap = await daemon.ledger.snapshot()
    found = snap.find(allocation_id)
    if found is None:
        return {"ok": True, "applied": False, "allocation": None, **_view(snap, who)}
    if not who.admin and owner_uid(found) != who.uid:
        raise NotPermitted(
            f"allocation {found.id} belongs to another user; only they or an admin may change it"
        )
    if found != before:  # changed since the caller read it: it recomputes on this view
        return {"ok": True, "applied": False, "allocation": found.to_json(), **_view(snap, who)}
    node = found.node
    current = snap.on_node(node)
    inventory = [g for g in await daemon.ledger.gpus() if g.node == node]
    access = access_of(daemon)
    try:
        result = authorize(
            current,
            [after if a.id == allocation_id else a for a in current],
            who,
            node,
            inventory,
            None,
            access.system,
            access.policy,
        )
    except OverCapacity:
        if message.get("version") != snap.versions.get(node, 0):  # decided on an old view
            return {"ok": True, "applied": False, "allocation": found.to_json(), **_view(snap, who)}
        raise
    if not await daemon.ledger.compare_and_swap(node, snap.versions.get(node, 0), result):
        return wire.refusal("busy", "the ledger changed under the agent; try again")
    if node == daemon.settings.node:
        await daemon.refresh()
    made = next(a for a in result if a.id == allocation_id)
    version = snap.versions.get(node, 0) + 1
    reply = {"ok": True, "applied": True, "allocation": made.to_json(), "version": version}
    return await _with_view(daemon, who, message.get("view") is True, reply)


async def _with_view(
    daemon: Daemon, who: Caller, view: bool, reply: dict[str, Any]
) -> dict[str, Any]:
    """``reply``, with the ledger as ``who`` may see it now when the caller asked (``"view":
    true``: it has no view of the node to patch)."""
    if view:
        reply.update(_view(await daemon.ledger.snapshot(), who))
    return reply


def _view(snap: Any, who: Caller) -> dict[str, Any]:
    return {"allocations": _shown(snap, who), "versions": dict(snap.versions)}


def _parse(raw: object, name: str) -> Allocation:
    if not isinstance(raw, dict):
        raise ShareError(name, raw, "an allocation object")
    try:
        return Allocation.from_json(raw)
    except ShareError as exc:
        raise ShareError(f"{name}.{exc.field}", exc.value, exc.allowed) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ShareError(name, raw.get("id"), f"an allocation with every field ({exc})") from None
