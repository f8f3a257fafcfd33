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

Who may report (:class:`NodeAuth`): the caller sends its service-account token
(``Authorization: Bearer``); the controller asks the API server who that is with a
``TokenReview`` (``authentication.k8s.io/v1``) and accepts only the node daemon's service
account (``system:serviceaccount:<namespace>:gpushare-daemon``). When the token is bound to a
pod (a projected service-account token, as the DaemonSet mounts it), the review names that pod
and the controller checks that the pod runs on the node the report is about: a daemon cannot
report for another node. A legacy (unbound) token of the daemon's account proves "a node daemon"
only. Anything else — no token, a user's token, another account, a daemon of another node — is
refused (401/403) and the report dropped. Even an accepted report speaks only for the
allocations the ledger places on its node; entries about any other are dropped. Verdicts are
cached for ``ttl`` seconds (bounded), so a daemon reporting every 2 s costs one TokenReview a
minute.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ..k8s.client import ApiException, Kube
from ..k8s.usage import CLOCK_SLACK, FORMAT, STALE_INTERVALS, NodeUsage, view_of
from ..usage import UsageSource, UsageView
from .client import controller_context
from .errors import bad_request, forbidden, unauthorized, unavailable

log = logging.getLogger("jupyter_gpushare.controller")

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
MAX_ALLOCATIONS = 4096


class NodeAuth:
    """Resolve a node daemon's service-account token (TokenReview) for one node's report."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        service_account: str = "gpushare-daemon",
        ttl: float = 60.0,
        max_entries: int = 4096,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.username = f"system:serviceaccount:{namespace}:{service_account}"
        self.ttl = ttl
        self.max_entries = max_entries
        self.reviews = 0
        # sha256(token) -> (expires, username or None, bound pod or None)
        self._cache: OrderedDict[str, tuple[float, str | None, str | None]] = OrderedDict()
        self._pods: dict[str, tuple[float, str | None]] = {}  # pod -> (expires, its node)
        self._inflight: dict[str, asyncio.Future[tuple[str | None, str | None]]] = {}

    async def check(self, token: str, node: str) -> None:
        """Return when ``token`` is the node daemon's and may report for ``node``; raise 401 /
        403 otherwise."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is None or cached[0] <= now:
            pending = self._inflight.get(key)
            if pending is None:  # one review per token at a time, however many reports wait
                pending = asyncio.ensure_future(self._review(token))
                self._inflight[key] = pending
                try:
                    username, pod = await pending
                finally:
                    self._inflight.pop(key, None)
            else:
                username, pod = await pending
            ttl = self.ttl if username else min(self.ttl, 5.0)
            cached = (now + ttl, username, pod)
            self._cache[key] = cached
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        _, username, pod = cached
        if username is None:
            raise unauthorized("the token was refused by the Kubernetes API server")
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

    async def _review(self, token: str) -> tuple[str | None, str | None]:
        self.reviews += 1
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        }
        from kubernetes_asyncio import client

        api: Any = client.AuthenticationV1Api(self.kube.api)
        try:
            review = await self.kube._json(api.create_token_review(body, _preload_content=False))
        except (ApiException, OSError, asyncio.TimeoutError) as exc:
            raise unavailable(
                "cluster_unavailable", f"the token could not be reviewed: {exc}"
            ) from None
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return None, None
        user = status.get("user") or {}
        pods = (user.get("extra") or {}).get(POD_NAME_EXTRA) or []
        return str(user.get("username") or ""), (str(pods[0]) if pods else None)

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


class NodeReports:
    """The latest usage report of each node, in memory; a
    :class:`~jupyter_gpushare.usage.UsageSource` for the controller's resize checks.

    Every user's server polls ``GET /api/usage``; the view it reads is built once and kept until
    it could change: a new report (``version`` counts them), a fresh report turning stale (the
    earliest deadline is kept), or ``max_age`` seconds (the ages it shows, ``age_s``, are at most
    that much behind). ``builds`` counts the views built."""

    def __init__(
        self, clock: Any = time.time, fallback: UsageSource | None = None, max_age: float = 1.0
    ) -> None:
        self.clock = clock
        #: read while no daemon has reported here (daemons still writing usage ConfigMaps)
        self.fallback = fallback
        self.max_age = max_age
        self._reports: dict[str, Mapping[str, Any]] = {}
        self.received = 0
        self.version = 0
        self.builds = 0
        #: (version, built at, valid until, view)
        self._view: tuple[int, float, float, UsageView] | None = None

    def put(self, node: str, document: Mapping[str, Any]) -> None:
        self._reports[node] = document
        self.received += 1
        self.version += 1

    def nodes(self) -> list[str]:
        return sorted(self._reports)

    async def read(self, fresh: bool = False) -> UsageView:
        """The view of the reports; ``fresh`` needs no cache bypass: a new report replaces the
        view at once."""
        if not self._reports:
            if self.fallback is not None:
                return await self.fallback.read(fresh)
            return UsageView(
                "kubernetes",
                message="no node daemon has reported usage to the controller yet",
            )
        now = self.clock()
        cached = self._view
        if cached is not None and cached[0] == self.version and cached[1] <= now <= cached[2]:
            return cached[3]
        reports = [NodeUsage(node, doc, now) for node, doc in self._reports.items()]
        view = view_of(reports)
        until = now + self.max_age
        for report in reports:  # the view changes when a fresh report turns stale
            if not report.stale:
                turns_stale = report.read_at - report.age + STALE_INTERVALS * report.interval
                until = min(until, turns_stale + CLOCK_SLACK)
        self._view = (self.version, now, until, view)
        self.builds += 1
        return view

    async def changed(self) -> None:
        """Nothing to do: node daemons watch their GpuLedger and apply changes themselves."""


def usage_json(view: UsageView, allowed: set[str] | None) -> dict[str, Any]:
    """``GET /api/usage``: the view, only allocations in ``allowed`` (None: all, for admins)."""
    return {
        "source": view.source,
        "allocations": {
            k: dict(v) for k, v in view.allocations.items() if allowed is None or k in allowed
        },
        "nodes": sorted(view.nodes),
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
    "ControllerModeUsage",
    "NodeAuth",
    "NodeReports",
    "check_report",
    "usage_json",
    "view_from_json",
]
