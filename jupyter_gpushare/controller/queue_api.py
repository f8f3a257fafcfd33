"""The controller's HTTP API for the queue (:mod:`.queue`), beside :mod:`.api`'s routes.

=======  ==================================  ==============================================
POST     /api/queue                          place now (201 ``{"allocation"}``) or wait
                                             (202 ``{"entry"}``); the body of
                                             ``POST /api/allocations``; 409 ``never_fits``,
                                             ``queue_full``
GET      /api/queue                          ``{"entries", "metrics"}``: waiting starts in
                                             order (the caller's own whole, others' as
                                             capacity; admins all)
GET      /api/queue/{id}?wait=S              one entry; with ``wait`` (≤ 20 s) once it
                                             changes state (started: with ``allocation``)
DELETE   /api/queue/{id}                     cancel (``cancelled``; or ``started`` with its
                                             allocation when the start won)
GET      /metrics                            Prometheus text: the queue's series of the
                                             node agent (``gpushare_queue_*``, the
                                             definitions of ``daemon/metrics.py``),
                                             ``Hostname`` the replica; counts only, no
                                             user's name: no token needed (a replica
                                             that does not lead: no series)
=======  ==================================  ==============================================

An entry's view: ``{id, state, share, since, waited_s, position, eta: {computed_at, lo_s,
hi_s, by_s, reclaims, basis}, message}`` + for its user (and admins) ``{user, kernel_id,
owner, server_id, reason, allocation, first_eta}``: the shape of the node agent's queue, so a
user's server answers ``GET /gpushare/api/queue`` the same either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..daemon.metrics import queue_families
from .api import Handler, State
from .errors import ControllerError, bad_request


class QueueHandler(Handler):
    @property
    def queue(self) -> Any:
        self.service  # noqa: B018 - 503 not_leader once this replica lost the lease
        if self.state.queue is None:
            raise ControllerError(404, "no_queue", "this controller has no queue")
        return self.state.queue

    async def get(self) -> None:
        self.reply(await self.queue.listing(self.user))

    async def post(self) -> None:
        answer = await self.queue.reserve(self.user, self.body())
        self.reply(answer, 201 if "allocation" in answer else 202)


class QueueEntryHandler(QueueHandler):
    async def get(self, entry_id: str) -> None:  # type: ignore[override]
        text = self.get_query_argument("wait", "0")
        try:
            wait = float(text)
        except ValueError:
            wait = -1.0
        if not 0 <= wait <= 20:
            raise bad_request("wait", text, "seconds from 0 to 20")
        self.reply({"entry": await self.queue.wait(self.user, entry_id, wait)})

    async def delete(self, entry_id: str) -> None:
        self.reply({"entry": await self.queue.cancel(self.user, entry_id)})


class _QueueCollector:
    """The leading replica's queue figures as the node agent's ``gpushare_queue_*`` series."""

    def __init__(self, state: State) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        queue = self.state.queue
        if queue is not None:
            yield from queue_families(queue.figures(), self.state.identity)


def metrics_text(state: State) -> bytes:
    """The Prometheus exposition of the controller's queue (empty where it has none)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_QueueCollector(state))
    return bytes(generate_latest(registry))


class MetricsHandler(Handler):
    async def prepare(self) -> None:  # counts only: no token, on any replica
        return None

    async def get(self) -> None:
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(metrics_text(self.state))


def queue_routes(state: State) -> list[tuple[str, type[Handler], dict[str, Any]]]:
    return [
        (r"/api/queue", QueueHandler, {"state": state}),
        (r"/api/queue/(q-[0-9a-f]{16})", QueueEntryHandler, {"state": state}),
        (r"/metrics", MetricsHandler, {"state": state}),
    ]


__all__ = ["MetricsHandler", "QueueEntryHandler", "QueueHandler", "metrics_text", "queue_routes"]
