"""The node agent's Prometheus endpoint is a port other pods can reach (only Prometheus, where
the CNI enforces the chart's NetworkPolicy): connections are bounded and idle ones dropped, so a
client that opens many and sends nothing cannot pile up threads in the agent that serves every
kernel's leases, and scrapes work again once it lets go."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from typing import Any

import pytest

from jupyter_gpushare.daemon import metrics


def _status() -> dict[str, Any]:
    return {"daemon": {"node": "node-1", "clients": 3, "refused": 0}, "gpus": [], "allocations": []}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def test_idle_connections_are_bounded_and_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics._Handler, "timeout", 1.0)
    port = metrics.serve(_status, "127.0.0.1", 0)
    assert 'Hostname="node-1"' in _scrape(port)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(50)]
    try:
        time.sleep(0.5)
        grown = threading.active_count() - before
        assert grown <= metrics.BoundedMetricsServer.max_connections, grown
        # the server drops a silent connection after its timeout (recv sees the close)
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the slots come back as the server sees the closes
        try:
            body = _scrape(port)
            break
        except OSError:
            assert time.monotonic() < deadline, "scrapes did not come back"
            time.sleep(0.2)
    assert 'gpushare_daemon_clients{Hostname="node-1"} 3.0' in body, body
