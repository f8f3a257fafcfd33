"""Observability (issue 15): the node daemon's metrics name each kernel's pod, namespace, user
and kernel id and each GPU by DCGM exporter's labels; the chart scrapes them by default (a
metrics port and a NetworkPolicy for Prometheus; a PodMonitor on request); and the Grafana
dashboard in deploy/grafana asks only for series the daemon exports, by labels it sets.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because it needs two GPU nodes of two types and scrapes the daemon's metrics port on this host.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_helm import DEPLOY, container, one, render
from test_helm import helm as helm

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.daemon.metrics import ALLOCATION_LABELS, GPU_LABELS, METRIC_NAMES
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.share import ShareSpec

DASHBOARD = DEPLOY / "grafana" / "gpushare.json"
NODE = "metrics-node"
GiB = 1 << 30
#: labels Prometheus adds to every scraped series (target labels), usable in queries too
TARGET_LABELS = {"instance", "job", "container", "endpoint", "service"}


# -- the daemon's endpoint ----------------------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonClient, SQLiteLedger]]:
    """A real node daemon (simulated A100) with its metrics endpoint on a free port."""
    socket = tmp_path / "daemon.sock"
    ledger = tmp_path / "ledger.sqlite"
    args = [
        sys.executable,
        "-m",
        "jupyter_gpushare.daemon",
        f"--socket={socket}",
        f"--ledger={ledger}",
        f"--node={NODE}",
        "--simulate-devices=1xA100",
        f"--state-dir={tmp_path / 'shm'}",
        "--poll-ms=100",
        "--metrics-host=127.0.0.1",
        "--metrics-port=-1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["GPUSHARE_SIM_STATE"] = str(tmp_path / "sim.state")
    with open(tmp_path / "daemon.log", "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
    client = DaemonClient(str(socket))
    try:
        deadline = time.monotonic() + 30
        while not client.alive():
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "daemon.log"
            ).read_text()
            time.sleep(0.05)
        yield client, SQLiteLedger(str(ledger))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def scrape(client: DaemonClient) -> dict[str, list[Any]]:
    port = client.status()["daemon"]["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    series: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample)
    return series


def test_metrics_name_the_kernel_pod_user_and_gpu(
    daemon: tuple[DaemonClient, SQLiteLedger],
) -> None:
    client, ledger = daemon
    [gpu] = simulated_gpus("1xA100", NODE)
    kernel_pod = Allocation(
        id=Allocation.new_id(),
        node=NODE,
        gpus=(gpu.uuid,),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5, gpu_memory=2 * GiB, gpu_type=gpu.type),
        memory=2 * GiB,
        kernel_id="k-1234",
        backend="kubernetes",
        user="alice",
        extra={"k8s_pod": "gpushare-kernel-k-1234-1", "k8s_namespace": "gpushare"},
    )
    local = Allocation(
        id=Allocation.new_id(),
        node=NODE,
        gpus=(gpu.uuid,),
        spec=ShareSpec(gpu_request=0.5, gpu_limit=1.0, gpu_memory=GiB, gpu_type=gpu.type),
        memory=GiB,
        user="bob",
    )
    snap = ledger.snapshot_sync()
    assert ledger.compare_and_swap_sync(NODE, snap.versions.get(NODE, 0), [kernel_pod, local])
    client.refresh()

    def both_shares_and_nvml(series: dict[str, list[Any]]) -> bool:
        # the gpu label is NVML's index, known once the agent's NVML sampler (in a thread, every
        # second) has read the device: on a loaded machine that comes after the shares do
        shares = series.get("gpushare_allocation_share", [])
        return len(shares) == 2 and all(s.labels["gpu"] for s in shares)

    deadline = time.monotonic() + 30
    while not both_shares_and_nvml(series := scrape(client)):
        assert time.monotonic() < deadline, f"the daemon never showed both shares: {series}"
        time.sleep(0.2)
        client.refresh()
    assert set(series) <= METRIC_NAMES, set(series) - METRIC_NAMES
    assert METRIC_NAMES <= set(series), METRIC_NAMES - set(series)  # every name is exported
    by_allocation = {s.labels["allocation"]: s for s in series["gpushare_allocation_request"]}
    pod = by_allocation[kernel_pod.id]
    assert pod.value == 0.25
    assert pod.labels == {
        "allocation": kernel_pod.id,
        "kernel_id": "k-1234",
        "user": "alice",
        "pod": "gpushare-kernel-k-1234-1",
        "namespace": "gpushare",
        "gpu": "0",  # the simulated NVML's index, as DCGM exporter names it
        "UUID": gpu.uuid,
        "Hostname": NODE,
    }
    other = by_allocation[local.id].labels
    assert (other["user"], other["pod"], other["namespace"]) == ("bob", "", "")
    caps = {s.labels["allocation"]: s.value for s in series["gpushare_allocation_memory_cap_bytes"]}
    assert caps == {kernel_pod.id: 2 * GiB, local.id: GiB}
    [busy] = series["gpushare_gpu_busy_share"]
    assert busy.labels == {"gpu": "0", "UUID": gpu.uuid, "Hostname": NODE}
    [reserved] = series["gpushare_gpu_reserved_request"]
    assert reserved.value == pytest.approx(0.75)
    assert series["gpushare_gpu_shares"][0].value == 2
    for name, samples in series.items():
        want = set(ALLOCATION_LABELS) if "_allocation_" in name else set(GPU_LABELS)
        if name.startswith(("gpushare_daemon_", "gpushare_queue_")):
            want = {"Hostname"}  # the agent's own series, and its queue's (one per agent)
        # a histogram's buckets carry their bound too
        assert all(set(s.labels) - {"le"} == want for s in samples), (name, samples)
        assert all("le" in s.labels for s in samples if s.name.endswith("_bucket")), name


async def test_the_node_daemon_names_a_kernel_pod_in_its_metrics(
    control_plane: Any, node_agent: Path, jupyter_server_factory: Any
) -> None:
    """End to end on the cluster: a kernel started through the Jupyter server runs in its pod,
    and the DaemonSet's daemon on that node exports its share labelled with the pod, the
    namespace, the kernel id, the record's user and the GPU."""
    from cluster import NAMESPACE, node_daemon_socket
    from test_kernels import admin, eventually, kernel_pods, kernel_records, shut_down

    kube = await admin(control_plane)
    server = jupyter_server_factory()
    reply = await asyncio.to_thread(
        server.request,
        "POST",
        "/gpushare/api/kernels",
        json={"name": "gpushare-k8s-t4", "share": {"gpu_request": 0.3, "gpu_limit": 0.5}},
    )
    assert reply.status_code == 201, reply.text
    kernel = reply.json()["id"]
    try:
        [record] = await kernel_records(kube, kernel)
        [pod] = await kernel_pods(kube, kernel)
        client = DaemonClient(str(node_daemon_socket(node_agent, record.node)))

        async def labelled() -> Any:
            series = await asyncio.to_thread(scrape, client)
            found = [  # labelled with the GPU once the agent's NVML sampler has read it
                s
                for s in series.get("gpushare_allocation_request", [])
                if s.labels["allocation"] == record.id and s.labels["gpu"]
            ]
            return found[0] if found else None

        sample = await eventually(labelled, 30, "the kernel's share in the daemon's metrics")
        assert sample.value == pytest.approx(0.3)
        assert sample.labels == {
            "allocation": record.id,
            "kernel_id": kernel,
            "user": record.user,
            "pod": pod["metadata"]["name"],
            "namespace": NAMESPACE,
            "gpu": sample.labels["gpu"],  # the simulated NVML's index on that node
            "UUID": record.gpus[0],
            "Hostname": record.node,
        }
        assert record.user and sample.labels["gpu"].isdigit()
    finally:
        await shut_down(server, kube, kernel)


# -- the Grafana dashboard ----------------------------------------------------------------------

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "offset", "bool",
}  # fmt: skip


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses. Strings, durations and Grafana's
    variables are dropped; names before ``(`` are functions; label lists after by/without/
    on/ignoring/group_* and inside ``{}`` are labels."""
    labels: set[str] = set()
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for inside in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", inside))
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    for inside in re.findall(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr
    ):
        labels |= set(re.findall(r"[A-Za-z_]\w*", inside))
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\w+", " ", expr)
    metrics = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", expr):
        rest = expr[match.end() :].lstrip()
        word = match.group()
        if rest.startswith("(") or word in PROMQL_WORDS or re.fullmatch(r"\d\w*", word):
            continue
        metrics.add(word)
    return metrics, labels


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(expression, legend) of every panel target and query variable."""
    queries = [
        (target["expr"], target.get("legendFormat", ""))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", text)
        assert found, text
        queries.append((found.group(1), "{{" + found.group(2) + "}}"))
    return queries


def test_the_checker_sees_foreign_names() -> None:
    """Not a check that cannot fail: a DCGM metric, an unknown label and a typo are found."""
    metrics, labels = promql_names(
        'sum by (node) (rate(gpushare_allocation_lease_waits_total{user=~"$user"}[5m]))'
        " * on(UUID) group_left DCGM_FI_DEV_GPU_UTIL / gpushare_gpu_busy_shar"
    )
    assert metrics == {
        "gpushare_allocation_lease_waits_total",
        "DCGM_FI_DEV_GPU_UTIL",
        "gpushare_gpu_busy_shar",
    }
    assert labels == {"node", "user", "UUID"}


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    used: set[str] = set()
    exported_labels = set(ALLOCATION_LABELS) | TARGET_LABELS
    for expr, legend in queries:
        metrics, labels = promql_names(expr)
        assert metrics and metrics <= METRIC_NAMES, (expr, metrics - METRIC_NAMES)
        legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert labels | legend_labels <= exported_labels, (expr, legend)
        used |= metrics
    # what the issue asks the dashboard to show
    for shown in (
        "gpushare_allocation_share",  # achieved ...
        "gpushare_allocation_request",  # ... vs request
        "gpushare_allocation_limit",  # ... and limit, per kernel
        "gpushare_allocation_memory_used_bytes",
        "gpushare_allocation_memory_cap_bytes",
        "gpushare_allocation_lease_waits_total",
        "gpushare_gpu_busy_share",  # per GPU
    ):
        assert shown in used, shown
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))


# -- the chart: metrics on by default, a PodMonitor on request ----------------------------------


def test_chart_scrapes_metrics_by_default(helm: str, tmp_path: Path) -> None:
    objs = render(helm, tmp_path)
    daemon = container(one(objs, "DaemonSet")["spec"]["template"]["spec"], "daemon")
    assert "--metrics-port=9401" in daemon["command"]
    assert "--metrics-host=0.0.0.0" in daemon["command"]
    assert daemon["ports"] == [{"name": "metrics", "containerPort": 9401}]
    assert not [o for o in objs if o["kind"] == "PodMonitor"]  # off: needs the operator's CRD
    node = next(
        o for o in objs if o["metadata"]["name"] == "gpushare-node" and "ingress" in o["spec"]
    )
    [rule] = node["spec"]["ingress"]
    assert rule["ports"] == [{"port": 9401, "protocol": "TCP"}]


def test_chart_pod_monitor(helm: str, tmp_path: Path) -> None:
    values = {
        "daemon": {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}}
    }
    args = [
        helm, "template", "gs", str(DEPLOY / "helm" / "jupyter-gpushare"), "-n", "gpushare",
        "--set", "daemon.metrics.podMonitor.enabled=true",
    ]  # fmt: skip
    refused = subprocess.run(args, capture_output=True, text=True)
    assert refused.returncode != 0
    assert "no PodMonitor (monitoring.coreos.com/v1)" in refused.stderr, refused.stderr
    objs = render(
        helm, tmp_path, values, extra=["--api-versions", "monitoring.coreos.com/v1/PodMonitor"]
    )
    monitor = one(objs, "PodMonitor")
    ds = one(objs, "DaemonSet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    no_port = subprocess.run(
        [*args, "--api-versions", "monitoring.coreos.com/v1/PodMonitor", "--set",
         "daemon.metrics.port=0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert no_port.returncode != 0 and "needs daemon.metrics.port" in no_port.stderr
