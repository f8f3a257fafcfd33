"""The user-server side of the controller: an HTTP client, and the ledger it shows the server.

A user's Jupyter server in controller mode (``c.KubernetesBackendConfig.controller_url``) holds
no Kubernetes credentials. It authenticates to the controller with the token JupyterHub gave it
(``JUPYTERHUB_API_TOKEN``). Refusals come back as the exceptions the provisioner and the REST
handlers already know (:class:`~jupyter_gpushare.share.ShareError` for 400s naming a field,
:class:`~jupyter_gpushare.placement.PlacementRefused` for ``no_fit``, :class:`ControllerRefused`
(an HTTP error with the controller's status and message) for the rest).

Requests are retried while the controller fails over (connection refused, 503 ``not_leader``)
for up to ``retry_for`` seconds: every call is idempotent (placing by ``kernel_id``, a launch by
its ``launch_id``), so a retry never doubles a share.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.web import HTTPError

from ..errors import GpushareError
from ..inventory import Gpu
from ..ledger import Allocation, AllocationNotFound, Ledger, PlaceFunction, Snapshot
from ..placement import PlacementRefused
from ..resize import RESIZABLE
from ..share import ShareError, ShareSpec

log = logging.getLogger("jupyter_gpushare.controller")

#: the longest single wait for a queued start's change (a progress report at least this often)
QUEUE_POLL_S = 10.0


class ControllerRefused(HTTPError):
    """The controller's refusal (or absence), with its status, code and message."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(
            status,
            log_message=str(body.get("message", "")),
            reason=str(body.get("error", "controller_error")),
        )
        self.body = body

    def __str__(self) -> str:
        return str(self.body.get("message", ""))


class ControllerClient:
    def __init__(
        self, urls: Sequence[str], token: str, timeout: float = 330.0, retry_for: float = 60.0
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("no controller URL")
        self.token = token
        self.timeout = timeout
        self.retry_for = retry_for

    async def request(
        self, method: str, path: str, body: Any = None, retry: bool = True
    ) -> dict[str, Any]:
        deadline = time.monotonic() + (self.retry_for if retry else 0.0)
        delay = 0.2
        last: ControllerRefused | None = None
        while True:
            for url in self.urls:
                try:
                    return await self._once(url, method, path, body)
                except ControllerRefused as exc:
                    if exc.status_code != 503 or exc.body.get("error") not in (
                        "not_leader",
                        "controller_unreachable",
                    ):
                        raise
                    last = exc
            if time.monotonic() + delay > deadline:
                assert last is not None
                raise last
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 2.0)

    async def _once(self, url: str, method: str, path: str, body: Any) -> dict[str, Any]:
        request = HTTPRequest(
            url + path,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=json.dumps(body)
            if body is not None
            else (b"" if method in ("POST", "PUT", "PATCH") else None),
            request_timeout=self.timeout,
            connect_timeout=5.0,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as exc:
            if exc.code == 599 or exc.response is None:
                raise ControllerRefused(
                    503,
                    {
                        "error": "controller_unreachable",
                        "message": f"the gpushare controller at {url} cannot be reached: {exc}",
                    },
                ) from None
            raise _refusal(exc.code, exc.response.body) from None
        except OSError as exc:
            raise ControllerRefused(
                503,
                {
                    "error": "controller_unreachable",
                    "message": f"the gpushare controller at {url} cannot be reached: {exc}",
                },
            ) from None
        return json.loads(response.body) if response.body else {}


def _refusal(status: int, raw: bytes | None) -> Exception:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    body.setdefault("error", "controller_error")
    body.setdefault("message", f"the gpushare controller answered {status}")
    if status == 400 and "field" in body:
        return ShareError(str(body["field"]), body.get("value"), str(body.get("allowed", "")))
    if status == 409 and body["error"] in ("no_fit", "over_quota"):
        return PlacementRefused(str(body["message"]), body.get("suggestions") or ())
    if status == 404 and body["error"] == "not_found" and body.get("field") == "allocation":
        return AllocationNotFound(str(body.get("value", "")))
    return ControllerRefused(status, body)


class ControllerLedger(Ledger):
    """The ledger as a user's server sees it through the controller: its own allocations.

    Placing (``allocate``), releasing and resizing go to the controller, which places on the
    cluster's ledger and checks the user's bound. The controller owns each record's state
    (``reserved``/``active`` follow the kernel pod), so changes other than request, limit and
    memory apply to the copy this server returns only."""

    def __init__(self, client: ControllerClient, server_id: str) -> None:
        self.client = client
        self.server_id = server_id

    async def snapshot(self) -> Snapshot:
        return Snapshot(allocations=tuple(await self.list()), versions={})

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        raise NotImplementedError("in controller mode only the controller writes the ledger")

    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        raise NotImplementedError("node daemons publish GPUs on their Node objects")

    async def gpus(self) -> list[Gpu]:
        data = await self.client.request("GET", "/api/gpus")
        return [Gpu.from_json(g) for g in data.get("gpus") or []]

    async def list(self, node: str | None = None) -> list[Allocation]:
        data = await self.client.request("GET", "/api/allocations")
        found = [Allocation.from_json(a) for a in data.get("allocations") or []]
        return [a for a in found if node is None or a.node == node]

    async def get(self, allocation_id: str) -> Allocation:
        return Allocation.from_json(
            await self.client.request("GET", f"/api/allocations/{quote(allocation_id, safe='')}")
        )

    async def allocate(
        self, spec: ShareSpec, inventory: Sequence[Gpu], place: PlaceFunction, **fields: Any
    ) -> Allocation:
        body = {
            "share": spec.to_json(),
            "kernel_id": fields.get("kernel_id"),
            "server_id": self.server_id,
            "owner": fields.get("owner", "kernel"),
        }
        return Allocation.from_json(await self.client.request("POST", "/api/allocations", body))

    async def reserve_waiting(
        self,
        spec: ShareSpec,
        policy: Any,
        timeout: float | None,
        progress: Callable[[dict[str, Any]], None] | None = None,
        **fields: Any,
    ) -> Allocation:
        """Place ``spec`` now, or wait in the controller's queue (DESIGN box 13,
        :mod:`.queue`) up to ``timeout`` seconds (None: as long as it takes) and return the
        share it started; no kernel pod exists meanwhile. ``progress`` is called with each view
        of the waiting entry (``position``, ``eta``, ``message``). Raises ``PlacementRefused``
        when the wait ends without a start, and at once for a start that can never fit or
        one over the user's cap on waiting starts. A cancelled wait (a stopped start, Ctrl-C)
        cancels the entry; a share started in that moment is released. ``policy`` is the
        controller's (ignored here)."""
        body = {
            "share": spec.to_json(),
            "kernel_id": fields.get("kernel_id"),
            "server_id": self.server_id,
            "owner": fields.get("owner", "kernel"),
        }
        try:
            reply = await self.client.request("POST", "/api/queue", body)
        except ControllerRefused as exc:
            if exc.body.get("error") in ("never_fits", "queue_full"):
                raise PlacementRefused(str(exc)) from None
            raise
        if reply.get("allocation"):
            return Allocation.from_json(reply["allocation"])
        entry = reply["entry"]
        refused = str(entry.get("refusal") or "nothing fits now")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if progress is not None:
                    progress(entry)
                if entry["state"] == "started":
                    return Allocation.from_json(entry["allocation"])
                if entry["state"] != "waiting":
                    raise PlacementRefused(f"{refused}; the queued start was {entry['message']}")
                left = QUEUE_POLL_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                wait = max(0.0, min(left, QUEUE_POLL_S))
                entry = (
                    await self.client.request("GET", f"/api/queue/{entry['id']}?wait={wait:.1f}")
                )["entry"]
        except BaseException:
            ended = await asyncio.shield(self._cancel_quietly(str(entry["id"])))
            if ended.get("state") == "started" and ended.get("allocation"):
                await asyncio.shield(self.release(str(ended["allocation"]["id"])))
            raise
        last = await self._cancel_quietly(str(entry["id"]))
        if last.get("state") == "started" and last.get("allocation"):
            return Allocation.from_json(last["allocation"])
        raise PlacementRefused(
            f"{refused}; waited {timeout:g} s in the queue: {entry.get('message')}"
        )

    async def queue_listing(self) -> dict[str, Any]:
        """``{"entries", "metrics"}``: the waiting starts in the controller's order (others'
        as capacity only, unless an admin)."""
        return await self.client.request("GET", "/api/queue")

    async def queue_cancel(self, entry_id: str) -> dict[str, Any]:
        """Cancel a waiting start; the entry as it ended (``started`` with its allocation
        when the start won: the caller then holds a share it may release). 404
        ``unknown_entry`` for an entry that is not the user's."""
        try:
            reply = await self.client.request("DELETE", f"/api/queue/{quote(entry_id, safe='')}")
        except ControllerRefused as exc:
            if exc.status_code == 404:
                raise GpushareError(str(exc), code="unknown_entry", status=404) from None
            raise
        entry = reply.get("entry")
        return entry if isinstance(entry, dict) else {}

    async def _cancel_quietly(self, entry_id: str) -> dict[str, Any]:
        """:meth:`queue_cancel` for a wait that ends: ``{}`` when the controller could not
        be asked (the entry is dropped once this server's Lease expires)."""
        try:
            return await self.queue_cancel(entry_id)
        except (GpushareError, ControllerRefused, OSError) as exc:
            log.warning("gpushare: could not cancel the queued start %s: %s", entry_id, exc)
            return {}

    async def release(
        self, allocation_id: str, if_unchanged: Allocation | None = None
    ) -> Allocation | None:
        try:
            return Allocation.from_json(
                await self.client.request(
                    "DELETE", f"/api/allocations/{quote(allocation_id, safe='')}"
                )
            )
        except AllocationNotFound:
            return None

    async def update(
        self,
        allocation_id: str,
        change: Callable[[Allocation, builtins.list[Allocation]], Allocation],
    ) -> Allocation:
        current = await self.get(allocation_id)
        changed = change(current, [])
        body = {}
        if changed.spec.gpu_request != current.spec.gpu_request:
            body["gpu_request"] = changed.spec.gpu_request
        if changed.spec.gpu_limit != current.spec.gpu_limit:
            body["gpu_limit"] = changed.spec.gpu_limit
        if changed.memory != current.memory:
            body["gpu_memory"] = changed.memory
        assert set(body) <= set(RESIZABLE)
        if not body:
            return changed
        return Allocation.from_json(
            await self.client.request(
                "PATCH", f"/api/allocations/{quote(allocation_id, safe='')}", body
            )
        )


class ControllerContext:
    """What all kernels of one server share in controller mode (per event loop): the client,
    the ledger view and the heartbeat that keeps the server's Lease alive."""

    def __init__(self, config: Any, client: ControllerClient) -> None:
        self.config = config
        self.client = client
        self.ledger = ControllerLedger(client, config.server_id)
        self._heartbeat: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._heartbeat = asyncio.create_task(self._beat(), name="gpushare-controller-heartbeat")

    async def _beat(self) -> None:
        while True:
            try:
                await self.client.request(
                    "PUT", f"/api/servers/{self.config.server_id}", retry=False
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep beating through failovers
                log.warning("gpushare: heartbeat to the controller failed: %s", exc)
            await asyncio.sleep(self.config.lease_renew_interval)

    async def close(self, delete_lease: bool = False) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None


_contexts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ControllerContext] = (
    weakref.WeakKeyDictionary()
)


def hub_token(config: Any) -> str:
    token = config.controller_token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    if not token:
        raise ControllerRefused(
            503,
            {
                "error": "no_hub_token",
                "message": "controller mode needs the server's JupyterHub "
                "API token ($JUPYTERHUB_API_TOKEN, or c.KubernetesBackendConfig.controller_token)",
            },
        )
    return str(token)


async def controller_context(config: Any) -> ControllerContext:
    loop = asyncio.get_running_loop()
    ctx = _contexts.get(loop)
    if ctx is None:
        client = ControllerClient(
            config.controller_url.split(","),
            hub_token(config),
            timeout=config.start_timeout + 30.0,
            retry_for=config.controller_retry_for,
        )
        ctx = _contexts[loop] = ControllerContext(config, client)
        ctx.start()
    return ctx


async def close_controller_context() -> None:
    ctx = _contexts.pop(asyncio.get_running_loop(), None)
    if ctx is not None:
        await ctx.close()


__all__ = [
    "ControllerClient",
    "ControllerContext",
    "ControllerLedger",
    "ControllerRefused",
    "close_controller_context",
    "controller_context",
    "hub_token",
]
