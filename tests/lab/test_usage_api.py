"""GET /gpushare/api/usage (jupyter_gpushare/serverext/ui_handlers.py), which feeds the Lab
status bar: live use per allocation from the node daemon, on a real jupyter_server."""

from __future__ import annotations

from typing import Any

from support import wait_for


def test_usage_lists_each_kernels_allocation(jupyter_server: Any) -> None:
    server = jupyter_server("1xA100")
    kernel = server.start_kernel("gpushare-python")
    (allocation,) = [a for a in server.allocations() if a["kernel_id"] == kernel["id"]]

    def listed() -> dict[str, Any] | None:
        body = server.get("/gpushare/api/usage").json()
        if not body["daemon"]:  # the daemon starts with the server; give it a moment
            return None
        return next((u for u in body["allocations"] if u["id"] == allocation["id"]), None)

    usage = wait_for(listed, timeout=30)
    assert usage["kernel_id"] == kernel["id"]
    assert (usage["request"], usage["limit"]) == (
        allocation["gpu_request"],
        allocation["gpu_limit"],
    )
    assert usage["memory_cap"] == allocation["gpu_memory"]
    assert 0 <= usage["achieved_share"] <= 1


def test_usage_without_daemon_says_so(jupyter_server: Any) -> None:
    server = jupyter_server("1xA100", "--GpuShare.enforce=False")
    body = server.get("/gpushare/api/usage").json()
    assert body["daemon"] is False and body["allocations"] == []
    assert "daemon" in body["message"]
