"""The controller's HTTP API (tornado, JSON) for users' Jupyter servers.

Every handler authenticates first (:mod:`.auth`: the caller's JupyterHub API token), then asks
the :class:`~.kernels.KernelService`, which authorizes by the record. Refusals are
:class:`~.errors.ControllerError` bodies ``{"error", "message", ...}``; nothing else leaves as a
traceback. A standby replica (not the leader) answers every request with 503 ``not_leader``
naming the active replica, and ``GET /api/health`` the same, so a readiness probe on it keeps
the Service routed to the leader only.

=======  ==================================  ==============================================
GET      /api/health                         leader or 503 not_leader (no auth)
GET      /api/gpus                           inventory with free capacity
GET      /api/allocations                    the caller's allocations (admins: all)
POST     /api/allocations                    place a share {kernel_id, server_id, share}
GET      /api/allocations/{id}               one allocation
PATCH    /api/allocations/{id}               live resize {gpu_request, gpu_limit, gpu_memory}
DELETE   /api/allocations/{id}               release (its pod is deleted too)
GET      /api/kernels                        the caller's kernels with their pod's state
POST     /api/kernels                        start a kernel pod {allocation_id | share, ...}
GET      /api/kernels/{allocation_id}        the pod's state (the server's poll)
DELETE   /api/kernels/{allocation_id}        stop the pod, keep the share (?grace=seconds)
PUT      /api/servers/{server_id}            heartbeat: renew the server's Lease
GET      /api/usage                          live usage of the caller's allocations (admins: all)
PUT      /api/usage/{node}                   a node daemon's usage report (its SA token)
*        /api/queue, /api/queue/{id}         starts that wait for a share (:mod:`.queue_api`)
=======  ==================================  ==============================================
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from tornado.web import Application, HTTPError, RequestHandler

from ..errors import write_error
from ..ledger import Allocation
from ..placement import to_units
from ..placement.engine import from_units
from .auth import HubAuth, HubUser, token_from_header
from .errors import ControllerError, bad_request, from_exception, unavailable
from .usage import NodeReports, check_report, usage_json

log = logging.getLogger("jupyter_gpushare.controller")

MAX_BODY = 1 << 20


class State:
    """What the handlers need; ``service`` is None while this replica is not the leader."""

    def __init__(self, auth: HubAuth, identity: str) -> None:
        self.auth = auth
        self.identity = identity
        self.service: Any = None
        self.queue: Any = None  # .queue.ControllerQueue, while the service runs
        self.leader: Any = None  # LeaderElection, for the standby's reason
        self.node_auth: Any = None  # .usage.NodeAuth: who may report a node's usage
        self.reports = NodeReports()  # the nodes' latest usage reports (kept across terms)

    def not_leader(self) -> ControllerError:
        holder = getattr(self.leader, "holder", None)
        error = getattr(self.leader, "last_error", None)
        where = f"the active controller is {holder}" if holder else "no controller is active"
        why = f"; last error: {error}" if error else ""
        return unavailable(
            "not_leader",
            f"this controller replica ({self.identity}) is "
            f"standing by: {where}{why}; retry shortly",
            leader=holder,
        )


class Handler(RequestHandler):
    state: State
    user: HubUser

    def initialize(self, state: State) -> None:
        self.state = state

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")

    async def prepare(self) -> None:
        if self.state.service is None:
            raise self.state.not_leader()
        token = token_from_header(self.request.headers.get("Authorization"))
        self.user = await self.state.auth.user(token)

    @property
    def service(self) -> Any:
        if self.state.service is None:  # lost the lease during the request
            raise self.state.not_leader()
        return self.state.service

    def body(self) -> dict[str, Any]:
        try:
            data = json.loads(self.request.body or b"{}")
        except (ValueError, RecursionError):
            raise bad_request(
                "body", self.request.body[:80].decode(errors="replace"), "a JSON object"
            ) from None
        if not isinstance(data, dict):
            raise bad_request("body", data, "a JSON object")
        return data

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def _handle_request_exception(self, e: BaseException) -> None:
        mapped = from_exception(e)
        if mapped is None and isinstance(e, HTTPError):
            mapped = ControllerError(e.status_code, "http_error", e.log_message or e.reason or "")
        if mapped is None:
            log.error(
                "gpushare controller: %s %s failed",
                self.request.method,
                self.request.path,
                exc_info=e,
            )
            mapped = ControllerError(500, "internal", "the controller failed; see its log")
        if self._finished:
            return
        self.clear()
        self.set_default_headers()
        write_error(self, mapped)


def allocation_json(allocation: Allocation) -> dict[str, Any]:
    return allocation.to_json()


class HealthHandler(Handler):
    async def prepare(self) -> None:
        if self.state.service is None:
            raise self.state.not_leader()

    async def get(self) -> None:
        self.reply({"leader": True, "identity": self.state.identity})


class GpusHandler(Handler):
    async def get(self) -> None:
        gpus = await self.service.gpus()
        allocations = await self.service.ledger.list()
        used: dict[str, int] = {}
        for a in allocations:
            for uuid in a.gpus:
                used[uuid] = used.get(uuid, 0) + to_units(a.request)
        out = []
        for gpu in gpus:
            item = gpu.to_json()
            item["allocated"] = from_units(used.get(gpu.uuid, 0))
            out.append(item)
        self.reply({"gpus": out})


class AllocationsHandler(Handler):
    async def get(self) -> None:
        found = await self.service.allocations(self.user)
        self.reply({"allocations": [allocation_json(a) for a in found]})

    async def post(self) -> None:
        allocation = await self.service.reserve(self.user, self.body())
        self.reply(allocation_json(allocation), 201)


class AllocationHandler(Handler):
    async def get(self, allocation_id: str) -> None:
        self.reply(allocation_json(await self.service.allocation(self.user, allocation_id)))

    async def patch(self, allocation_id: str) -> None:
        after = await self.service.resize(self.user, allocation_id, self.body())
        self.reply(allocation_json(after))

    async def delete(self, allocation_id: str) -> None:
        released = await self.service.release(self.user, allocation_id)
        self.reply(allocation_json(released))


class KernelsHandler(Handler):
    async def get(self) -> None:
        found = await self.service.allocations(self.user)
        self.reply(
            {
                "kernels": [
                    {
                        **self.service.kernel_status(a),
                        "kernel_id": a.kernel_id,
                        "user": a.user,
                        "node": a.node,
                    }
                    for a in found
                    if a.extra.get("k8s_pod")
                ]
            }
        )

    async def post(self) -> None:
        self.reply(await self.service.launch(self.user, self.body()), 201)


class KernelHandler(Handler):
    async def get(self, allocation_id: str) -> None:
        try:
            allocation = await self.service.allocation(self.user, allocation_id)
        except ControllerError as exc:
            # a share released from inside its kernel: the pod runs on without it
            pod = self.service.released_pod(self.user, allocation_id)
            if exc.status != 404 or pod is None:
                raise
            self.reply(self.service.released_status(allocation_id, pod))
            return
        self.reply(self.service.kernel_status(allocation))

    async def delete(self, allocation_id: str) -> None:
        text = self.get_query_argument("grace", "1")
        if not text.isascii() or not text.isdigit() or int(text) > 300:
            raise bad_request("grace", text, "whole seconds 0-300")
        self.reply(await self.service.stop_kernel(self.user, allocation_id, int(text)))


class ServerHandler(Handler):
    async def put(self, server_id: str) -> None:
        await self.service.servers.touch(self.user, server_id)
        self.reply({"server_id": server_id, "user": self.user.name})


class UsageHandler(Handler):
    async def get(self) -> None:
        view = await self.service.usage.read()
        mine = None
        if not self.user.admin:
            mine = {a.id for a in await self.service.allocations(self.user)}
        self.reply(usage_json(view, mine))


class UsageReportHandler(Handler):
    """A node daemon's report (its service-account token, not a Hub token: :mod:`.usage`)."""

    async def prepare(self) -> None:
        if self.state.service is None or self.state.node_auth is None:
            raise self.state.not_leader()
        header = self.request.headers.get("Authorization") or ""
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ControllerError(
                401, "unauthorized", "send the node daemon's service-account token as Bearer"
            )
        node = self.path_args[0] if self.path_args else ""
        await self.state.node_auth.check(token.strip(), node)

    async def put(self, node: str) -> None:
        document = check_report(node, self.body())
        # a node speaks only for the allocations the ledger places on it
        ledger = self.service.ledger
        entries = document["allocations"]
        document["allocations"] = [e for e in entries if ledger.node_of(e["id"]) == node]
        self.state.reports.put(node, document)
        self.reply(
            {
                "node": node,
                "allocations": len(document["allocations"]),
                "ignored": len(entries) - len(document["allocations"]),
            }
        )


class NotFoundHandler(Handler):
    async def prepare(self) -> None:
        raise ControllerError(404, "not_found", f"no such endpoint: {self.request.path}")


def make_app(
    state: State,
    extra_routes: list[tuple[str, type[Handler], dict[str, Any]]] | None = None,
    **settings: Any,
) -> Application:
    """The controller's HTTP application: this module's routes, then ``extra_routes`` (the
    queue's, :func:`.queue_api.queue_routes`, added by the caller so that neither module imports
    the other's routes)."""
    ident = r"([A-Za-z0-9][-A-Za-z0-9_]{0,79})"
    routes: list[tuple[str, type[Handler], dict[str, Any]]] = [
        (r"/api/health", HealthHandler, {"state": state}),
        (r"/api/gpus", GpusHandler, {"state": state}),
        (r"/api/allocations", AllocationsHandler, {"state": state}),
        (rf"/api/allocations/{ident}", AllocationHandler, {"state": state}),
        (r"/api/kernels", KernelsHandler, {"state": state}),
        (rf"/api/kernels/{ident}", KernelHandler, {"state": state}),
        (rf"/api/servers/{ident}", ServerHandler, {"state": state}),
        (r"/api/usage", UsageHandler, {"state": state}),
        (
            r"/api/usage/([a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?)",
            UsageReportHandler,
            {"state": state},
        ),
    ]
    routes += extra_routes or []
    default: Callable[..., Any] = NotFoundHandler
    return Application(
        routes, default_handler_class=default, default_handler_args={"state": state}, **settings
    )


__all__ = ["State", "make_app"]
