"""The agent's queue (DESIGN box 13, local deployments): starts that do not fit wait here.

The order, the ETA and the words are the pure :mod:`jupyter_gpushare.queue`; this is its shell
in the node agent, which owns the ledger and so the queue:

``ledger.reserve`` (:mod:`.intents`) with ``"queue": true`` → placed and recorded when it fits
    and no other start waits for its kind of GPU (else it joins the queue, whose fair order
    decides: a newcomer does not pass those already waiting by arriving while capacity frees);
    else, when it could fit on this machine at all (on its GPUs with nothing else on them, and
    within the caller's bound), a queue entry: ``{"ok", "queued": true, "entry": view}``; a
    start that can never fit is refused at once with the reason (``never_fits``), as is one
    over the per-user cap on waiting starts (``queue_full``).
``ledger.queue.wait`` ``{"entry", "timeout": s ≤ 20}`` → the entry's view once it changed
    state (started: with its ``allocation``; cancelled, dropped, failed: with the ``reason``),
    or after ``timeout`` with its current position and ETA.
``ledger.queue.cancel`` ``{"entry"}`` → the entry's view (``cancelled``; or ``started`` with
    its allocation when the start won: the caller then holds a share it may release).
``ledger.queue`` → the waiting entries in order: a caller's own whole, others' as capacity
    only (position, share, since); admins see who.

Promises: entries live in the ledger's SQLite file (table ``queue``), so an agent restart keeps
them; every write of the ledger (a release, a shutdown, idle reclaim, a resize down, a pool
kernel given back) wakes the runner at once, which tries the waiting starts in order in the
writer's turn (:class:`.intents.FairWriter`: nothing else changes the ledger meanwhile), so a
start that fits begins well within 1 s of the release; a ledger write from outside the writer
(the agent's reconciliation) is seen within :data:`TICK_S`. An entry is started at most once:
its allocation carries ``extra.queue_entry``, and a restarted agent marks an entry whose
allocation exists as started instead of starting it again. An entry whose requester (the
process that asked, or the ``server_pid`` it named) is gone is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import sqlite3
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from .. import bound as bounds
from ..inventory import Gpu
from ..ledger import LedgerUnavailable, Snapshot
from ..placement.engine import PlacementRefused, place
from ..placement.policy import Policy
from ..queue import (
    Deadline,
    Entry,
    Eta,
    Pass,
    QueuePolicy,
    Release,
    describe,
    estimate,
    fair_order,
)
from ..queue.figures import QueueMetrics
from ..share import ShareError, ShareSpec
from . import wire
from .intents import parse_reserve, place_and_record, policy_for, write, writer_of
from .ledger_ops import (
    Caller,
    NotPermitted,
    OverCapacity,
    bound_for,
    caller,
    may_use,
    owner_uid,
)

if TYPE_CHECKING:
    from .server import Client, Daemon

log = logging.getLogger("jupyter_gpushare.daemon")

#: how often the runner looks without being woken (writes from outside the writer; requesters
#: that died)
TICK_S = 0.25
#: the longest ``ledger.queue.wait``
MAX_WAIT_S = 20.0
#: ``Allocation.extra`` key naming the queue entry a share was started for
ENTRY_KEY = "queue_entry"
#: releases remembered for the ETA's rate
HISTORY = 2048
#: finished entries kept (to answer a late ``wait``/``cancel``)
FINISHED_KEPT = 1024

WAITING, STARTED, CANCELLED, DROPPED, FAILED = (
    "waiting",
    "started",
    "cancelled",
    "dropped",
    "failed",
)


@dataclass
class QueueEntry:
    """One waiting start, as the agent keeps it (and writes it to the ``queue`` table)."""

    id: str
    uid: int
    user: str
    share: dict[str, Any]
    policy: dict[str, Any] | None
    fields: dict[str, Any]
    bound: dict[str, Any] | None
    requester: int
    requester_start: float | None
    since: float
    priority: int = 0
    weight: float = 1.0
    state: str = WAITING
    allocation: dict[str, Any] | None = None
    reason: str | None = None
    first_eta: dict[str, Any] | None = None
    ended: float | None = None

    @property
    def spec(self) -> ShareSpec:
        return ShareSpec.from_mapping(self.share)

    def entry(self) -> Entry:
        spec = self.spec
        return Entry(
            id=self.id,
            user=self.user,
            request=spec.gpu_request,
            memory=spec.gpu_memory or 0,
            count=spec.gpu_count,
            gpu_type=spec.gpu_type,
            since=self.since,
            priority=self.priority,
            weight=self.weight,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QueueEntry:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class QueueStore:
    """The ``queue`` table in the ledger's SQLite file (the agent's alone, as the ledger is)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("CREATE TABLE IF NOT EXISTS queue (id TEXT PRIMARY KEY, body TEXT NOT NULL)")
        return db

    def load_sync(self) -> list[QueueEntry]:
        with contextlib.closing(self._db()) as db:
            rows = db.execute("SELECT body FROM queue").fetchall()
        out = []
        for (body,) in rows:
            try:
                out.append(QueueEntry.from_json(json.loads(body)))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("skipped an unreadable queue entry: %s", exc)
        return out

    def put_sync(self, entries: Sequence[QueueEntry], gone: Sequence[str] = ()) -> None:
        with contextlib.closing(self._db()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO queue (id, body) VALUES (?, ?) "
                "ON CONFLICT(id) DO UPDATE SET body=excluded.body",
                [(e.id, json.dumps(e.to_json())) for e in entries],
            )
            db.executemany("DELETE FROM queue WHERE id=?", [(i,) for i in gone])
            db.execute("COMMIT")


class AgentQueue:
    """One agent's queue: entries, their store, the runner, what releases were seen."""

    def __init__(self, daemon: Daemon, policy: QueuePolicy) -> None:
        self.daemon = daemon
        self.policy = policy
        path = getattr(daemon.ledger, "path", None)
        self.store = QueueStore(Path(path)) if isinstance(path, (str, Path)) else None
        self.entries: dict[str, QueueEntry] = {}
        self.finished: dict[str, QueueEntry] = {}
        self.changed: dict[str, asyncio.Event] = {}
        self.releases: deque[Release] = deque(maxlen=HISTORY)
        self.metrics = QueueMetrics()
        self._seen: dict[str, tuple[float, str]] = {}
        self._seen_snap: Snapshot | None = None
        self._kick = asyncio.Event()
        self._kicked_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._loaded = False

    # -- life ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if self.store is not None:
            try:
                for e in await asyncio.to_thread(self.store.load_sync):
                    (self.entries if e.state == WAITING else self.finished)[e.id] = e
            except sqlite3.Error as exc:
                log.warning("could not read the queue from %s: %s", self.store.path, exc)
        writer_of(self.daemon).after.append(self.kick)
        self._task = asyncio.get_running_loop().create_task(self._run())
        if self.entries:
            log.info("queue: %d waiting starts kept from before", len(self.entries))

    def kick(self) -> None:
        """Capacity may have freed: try the waiting starts now."""
        if self._kicked_at is None:
            self._kicked_at = time.monotonic()
        self._kick.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), TICK_S)
            self._kick.clear()
            kicked, self._kicked_at = self._kicked_at, None
            try:
                await self._observe()
                if self.entries:
                    await write(self.daemon, None, functools.partial(self._pass, kicked))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken ledger: logged by the agent's own reads
                log.debug("queue pass failed: %r", exc)

    async def _persist(self, *entries: QueueEntry, gone: Sequence[str] = ()) -> None:
        if self.store is None:
            return
        try:
            await asyncio.to_thread(self.store.put_sync, entries, gone)
        except sqlite3.Error as exc:
            log.warning("could not write the queue to %s: %s", self.store.path, exc)

    # -- what frees capacity ---------------------------------------------------------------

    async def _observe(self) -> None:
        """Releases and resizes down since the last look (for the ETA's rate)."""
        snap = await self.daemon.ledger.snapshot()
        if snap is self._seen_snap:
            return
        self._seen_snap = snap
        now = time.time()
        current = {
            a.id: (a.request * a.spec.gpu_count, str(a.spec.gpu_type or "GPU"))
            for a in snap.allocations
        }
        for aid, (request, kind) in self._seen.items():
            after = current.get(aid)
            freed = request - (after[0] if after else 0.0)
            if freed > 1e-9:
                self.releases.append(Release(now, freed, kind))
        self._seen = current

    # -- entries -------------------------------------------------------------------------------

    def _finish(self, entry: QueueEntry, state: str, reason: str | None = None) -> None:
        entry.state = state
        entry.reason = reason
        entry.ended = time.time()
        self.entries.pop(entry.id, None)
        self.finished[entry.id] = entry
        while len(self.finished) > FINISHED_KEPT:
            self.finished.pop(next(iter(self.finished)))
        event = self.changed.pop(entry.id, None)
        if event is not None:
            event.set()

    def _alive(self, entry: QueueEntry) -> bool:
        try:
            proc = psutil.Process(entry.requester)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            start = entry.requester_start
            return start is None or abs(proc.create_time() - start) < 0.05
        except psutil.Error:
            return False

    async def _pass(self, kicked: float | None) -> dict[str, Any]:
        """Try the waiting starts in order (in the writer's turn)."""
        daemon = self.daemon
        dead = [e for e in self.entries.values() if not self._alive(e)]
        for e in dead:
            self._finish(e, DROPPED, "the process that asked for it is gone")
            self.metrics.dropped += 1
        snap = await daemon.ledger.snapshot()
        # shares started for an entry (before a restart, say): only a share of the entry's
        # own user counts, so nobody can mark another's waiting start as started
        made = {
            (a.extra.get(ENTRY_KEY), owner_uid(a)): a
            for a in snap.allocations
            if a.extra.get(ENTRY_KEY)
        }
        changed: list[QueueEntry] = list(dead)
        now = time.time()
        turn = Pass(now, self.policy.hold_s)
        gpus = await daemon.ledger.gpus()
        for item in self._ordered(snap, gpus):
            entry = self.entries.get(item.id)
            if entry is None:
                continue
            if (entry.id, entry.uid) in made:  # started before a restart: never twice
                entry.allocation = made[entry.id, entry.uid].to_json()
                self._finish(entry, STARTED)
                changed.append(entry)
                continue
            reply = await self._try(entry, turn.held)
            if reply.get("ok"):
                entry.allocation = reply["allocation"]
                self._started(entry, now, kicked)
                changed.append(entry)
                snap = await daemon.ledger.snapshot()
            elif reply.get("error") == PlacementRefused.code:
                turn.missed(item, self._emptiest(entry, snap, gpus))
            else:
                self._finish(entry, FAILED, str(reply.get("message") or reply.get("error")))
                self.metrics.failed += 1
                changed.append(entry)
        if changed:
            await self._persist(*changed)
        return {"ok": True}

    def _emptiest(self, entry: QueueEntry, snap: Snapshot, gpus: Sequence[Gpu]) -> list[str]:
        """The GPUs ``entry`` could use, the one with most free compute first."""
        spec = entry.spec
        kind = (spec.gpu_type or "").lower()
        node = self.daemon.settings.node
        usable = [
            g for g in gpus if g.node == node and g.healthy and (not kind or g.type.lower() == kind)
        ]
        used = {g.uuid: 0.0 for g in usable}
        for a in snap.allocations:
            for u in a.gpus:
                if u in used:
                    used[u] += a.request
        return sorted(used, key=lambda u: (used[u], u))

    async def _try(self, entry: QueueEntry, held: set[str]) -> dict[str, Any]:
        try:
            spec = entry.spec
            policy = policy_for(self.daemon, entry.policy)
            if held:  # GPUs kept for starts that waited past the hold: not for this one
                policy = replace(policy, cordoned_gpus=policy.cordoned_gpus | frozenset(held))
            fields = dict(entry.fields)
            fields["extra"] = {**dict(fields.get("extra") or {}), ENTRY_KEY: entry.id}
            who = Caller(entry.uid, entry.user, False, frozenset())
            return await place_and_record(
                self.daemon, who, spec, policy, fields, bounds.from_json(entry.bound, "bound")
            )
        except (ShareError, NotPermitted, OverCapacity) as exc:
            return {"ok": False, "error": "refused", "message": str(exc)}

    def _started(self, entry: QueueEntry, now: float, kicked: float | None) -> None:
        if kicked is not None:
            self.metrics.reactions.append(time.monotonic() - kicked)
        self.metrics.started_after(now - entry.since, entry.first_eta, now)
        self._finish(entry, STARTED)

    # -- order, position, ETA ---------------------------------------------------------------

    def _ordered(self, snap: Snapshot, gpus: Sequence[Gpu]) -> list[Entry]:
        node = [g for g in gpus if g.node == self.daemon.settings.node]
        held: dict[str, tuple[float, float]] = {}
        for a in snap.allocations:
            c, m = held.get(a.user, (0.0, 0.0))
            held[a.user] = (c + a.request * a.spec.gpu_count, m + a.memory * a.spec.gpu_count)
        return fair_order(
            [e.entry() for e in self.entries.values()],
            held,
            float(len(node)),
            float(sum(g.memory for g in node)),
        )

    def view(
        self,
        entry: QueueEntry,
        who: Caller | None,
        snap: Snapshot,
        gpus: Sequence[Gpu],
        ordered: list[Entry] | None = None,
    ) -> dict[str, Any]:
        """What ``who`` sees of ``entry`` (None: everything)."""
        whole = who is None or who.admin or who.uid == entry.uid
        out: dict[str, Any] = {
            "id": entry.id,
            "state": entry.state,
            "share": entry.share,
            "since": entry.since,
            "waited_s": round((entry.ended or time.time()) - entry.since, 1),
        }
        if whole:
            out.update(
                user=entry.user,
                kernel_id=entry.fields.get("kernel_id"),
                owner=entry.fields.get("owner"),
                reason=entry.reason,
                allocation=entry.allocation,
                first_eta=entry.first_eta,
            )
        if entry.state == WAITING:
            order = ordered if ordered is not None else self._ordered(snap, gpus)
            position = next((i for i, e in enumerate(order, 1) if e.id == entry.id), 0)
            eta = self.eta(entry, order[: max(position - 1, 0)], snap, gpus)
            out["position"] = position
            out["eta"] = eta.to_json()
            out["message"] = describe(position, self._typed(entry.spec, gpus).describe(), eta)
        else:
            out["message"] = {
                STARTED: "started",
                CANCELLED: "cancelled",
                DROPPED: f"dropped: {entry.reason}",
                FAILED: f"could not start: {entry.reason}",
            }.get(entry.state, entry.state)
        return out

    def _typed(self, spec: ShareSpec, gpus: Sequence[Gpu]) -> ShareSpec:
        """``spec`` with its type named where it takes any and this machine has one type (so
        the words say "0.5 of an A100", not "of a GPU")."""
        if spec.gpu_type is not None:
            return spec
        types = {g.type for g in gpus if g.node == self.daemon.settings.node}
        return replace(spec, gpu_type=types.pop()) if len(types) == 1 else spec

    def eta(
        self, entry: QueueEntry, ahead: Sequence[Entry], snap: Snapshot, gpus: Sequence[Gpu]
    ) -> Eta:
        spec = self._typed(entry.spec, gpus)
        kind = (spec.gpu_type or "GPU").lower()
        node = [
            g
            for g in gpus
            if g.node == self.daemon.settings.node and (kind == "gpu" or g.type.lower() == kind)
        ]
        used: dict[str, float] = {g.uuid: 0.0 for g in node}
        deadlines: list[Deadline] = []
        for a in snap.allocations:
            for u in a.gpus:
                if u in used:
                    used[u] += a.request
            warning = a.extra.get("reclaim_warning")
            if isinstance(warning, dict):
                with contextlib.suppress(TypeError, ValueError):
                    at = float(warning.get("release_at", 0))
                    deadlines.extend(
                        Deadline(at, a.request, str(a.spec.gpu_type or "GPU"), u)
                        for u in a.gpus
                        if u in used
                    )
        same = [e for e in ahead if e.kind in (kind, "*") or kind == "gpu"]
        now = time.time()
        return estimate(
            spec.gpu_request,
            str(spec.gpu_type or "GPU"),
            now,
            [r for r in self.releases if kind == "gpu" or r.gpu_type.lower() == kind],
            deadlines,
            window_s=self.policy.eta_window_s,
            ahead=sum(e.request for e in same),
            free={u: max(0.0, 1.0 - v) for u, v in used.items()},
        )

    # -- ops -----------------------------------------------------------------------------------

    async def enqueue(
        self,
        who: Caller,
        client: Client,
        spec: ShareSpec,
        policy: Policy,
        fields: dict[str, Any],
        bound: ShareSpec | None,
        refused: dict[str, Any],
    ) -> dict[str, Any]:
        daemon = self.daemon
        node = daemon.settings.node
        inventory = [g for g in await daemon.ledger.gpus() if g.node == node]
        try:  # could it fit on this machine at all, nothing else on it?
            empty = place(inventory, [], spec, policy)
        except (PlacementRefused, ShareError) as exc:
            return wire.refusal(
                "never_fits",
                f"{spec.describe()} can never fit here, even with no other share: "
                f"{getattr(exc, 'message', None) or exc}",
            )
        try:
            bounds.check_within(spec, empty.memory, bound)
        except ShareError as exc:
            return {"ok": False, **exc.to_json()}
        mine = [e for e in self.entries.values() if e.uid == who.uid]
        if not who.admin and len(mine) >= self.policy.max_per_user:
            return wire.refusal(
                "queue_full",
                f"user {who.name} has {len(mine)} starts waiting already (at most "
                f"{self.policy.max_per_user}); cancel one or wait for one to start",
            )
        holder = fields.get("server_pid") or fields.get("pid") or client.pid
        try:
            proc = psutil.Process(holder)
            if not who.admin and proc.uids().real != who.uid:
                raise NotPermitted(f"process {holder} is not a process of user {who.name}")
            started = proc.create_time()
        except psutil.Error:
            return wire.refusal(wire.E_NOT_PERMITTED, f"process {holder} is gone")
        groups = _group_names(who.groups)
        entry = QueueEntry(
            id="q-" + uuid.uuid4().hex[:16],
            uid=who.uid,
            user=who.name,
            share=_share_json(replace(spec, gpu_memory=spec.gpu_memory)),
            policy=policy.to_json(),
            fields=fields,
            bound=bounds.to_json(bound) if bound is not None else None,
            requester=int(holder),
            requester_start=started,
            since=time.time(),
            priority=self.policy.priority_of(groups),
            weight=self.policy.weight_of(groups),
        )
        self.entries[entry.id] = entry
        # one pass first: a start the fair order lets in now starts now, shown no ETA
        await write(daemon, None, functools.partial(self._pass, None))
        if entry.state != WAITING:
            await self._persist(entry)
            if entry.state == STARTED and entry.allocation is not None:
                return {"ok": True, "allocation": entry.allocation}
            return wire.refusal("refused", f"the start could not begin: {entry.reason}")
        snap = await daemon.ledger.snapshot()
        gpus = await daemon.ledger.gpus()
        shown = self.view(entry, who, snap, gpus)
        entry.first_eta = shown["eta"] if shown["eta"]["hi_s"] is not None else None
        shown["first_eta"] = entry.first_eta
        await self._persist(entry)
        log.info("queue: %s waits for %s (%s)", who.name, spec.describe(), shown["message"])
        self.kick()
        return {"ok": True, "queued": True, "entry": shown, "refusal": refused.get("message")}

    def competing(self, spec: ShareSpec) -> int:
        """How many waiting starts could take the capacity ``spec`` would (same GPU type, or
        either takes any type)."""
        kind = (spec.gpu_type or "*").lower()
        return sum(1 for e in self.entries.values() if kind == "*" or e.entry().kind in (kind, "*"))

    def find(self, entry_id: object, who: Caller) -> QueueEntry | dict[str, Any]:
        key = entry_id if isinstance(entry_id, str) else ""
        entry = self.entries.get(key) or self.finished.get(key)
        if entry is None or not (who.admin or entry.uid == who.uid):
            return wire.refusal("unknown_entry", f"no queued start {entry_id!r:.40} of yours")
        return entry

    async def wait(self, who: Caller, message: dict[str, Any]) -> dict[str, Any]:
        found = self.find(message.get("entry"), who)
        if isinstance(found, dict):
            return found
        timeout = message.get("timeout", MAX_WAIT_S)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise ShareError("timeout", timeout, f"seconds, from 0 to {MAX_WAIT_S:g}")
        if found.state == WAITING:
            event = self.changed.setdefault(found.id, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), min(float(timeout), MAX_WAIT_S))
        snap = await self.daemon.ledger.snapshot()
        return {"ok": True, "entry": self.view(found, who, snap, await self.daemon.ledger.gpus())}

    async def cancel(self, who: Caller, message: dict[str, Any]) -> dict[str, Any]:
        found = self.find(message.get("entry"), who)
        if isinstance(found, dict):
            return found

        async def job() -> dict[str, Any]:  # in the writer's turn: never beside its start
            if found.state == WAITING:
                self._finish(found, CANCELLED, f"cancelled by {who.name}")
                self.metrics.cancelled += 1
                await self._persist(found)
            snap = await self.daemon.ledger.snapshot()
            gpus = await self.daemon.ledger.gpus()
            return {"ok": True, "entry": self.view(found, who, snap, gpus)}

        return await write(self.daemon, None, job)

    async def listing(self, who: Caller) -> dict[str, Any]:
        snap = await self.daemon.ledger.snapshot()
        gpus = await self.daemon.ledger.gpus()
        order = self._ordered(snap, gpus)
        return {
            "ok": True,
            "entries": [self.view(self.entries[e.id], who, snap, gpus, order) for e in order],
            "metrics": self.figures(),
        }

    def figures(self) -> dict[str, Any]:
        return self.metrics.to_json(len(self.entries))


def _share_json(spec: ShareSpec) -> dict[str, Any]:
    return {k: v for k, v in spec.to_json().items() if v is not None}


def _group_names(gids: frozenset[int]) -> list[str]:
    import grp

    out = []
    for gid in gids:
        try:
            out.append(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return out


_QUEUES: weakref.WeakKeyDictionary[Any, AgentQueue] = weakref.WeakKeyDictionary()
_POLICIES: weakref.WeakKeyDictionary[Any, QueuePolicy] = weakref.WeakKeyDictionary()


def figures_of(daemon: Daemon) -> dict[str, Any] | None:
    """The queue's figures (metrics), None where the agent has no queue."""
    found = _QUEUES.get(daemon)
    return found.figures() if found is not None else None


def configure(daemon: Daemon, policy: QueuePolicy) -> None:
    """The admin's queue rules (``--queue-*``), set before the agent serves."""
    _POLICIES[daemon] = policy


async def queue_of(daemon: Daemon) -> AgentQueue:
    found = _QUEUES.get(daemon)
    if found is None:
        found = _QUEUES[daemon] = AgentQueue(daemon, _POLICIES.get(daemon, QueuePolicy()))
    await found.start()
    return found


async def serve(daemon: Daemon, client: Client, message: dict[str, Any]) -> dict[str, Any]:
    """``ledger.reserve`` and ``ledger.queue``, ``ledger.queue.wait``, ``ledger.queue.cancel``."""
    who = caller(daemon, client)
    refusal = may_use(daemon, who)
    if refusal is not None:
        return refusal
    op = message.get("op")
    queue = await queue_of(daemon)
    try:
        if op == "ledger.reserve":
            spec, policy, fields = parse_reserve(daemon, message)
            bound = bound_for(daemon, who, bounds.from_json(message.get("bound"), "bound"))
            waits = message.get("queue") is True
            ahead = queue.competing(spec) if waits else 0
            if ahead:  # others wait for this kind of GPU: the fair order decides, not arrival
                refused = {"message": f"{ahead} start{'s' if ahead != 1 else ''} wait already"}
                return await queue.enqueue(who, client, spec, policy, fields, bound, refused)
            view = message.get("view") is True
            reply = await write(
                daemon,
                who,
                lambda: place_and_record(daemon, who, spec, policy, fields, bound, view),
            )
            if reply.get("error") == PlacementRefused.code and waits:
                return await queue.enqueue(who, client, spec, policy, fields, bound, reply)
            return reply
        if op == "ledger.queue":
            return await queue.listing(who)
        if op == "ledger.queue.wait":
            return await queue.wait(who, message)
        if op == "ledger.queue.cancel":
            return await queue.cancel(who, message)
    except ShareError as exc:
        return {"ok": False, **exc.to_json()}
    except NotPermitted as exc:
        return wire.refusal(wire.E_NOT_PERMITTED, str(exc))
    except OverCapacity as exc:
        return {"ok": False, "error": "over_capacity", "message": str(exc)}
    except LedgerUnavailable as exc:  # the agent's own file: a full disk, a broken database
        return {"ok": False, **exc.to_json()}
    return wire.refusal(wire.E_BAD_REQUEST, f"unknown op {op!r}")
