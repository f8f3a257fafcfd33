"""Prometheus metrics of the daemon, served on a loopback HTTP port (names ``gpushare_…``).

A collector reads the daemon's status at scrape time, so the numbers are the status API's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class DaemonCollector(Collector):
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Any]:
        status = self._status()
        labels = ["allocation", "gpu"]
        share = GaugeMetricFamily(
            "gpushare_allocation_share",
            "Achieved share of device time in the window",
            labels=labels,
        )
        request = GaugeMetricFamily("gpushare_allocation_request", "Requested share", labels=labels)
        limit = GaugeMetricFamily("gpushare_allocation_limit", "Share limit", labels=labels)
        seconds = CounterMetricFamily(
            "gpushare_allocation_device_seconds",
            "Device time charged to the allocation",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "gpushare_allocation_memory_used_bytes",
            "Device memory reserved by the allocation",
            labels=labels,
        )
        cap = GaugeMetricFamily(
            "gpushare_allocation_memory_cap_bytes",
            "Device memory cap of the allocation",
            labels=labels,
        )
        ooms = CounterMetricFamily(
            "gpushare_allocation_oom_refusals", "Allocations refused at the cap", labels=labels
        )
        waits = CounterMetricFamily(
            "gpushare_allocation_lease_waits", "Launches that waited for a lease", labels=labels
        )
        wait_s = CounterMetricFamily(
            "gpushare_allocation_lease_wait_seconds",
            "Time launches spent waiting for a lease",
            labels=labels,
        )
        for allocation in status["allocations"]:
            for g in allocation["gpus"]:
                key = [allocation["id"], g["gpu"]]
                share.add_metric(key, g["achieved_share"])
                request.add_metric(key, g["request"])
                limit.add_metric(key, g["limit"])
                seconds.add_metric(key, g["device_seconds"])
                used.add_metric(key, g["memory_used"])
                cap.add_metric(key, g["memory_cap"])
                ooms.add_metric(key, g["oom_refusals"])
                waits.add_metric(key, g["lease_waits"])
                wait_s.add_metric(key, g["lease_wait_seconds"])
        busy = GaugeMetricFamily(
            "gpushare_gpu_busy_share", "Share of the window the GPU was leased", labels=["gpu"]
        )
        handoffs = CounterMetricFamily(
            "gpushare_gpu_lease_handoffs", "Leases granted", labels=["gpu"]
        )
        for g in status["gpus"]:
            busy.add_metric([g["uuid"]], g["busy_share"])
            handoffs.add_metric([g["uuid"]], g["handoffs"])
        clients = GaugeMetricFamily("gpushare_daemon_clients", "Connected processes")
        clients.add_metric([], status["daemon"]["clients"])
        refused = CounterMetricFamily(
            "gpushare_daemon_refused_connections",
            "Processes refused (no or someone else's allocation)",
        )
        refused.add_metric([], status["daemon"]["refused"])
        yield from (
            share,
            request,
            limit,
            seconds,
            used,
            cap,
            ooms,
            waits,
            wait_s,
            busy,
            handoffs,
            clients,
            refused,
        )


def serve(status: Callable[[], dict[str, Any]], host: str, port: int) -> int:
    """Start the metrics endpoint in a thread; returns the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(status))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_address[1])
