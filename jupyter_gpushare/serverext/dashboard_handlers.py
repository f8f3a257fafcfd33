"""REST behind the JupyterLab GPU dashboard (DEVELOPING.md, box 10).

``GET /gpushare/api/dashboard`` — the node's (or, on Kubernetes, the cluster's) GPUs and the
shares on each, with live use: per GPU its type, memory, reserved and free capacity and the sum
of the achieved shares; per share its request, limit, memory cap, achieved share and memory in
use, and, where the viewer may see whose it is, the user, the notebook path or command, the kernel
and the allocation id. It reads what ``/gpus``, ``/allocations`` and ``/usage`` read (the
backend's ledger and usage source, :mod:`jupyter_gpushare.usage`), so it shows nothing those do
not; the node agent itself shows a non-admin caller others' shares as capacity only.

Who sees what (the trust edge is :meth:`DashboardHandler.viewer_is_admin`, from the server's
Authorizer): a viewer the Authorizer allows ``read`` on the resource ``gpushare_admin`` (see
:data:`ADMIN_RESOURCE`) sees every share whole. Anyone else (``read`` on ``gpushare`` is needed
for the endpoint at all) sees this server's user's own shares whole and everyone else's as
capacity only (``mine: false``, no id, user, path, command, kernel or live use) — enough to see
what is free. jupyter_server's default Authorizer allows everything, so on a one-person server
its user is the admin; a deployment with several identities grants ``gpushare_admin`` to its
admins only. Where every user's server reads one cluster ledger (Kubernetes), other servers'
shares stay capacity only even for such an admin unless ``GpushareDashboard.show_other_servers``
is set: JupyterHub's single-user Authorizer allows every action to a server's owner, so without
that switch every user would see everyone's notebooks.

Where the node agent keeps a queue (DESIGN box 13), the dashboard's data also has ``queue``:
the waiting starts in order, as ``GET /gpushare/api/queue`` lists them (who only where the agent
lets this server's user see it: their own, or all for an admin).

``GET /gpushare/api/starts`` — this server's kernel starts under way and those that ended in the
last minute, with their phase (placing, placed, launching, scheduling, pulling, starting, ready,
failed) and the cluster's words when it is slow (:mod:`jupyter_gpushare.progress`). The Lab
picker and status bar poll it while a kernel starts.
"""

from __future__ import annotations

import getpass
import json
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.utils import url_path_join
from tornado import web
from traitlets import Bool
from traitlets.config import Configurable

from ..backends import Backend
from ..daemon.ledger_ops import REDACTED_KEY, UID_KEY
from ..errors import GpushareError
from ..inventory import Gpu
from ..ledger import Allocation
from ..progress import board
from ..usage import UsageView
from .handlers import GpushareHandler, _maybe_await, gpu_usage

#: The Authorizer resource whose ``read`` lets a viewer see every user's shares whole.
ADMIN_RESOURCE = "gpushare_admin"


class GpushareDashboard(Configurable):
    """What the GPU dashboard (``GET /gpushare/api/dashboard``) shows."""

    show_other_servers = Bool(
        False,
        config=True,
        help="Where every user's Jupyter server reads one cluster ledger (Kubernetes): show "
        "the shares of other servers' kernels whole (user, notebook, live use) to viewers the "
        "Authorizer allows 'read' on 'gpushare_admin'. Off: they show as capacity only to "
        "everyone. Leave off under JupyterHub unless its Authorizer grants 'gpushare_admin' to "
        "admins only (the default single-user Authorizer allows every action to a server's "
        "owner).",
    )


#: how far back the dashboard's history goes, and the closest two samples may be
HISTORY_S = 120.0
SAMPLE_MIN_GAP_S = 1.0


class UsageHistory:
    """The last :data:`HISTORY_S` seconds of live use of one server's allocations (achieved
    share by allocation id), sampled whenever the server reads its usage source for a viewer
    (``/usage``: the status bar's poll; ``/dashboard``). Which part a viewer sees is decided
    when it is shown (:func:`dashboard`), never stored per viewer."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[str, float]]] = deque()
        #: the records of the allocations in :attr:`samples` as last seen in the ledger: a share
        #: released (or its kernel gone) still counts in its GPU's past, for the viewers who
        #: saw it whole
        self.records: dict[str, Allocation] = {}

    def add(
        self, view: UsageView, allocations: Sequence[Allocation] = (), now: float | None = None
    ) -> None:
        for a in allocations:
            self.records[a.id] = a
        now = time.time() if now is None else now
        # nothing measured: no sample (a gap, not zeros)
        if view.nodes and (not self.samples or now - self.samples[-1][0] >= SAMPLE_MIN_GAP_S):
            achieved = {
                aid: float(u["achieved_share"])
                for aid, u in view.allocations.items()
                if _number(u.get("achieved_share")) is not None
            }
            self.samples.append((now, achieved))
        while self.samples and now - self.samples[0][0] > HISTORY_S:
            self.samples.popleft()
        current = {a.id for a in allocations}
        sampled = {aid for _t, values in self.samples for aid in values}
        for gone in [aid for aid in self.records if aid not in current and aid not in sampled]:
            del self.records[gone]  # bounded by the window


_HISTORIES: weakref.WeakKeyDictionary[Any, UsageHistory] = weakref.WeakKeyDictionary()


def usage_history(settings: Any) -> UsageHistory:
    """The usage history of the server whose settings (``GpuShare``) these are."""
    found = _HISTORIES.get(settings)
    if found is None:
        found = _HISTORIES[settings] = UsageHistory()
    return found


def owned_here(backend: Backend) -> Callable[[Allocation], bool]:
    """Is a record this server's user's own? Where servers share a ledger (Kubernetes): this
    server's kernels (``Backend.may_touch``); on a machine's ledger: records of this server's
    Unix user (``extra.uid``, else the user name). A record the node agent redacted is never
    anyone's here."""
    shared_ledger = backend.server_id() is not None
    uid = os.getuid()
    user = getpass.getuser()

    def own(a: Allocation) -> bool:
        if a.extra.get(REDACTED_KEY) or not backend.may_touch(a.extra):
            return False
        if shared_ledger:
            return True
        recorded = a.extra.get(UID_KEY)
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            return recorded == uid
        return a.user in ("", user)

    return own


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def share_entry(
    a: Allocation,
    live: Mapping[str, Any] | None,
    *,
    mine: bool,
    whole: bool,
    paths: Mapping[str, str],
) -> dict[str, Any]:
    """One share on a GPU as the viewer may see it (``mine``: this server's user's own;
    ``whole``: with who holds it and its live use, else its capacity only)."""
    entry: dict[str, Any] = {
        "mine": mine,
        "request": a.request,
        "limit": a.limit,
        "memory_cap": a.memory,
        "gpu_count": a.spec.gpu_count,
        "state": a.state,
    }
    if not whole:
        return entry
    command = a.extra.get("command")
    # this server's sessions name the notebook relative to its root; another server's kernel
    # carries the path its provisioner recorded (``extra.notebook``, as `gpushare status` shows)
    path = (paths.get(a.kernel_id) if a.kernel_id else None) or a.extra.get("notebook")
    entry.update(
        id=a.id,
        user=a.user or None,
        owner=a.owner,
        kernel_id=a.kernel_id,
        node=a.node,
        path=str(path) if path else None,
        command=" ".join(str(c) for c in command) if isinstance(command, list) else None,
        pool=a.extra.get("pool") or a.extra.get("claimed_from_pool"),
        created=a.created,
        achieved_share=_number((live or {}).get("achieved_share")),
        memory_used=_number((live or {}).get("memory_used")),
        idle_s=_number((live or {}).get("idle_s")),
        metered=live is not None,
    )
    return entry


def dashboard(
    gpus: Sequence[Gpu],
    allocations: Sequence[Allocation],
    usage: UsageView,
    *,
    admin: bool,
    own: Callable[[Allocation], bool],
    visible: Callable[[Allocation], bool] = lambda _a: True,
    paths: Mapping[str, str],
    simulated: bool,
    history: Sequence[tuple[float, Mapping[str, float]]] = (),
    past: Mapping[str, Allocation] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The dashboard's body (pure): every GPU with the shares on it, as the viewer may see
    them: ``own`` records whole; with ``admin`` also the others that are ``visible``.
    ``past``: the records of allocations in ``history`` (:attr:`UsageHistory.records`), so
    that a share released since still counts in its GPU's history."""

    rows = gpu_usage(gpus, allocations)
    by_id = {a.id: a for a in allocations}
    out_gpus = []
    shown_history: dict[str, list[list[float]]] = {}  # allocation id -> [[time, achieved]]
    gpu_history: dict[str, list[list[float]]] = {}  # GPU uuid -> [[time, sum shown]]
    for row in rows:
        shares = []
        seen_here = []  # the shares on this GPU the viewer sees whole
        achieved = 0.0
        metered = False
        memory_used = 0.0
        for allocation_id in row["allocations"]:
            a = by_id[allocation_id]
            mine = own(a)
            whole = mine or (admin and visible(a))
            if whole:
                seen_here.append(a)
            entry = share_entry(a, usage.get(a.id), mine=mine, whole=whole, paths=paths)
            if whole and entry["achieved_share"] is not None:
                per_gpu = entry["achieved_share"] / max(1, len(a.gpus))
                achieved += per_gpu
                metered = True
            if whole and entry["memory_used"] is not None:
                memory_used += entry["memory_used"] / max(1, len(a.gpus))
            shares.append(entry)
        # the GPU's past: the shares on it now, and those released since, seen whole
        counted = list(seen_here)
        for a in (past or {}).values():
            if a.id not in by_id and row["uuid"] in a.gpus and (own(a) or (admin and visible(a))):
                counted.append(a)
        points = []
        for t, values in history:
            known = [values[a.id] / max(1, len(a.gpus)) for a in counted if a.id in values]
            if known:
                points.append([round(t, 3), round(sum(known), 4)])
        gpu_history[row["uuid"]] = points
        for a in seen_here:
            shown_history[a.id] = [
                [round(t, 3), round(values[a.id], 4)] for t, values in history if a.id in values
            ]
        shares.sort(key=lambda s: (not s["mine"], -s["request"]))
        out_gpus.append(
            {
                "uuid": row["uuid"],
                "index": row["index"],
                "node": row["node"],
                "name": row["name"],
                "type": row["type"],
                "memory": row["memory"],
                "healthy": row["healthy"],
                "simulated": row["simulated"],
                "reserved_request": row["allocated_request"],
                "reserved_memory": row["allocated_memory"],
                "free_request": row["free_request"],
                "free_memory": row["free_memory"],
                # the achieved shares the viewer may see, summed (None: none of them metered)
                "achieved_share": round(achieved, 4) if metered else None,
                "memory_used": int(memory_used) if metered else None,
                "shares": shares,
            }
        )
    return {
        "time": time.time() if now is None else now,
        "admin": admin,
        "simulated": simulated,
        "source": usage.source,
        "metered": bool(usage.nodes),
        "gpus": out_gpus,
        "history": {"window_s": HISTORY_S, "gpus": gpu_history, "shares": shown_history},
        **({"message": usage.message} if usage.message else {}),
    }


class DashboardHandler(GpushareHandler):
    async def viewer_is_admin(self) -> bool:
        """Whether the server's Authorizer lets this viewer see every user's shares."""
        return bool(
            await _maybe_await(
                self.authorizer.is_authorized(self, self.current_user, "read", ADMIN_RESOURCE)
            )
        )

    def admin_may_see(self) -> Callable[[Allocation], bool]:
        """Which records an admin sees whole: all on a machine's ledger; on a ledger that many
        servers share, this server's own unless ``GpushareDashboard.show_other_servers``."""
        backend = self.backend
        if backend.server_id() is None or GpushareDashboard(config=self.config).show_other_servers:
            return lambda _a: True
        return lambda a: backend.may_touch(a.extra)

    async def session_paths(self) -> dict[str, str]:
        """This server's sessions: kernel id -> notebook (or console) path."""
        try:
            sessions = await self.session_manager.list_sessions()
        except Exception as exc:  # paths are a nicety; the dashboard answers without
            self.log.debug("gpushare: dashboard without session paths: %s", exc)
            return {}
        return {
            s["kernel"]["id"]: s["path"]
            for s in sessions
            if isinstance(s.get("kernel"), dict) and s["kernel"].get("id") and s.get("path")
        }

    @web.authenticated
    @authorized
    async def get(self) -> None:
        settings = self.gpushare
        admin = await self.viewer_is_admin()
        gpus, problem = await self.inventory()
        allocations = await (await self.ledger()).list()
        usage = await (await self.backend.usage()).read()
        history = usage_history(settings)
        history.add(usage, allocations)
        body = dashboard(
            gpus,
            allocations,
            usage,
            admin=admin,
            own=owned_here(self.backend),
            visible=self.admin_may_see(),
            paths=await self.session_paths(),
            simulated=bool(settings.simulated or any(g.simulated for g in gpus)),
            history=list(history.samples),
            past=history.records,
        )
        if problem:
            body["message"] = problem
        waiting = getattr(await self.ledger(), "queue", None)  # the node agent's (box 13)
        if waiting is not None:
            try:
                body["queue"] = await waiting()  # as the agent lets this server's user see it
            except GpushareError:  # an agent without a queue
                pass
        self.finish(json.dumps(body))


class StartsHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        starts = board(self.gpushare).starts()
        self.finish(json.dumps({"time": time.time(), "starts": [s.to_json() for s in starts]}))


def dashboard_handlers(base_url: str) -> list[tuple[str, type]]:
    api = url_path_join(base_url, "gpushare", "api")
    return [
        (url_path_join(api, "dashboard"), DashboardHandler),
        (url_path_join(api, "starts"), StartsHandler),
    ]
