"""REST endpoints the JupyterLab extension needs beyond the core API (DEVELOPING.md, box 10).

``GET /gpushare/api/usage`` — live use of each allocation, as the node daemons measure it
(achieved share over the daemon's window, memory in use, idle time …). The Lab status bar polls
it about every 2 s. The source is the server's backend (:mod:`jupyter_gpushare.usage`):

- local: this node's daemon, over its unix socket. Without a running daemon
  (``GpuShare.enforce = False``, or the daemon is down) it answers ``{"daemon": false,
  "message": …, "allocations": []}`` rather than failing, so the status bar can say
  "not metered" instead of showing an error.
- kubernetes: the usage ConfigMaps the node daemons publish every ``--usage-interval`` seconds
  (:mod:`jupyter_gpushare.k8s.usage`), this server's kernels only. Each entry carries its
  ``node`` and ``age_s``; reports too old to trust are left out and named in ``stale``
  (``{node: age_s}``) and ``message``. ``daemon`` is true when at least one node reports.
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.utils import url_path_join
from tornado import web

from .dashboard_handlers import usage_history
from .handlers import GpushareHandler


class UsageHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        backend = self.backend
        view = await (await backend.usage()).read()
        history = usage_history(self.gpushare)  # the GPU dashboard's history
        # a share first measured here: its record (GPU, owner), so that its part of its GPU's
        # history outlives its release (read once per new share, not at every poll)
        new = any(aid not in history.records for aid in view.allocations)
        history.add(view, await (await self.ledger()).list() if new else ())
        body: dict[str, Any] = {
            "daemon": bool(view.nodes),
            "source": view.source,
            "allocations": [dict(u) for u in view.allocations.values() if backend.may_touch(u)],
        }
        if view.stale:
            body["stale"] = dict(view.stale)
        if view.message:
            body["message"] = view.message
        self.finish(json.dumps(body))


def ui_handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, "gpushare", "api", "usage"), UsageHandler)]
