"""REST endpoints the JupyterLab extension needs beyond the core API (box 10 of DESIGN.md).

``GET /gpushare/api/usage`` — live use of each allocation on this node, from the node daemon's
status (achieved share over the daemon's window, memory in use). The Lab status bar polls it
about every 2 s. Without a running daemon (``GpuShare.enforce = False``, or the daemon is down)
it answers ``{"daemon": false, "message": …, "allocations": []}`` rather than failing, so the
status bar can say "not metered" instead of showing an error.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from ..daemon.client import DaemonClient, DaemonUnavailable

USAGE_KEYS = ("id", "kernel_id", "achieved_share", "memory_used", "memory_cap", "request",
              "limit", "connected", "lease_waits", "lease_wait_seconds")


def usage_from_status(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-allocation part of a daemon status answer, in the REST shape."""
    return [{k: a.get(k) for k in USAGE_KEYS} for a in status.get("allocations", [])]


class UsageHandler(APIHandler):  # type: ignore[misc]
    @web.authenticated
    async def get(self) -> None:
        settings = self.settings["gpushare"]
        client = DaemonClient(settings.socket_path, timeout=2.0)
        try:
            status = await asyncio.to_thread(client.status)
        except (DaemonUnavailable, OSError, ValueError) as exc:
            self.finish(json.dumps({"daemon": False, "message": str(exc), "allocations": []}))
            return
        self.finish(json.dumps({"daemon": True, "allocations": usage_from_status(status)}))


def ui_handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, "gpushare", "api", "usage"), UsageHandler)]
