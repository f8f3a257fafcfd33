"""``GET /gpushare/api/dashboard`` with backend ``kubernetes`` on the real control plane: every
user's Jupyter server reads the cluster's ledger, so a server shows the cluster's GPUs and its
own kernels' shares whole, and another server's kernel only as capacity - also to a viewer
jupyter_server's default Authorizer allows everything (it would be JupyterHub's single-user
Authorizer for a server's owner) - unless ``GpushareDashboard.show_other_servers`` is set.

Where it runs: the kubelet double (``node_agent.py``: pods are local processes, at 127.0.0.1),
because it needs two GPU nodes of two types; the server side is the same on a real node.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)


def _start(server: Any) -> str:
    reply = server.request("POST", "/api/kernels", json={"name": "gpushare-k8s"})
    assert reply.status_code == 201, reply.text
    return str(reply.json()["id"])


def _shares(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for g in body["gpus"] for s in g["shares"]]


async def test_a_server_sees_the_cluster_and_only_its_own_kernels_whole(
    jupyter_server_factory: Any,
) -> None:
    mine_server = jupyter_server_factory()
    other_server = jupyter_server_factory()
    open_server = jupyter_server_factory(extra="c.GpushareDashboard.show_other_servers = True")
    mine = _start(mine_server)
    theirs = _start(other_server)

    body = mine_server.request("GET", "/gpushare/api/dashboard").json()
    assert body["admin"] is True and body["source"] == "kubernetes"
    assert len({g["node"] for g in body["gpus"]}) >= 2  # the cluster's GPUs, not one node's
    shares = _shares(body)
    whole = [s for s in shares if "id" in s]
    assert [s["kernel_id"] for s in whole] == [mine] and whole[0]["mine"] is True
    others = [s for s in shares if "id" not in s]
    assert len(others) == 1 and others[0]["mine"] is False
    assert theirs not in json.dumps(body)  # nothing of the other server's kernel but capacity

    # a server configured to show other servers' shares to its admins
    opened = _shares(open_server.request("GET", "/gpushare/api/dashboard").json())
    assert {s.get("kernel_id") for s in opened} >= {mine, theirs}
    assert not any(s["mine"] for s in opened)  # neither kernel is that server's own
