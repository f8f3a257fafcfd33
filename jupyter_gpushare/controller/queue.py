"""The queue on Kubernetes (DESIGN box 13): kernel starts that do not fit wait in the controller.

The order, the ETA and the words are the pure :mod:`jupyter_gpushare.queue` (the node agent's
queue uses the same core); this is its shell in the controller, which owns the ledger and so
the queue:

- **Durable where the ledger lives.** The entries are one ``GpuQueue`` object
  (``deploy/crds/gpuqueues.yaml``, named :data:`OBJECT`) in the controller's namespace; every
  change is a compare-and-swap on its ``resourceVersion`` (:meth:`ControllerQueue._commit`), so
  a restarted controller or a new leader reads the same queue, and two replicas that both think
  they lead cannot both start one entry.
- **No Pending pod.** A queued start holds no allocation and no pod; the user's server creates
  the kernel pod (``POST /api/kernels``) only once the entry is ``started`` with an allocation
  the controller placed for it.
- **Started at most once.** Starting an entry places its allocation with
  ``extra.queue_entry`` (CAS on the GpuLedger), then marks the entry started with a CAS that
  requires it still waiting; a lost race releases that allocation. A new leader that finds an
  allocation carrying a waiting entry's id marks the entry started with it instead of placing
  again.
- **Started by itself.** Every change of a GpuLedger the controller's watch sees (a release, a
  shutdown, idle reclaim, a resize down) and every server Lease change wakes the runner at
  once; it also looks every :data:`TICK_S` seconds.
- **Dropped when its server died**: the entry's server Lease is gone or expired past the grace.
- **Refused at once when it can never fit** (``never_fits``: not even on an empty cluster), or
  when the user has :attr:`~jupyter_gpushare.queue.QueuePolicy.max_per_user` starts waiting
  (``queue_full``).

HTTP (:mod:`.queue_api`): ``POST /api/queue`` (place now, or wait), ``GET /api/queue`` (the
waiting starts in order: the caller's own whole, others' as capacity; admins all),
``GET /api/queue/{id}?wait=S`` (long poll until it changes state), ``DELETE /api/queue/{id}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

from traitlets import Dict, Float, Int
from traitlets.config import Configurable

from ..bound import from_json as bound_from_json
from ..bound import narrowed, record
from ..bound import to_json as bound_to_json
from ..errors import GpushareError
from ..inventory import Gpu, check_spec
from ..k8s import manifests
from ..k8s.client import GROUP, VERSION, ApiException, Kube
from ..ledger import Allocation, LedgerConflict
from ..placement import allocate
from ..placement.engine import PlacementRefused, place
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
from .auth import HubUser
from .errors import ControllerError, bad_request
from .kernels import check_kernel_id
from .servers import check_server_id

if TYPE_CHECKING:
    from .kernels import KernelService

log = logging.getLogger("jupyter_gpushare.controller")

PLURAL = "gpuqueues"
#: the one GpuQueue object of the controller's namespace
OBJECT = "gpushare-queue"
#: ``Allocation.extra`` key naming the queue entry a share was started for
ENTRY_KEY = "queue_entry"
#: how often the runner looks without being woken (expired server Leases)
TICK_S = 1.0
#: the longest ``GET /api/queue/{id}?wait=``
MAX_WAIT_S = 20.0
#: finished entries kept in the object (a late poll after a failover still finds its start)
FINISHED_KEPT = 256
#: waiting entries the object holds at most (one API object: bounded size)
MAX_WAITING = 1000
#: attempts of one compare-and-swap on the queue object
ATTEMPTS = 8
HISTORY = 2048

WAITING, STARTED, CANCELLED, DROPPED, FAILED = (
    "waiting",
    "started",
    "cancelled",
    "dropped",
    "failed",
)

T = TypeVar("T")


class ControllerQueueSettings(Configurable):
    """The admin's rules for the controller's queue (``c.ControllerQueueSettings.*``)."""

    group_weights = Dict(
        default_value={},
        config=True,
        help="JupyterHub group -> weight in the fair order (a user's dominant share is divided "
        "by their largest weight): {'course': 2.0}.",
    )
    group_priorities = Dict(
        default_value={},
        config=True,
        help="JupyterHub group -> priority (higher goes first, whatever users hold): "
        "{'course': 1}.",
    )
    max_per_user = Int(
        8, config=True, help="Starts one user may have waiting at once (Hub admins: no cap)."
    )
    hold = Float(
        300.0,
        config=True,
        help="Seconds a waiting start may be passed by later, smaller starts that fit before "
        "it; then the GPUs it waits for drain until it fits.",
    )
    eta_window = Float(
        1800.0, config=True, help="Seconds of releases the ETA's observed release rate uses."
    )
    server_grace = Float(
        10.0,
        config=True,
        help="Seconds a waiting start's server Lease may be overdue before the start is "
        "dropped (its server died).",
    )

    def policy(self) -> QueuePolicy:
        return QueuePolicy(
            weights={str(k): float(v) for k, v in self.group_weights.items()},
            priorities={str(k): int(v) for k, v in self.group_priorities.items()},
            max_per_user=int(self.max_per_user),
            hold_s=float(self.hold),
            eta_window_s=float(self.eta_window),
        )


@dataclass
class QueuedStart:
    """One waiting start, as the GpuQueue object stores it."""

    id: str
    user: str
    groups: list[str]
    server_id: str
    kernel_id: str
    owner: str
    share: dict[str, Any]
    bound: dict[str, Any] | None
    since: float
    priority: int = 0
    weight: float = 1.0
    state: str = WAITING
    allocation: dict[str, Any] | None = None
    reason: str | None = None
    first_eta: dict[str, Any] | None = None
    ended: float | None = None
    #: the controller replica that started it
    by: str | None = None

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

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> QueuedStart:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class QueueStore:
    """The GpuQueue object: read it, and write it only over the version read (CAS)."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    async def read(self) -> tuple[str | None, list[QueuedStart]]:
        """The object's resourceVersion (None: no object yet) and its entries."""
        custom: Any = self.kube.custom
        try:
            obj = await self.kube._json(
                custom.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, OBJECT, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None, []
            raise _unusable(exc) from None
        out = []
        for data in (obj.get("spec") or {}).get("entries") or []:
            try:
                out.append(QueuedStart.from_json(data))
            except (TypeError, ValueError, KeyError) as exc:  # never started, never lost twice
                log.warning("gpushare controller: skipped an unreadable queue entry: %s", exc)
        return str(obj["metadata"]["resourceVersion"]), out

    async def write(self, version: str | None, entries: Sequence[QueuedStart]) -> str | None:
        """Write ``entries`` over ``version``; the new version, or None when the race was lost."""
        body: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GpuQueue",
            "metadata": {
                "name": OBJECT,
                "namespace": self.namespace,
                "labels": {manifests.LABEL_COMPONENT: "gpushare-queue"},
            },
            "spec": {"entries": [asdict(e) for e in entries]},
            "status": {"waiting": sum(1 for e in entries if e.state == WAITING)},
        }
        custom: Any = self.kube.custom
        try:
            if version is None:
                obj = await self.kube._json(
                    custom.create_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, PLURAL, body, _preload_content=False
                    )
                )
            else:
                body["metadata"]["resourceVersion"] = version
                obj = await self.kube._json(
                    custom.replace_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, PLURAL, OBJECT, body, _preload_content=False
                    )
                )
        except ApiException as exc:
            if exc.status == 409 or (exc.status == 404 and version is not None):
                return None  # changed (or made, or deleted) since it was read
            raise _unusable(exc) from None
        return str(obj["metadata"]["resourceVersion"])


def ordered(
    waiting: Sequence[QueuedStart], allocations: Sequence[Allocation], gpus: Sequence[Gpu]
) -> list[Entry]:
    """``waiting`` in the fair order, by what each user holds in ``allocations``."""
    held: dict[str, tuple[float, float]] = {}
    for a in allocations:
        c, m = held.get(a.user, (0.0, 0.0))
        held[a.user] = (c + a.request * a.spec.gpu_count, m + a.memory * a.spec.gpu_count)
    return fair_order(
        [r.entry() for r in waiting],
        held,
        float(len(gpus)),
        float(sum(g.memory for g in gpus)),
    )


def typed(spec: ShareSpec, gpus: Sequence[Gpu]) -> ShareSpec:
    """``spec`` with its type named where it takes any and the cluster has one type."""
    if spec.gpu_type is not None:
        return spec
    types = {g.type for g in gpus}
    return replace(spec, gpu_type=types.pop()) if len(types) == 1 else spec


def eta_of(
    r: QueuedStart,
    ahead: Sequence[Entry],
    allocations: Sequence[Allocation],
    gpus: Sequence[Gpu],
    releases: Sequence[Release],
    policy: QueuePolicy,
) -> Eta:
    """``r``'s estimate behind ``ahead``: the reclaim deadlines of ``allocations`` and the
    ``releases`` seen (none: the deadline bound only, where one applies)."""
    spec = typed(r.spec, gpus)
    kind = (spec.gpu_type or "GPU").lower()
    mine = [g for g in gpus if kind == "gpu" or g.type.lower() == kind]
    used: dict[str, float] = {g.uuid: 0.0 for g in mine}
    deadlines: list[Deadline] = []
    for a in allocations:
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
        [x for x in releases if kind == "gpu" or x.gpu_type.lower() == kind],
        deadlines,
        window_s=policy.eta_window_s,
        ahead=sum(e.request for e in same),
        free={u: max(0.0, 1.0 - v) for u, v in used.items()},
    )


async def waiting_status(
    kube: Kube, namespace: str, allocations: Sequence[Allocation], gpus: Sequence[Gpu]
) -> list[dict[str, Any]]:
    """The starts waiting in the GpuQueue, in the fair order, as an admin reads them from the
    cluster (``jupyter gpushare status``): who, what, since, position and an ETA in words. The
    ETA rests on what the cluster shows: reclaim deadlines (the controller's answer to the
    user also counts the release rate it observed, which lives only in the controller)."""
    _version, entries = await QueueStore(kube, namespace).read()
    waiting = [r for r in entries if r.state == WAITING]
    order = ordered(waiting, allocations, gpus)
    by_id = {r.id: r for r in waiting}
    out = []
    for position, e in enumerate(order, 1):
        r = by_id[e.id]
        eta = eta_of(r, order[: position - 1], allocations, gpus, [], QueuePolicy())
        out.append(
            {
                "id": r.id,
                "state": r.state,
                "user": r.user,
                "kernel_id": r.kernel_id,
                "server_id": r.server_id,
                "share": r.share,
                "since": r.since,
                "waited_s": round(time.time() - r.since, 1),
                "position": position,
                "eta": eta.to_json(),
                "first_eta": r.first_eta,
                "message": describe(position, typed(r.spec, gpus).describe(), eta),
            }
        )
    return out


class ControllerQueue:
    """The active controller's queue: entries (as stored), the runner, the releases seen."""

    def __init__(
        self,
        service: KernelService,
        policy: QueuePolicy,
        identity: str,
        server_grace: float = 10.0,
    ) -> None:
        self.service = service
        self.policy = policy
        self.identity = identity
        self.server_grace = server_grace
        self.store = QueueStore(service.kube, service.namespace)
        self.records: dict[str, QueuedStart] = {}
        self.version: str | None = None
        self.releases: deque[Release] = deque(maxlen=HISTORY)
        self.figures_ = QueueMetrics()
        self._changed: dict[str, asyncio.Event] = {}
        self._commit_lock = asyncio.Lock()
        self._pass_lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._kicked_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    # -- life ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the stored queue, follow the ledger and the server Leases, run the runner."""
        try:
            self.version, found = await self.store.read()
        except ControllerError as exc:  # the rest of the controller works without its queue
            log.error("gpushare controller: %s; starts that do not fit are refused", exc.message)
            found = []
        self.records = {r.id: r for r in found}
        self.service.ledger.ledgers.subscribe(self._ledger_changed)
        self.service.servers.leases.subscribe(self._lease_changed)
        self._task = asyncio.get_running_loop().create_task(self._run())
        waiting = sum(1 for r in found if r.state == WAITING)
        if waiting:
            log.info("gpushare controller: queue: %d waiting starts kept from before", waiting)

    async def stop(self) -> None:
        self.service.ledger.ledgers.unsubscribe(self._ledger_changed)
        self.service.servers.leases.unsubscribe(self._lease_changed)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        for event in self._changed.values():  # long polls answer (and find no leader)
            event.set()

    def kick(self) -> None:
        """Capacity may have freed: try the waiting starts now."""
        if self._kicked_at is None:
            self._kicked_at = time.monotonic()
        self._kick.set()

    def _ledger_changed(
        self, kind: str, obj: dict[str, Any], before: dict[str, Any] | None
    ) -> None:
        now = time.time()
        after = {} if kind == "DELETED" else _requests(obj)
        for aid, (request, gpu_type) in _requests(before).items():
            freed = request - after.get(aid, (0.0, gpu_type))[0]
            if freed > 1e-9:
                self.releases.append(Release(now, freed, gpu_type))
        if self.waiting():
            self.kick()

    def _lease_changed(self, _kind: str, _obj: Any, _before: Any) -> None:
        if self.waiting():
            self.kick()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self._kick.wait(), TICK_S)
            self._kick.clear()
            kicked, self._kicked_at = self._kicked_at, None
            try:
                await self.sweep()
                if self.waiting():
                    await self.run_pass(kicked)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server away: the next wake-up tries again
                log.warning("gpushare controller: queue pass failed: %s", exc)

    # -- the stored queue ------------------------------------------------------------------

    def waiting(self) -> list[QueuedStart]:
        return [r for r in self.records.values() if r.state == WAITING]

    async def _commit(self, change: Callable[[dict[str, QueuedStart]], tuple[T, bool]]) -> T:
        """Apply ``change`` (on copies of the stored entries; it returns its result and whether
        it changed anything) and write the result over the version read; after a lost race,
        read the object again and apply ``change`` to what it holds."""
        async with self._commit_lock:
            for _attempt in range(ATTEMPTS):
                records = {k: replace(v) for k, v in self.records.items()}
                result, changed = change(records)
                if not changed:
                    return result
                kept = _pruned(records)
                version = await self.store.write(self.version, list(kept.values()))
                if version is not None:
                    ended = [
                        r
                        for r in kept.values()
                        if r.state != WAITING and self.records.get(r.id, r).state == WAITING
                    ]
                    self.records, self.version = kept, version
                    for r in ended:
                        event = self._changed.pop(r.id, None)
                        if event is not None:
                            event.set()
                    return result
                self.version, found = await self.store.read()  # another replica wrote it
                self.records = {r.id: r for r in found}
                for r in found:  # ended there: their long polls answer now
                    if r.state != WAITING and r.id in self._changed:
                        self._changed.pop(r.id).set()
        raise ControllerError(
            503, "queue_busy", "the queue kept changing while this change was written; try again"
        )

    async def _finish(self, entry_id: str, state: str, reason: str | None) -> QueuedStart | None:
        def change(records: dict[str, QueuedStart]) -> tuple[QueuedStart | None, bool]:
            found = records.get(entry_id)
            if found is None or found.state != WAITING:
                return found, False
            found.state, found.reason, found.ended = state, reason, time.time()
            return found, True

        return await self._commit(change)

    # -- one pass: start what fits, in the fair order ---------------------------------------

    async def run_pass(self, kicked: float | None = None) -> None:
        async with self._pass_lock:
            await self._pass(kicked)

    async def _pass(self, kicked: float | None) -> None:
        ledger = self.service.ledger
        for gone in self.waiting():
            if not self._server_alive(gone):
                await self._finish(gone.id, DROPPED, f"its server {gone.server_id} is gone")
                self.figures_.dropped += 1
        allocations = await ledger.list()
        made = {str(a.extra.get(ENTRY_KEY)): a for a in allocations if a.extra.get(ENTRY_KEY)}
        gpus = await ledger.gpus()
        turn = Pass(time.time(), self.policy.hold_s)
        for item in self._ordered(allocations, gpus):
            r = self.records.get(item.id)
            if r is None or r.state != WAITING:
                continue
            if r.id in made:  # placed by a replica that stopped before recording the start
                await self._record_start(r.id, made[r.id], kicked)
                continue
            try:
                allocation = await self._place(r, gpus, turn.held)
            except PlacementRefused:
                turn.missed(item, self._emptiest(r, await ledger.list(), gpus))
                continue
            except LedgerConflict:  # a busy node's GpuLedger: the next pass tries again
                self.kick()
                continue
            except ControllerError as exc:
                if exc.code == "over_quota":  # their own release makes room: keep waiting
                    continue
                await self._finish(r.id, FAILED, exc.message)
                self.figures_.failed += 1
                continue
            except (GpushareError, ShareError) as exc:
                await self._finish(r.id, FAILED, str(exc))
                self.figures_.failed += 1
                continue
            await self._take(r.id, allocation, kicked)

    async def sweep(self) -> list[str]:
        """Release the shares placed for entries that ended without them (a replica stopped
        between placing a share and recording the start, and the entry was cancelled or
        started with another share meanwhile). An ended entry never waits again, so a stale
        view of the queue cannot make this release a share that is in use. The ids released."""
        gone = []
        for a in await self.service.ledger.list():
            entry_id = a.extra.get(ENTRY_KEY)
            r = self.records.get(str(entry_id)) if entry_id else None
            if r is None or r.state == WAITING or (r.allocation or {}).get("id") == a.id:
                continue
            if await self.service.ledger.release(a.id, if_unchanged=a) is not None:
                log.info("gpushare controller: queue: released %s, nobody's (%s)", a.id, r.id)
                gone.append(a.id)
        return gone

    async def _take(self, entry_id: str, allocation: Allocation, kicked: float | None) -> bool:
        """Record the start of ``entry_id`` with ``allocation``, just placed for it; when the
        entry was cancelled meanwhile or another replica started it with another share, give
        this one back (so each entry holds one share, whoever placed it)."""
        if await self._record_start(entry_id, allocation, kicked):
            return True
        await self.service.ledger.release(allocation.id)
        return False

    def _server_alive(self, r: QueuedStart) -> bool:
        lease = self.service.servers.leases.get(manifests.lease_name(r.server_id))
        if lease is None:
            return False
        return not manifests.lease_expired(lease, datetime.now(timezone.utc), self.server_grace)

    async def _place(self, r: QueuedStart, gpus: Sequence[Gpu], held: set[str]) -> Allocation:
        service = self.service
        spec = r.spec
        user = HubUser(r.user, groups=tuple(r.groups))
        place_fn: Any = service.ledger.indexed(service.policy)
        if held:  # GPUs kept draining for a start that waited past the hold

            def place_fn(
                all_gpus: Sequence[Gpu], allocations: Sequence[Allocation], s: ShareSpec
            ) -> Any:
                free = [g for g in all_gpus if g.uuid not in held]
                return place(free, allocations, s, service.policy)

        async with service._user_lock(user):
            held_now = [a for a in await service.ledger.list() if a.user == r.user]
            service._check_quota(user, held_now, spec.gpu_request * spec.gpu_count)
            bound = bound_from_json(r.bound, "bound")
            return await allocate(
                service.ledger,
                spec,
                gpus,
                service.policy,
                place_fn=place_fn,
                owner=r.owner,
                kernel_id=r.kernel_id,
                backend="kubernetes",
                user=r.user,
                extra=record(
                    {
                        "k8s_server": r.server_id,
                        "k8s_namespace": service.namespace,
                        ENTRY_KEY: r.id,
                    },
                    bound,
                ),
            )

    async def _record_start(
        self, entry_id: str, allocation: Allocation, kicked: float | None
    ) -> bool:
        """Mark ``entry_id`` started with ``allocation`` (only while it still waits). False:
        the entry ended otherwise or holds another share, and ``allocation`` is nobody's."""
        now = time.time()

        def change(records: dict[str, QueuedStart]) -> tuple[bool, bool]:
            found = records.get(entry_id)
            if found is not None and found.state == STARTED and found.allocation:
                # another replica recorded this very share (found in the ledger): it is kept
                return found.allocation.get("id") == allocation.id, False
            if found is None or found.state != WAITING:
                return False, False
            found.state, found.ended, found.by = STARTED, now, self.identity
            found.allocation = allocation.to_json()
            return True, True

        if not await self._commit(change):
            return False
        r = self.records[entry_id]
        if r.by != self.identity or r.ended != now:
            return True  # recorded by another replica: its figures
        if kicked is not None:
            self.figures_.reactions.append(time.monotonic() - kicked)
        self.figures_.started_after(now - r.since, r.first_eta, now)
        log.info(
            "gpushare controller: queue: started %s of %s (kernel %s) after %.1f s: %s on %s",
            entry_id,
            r.user,
            r.kernel_id,
            now - r.since,
            allocation.id,
            allocation.node,
        )
        return True

    def _emptiest(
        self, r: QueuedStart, allocations: Sequence[Allocation], gpus: Sequence[Gpu]
    ) -> list[str]:
        kind = (r.spec.gpu_type or "").lower()
        usable = [g for g in gpus if g.healthy and (not kind or g.type.lower() == kind)]
        used = {g.uuid: 0.0 for g in usable}
        for a in allocations:
            for u in a.gpus:
                if u in used:
                    used[u] += a.request
        return sorted(used, key=lambda u: used[u])

    # -- order, position, ETA ---------------------------------------------------------------

    def _ordered(self, allocations: Sequence[Allocation], gpus: Sequence[Gpu]) -> list[Entry]:
        return ordered(self.waiting(), allocations, gpus)

    def _typed(self, spec: ShareSpec, gpus: Sequence[Gpu]) -> ShareSpec:
        return typed(spec, gpus)

    def eta(
        self,
        r: QueuedStart,
        ahead: Sequence[Entry],
        allocations: Sequence[Allocation],
        gpus: Sequence[Gpu],
    ) -> Eta:
        return eta_of(r, ahead, allocations, gpus, list(self.releases), self.policy)

    async def view(
        self, r: QueuedStart, who: HubUser | None, order: list[Entry] | None = None
    ) -> dict[str, Any]:
        """What ``who`` sees of ``r`` (None: everything): a user their own whole, others'
        as capacity only (position, share, since); admins all."""
        whole = who is None or who.admin or who.name == r.user
        out: dict[str, Any] = {
            "id": r.id,
            "state": r.state,
            "share": r.share,
            "since": r.since,
            "waited_s": round((r.ended or time.time()) - r.since, 1),
        }
        if whole:
            out.update(
                user=r.user,
                kernel_id=r.kernel_id,
                owner=r.owner,
                server_id=r.server_id,
                reason=r.reason,
                allocation=r.allocation,
                first_eta=r.first_eta,
            )
        if r.state == WAITING:
            allocations = await self.service.ledger.list()
            gpus = await self.service.ledger.gpus()
            if order is None:
                order = self._ordered(allocations, gpus)
            position = next((i for i, e in enumerate(order, 1) if e.id == r.id), 0)
            eta = self.eta(r, order[: max(position - 1, 0)], allocations, gpus)
            out["position"] = position
            out["eta"] = eta.to_json()
            out["message"] = describe(position, self._typed(r.spec, gpus).describe(), eta)
        else:
            out["message"] = {
                STARTED: "started",
                CANCELLED: "cancelled",
                DROPPED: f"dropped: {r.reason}",
                FAILED: f"could not start: {r.reason}",
            }.get(r.state, r.state)
        return out

    def figures(self) -> dict[str, Any]:
        """The queue's figures (:meth:`.QueueMetrics.to_json`): the ``metrics`` of
        ``GET /api/queue`` and what ``/metrics`` exports."""
        return self.figures_.to_json(len(self.waiting()))

    # -- what users ask ---------------------------------------------------------------------

    async def reserve(self, user: HubUser, body: Mapping[str, Any]) -> dict[str, Any]:
        """Place the share now (``{"allocation"}``), or queue the start (``{"entry"}``)."""
        kernel_id = check_kernel_id(body.get("kernel_id"))
        server_id = check_server_id(body.get("server_id"))
        service = self.service
        for r in self.records.values():  # a retry of a start that waits
            if r.user == user.name and r.kernel_id == kernel_id and r.state == WAITING:
                return {"entry": await self.view(r, user)}
        for a in await service.ledger.list():  # a retry of a placed (or started) kernel
            if a.user == user.name and a.kernel_id == kernel_id:
                return {"allocation": a.to_json()}
        share = body.get("share")
        if not isinstance(share, Mapping):
            raise bad_request("share", share, "an object with gpu_request, gpu_limit, ...")
        spec = ShareSpec.from_mapping({k: v for k, v in share.items() if v is not None})
        bound = service.bounds.of(user)
        spec = check_spec(narrowed(spec, bound), await service.gpus(), service.aliases)
        await self._check_could_fit(user, spec)
        ahead = self._competing(spec)
        if ahead:  # others wait for this kind of GPU: the fair order decides, not arrival
            refused = f"{ahead} start{'s' if ahead != 1 else ''} wait already"
        else:
            try:
                return {"allocation": (await service.reserve(user, body)).to_json()}
            except PlacementRefused as exc:
                refused = exc.message
            except ControllerError as exc:
                if exc.code != "over_quota":  # over quota: waits for the user's own release
                    raise
                refused = exc.message
        return {"entry": await self._enqueue(user, body, spec, bound, server_id, refused)}

    async def _check_could_fit(self, user: HubUser, spec: ShareSpec) -> None:
        """Refuse at once (409 ``never_fits``) a start that could not fit even with no other
        share in the cluster, or that is more than the user's quota by itself."""
        service = self.service
        try:
            place(await service.gpus(), [], spec, service.policy)
        except (PlacementRefused, ShareError) as exc:
            raise ControllerError(
                409,
                "never_fits",
                f"{spec.describe()} can never fit in this cluster, even with no other share: "
                f"{getattr(exc, 'message', None) or exc}",
            ) from None
        quota = service.quotas.of(user)
        if quota is not None and spec.gpu_request * spec.gpu_count > quota + 1e-9:
            raise ControllerError(
                409,
                "never_fits",
                f"{spec.describe()} can never start: it is more than {user.name}'s quota of "
                f"{quota:g} GPU in all",
            )

    def _competing(self, spec: ShareSpec) -> int:
        kind = (spec.gpu_type or "*").lower()
        return sum(1 for r in self.waiting() if kind == "*" or r.entry().kind in (kind, "*"))

    async def _enqueue(
        self,
        user: HubUser,
        body: Mapping[str, Any],
        spec: ShareSpec,
        bound: ShareSpec | None,
        server_id: str,
        refused: str,
    ) -> dict[str, Any]:
        service = self.service
        owner = body.get("owner", "kernel")
        if owner not in ("kernel", "pool"):
            raise bad_request("owner", owner, "'kernel' or 'pool'")
        await service.servers.touch(user, server_id)  # its Lease says whether it still lives
        entry = QueuedStart(
            id="q-" + uuid.uuid4().hex[:16],
            user=user.name,
            groups=list(user.groups),
            server_id=server_id,
            kernel_id=str(body["kernel_id"]),
            owner=str(owner),
            share={k: v for k, v in spec.to_json().items() if v is not None},
            bound=bound_to_json(bound) if bound is not None else None,
            since=time.time(),
            priority=self.policy.priority_of(user.groups),
            weight=self.policy.weight_of(user.groups),
        )

        def add(records: dict[str, QueuedStart]) -> tuple[None, bool]:
            waiting = [r for r in records.values() if r.state == WAITING]
            mine = [r for r in waiting if r.user == user.name]
            if not user.admin and len(mine) >= self.policy.max_per_user:
                raise ControllerError(
                    409,
                    "queue_full",
                    f"user {user.name} has {len(mine)} starts waiting already (at most "
                    f"{self.policy.max_per_user}); cancel one or wait for one to start",
                )
            if len(waiting) >= MAX_WAITING:
                raise ControllerError(
                    409, "queue_full", f"{len(waiting)} starts wait already (at most {MAX_WAITING})"
                )
            records[entry.id] = entry
            return None, True

        await self._commit(add)
        shown = await self.view(self.records[entry.id], user)
        first = shown["eta"] if shown["eta"]["hi_s"] is not None else None
        if first is not None:

            def note(records: dict[str, QueuedStart]) -> tuple[None, bool]:
                found = records.get(entry.id)
                if found is None:
                    return None, False
                found.first_eta = first
                return None, True

            await self._commit(note)
            shown["first_eta"] = first
        shown["refusal"] = refused
        log.info(
            "gpushare controller: queue: %s waits for %s (%s)",
            user.name,
            spec.describe(),
            shown["message"],
        )
        self.kick()
        return shown

    def find(self, user: HubUser, entry_id: str) -> QueuedStart:
        found = self.records.get(entry_id)
        if found is None or not (user.admin or found.user == user.name):
            raise ControllerError(
                404, "unknown_entry", f"no queued start {entry_id!r:.40} of yours"
            )
        return found

    async def wait(self, user: HubUser, entry_id: str, timeout: float) -> dict[str, Any]:
        found = self.find(user, entry_id)
        if found.state == WAITING and timeout > 0:
            event = self._changed.setdefault(found.id, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(event.wait(), min(timeout, MAX_WAIT_S))
        return await self.view(self.records.get(entry_id, found), user)

    async def cancel(self, user: HubUser, entry_id: str) -> dict[str, Any]:
        self.find(user, entry_id)
        async with self._pass_lock:  # never beside its start
            ended = await self._finish(entry_id, CANCELLED, f"cancelled by {user.name}")
            if ended is not None and ended.state == CANCELLED and ended.ended:
                self.figures_.cancelled += 1
        return await self.view(self.records.get(entry_id) or self.find(user, entry_id), user)

    async def listing(self, user: HubUser) -> dict[str, Any]:
        allocations = await self.service.ledger.list()
        gpus = await self.service.ledger.gpus()
        order = self._ordered(allocations, gpus)
        return {
            "entries": [await self.view(self.records[e.id], user, order) for e in order],
            "metrics": self.figures(),
        }


def _unusable(exc: ApiException) -> ControllerError:
    """The queue object cannot be read or written: say what the admin is to do."""
    why = {
        403: "the controller's Role lacks get/update/create of gpuqueues (apply deploy/rbac.yaml "
        "or upgrade the chart)",
        404: "the GpuQueue CRD is not installed (kubectl apply -f deploy/crds/gpuqueues.yaml: "
        "Helm installs CRDs only on the first install)",
    }.get(exc.status, f"the API server answered {exc.status} {exc.reason}")
    return ControllerError(503, "queue_unavailable", f"the queue cannot be kept: {why}")


def _requests(obj: Mapping[str, Any] | None) -> dict[str, tuple[float, str]]:
    """A GpuLedger object's allocations: id -> (compute held, GPU type)."""
    out: dict[str, tuple[float, str]] = {}
    for a in ((obj or {}).get("spec") or {}).get("allocations") or []:
        with contextlib.suppress(TypeError, ValueError, KeyError):
            count = len(a.get("gpus") or ()) or 1
            out[str(a["id"])] = (
                float(a.get("gpu_request") or 0.0) * count,
                str(a.get("gpu_type") or "GPU"),
            )
    return out


def _pruned(records: dict[str, QueuedStart]) -> dict[str, QueuedStart]:
    """The waiting entries and the latest :data:`FINISHED_KEPT` finished ones."""
    finished = sorted(
        (r for r in records.values() if r.state != WAITING), key=lambda r: r.ended or 0.0
    )
    gone = {r.id for r in finished[: max(0, len(finished) - FINISHED_KEPT)]}
    return {k: v for k, v in records.items() if k not in gone}


__all__ = [
    "ENTRY_KEY",
    "OBJECT",
    "ControllerQueue",
    "ControllerQueueSettings",
    "QueueStore",
    "QueuedStart",
]
