"""Live usage in controller mode: node daemons report to the controller, not to etcd.

Why this way (issue 16): written into a ConfigMap every 2 s per node, usage costs 500 writes/s
at 1,000 nodes, and every reader LISTs every ConfigMap. Writing only on change with a floor
(>= 30 s) would cut the writes but make usage 30 s old exactly where it matters (the below-use
check of a live resize, idle reclaim, the status bar), and readers would still need a watch on
every report. The report is a measurement, not state: nothing needs it to survive a restart (the
daemons report again within one interval). So each node daemon sends it to the controller
(``PUT /api/usage/{node}`` every ``--usage-interval``, the same
:func:`~jupyter_gpushare.k8s.usage.usage_document`), the controller keeps the latest report of
each node in memory (:class:`NodeReports`), and users' servers read theirs with
``GET /api/usage``. The API server sees none of it.

Who may report (:class:`NodeAuth`): the caller sends a service-account token made for the
controller (``Authorization: Bearer``): the DaemonSet mounts a projected token with
``audience: gpushare-controller`` (:data:`AUDIENCE`), bound to the daemon's pod, expiring after
``daemon.controllerTokenExpirationSeconds`` (default 600 s; the kubelet rotates it and the daemon
re-reads the file for every report). The reports travel over plain HTTP inside the cluster, so
the token is one a sniffer could replay: made for the controller's audience, the API server
refuses it (it is useless there), and only until it expires. The controller asks the API server
who it is with a ``TokenReview`` (``authentication.k8s.io/v1``) that names that audience
(``spec.audiences``) and refuses a status whose audiences do not include it; a token made for
the API server (the default service-account token, a static token) is refused with 401 naming
the audience. It accepts only the node daemon's service account
(``system:serviceaccount:<namespace>:gpushare-daemon``). When the token is bound to a pod (as the
DaemonSet's is), the review names that pod and the controller checks that the pod runs on the
node the report is about: a daemon cannot report for another node. An unbound token of the
daemon's account proves "a node daemon" only. Anything else - no token, a user's token, another
account, a daemon of another node - is refused (401/403) and the report dropped. Even an
accepted report speaks only for the allocations the ledger places on its node; entries about
any other are dropped.

What an unauthenticated caller can make the controller do is bounded: a token that is not a JWT
(three base64url parts with a JSON header and claims) or whose unverified claims name another
audience, or that has expired, is refused before any review; at most ``max_reviews`` reviews are
in flight at once and at most ``max_waiting`` more wait (beyond that: 503, try again); a
refusal is remembered for ``refused_ttl`` seconds in a bounded cache of its own (garbage cannot
evict the daemons' cached verdicts); one review per token at a time, shielded, so a caller who
hangs up does not cancel it for the others waiting on it. Verdicts are cached for ``ttl``
seconds (bounded), so a daemon reporting every 2 s costs one TokenReview a minute.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..k8s.client import ApiException, Kube
from ..k8s.usage import CLOCK_SLACK, FORMAT, STALE_INTERVALS, NodeUsage
from ..usage import UsageSource, UsageView
from .client import controller_context
from .errors import bad_request, forbidden, unauthorized, unavailable

log = logging.getLogger("jupyter_gpushare.controller")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
MAX_ALLOCATIONS = 4096


#: the audience of the node daemons' tokens for the controller (the DaemonSet's projected token)
AUDIENCE = "gpushare-controller"
#: longest token considered (a service-account JWT is about 1 KiB)
MAX_TOKEN_BYTES = 16384
_B64URL = re.compile(r"^[A-Za-z0-9_-]+$")


def _b64json(part: str) -> Any:
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def jwt_claims(token: str) -> dict[str, Any] | None:
    """The (unverified) claims of a JWT-shaped ``token``: three base64url parts, the first a
    JSON header naming an ``alg``, the second a JSON object; None for anything else (pure)."""
    if len(token) > MAX_TOKEN_BYTES:
        return None
    parts = token.split(".")
    if len(parts) != 3 or not all(_B64URL.match(p) for p in parts):
        return None
    try:
        header, claims = _b64json(parts[0]), _b64json(parts[1])
    except (ValueError, TypeError):
        return None
    if not isinstance(header, dict) or "alg" not in header or not isinstance(claims, dict):
        return None
    return claims


def precheck(token: str, audience: str, now: float) -> str | None:
    """Why ``token`` cannot pass a review for ``audience`` (None: it might), read from its
    unverified claims, so garbage costs no TokenReview (pure). The review decides the rest."""
    claims = jwt_claims(token)
    if claims is None:
        return (
            f"the token is not a service-account token (a JWT); send one made for audience "
            f"{audience!r} (a projected service-account token)"
        )
    aud = claims.get("aud")
    audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if audience not in audiences:
        return (
            f"the token is not made for audience {audience!r} (its audiences: "
            f"{', '.join(map(str, audiences[:4])) or 'none'}); mount a projected "
            f"service-account token with audience: {audience}"
        )
    exp = claims.get("exp")
    if isinstance(exp, (int, float)) and exp < now:
        return "the token has expired"
    return None


class NodeAuth:
    """Resolve a node daemon's service-account token (TokenReview) for one node's report."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        service_account: str = "gpushare-daemon",
        ttl: float = 60.0,
        max_entries: int = 4096,
        audience: str = AUDIENCE,
        max_reviews: int = 8,
        max_waiting: int = 256,
        refused_ttl: float = 5.0,
        max_refused: int = 1024,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.username = f"system:serviceaccount:{namespace}:{service_account}"
        self.ttl = ttl
        self.max_entries = max_entries
        self.audience = audience
        self.max_waiting = max_waiting
        self.refused_ttl = refused_ttl
        self.max_refused = max_refused
        self.reviews = 0  # TokenReviews asked of the API server
        self.in_flight = 0  # of them, under way now
        self.most_in_flight = 0
        self._reviewing = asyncio.Semaphore(max_reviews)
        # sha256(token) -> (expires, username, bound pod or None): tokens the API server knows
        self._cache: OrderedDict[str, tuple[float, str, str | None]] = OrderedDict()
        # sha256(token) -> (expires, why): refused tokens, bounded apart from the above
        self._refused: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._pods: dict[str, tuple[float, str | None]] = {}  # pod -> (expires, its node)
        self._inflight: dict[str, asyncio.Future[tuple[str | None, str | None, str]]] = {}

    async def check(self, token: str, node: str) -> None:
        """Return when ``token`` is the node daemon's and may report for ``node``; raise 401 /
        403 otherwise (503 while too many reviews are under way or the API server is away)."""
        why = precheck(token, self.audience, time.time())
        if why is not None:
            raise unauthorized(why)
        username, pod = await self._identity(token)
        if username != self.username:
            raise forbidden(
                f"{username} may not report node usage (only the node daemon's service "
                f"account {self.username})"
            )
        if pod is not None:
            where = await self._pod_node(pod)
            if where != node:
                raise forbidden(
                    f"the token is bound to pod {pod} on node {where or '(none)'}; it may not "
                    f"report for node {node}"
                )

    async def _identity(self, token: str) -> tuple[str, str | None]:
        """(username, bound pod) of a token the API server accepts for our audience, from the
        caches or one shared review; 401 for a refused one."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(key)
            return cached[1], cached[2]
        refused = self._refused.get(key)
        if refused is not None and refused[0] > now:
            raise unauthorized(refused[1])
        pending = self._inflight.get(key)
        if pending is None:  # one review per token at a time, however many reports wait
            if len(self._inflight) >= self.max_waiting:
                raise unavailable(
                    "busy", "too many token reviews under way; report again in a moment"
                )
            pending = asyncio.ensure_future(self._review(token))
            self._inflight[key] = pending
            pending.add_done_callback(lambda done: self._settled(key, done))
        # shielded: a caller who hangs up does not cancel the review the others wait on
        username, pod, why = await asyncio.shield(pending)
        if username is None:
            raise unauthorized(why)
        return username, pod

    def _settled(self, key: str, done: asyncio.Future[tuple[str | None, str | None, str]]) -> None:
        if self._inflight.get(key) is done:
            del self._inflight[key]
        if done.cancelled() or done.exception() is not None:
            return  # the API server away: nothing is remembered
        username, pod, why = done.result()
        now = time.monotonic()
        if username is None:
            self._refused[key] = (now + self.refused_ttl, why)
            self._refused.move_to_end(key)
            while len(self._refused) > self.max_refused:
                self._refused.popitem(last=False)
            return
        self._cache[key] = (now + self.ttl, username, pod)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)

    async def _review(self, token: str) -> tuple[str | None, str | None, str]:
        """(username, bound pod, "") of a token the API server accepts for our audience, or
        (None, None, why)."""
        async with self._reviewing:
            self.reviews += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                status = await self._token_review(token)
            finally:
                self.in_flight -= 1
        if not status.get("authenticated"):
            error = str(status.get("error") or "")[:200]
            return (
                None,
                None,
                f"the token was refused by the Kubernetes API server for audience "
                f"{self.audience!r}" + (f": {error}" if error else ""),
            )
        if self.audience not in (status.get("audiences") or []):
            return (
                None,
                None,
                f"the API server did not confirm the token for audience {self.audience!r} "
                f"(audiences: {status.get('audiences')})",
            )
        user = status.get("user") or {}
        pods = (user.get("extra") or {}).get(POD_NAME_EXTRA) or []
        return str(user.get("username") or ""), (str(pods[0]) if pods else None), ""

    async def _token_review(self, token: str) -> dict[str, Any]:
        """The ``status`` of a TokenReview of ``token`` for our audience (503 when the API
        server cannot be asked)."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]},
        }
        from kubernetes_asyncio import client

        api: Any = client.AuthenticationV1Api(self.kube.api)
        try:
            review = await self.kube._json(api.create_token_review(body, _preload_content=False))
        except (ApiException, OSError, asyncio.TimeoutError) as exc:
            raise unavailable(
                "cluster_unavailable", f"the token could not be reviewed: {exc}"
            ) from None
        return dict(review.get("status") or {})

    async def _pod_node(self, pod: str) -> str | None:
        now = time.monotonic()
        cached = self._pods.get(pod)
        if cached is not None and cached[0] > now:
            return cached[1]
        found = await self.kube.get_pod(self.namespace, pod)
        where = ((found or {}).get("spec") or {}).get("nodeName")
        self._pods[pod] = (now + self.ttl, where)
        if len(self._pods) > self.max_entries:
            self._pods.pop(next(iter(self._pods)))
        return where


def check_report(node: str, document: Any) -> dict[str, Any]:
    """A report as :func:`~jupyter_gpushare.k8s.usage.usage_document` makes it, for ``node``."""
    if not isinstance(document, dict):
        raise bad_request("body", document, "a usage document (JSON object)")
    if document.get("format") != FORMAT:
        raise bad_request("format", document.get("format"), f"{FORMAT}")
    if document.get("node") != node:
        raise bad_request("node", document.get("node"), f"{node!r} (the node in the path)")
    if not isinstance(document.get("time"), (int, float)):
        raise bad_request("time", document.get("time"), "the daemon's wall time in seconds")
    allocations = document.get("allocations")
    if not isinstance(allocations, list) or len(allocations) > MAX_ALLOCATIONS:
        raise bad_request("allocations", "...", f"a list of at most {MAX_ALLOCATIONS} entries")
    for entry in allocations:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise bad_request("allocations[].id", entry, "each entry an object with an 'id'")
    if not isinstance(document.get("gpus", []), list):
        raise bad_request("gpus", document.get("gpus"), "a list")
    return document


@dataclass(frozen=True)
class _NodePart:
    """One node's latest report as the view needs it (built once, when the report comes)."""

    time: float  # the daemon's wall time of the report
    threshold: float  # stale once older than this (STALE_INTERVALS intervals + CLOCK_SLACK)
    entries: Mapping[str, Mapping[str, Any]]  # allocation id -> its entry, with "node"


class _Allocations(Mapping[str, Mapping[str, Any]]):
    """The allocations of one view (a :class:`~jupyter_gpushare.usage.UsageView`'s
    ``allocations``): an allocation id is looked up through the index to its node's part, and
    its ``age_s`` is that part's age at the view's time. What :func:`view_of` would hold, built
    in O(nodes) instead of O(allocations); an entry is made when it is read."""

    __slots__ = ("_fresh", "_index", "_now", "_parts")

    def __init__(
        self,
        index: Mapping[str, str],
        parts: Mapping[str, _NodePart],
        fresh: frozenset[str],
        now: float,
    ) -> None:
        self._index = index
        self._parts = parts
        self._fresh = fresh
        self._now = now

    def __getitem__(self, key: str) -> Mapping[str, Any]:
        node = self._index.get(key)
        if node is None or node not in self._fresh:
            raise KeyError(key)
        part = self._parts[node]
        return {**part.entries[key], "age_s": round(max(0.0, self._now - part.time), 1)}

    def __iter__(self) -> Iterator[str]:
        fresh = self._fresh
        return (key for key, node in self._index.items() if node in fresh)

    def __len__(self) -> int:
        fresh = self._fresh
        return sum(1 for node in self._index.values() if node in fresh)


class NodeReports:
    """The latest usage report of each node, in memory; a
    :class:`~jupyter_gpushare.usage.UsageSource` for the controller's resize checks.

    Cost at scale (1,000 nodes reporting every 2 s: 500 reports a second, and every user's
    server polling ``GET /api/usage``): a report costs the event loop only its own node's part
    (:meth:`put`: O(its entries), plus the allocation-id index), never a rebuild of the whole
    view. The view a GET reads is assembled from the parts (O(nodes): which are stale, which
    part turns stale first; copies of the part and index maps) and kept until it could change:

    - a new report (``version`` counts them), but at most one new view per ``coalesce``
      seconds: **a view is at most** ``coalesce`` **seconds behind the newest report** (default
      0.1 s; the reports themselves come every ~2 s). ``read(fresh=True)`` (a resize's
      below-use check) takes every report received so far;
    - a fresh report turning stale (the earliest deadline is kept; stale-report semantics as
      :func:`~jupyter_gpushare.k8s.usage.view_of`: older than ``STALE_INTERVALS`` intervals plus
      ``CLOCK_SLACK``, the node is named in ``stale``, its allocations dropped);
    - ``max_age`` seconds (the ages it shows, ``age_s``, are at most that much behind).

    ``builds`` counts the views built; ``received`` the reports. An allocation id reported by two
    nodes (the controller's handler keeps only entries of allocations the ledger places on the
    reporting node, so not there): the latest report wins."""

    def __init__(
        self,
        clock: Any = time.time,
        fallback: UsageSource | None = None,
        max_age: float = 1.0,
        coalesce: float = 0.1,
    ) -> None:
        self.clock = clock
        #: read while no daemon has reported here (daemons still writing usage ConfigMaps)
        self.fallback = fallback
        self.max_age = max_age
        self.coalesce = coalesce
        self._parts: dict[str, _NodePart] = {}
        self._index: dict[str, str] = {}  # allocation id -> the node whose report holds it
        self.received = 0
        self.version = 0
        self.builds = 0
        #: (version, built at, valid until, view)
        self._view: tuple[int, float, float, UsageView] | None = None

    def put(self, node: str, document: Mapping[str, Any]) -> None:
        """Keep ``document`` (checked: :func:`check_report`) as ``node``'s latest report."""
        report = NodeUsage(node, document, 0.0)
        entries = {str(e["id"]): {**e, "node": node} for e in report.allocations}
        before = self._parts.get(node)
        index = self._index
        if before is not None:
            for gone in before.entries.keys() - entries.keys():
                if index.get(gone) == node:
                    del index[gone]
        for key in entries:
            index[key] = node
        threshold = STALE_INTERVALS * report.interval + CLOCK_SLACK
        self._parts[node] = _NodePart(float(document.get("time") or 0.0), threshold, entries)
        self.received += 1
        self.version += 1

    def nodes(self) -> list[str]:
        return sorted(self._parts)

    async def read(self, fresh: bool = False) -> UsageView:
        """The view of the reports (see the class); ``fresh``: every report received so far."""
        if not self._parts:
            if self.fallback is not None:
                return await self.fallback.read(fresh)
            return UsageView(
                "kubernetes",
                message="no node daemon has reported usage to the controller yet",
            )
        now = self.clock()
        cached = self._view
        if cached is not None and cached[1] <= now <= cached[2]:
            if cached[0] == self.version or (not fresh and now - cached[1] < self.coalesce):
                return cached[3]
        view, until = self._build(now)
        self._view = (self.version, now, until, view)
        self.builds += 1
        return view

    def _build(self, now: float) -> tuple[UsageView, float]:
        """The view at ``now`` and until when it holds (the first fresh report to turn stale,
        or ``max_age``)."""
        fresh: set[str] = set()
        stale: dict[str, float] = {}
        until = now + self.max_age
        for node, part in self._parts.items():
            age = max(0.0, now - part.time)
            if age > part.threshold:
                stale[node] = round(age, 1)
                continue
            fresh.add(node)
            until = min(until, part.time + part.threshold)
        nodes = frozenset(fresh)
        allocations = _Allocations(dict(self._index), dict(self._parts), nodes, now)
        message = None
        if stale:
            message = "no current usage from node(s) " + ", ".join(
                f"{n} (last report {age:.0f} s ago)" for n, age in sorted(stale.items())
            )
        return UsageView("kubernetes", allocations, nodes, stale, message), until

    async def changed(self) -> None:
        """Nothing to do: node daemons watch their GpuLedger and apply changes themselves."""


#: the nodes of the last view answered, sorted (one view answers every GET until the next)
_sorted_nodes: tuple[frozenset[str], list[str]] = (frozenset(), [])


def usage_json(view: UsageView, allowed: set[str] | None) -> dict[str, Any]:
    """``GET /api/usage``: the view, only allocations in ``allowed`` (None: all, for admins)."""
    global _sorted_nodes
    if _sorted_nodes[0] is not view.nodes:
        _sorted_nodes = (view.nodes, sorted(view.nodes))
    if allowed is None:
        mine = {k: dict(v) for k, v in view.allocations.items()}
    else:  # a user's few ids looked up, not every allocation of the cluster scanned
        mine = {k: dict(v) for k in allowed if (v := view.allocations.get(k)) is not None}
    return {
        "source": view.source,
        "allocations": mine,
        "nodes": list(_sorted_nodes[1]),
        "stale": dict(view.stale),
        "message": view.message,
    }


def view_from_json(data: Mapping[str, Any]) -> UsageView:
    """What a user's server makes of ``GET /api/usage`` (its :class:`UsageView`)."""
    return UsageView(
        str(data.get("source") or "kubernetes"),
        dict(data.get("allocations") or {}),
        frozenset(data.get("nodes") or ()),
        dict(data.get("stale") or {}),
        data.get("message"),
    )


class ControllerModeUsage:
    """Controller mode: the server holds no Kubernetes rights; it reads the usage of its
    user's allocations from the controller (``GET /api/usage``), which the node daemons report
    to (this module). ``config``: the server's
    ``KubernetesBackendConfig`` (the controller's URL and the Hub token)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    async def read(self, fresh: bool = False) -> UsageView:
        try:
            remote = await controller_context(self.config)
            return view_from_json(await remote.client.request("GET", "/api/usage", retry=False))
        except Exception as exc:  # the controller away: say so, kernels keep running
            return UsageView(
                "kubernetes", message=f"usage could not be read from the controller: {exc}"
            )

    async def changed(self) -> None:
        """Nothing to do: node daemons watch their GpuLedger."""


__all__ = [
    "AUDIENCE",
    "ControllerModeUsage",
    "NodeAuth",
    "NodeReports",
    "check_report",
    "jwt_claims",
    "precheck",
    "usage_json",
    "view_from_json",
]
