"""Live usage on Kubernetes: node daemons publish it, Jupyter servers read it.

Two ways, chosen by the daemon's environment:

- **controller mode** (``$GPUSHARE_CONTROLLER_URL`` set; recommended): the daemon sends its
  report to the cluster controller (:class:`ControllerReporter`, authenticated with its
  service-account token), which keeps it in memory; servers read their users' usage with the
  controller's ``GET /api/usage`` (:class:`~jupyter_gpushare.controller.usage.
  ControllerModeUsage`). etcd sees none of it (why: :mod:`jupyter_gpushare.controller.usage`);
- **direct mode**: the ConfigMaps below.

The server cannot reach a node daemon's unix socket in a cluster, yet idle reclaim, the below-use
check of a live resize and ``GET /gpushare/api/usage`` need what only the daemon measures
(achieved share, memory in use, idle time). So each node daemon (``--kubernetes-namespace``)
runs a :class:`UsagePublisher` that writes its node's usage every ``--usage-interval`` seconds
(default 2) into one ConfigMap, ``gpushare-usage-<node>``, in the ledger's namespace:

- ``data["usage.json"]``: :func:`usage_document` — per allocation ``achieved_share``,
  ``memory_used``, ``memory_cap``, ``idle_s``, ``last_launch_ago_s``, ``lease_wait_seconds``,
  ``connected`` …; per GPU the scheduler's busy share and the NVML summary; the daemon's wall
  ``time`` and its ``interval_s``.
- A ConfigMap of its own, not a field of the node's GpuLedger, on purpose: a usage write must not
  bump the ledger's ``resourceVersion``, which would make every placement's compare-and-swap on
  that node lose and retry every two seconds. ConfigMaps need no CRD, and RBAC stays narrow:
  the daemon may create/patch ConfigMaps, the server may list them (``deploy/rbac.yaml``).
- Owned by the Node (like the GpuLedger), so the garbage collector removes it with the node.
- One merge patch per interval per node (about 300 bytes per allocation).

The server's :class:`UsageReader` lists the ConfigMaps by label (one LIST shared by every reader
for ``ttl`` seconds, however many users poll) and drops reports older than
``STALE_INTERVALS`` intervals plus ``CLOCK_SLACK`` seconds (the daemon is down or cut off), naming
those nodes. Ages compare the daemon's wall clock with the server's: nodes are expected to run
NTP; a skew beyond ``CLOCK_SLACK`` makes reports look stale (never fresher than they are).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ..periodic import PeriodicTask
from ..usage import USAGE_KEYS, UsageView
from . import manifests
from .client import ApiException, Kube

log = logging.getLogger("jupyter_gpushare.k8s.usage")

FORMAT = 1
DATA_KEY = "usage.json"
NAME_PREFIX = "gpushare-usage-"
LABEL_COMPONENT = "app.kubernetes.io/component"
COMPONENT = "gpushare-usage"
LABEL_NODE = "gpushare.jupyter.org/node"
SELECTOR = f"{LABEL_COMPONENT}={COMPONENT}"
DEFAULT_INTERVAL = 2.0
#: a report older than this many intervals (plus CLOCK_SLACK) is not used
STALE_INTERVALS = 3.0
CLOCK_SLACK = 2.0
NVML_KEYS = ("memory_used", "memory_total", "utilization_gpu", "temperature_c", "power_w")


def configmap_name(node: str) -> str:
    """``gpushare-usage-<node>``; node names up to 253 characters are shortened with a hash."""
    name = NAME_PREFIX + node
    if len(name) <= 253:
        return name
    digest = hashlib.sha1(node.encode()).hexdigest()[:10]
    return f"{NAME_PREFIX}{node[: 253 - len(NAME_PREFIX) - 11]}-{digest}"


# -- the daemon side ---------------------------------------------------------------------------


def usage_document(
    status: Mapping[str, Any],
    servers: Mapping[str, str | None],
    node: str,
    interval: float,
    now: float,
) -> dict[str, Any]:
    """The published form of a daemon's status (pure). ``servers``: allocation id -> the Jupyter
    server that holds it (``extra.k8s_server``), so a server can pick its own without reading
    the ledger."""
    allocations = []
    for a in status.get("allocations") or []:
        entry = {k: a.get(k) for k in USAGE_KEYS}
        entry["k8s_server"] = servers.get(a["id"])
        allocations.append(entry)
    gpus = []
    for g in status.get("gpus") or []:
        nvml = g.get("nvml") or {}
        gpus.append(
            {
                "uuid": g.get("uuid"),
                "busy_share": g.get("busy_share"),
                "allocations": len(g.get("allocations") or []),
                "nvml": {k: nvml.get(k) for k in NVML_KEYS} if nvml else None,
            }
        )
    daemon = status.get("daemon") or {}
    return {
        "format": FORMAT,
        "node": node,
        "time": round(now, 3),
        "interval_s": interval,
        "daemon": {k: daemon.get(k) for k in ("pid", "epoch", "uptime_s", "window_ms", "clients")},
        "allocations": allocations,
        "gpus": gpus,
    }


def usage_configmap(
    document: Mapping[str, Any], namespace: str, owner: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The ConfigMap holding ``document`` (pure)."""
    node = str(document["node"])
    meta: dict[str, Any] = {
        "name": configmap_name(node),
        "namespace": namespace,
        "labels": {LABEL_COMPONENT: COMPONENT, LABEL_NODE: node[:63].rstrip("-.")},
    }
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {DATA_KEY: json.dumps(document, separators=(",", ":"))},
    }


class _UsageSender(PeriodicTask):
    """A node daemon's usage document, sent somewhere every ``every`` seconds by
    :meth:`publish_once`. Never fatal to the daemon: a failure is logged once per distinct
    error (:meth:`_failed`) and retried on the next interval."""

    def __init__(
        self,
        kube: Kube,
        node: str,
        status: Callable[[], Mapping[str, Any]],
        servers: Callable[[], Mapping[str, str | None]],
        interval: float,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(log)
        self.kube = kube
        self.node = node
        self.status = status
        self.servers = servers
        self.every = interval
        self.clock = clock
        self.published = 0
        self._last_error: str | None = None

    def interval(self) -> float:
        return self.every

    def document(self) -> dict[str, Any]:
        return usage_document(self.status(), self.servers(), self.node, self.every, self.clock())

    async def publish_once(self) -> None:
        raise NotImplementedError

    def _failed(self, exc: Exception) -> str:
        """Log ``exc`` unless it is the error last logged; the text to compare next time."""
        raise NotImplementedError

    def _recovered(self) -> None:
        raise NotImplementedError

    async def run_once(self) -> None:
        try:
            await self.publish_once()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never stop the daemon over its usage report
            self._last_error = self._failed(exc)
            return
        self.published += 1
        if self._last_error is not None:
            self._recovered()
        self._last_error = None


class UsagePublisher(_UsageSender):
    """Writes a node daemon's usage into its node's ConfigMap every ``every`` seconds.

    Never fatal to the daemon: failed writes (API server away, RBAC missing) are logged once per
    distinct error and retried on the next interval."""

    what = "usage report"

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        node: str,
        status: Callable[[], Mapping[str, Any]],
        servers: Callable[[], Mapping[str, str | None]],
        interval: float = DEFAULT_INTERVAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(kube, node, status, servers, interval, clock)
        self.namespace = namespace
        self.name = configmap_name(node)
        self._exists = False

    async def publish_once(self) -> None:
        document = self.document()
        if self._exists:
            try:
                await self._patch(document)
                return
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self._exists = False
        core: Any = self.kube.core  # plain dicts in, JSON out (as in .client)
        try:
            await self.kube._json(
                core.create_namespaced_config_map(
                    self.namespace,
                    usage_configmap(document, self.namespace, await self._owner()),
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status != 409:  # AlreadyExists: a previous run of this daemon made it
                raise
            await self._patch(document)
        self._exists = True

    async def _patch(self, document: Mapping[str, Any]) -> None:
        body = {"data": {DATA_KEY: json.dumps(document, separators=(",", ":"))}}
        core: Any = self.kube.core
        await self.kube._json(
            core.patch_namespaced_config_map(
                self.name,
                self.namespace,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        )

    async def _owner(self) -> dict[str, Any] | None:
        """The Node, so that the ConfigMap goes with it; None when it cannot be read."""
        try:
            node = await self.kube.read_node(self.node)
        except ApiException:
            return None
        return manifests.node_owner(self.node, node["metadata"]["uid"])

    def _failed(self, exc: Exception) -> str:
        text = f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
        if text != self._last_error:
            log.warning(
                "writing usage ConfigMap %s/%s failed (retrying every %g s): %s",
                self.namespace,
                self.name,
                self.every,
                text,
            )
        return text

    def _recovered(self) -> None:
        log.info("usage ConfigMap %s/%s written again", self.namespace, self.name)


class ControllerReporter(_UsageSender):
    """Sends a node daemon's usage to the cluster controller every ``every`` seconds
    (``PUT {controller}/api/usage/<node>``, the same document as the ConfigMap), authenticated
    with the daemon's service-account token; the controller checks it with a TokenReview (see
    :mod:`jupyter_gpushare.controller.usage`). Nothing is written to the API server.

    The token is read on every report from ``token_file`` (``$GPUSHARE_CONTROLLER_TOKEN_FILE``:
    the DaemonSet's projected token, made for audience ``gpushare-controller``, bound to the
    daemon's pod, rotated by the kubelet; the controller also checks the pod's node). Without
    one it sends the API client's own bearer token, which is made for the API server and which
    the controller therefore refuses (401 naming the audience): a token that reaches the
    controller over the cluster network must be useless at the API server. Never fatal to the
    daemon: failures are logged once per distinct error."""

    what = "usage report to the controller"

    def __init__(
        self,
        urls: Sequence[str],
        kube: Kube,
        node: str,
        status: Callable[[], Mapping[str, Any]],
        servers: Callable[[], Mapping[str, str | None]],
        interval: float = DEFAULT_INTERVAL,
        token_file: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(kube, node, status, servers, interval, clock)
        self.urls = [u.rstrip("/") for u in urls if u.strip()]
        self.token_file = token_file

    async def token(self) -> str:
        if self.token_file:
            text = await asyncio.to_thread(Path(self.token_file).read_text)
            return text.strip()
        configuration: Any = self.kube.api.configuration
        value = await configuration.get_api_key_with_prefix("BearerToken") or ""
        scheme, _, token = str(value).partition(" ")
        return token.strip() if token else scheme.strip()

    async def publish_once(self) -> None:
        from urllib.parse import quote

        from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

        body = json.dumps(self.document(), separators=(",", ":"))
        headers = {
            "Authorization": f"Bearer {await self.token()}",
            "Content-Type": "application/json",
        }
        problems = []
        for url in self.urls:  # the Service routes to the leader; a list of replicas works too
            request = HTTPRequest(
                f"{url}/api/usage/{quote(self.node, safe='')}",
                method="PUT",
                headers=headers,
                body=body,
                request_timeout=max(2.0, self.every * 2),
                connect_timeout=2.0,
            )
            try:
                await AsyncHTTPClient().fetch(request)
                return
            except HTTPClientError as exc:
                text = exc.response.body.decode(errors="replace")[:300] if exc.response else ""
                problems.append(f"{url}: {exc.code} {text}")
            except OSError as exc:
                problems.append(f"{url}: {exc}")
        raise RuntimeError("; ".join(problems))

    def _failed(self, exc: Exception) -> str:
        text = str(exc) or type(exc).__name__
        if text != self._last_error:
            log.warning("usage report to the controller failed (retrying): %s", text)
        return text

    def _recovered(self) -> None:
        log.info("usage reports reach the controller again")


#: The node daemon reports to the controller (instead of a ConfigMap) when this is set: the
#: controller's URL(s), comma-separated (the DaemonSet sets it in controller mode).
CONTROLLER_URL_ENV = "GPUSHARE_CONTROLLER_URL"
#: the projected service-account token for those reports (audience gpushare-controller, pod
#: bound; the DaemonSet mounts it at /var/run/secrets/gpushare.jupyter.org/controller/token)
CONTROLLER_TOKEN_ENV = "GPUSHARE_CONTROLLER_TOKEN_FILE"


def start_publisher(
    daemon: Any, ledger: Any, interval: float = DEFAULT_INTERVAL
) -> UsagePublisher | ControllerReporter | None:
    """Start publishing ``daemon``'s usage when it follows a Kubernetes ledger (else None): to
    the controller when ``$GPUSHARE_CONTROLLER_URL`` is set, else into its node's ConfigMap."""
    import os

    from .ledger import KubernetesLedger

    if not isinstance(ledger, KubernetesLedger) or interval <= 0:
        return None

    def servers() -> dict[str, str | None]:
        return {a.id: a.extra.get("k8s_server") for a in daemon.allocations.values()}

    controller = os.environ.get(CONTROLLER_URL_ENV, "")
    if controller.strip():
        log.info("reporting usage to the controller at %s every %g s", controller, interval)
        reporter = ControllerReporter(
            controller.split(","),
            ledger.kube,
            daemon.settings.node,
            daemon.status,
            servers,
            interval,
            token_file=os.environ.get(CONTROLLER_TOKEN_ENV, ""),
        )
        reporter.start()
        return reporter

    log.info(
        "publishing usage to ConfigMap %s/%s every %g s",
        ledger.namespace,
        configmap_name(daemon.settings.node),
        interval,
    )
    publisher = UsagePublisher(
        ledger.kube, ledger.namespace, daemon.settings.node, daemon.status, servers, interval
    )
    publisher.start()
    return publisher


# -- the server side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeUsage:
    """One node's published usage, as read by a server at ``read_at`` (wall time)."""

    node: str
    document: Mapping[str, Any]
    read_at: float

    @property
    def interval(self) -> float:
        return float(self.document.get("interval_s") or DEFAULT_INTERVAL)

    @property
    def age(self) -> float:
        return max(0.0, self.read_at - float(self.document.get("time") or 0.0))

    @property
    def stale(self) -> bool:
        return self.age > STALE_INTERVALS * self.interval + CLOCK_SLACK

    @property
    def allocations(self) -> Sequence[Mapping[str, Any]]:
        return self.document.get("allocations") or []

    @property
    def gpus(self) -> Sequence[Mapping[str, Any]]:
        return self.document.get("gpus") or []


def read_configmaps(items: Sequence[Mapping[str, Any]], now: float) -> list[NodeUsage]:
    """The usage reports in a ConfigMap listing (pure); unreadable ones are skipped."""
    found = []
    for item in items:
        raw = (item.get("data") or {}).get(DATA_KEY)
        try:
            document = json.loads(raw) if raw else None
        except ValueError:
            document = None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            log.debug("skipping unreadable usage ConfigMap %s", item.get("metadata", {}))
            continue
        found.append(NodeUsage(str(document.get("node")), document, now))
    return found


def view_of(reports: Sequence[NodeUsage]) -> UsageView:
    """Current reports become the view; stale ones are named, their numbers dropped (pure)."""
    allocations: dict[str, Mapping[str, Any]] = {}
    fresh: set[str] = set()
    stale: dict[str, float] = {}
    for report in reports:
        if report.stale:
            stale[report.node] = round(report.age, 1)
            continue
        fresh.add(report.node)
        for entry in report.allocations:
            allocations[str(entry["id"])] = {
                **entry,
                "node": report.node,
                "age_s": round(report.age, 1),
            }
    message = None
    if stale:
        message = "no current usage from node(s) " + ", ".join(
            f"{n} (last report {age:.0f} s ago)" for n, age in sorted(stale.items())
        )
    elif not reports:
        message = "no node daemon has published usage (ConfigMaps " + SELECTOR + ")"
    return UsageView("kubernetes", allocations, frozenset(fresh), stale, message)


class UsageReader:
    """The usage ConfigMaps of a namespace, listed at most once per ``ttl`` seconds."""

    def __init__(
        self, kube: Kube, namespace: str, ttl: float = 1.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.ttl = ttl
        self.clock = clock
        self._cached: tuple[float, list[NodeUsage]] | None = None
        self._lock = asyncio.Lock()

    async def reports(self, fresh: bool = False) -> list[NodeUsage]:
        async with self._lock:
            now = time.monotonic()
            if not fresh and self._cached is not None and now - self._cached[0] < self.ttl:
                return self._cached[1]
            listing = await self.kube._json(
                self.kube.core.list_namespaced_config_map(
                    self.namespace, label_selector=SELECTOR, _preload_content=False
                )
            )
            reports = read_configmaps(listing.get("items") or [], self.clock())
            self._cached = (now, reports)
            return reports


class KubernetesUsage:
    """The :class:`~jupyter_gpushare.usage.UsageSource` of the Kubernetes backend."""

    def __init__(self, reader: UsageReader) -> None:
        self.reader = reader

    async def read(self, fresh: bool = False) -> UsageView:
        try:
            return view_of(await self.reader.reports(fresh))
        except ApiException as exc:
            problem = f"{exc.status} {exc.reason}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            problem = str(exc) or type(exc).__name__
        return UsageView("kubernetes", message=f"usage ConfigMaps could not be read: {problem}")

    async def changed(self) -> None:
        """Nothing to do: node daemons watch their GpuLedger and apply changes themselves."""


_sources: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, KubernetesUsage] = (
    weakref.WeakKeyDictionary()
)


def server_usage(kube: Kube, namespace: str) -> KubernetesUsage:
    """A server's reader of ``namespace``'s reports on ``kube`` (its Kubernetes context's
    client): one per event loop, so every poll of the loop shares one LIST per ``ttl``."""
    loop = asyncio.get_running_loop()
    source = _sources.get(loop)
    if source is None or source.reader.kube is not kube or source.reader.namespace != namespace:
        source = _sources[loop] = KubernetesUsage(UsageReader(kube, namespace))
    return source


__all__ = [
    "ControllerReporter",
    "KubernetesUsage",
    "NodeUsage",
    "UsagePublisher",
    "UsageReader",
    "configmap_name",
    "read_configmaps",
    "server_usage",
    "start_publisher",
    "usage_configmap",
    "usage_document",
    "view_of",
]
