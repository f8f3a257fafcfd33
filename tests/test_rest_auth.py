"""Authorization of the gpushare REST API under jupyter_server's Authorizer.

A real server runs with an Authorizer that allows what a file lists (``resource:action`` lines,
``*`` for any resource), so one server shows a read-only user, a user who may see GPUs but not
start or release, and one who may use gpushare but not start kernels. Every gpushare endpoint
checks the resource ``gpushare`` (GET -> ``read``; POST/PATCH/DELETE -> ``write``), and
``POST /gpushare/api/kernels`` also ``kernels:write``, as the core ``POST /api/kernels`` does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

AUTHORIZER = textwrap.dedent('''
    import os
    from jupyter_server.auth import Authorizer

    class FileAuthorizer(Authorizer):
        """Allows the (resource, action) pairs listed in $GS_TEST_PERMISSIONS, read per request."""

        def is_authorized(self, handler, user, action, resource):
            with open(os.environ["GS_TEST_PERMISSIONS"]) as f:
                allowed = {tuple(line.strip().split(":")) for line in f if line.strip()}
            return (resource, action) in allowed or ("*", action) in allowed
''')

GETS = [
    "/gpushare/api/gpus",
    "/gpushare/api/allocations",
    "/gpushare/api/presets",
    "/gpushare/api/pools",
    "/gpushare/api/reclaim",
    "/gpushare/api/usage",
]


@pytest.fixture
def server(jupyter_server: Any, gpushare_env: dict[str, str], tmp_path: Path) -> Any:
    (tmp_path / "fileauth.py").write_text(AUTHORIZER)
    permissions = tmp_path / "permissions"
    permissions.write_text("*:read\n*:write\n*:execute\n")
    gpushare_env["PYTHONPATH"] = f"{tmp_path}:{gpushare_env.get('PYTHONPATH', '')}"
    gpushare_env["GS_TEST_PERMISSIONS"] = str(permissions)
    srv = jupyter_server("1xA100", "--ServerApp.authorizer_class=fileauth.FileAuthorizer")
    srv.permissions = permissions
    return srv


def _allow(server: Any, *pairs: str) -> None:
    server.permissions.write_text("\n".join(pairs) + "\n")


def test_read_only_user_sees_but_cannot_start_resize_or_release(server: Any) -> None:
    started = server.post(
        "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
    )
    assert started.status_code == 201, started.text
    allocation = started.json()["allocation"]["id"]
    _allow(server, "*:read")

    # the core API refuses a read-only user a kernel; so does ours, and nothing is reserved
    assert server.post("/api/kernels", {"name": "gpushare-python"}).status_code == 403
    refused = server.post(
        "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
    )
    assert refused.status_code == 403, refused.text
    assert "gpushare" in refused.json()["message"] or "kernels" in refused.json()["message"]
    path = f"/gpushare/api/allocations/{allocation}"
    assert server.request("PATCH", path, json={"gpu_request": 0.5}).status_code == 403
    assert server.delete(path).status_code == 403
    for get in [*GETS, path]:
        assert server.get(get).status_code == 200, (get, server.get(get).text)
    rows = server.allocations()
    assert [a["id"] for a in rows] == [allocation]
    assert rows[0]["gpu_request"] == 0.25  # the refused PATCH changed nothing

    _allow(server, "*:read", "*:write", "*:execute")
    assert server.delete(path).status_code == 204


def test_see_gpus_without_start_or_release(server: Any) -> None:
    """gpushare:read alone (kernels allowed): GETs answer, gpushare writes do not."""
    _allow(server, "gpushare:read", "kernels:read", "kernels:write")
    assert server.get("/gpushare/api/gpus").status_code == 200
    assert server.post("/gpushare/api/kernels", {"name": "gpushare-python"}).status_code == 403
    assert (
        server.request(
            "PATCH", "/gpushare/api/allocations/a-x", json={"gpu_request": 0.5}
        ).status_code
        == 403
    )
    assert server.delete("/gpushare/api/allocations/a-x").status_code == 403
    assert server.allocations() == []


def test_gpushare_write_without_kernels_write_cannot_start_a_kernel(server: Any) -> None:
    _allow(server, "gpushare:read", "gpushare:write", "kernels:read")
    refused = server.post("/gpushare/api/kernels", {"name": "gpushare-python"})
    assert refused.status_code == 403, refused.text
    assert "kernels" in refused.json()["message"]
    assert server.allocations() == []
    assert server.get("/api/kernels").json() == []
