"""A kernel pod's start, phase by phase, as ``GET /gpushare/api/starts`` shows it (the Lab picker
and status bar poll it): on the real control plane, a start that works goes placing -> placed ->
launching -> (pod phases) -> starting -> ready; one the scheduler cannot place shows the
scheduler's own words while it waits; one whose image cannot be pulled shows the kubelet's.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because a start the scheduler cannot place needs the double's two GPU node types.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)


def _start_of(server: Any, kernel_id: str | None = None) -> dict[str, Any]:
    starts = server.request("GET", "/gpushare/api/starts").json()["starts"]
    if kernel_id is not None:
        starts = [s for s in starts if s["kernel_id"] == kernel_id]
    assert starts, starts
    return starts[-1]


async def test_a_started_kernel_went_through_each_phase(jupyter_server_factory: Any) -> None:
    server = jupyter_server_factory()
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s"})
    assert reply.status_code == 201, reply.text
    start = _start_of(server, reply.json()["id"])
    phases = [s["phase"] for s in start["steps"]]
    assert phases[:3] == ["placing", "placed", "launching"], start
    assert phases[-2:] == ["starting", "ready"], start
    assert start["ended"] is True and start["kernel_name"] == "gpushare-k8s"
    placed = start["steps"][1]["message"]  # which GPU, of which type
    assert re.search(r"of an? (A100|T4), .* on gpu-node-\d GPU-", placed), placed


async def test_unschedulable_start_shows_the_schedulers_words(jupyter_server_factory: Any) -> None:
    server = jupyter_server_factory(
        extra='c.KubernetesBackendConfig.resources = {"requests": {"cpu": "64"}}'
    )
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s"})
    assert reply.status_code >= 400
    start = _start_of(server)
    scheduling = [s for s in start["steps"] if s["phase"] == "scheduling"]
    assert scheduling and "Insufficient cpu" in scheduling[-1]["message"], start
    assert start["phase"] == "failed" and "Insufficient cpu" in start["message"]


async def test_image_pull_error_shows_the_kubelets_words(jupyter_server_factory: Any) -> None:
    server = jupyter_server_factory(
        extra='c.KubernetesBackendConfig.image = "registry.invalid/does-not-exist:1"'
    )
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s"})
    assert reply.status_code >= 400
    start = _start_of(server)
    pulling = [s for s in start["steps"] if s["phase"] == "pulling"]
    assert any("ErrImagePull" in s["message"] for s in pulling), start
    assert start["phase"] == "failed"
