"""REST for the queue (DESIGN box 13): kernel starts waiting for a share to free.

- ``GET /gpushare/api/queue`` → ``{"enabled": bool, "entries": [{id, state, share, since,
  waited_s, position, eta: {computed_at, lo_s, hi_s, by_s, reclaims, basis}, message} + for
  the viewer's own starts (an admin: all) {user, kernel_id, owner, first_eta}], "metrics":
  {waiting, started, cancelled, dropped, failed, eta_shown, eta_inside, …}, "max_wait": the
  most seconds a start may ask to wait (``GpuShare.start_wait_max``; 0 without a queue)}``,
  in the order the starts get capacity; ``enabled`` false (with ``message``) where the
  backend's ledger has no queue (a ledger this server writes itself: Kubernetes in direct
  mode). In controller mode the controller's queue answers
  (:mod:`jupyter_gpushare.controller.queue`, same shapes).
- ``DELETE /gpushare/api/queue/{entry}`` → 200 ``{"entry": …}`` (``cancelled``; or
  ``started`` with its ``allocation`` when the start won the race: this server's kernel start
  then goes on); 404 ``unknown_entry`` for an entry that is not the user's.

Starts wait through the provisioner (``GpushareProvisioner.queue_wait``, or the ``wait`` a
``POST /gpushare/api/kernels`` asks, up to ``GpuShare.start_wait_max``): ``POST
/gpushare/api/kernels``, ``POST /api/kernels`` and ``/api/sessions`` with a gpushare
kernelspec; their progress (``GET /gpushare/api/starts``) says where they are in line.
"""

from __future__ import annotations

import json
import math
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.utils import url_path_join
from tornado import web

from ..errors import GpushareError
from .handlers import GpushareHandler

NO_QUEUE = (
    "this server's ledger has no queue: starts that do not fit wait only where a node agent "
    "serves the ledger (jupyter gpushare daemon --system)"
)


class _QueueLedger(GpushareHandler):
    async def _ledger(self) -> Any:
        ledger = await self.gpushare.get_backend().ledger()
        return ledger if hasattr(ledger, "reserve_waiting") else None


class QueueHandler(_QueueLedger):
    """The queue as a whole (``GET``); one class per route, so that tornado never calls a
    method with arguments it does not take (that was a 500)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        ledger = await self._ledger()
        max_wait = self.gpushare.start_wait_max  # the most a start may ask to wait
        if ledger is None:
            body0 = {"enabled": False, "entries": [], "message": NO_QUEUE, "max_wait": 0.0}
            self.finish(json.dumps(body0))
            return
        if hasattr(ledger, "queue_listing"):  # the controller's queue (Kubernetes)
            reply = await ledger.queue_listing()
        else:
            reply = await ledger.request({"op": "ledger.queue"})
        body = {
            "enabled": True,
            "entries": reply.get("entries") or [],
            "metrics": reply.get("metrics") or {},
            "max_wait": max_wait,
        }
        self.finish(json.dumps(json_safe(body), default=str, allow_nan=False))


class QueueEntryHandler(_QueueLedger):
    """One waiting start (``DELETE``: cancel it)."""

    @web.authenticated
    @authorized
    async def delete(self, entry: str) -> None:
        ledger = await self._ledger()
        if ledger is None:
            raise GpushareError(NO_QUEUE, code="no_queue", status=404)
        if hasattr(ledger, "queue_cancel"):  # the controller's queue (Kubernetes)
            reply = {"entry": await ledger.queue_cancel(entry)}
        else:
            reply = await ledger.request({"op": "ledger.queue.cancel", "entry": entry})
        self.finish(json.dumps({"entry": reply.get("entry")}, default=str))


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite number as its Prometheus text (``+Inf``, ``-Inf``,
    ``NaN``): the agent's histograms end in an infinite bucket, and ``Infinity`` is not JSON
    (a browser's ``JSON.parse`` refused the whole reply)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def queue_handlers(base_url: str) -> list[tuple[str, type]]:
    return [
        (url_path_join(base_url, r"/gpushare/api/queue"), QueueHandler),
        (url_path_join(base_url, r"/gpushare/api/queue/(q-[0-9a-f]{16})"), QueueEntryHandler),
    ]
