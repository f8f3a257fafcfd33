"""Prometheus metrics of the daemon, served over HTTP (names ``gpushare_…``).

A collector reads the daemon's status at scrape time, so the numbers are the status API's.

Labels, chosen to join with NVIDIA's DCGM exporter (which cannot see kernel pods: the kubelet's
pod-resources API names only ``nvidia.com/gpu`` holders):

- per GPU (``gpushare_gpu_*``) and per allocation: ``gpu`` (NVML's index, as DCGM's ``gpu``;
  empty where NVML is not sampled), ``UUID`` (the GPU's UUID, DCGM's ``UUID``) and
  ``Hostname`` (the node, DCGM's ``Hostname`` where the exporter runs with ``NODE_NAME``; this
  machine's host name off Kubernetes);
- per allocation (``gpushare_allocation_*``): ``allocation``, ``kernel_id``, ``user`` (from the
  ledger record) and ``pod`` / ``namespace`` (the kernel pod on Kubernetes; empty for local
  kernels);
- the daemon's own series (``gpushare_daemon_*``): ``Hostname``.

Prometheus must keep these labels as they are: scrape with ``honor_labels: true`` (the chart's
PodMonitor does), or the scraped ``pod`` and ``namespace`` become ``exported_pod`` /
``exported_namespace`` next to the daemon pod's own.

So ``gpushare_allocation_share * on(UUID) group_left DCGM_FI_DEV_GPU_UTIL`` and the like work
as written; ``deploy/grafana/gpushare.json`` uses only the names below (``METRIC_NAMES``, checked
by ``tests/k8s/test_observability.py``).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.registry import Collector

GPU_LABELS = ["gpu", "UUID", "Hostname"]
ALLOCATION_LABELS = ["allocation", "kernel_id", "user", "pod", "namespace", *GPU_LABELS]

#: (kind, name, help): one family per entry, per allocation and GPU.
ALLOCATION_METRICS = [
    ("gauge", "gpushare_allocation_share", "Achieved share of device time in the window"),
    ("gauge", "gpushare_allocation_request", "Requested share (fraction of the GPU)"),
    ("gauge", "gpushare_allocation_limit", "Share limit (fraction of the GPU)"),
    ("counter", "gpushare_allocation_device_seconds", "Device time charged to the allocation"),
    ("gauge", "gpushare_allocation_memory_used_bytes", "Device memory held by the allocation"),
    ("gauge", "gpushare_allocation_memory_cap_bytes", "Device memory cap of the allocation"),
    ("counter", "gpushare_allocation_oom_refusals", "Allocations refused at the cap"),
    ("counter", "gpushare_allocation_lease_waits", "Launches that waited for a lease"),
    ("counter", "gpushare_allocation_lease_wait_seconds", "Time launches waited for a lease"),
    (
        "counter",
        "gpushare_allocation_memory_kills",
        "Processes of the allocation stopped because the driver reported its memory over its cap",
    ),
    (
        "counter",
        "gpushare_allocation_compute_fences",
        "Processes paused because the driver reported device time beyond the share's limit or "
        "taken from another share's request",
    ),
]
#: status key of each allocation metric, in ALLOCATION_METRICS' order
_ALLOCATION_KEYS = [
    "achieved_share",
    "request",
    "limit",
    "device_seconds",
    "memory_used",
    "memory_cap",
    "oom_refusals",
    "lease_waits",
    "lease_wait_seconds",
    "memory_kills",
    "compute_fences",
]
GPU_METRICS = [
    ("gauge", "gpushare_gpu_busy_share", "Share of the window the GPU was leased"),
    ("counter", "gpushare_gpu_lease_handoffs", "Leases granted"),
    ("gauge", "gpushare_gpu_shares", "Shares (allocations) on the GPU"),
    ("gauge", "gpushare_gpu_reserved_request", "Sum of the requests of the GPU's shares"),
    ("gauge", "gpushare_gpu_reserved_memory_bytes", "Sum of the memory caps of its shares"),
]
DAEMON_METRICS = [
    ("gauge", "gpushare_daemon_clients", "Connected processes"),
    ("counter", "gpushare_daemon_refused_connections", "Processes refused (no or another's share)"),
    (
        "counter",
        "gpushare_daemon_unshared_kills",
        "Processes stopped for using a GPU without a share on it (the driver's figures)",
    ),
]


#: the queue's series (DESIGN box 13; ``daemon/queue_ops.py``): (kind, name, help, status key)
QUEUE_METRICS = [
    ("gauge", "gpushare_queue_length", "Starts waiting in the queue", "waiting"),
    ("counter", "gpushare_queue_started", "Queued starts that began", "started"),
    ("counter", "gpushare_queue_cancelled", "Queued starts cancelled", "cancelled"),
    ("counter", "gpushare_queue_dropped", "Queued starts whose requester died", "dropped"),
    ("counter", "gpushare_queue_eta_shown", "Started entries that were shown an ETA", "eta_shown"),
    (
        "counter",
        "gpushare_queue_eta_inside",
        "Started entries that began inside the first ETA range shown",
        "eta_inside",
    ),
]
#: (name, help, buckets key, sum key): histograms of the queue
QUEUE_HISTOGRAMS = [
    (
        "gpushare_queue_wait_seconds",
        "How long started entries waited",
        "wait_buckets",
        "wait_sum_s",
    ),
    (
        "gpushare_queue_eta_error_seconds",
        "How far outside the first ETA range shown an entry began",
        "eta_error_buckets",
        "eta_error_sum_s",
    ),
]


def metric_names() -> set[str]:
    """Every series name the endpoint can export (a counter ``x`` is exported as ``x_total``)."""
    names = set()
    for kind, name, _ in [*ALLOCATION_METRICS, *GPU_METRICS, *DAEMON_METRICS]:
        names.add(f"{name}_total" if kind == "counter" else name)
    for kind, name, _, _ in QUEUE_METRICS:
        names.add(f"{name}_total" if kind == "counter" else name)
    for name, *_ in QUEUE_HISTOGRAMS:
        names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
    return names


METRIC_NAMES = frozenset(metric_names())


def _family(kind: str, name: str, help_text: str, labels: list[str]) -> Any:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, help_text, labels=labels)


class DaemonCollector(Collector):
    def __init__(self, status: Callable[[], dict[str, Any]], hostname: str = "") -> None:
        self._status = status
        self._hostname = hostname

    def collect(self) -> Iterator[Any]:
        status = self._status()
        host = str(status["daemon"].get("node") or self._hostname or socket.gethostname())
        index: dict[str, str] = {}
        for g in status["gpus"]:
            nvml = g.get("nvml") or {}
            index[g["uuid"]] = str(nvml["index"]) if nvml.get("index") is not None else ""

        def gpu_labels(uuid: str) -> list[str]:
            return [index.get(uuid, ""), uuid, host]

        per_allocation = [_family(*m, ALLOCATION_LABELS) for m in ALLOCATION_METRICS]
        for allocation in status["allocations"]:
            who = [
                allocation["id"],
                allocation.get("kernel_id") or "",
                allocation.get("user") or "",
                allocation.get("pod") or "",
                allocation.get("namespace") or "",
            ]
            for g in allocation["gpus"]:
                labels = who + gpu_labels(g["gpu"])
                for family, key in zip(per_allocation, _ALLOCATION_KEYS, strict=True):
                    family.add_metric(labels, g.get(key, 0))
        per_gpu = [_family(*m, GPU_LABELS) for m in GPU_METRICS]
        for g in status["gpus"]:
            values = [
                g["busy_share"],
                g["handoffs"],
                g.get("shares", 0),
                g.get("reserved_request", 0.0),
                g.get("reserved_memory", 0),
            ]
            for family, value in zip(per_gpu, values, strict=True):
                family.add_metric(gpu_labels(g["uuid"]), value)
        clients, refused, unshared = (_family(*m, ["Hostname"]) for m in DAEMON_METRICS)
        clients.add_metric([host], status["daemon"]["clients"])
        refused.add_metric([host], status["daemon"]["refused"])
        unshared.add_metric([host], status["daemon"].get("unshared_kills", 0))
        yield from (*per_allocation, *per_gpu, clients, refused, unshared)
        queue = status.get("queue")
        if queue is not None:
            yield from queue_families(queue, host)


def queue_families(queue: dict[str, Any], host: str) -> Iterator[Any]:
    """The queue's series (``QUEUE_METRICS``, ``QUEUE_HISTOGRAMS``) from its figures
    (:meth:`..queue.figures.QueueMetrics.to_json`), labelled ``Hostname`` ``host``: the node
    agent's here, the controller's on its ``/metrics``."""
    for kind, name, help_text, key in QUEUE_METRICS:
        family = _family(kind, name, help_text, ["Hostname"])
        family.add_metric([host], queue.get(key, 0))
        yield family
    for name, help_text, buckets_key, sum_key in QUEUE_HISTOGRAMS:
        family = HistogramMetricFamily(name, help_text, labels=["Hostname"])
        buckets = [
            ("+Inf" if bound == float("inf") else f"{bound:g}", count)
            for bound, count in queue.get(buckets_key) or []
        ]
        family.add_metric([host], buckets, queue.get(sum_key, 0.0))
        yield family


class _Handler(_SilentHandler):
    #: a connection that sends nothing for this long is closed (slow or idle clients)
    timeout = 10.0


class BoundedMetricsServer(ThreadingWSGIServer):
    """prometheus_client's threaded server with at most ``max_connections`` connections served
    at once; more are closed at once, and each is dropped after ``_Handler.timeout`` seconds of
    silence. The plain server starts a thread per connection without limit, so anyone who can
    reach the port (the NetworkPolicy admits only Prometheus, where the CNI enforces it) could
    hold thousands of threads in the node agent that serves every kernel's leases."""

    max_connections = 8

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _BoundedMetricsServer6(BoundedMetricsServer):
    address_family = socket.AF_INET6


def serve(status: Callable[[], dict[str, Any]], host: str, port: int) -> int:
    """Start the metrics endpoint in a thread; returns the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(status))
    server_class: type[BoundedMetricsServer] = BoundedMetricsServer
    if ":" in host:  # an IPv6 address
        server_class = _BoundedMetricsServer6
    server = make_server(host, port, make_wsgi_app(registry), server_class, _Handler)
    threading.Thread(target=server.serve_forever, name="gpushare-metrics", daemon=True).start()
    return int(server.server_address[1])
