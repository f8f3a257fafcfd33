"""REST handlers under ``/gpushare/api/`` (shapes in DEVELOPING.md, "REST").

Errors are JSON objects with ``error`` (a code), ``message`` (the same words the CLI prints) and,
for an invalid share, ``field``/``value``/``allowed``.

Every handler works on the ledger of the server's backend (``GpuShare.ledger()``: SQLite, or the
cluster's GpuLedgers). On Kubernetes, where every user's Jupyter server shares that ledger, a
server lists and changes only its own kernels' allocations (``Backend.may_touch``,
:mod:`jupyter_gpushare.backends`; 403 ``not_permitted`` for another's), while ``/gpus`` counts
everyone's shares.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from ..backends import Backend
from ..config import GpuShare
from ..daemon.supervisor import confirm_applied
from ..errors import GpushareError, write_error
from ..inventory import Gpu, check_spec
from ..ledger import Allocation, AllocationNotFound, Ledger, LedgerConflict
from ..provisioner import ShareRefused
from ..resize import resize
from ..share import ShareError, ShareSpec, key_name, shown_value


def gpu_usage(gpus: Sequence[Gpu], allocations: Sequence[Allocation]) -> list[dict[str, Any]]:
    """Each GPU with what is reserved on it and what is free."""
    held: dict[str, list[Allocation]] = defaultdict(list)
    for a in allocations:
        for uuid in a.gpus:
            held[uuid].append(a)
    rows = []
    for g in gpus:
        mine = held.get(g.uuid, [])
        used_compute = sum(a.spec.gpu_request for a in mine)
        used_memory = sum(a.memory for a in mine)
        rows.append(
            {
                **g.to_json(),
                "allocated_request": round(used_compute, 6),
                "allocated_memory": used_memory,
                "free_request": round(max(0.0, 1.0 - used_compute), 6),
                "free_memory": max(0, g.memory - used_memory),
                "allocations": [a.id for a in mine],
            }
        )
    return rows


def type_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    by_type: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["healthy"] and not row["cordoned"]:
            by_type[row["type"]].append(row)
    return [
        {
            "type": kind,
            "count": len(items),
            "memory": max(r["memory"] for r in items),
            "most_free_request": max(r["free_request"] for r in items),
            "most_free_memory": max(r["free_memory"] for r in items),
            "simulated": any(r["simulated"] for r in items),
        }
        for kind, items in sorted(by_type.items())
    ]


#: where the Kubernetes client's errors come from (HTTP answers, connections)
CLUSTER_ERROR_MODULES = ("kubernetes_asyncio", "aiohttp")


#: The Authorizer resource of every gpushare endpoint: ``read`` for GET (see GPUs, allocations,
#: usage, pools), ``write`` for POST/PATCH/DELETE (start a kernel with a share, resize, release).
#: ``POST /gpushare/api/kernels`` also needs ``write`` on the core ``kernels`` resource.
AUTH_RESOURCE = "gpushare"


class GpushareHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def gpushare(self) -> GpuShare:
        return self.settings["gpushare"]

    def json_body(self) -> dict[str, Any] | None:
        """The request's JSON object (``{}`` for an empty body), or None after answering 400
        ``bad_json``: not UTF-8, not JSON, nested too deep for the parser (RecursionError), a
        number of more digits than Python converts (ValueError), or not an object."""
        try:
            body = json.loads(self.request.body or b"{}", parse_int=_json_int)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            self.fail(_bad_json(f"the request body is not valid JSON: {reason}"))
            return None
        if not isinstance(body, dict):
            self.fail(_bad_json(f"the request body must be a JSON object, not {_json_kind(body)}"))
            return None
        return body

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Every refusal raised in a handler (a :class:`GpushareError`: a bad share, nothing
        fits, an unavailable ledger, ...) is answered by the one ``write_error`` with its status
        and JSON. An API server that cannot be reached or refuses (backend ``kubernetes``) is
        the cluster's problem, not a bug here: 503 ``cluster_unavailable`` with its words,
        instead of 500 "Unhandled error"."""
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        if isinstance(exc, ShareRefused):
            exc = exc.error
        if isinstance(exc, GpushareError):
            return write_error(self, exc)
        if exc is not None and type(exc).__module__.split(".")[0] in CLUSTER_ERROR_MODULES:
            status = getattr(exc, "status", None)
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            detail = f"{status} {reason}" if status else str(reason)
            return write_error(
                self,
                GpushareError(
                    f"the Kubernetes API server: {detail}", code="cluster_unavailable", status=503
                ),
            )
        super().write_error(status_code, **kwargs)

    def log_exception(self, typ: Any, value: BaseException | None, tb: Any) -> None:
        """A refusal is no bug here (an unavailable ledger logs itself, one line a minute): the
        caller gets its status and reason, so no traceback per request."""
        if isinstance(value, GpushareError):
            return
        super().log_exception(typ, value, tb)

    def fail(self, error: GpushareError) -> None:
        """Answer a refusal found here (the same as raising it)."""
        write_error(self, error)

    @property
    def backend(self) -> Backend:
        """This server's backend (ledger, inventory, usage, which records it may touch)."""
        return self.gpushare.get_backend()

    async def ledger(self) -> Ledger:
        return await self.backend.ledger()

    async def check_kernel_name(self, name: object) -> bool:
        """Whether ``name`` is a kernelspec whose provisioner is gpushare's; else False after
        answering 400 with the field ``name`` and the gpushare kernelspecs there are."""
        ksm = self.kernel_spec_manager
        specs = await _maybe_await(ksm.get_all_specs())
        ours = sorted(
            n
            for n, s in specs.items()
            if ((s.get("spec") or {}).get("metadata") or {})
            .get("kernel_provisioner", {})
            .get("provisioner_name")
            == PROVISIONER
        )
        if isinstance(name, str) and name in ours:
            return True
        allowed = (
            "the name of a gpushare kernelspec: " + ", ".join(ours)
            if ours
            else "a gpushare kernelspec, and none is installed (jupyter gpushare "
            "kernelspec install)"
        )
        self.fail(_field_error("name", name, allowed))
        return False

    async def inventory(self) -> tuple[list[Gpu], str | None]:
        """The GPUs placement can use, and why there are none when there are none."""
        return await self.backend.inventory()

    async def own_allocation(self, allocation_id: str) -> Allocation | None:
        """The allocation if this server may show and change it; else None after answering
        404 (unknown) or 403 (another Jupyter server's kernel, on a shared cluster ledger)."""
        found = (await (await self.ledger()).snapshot()).find(allocation_id)
        if found is None:
            self.fail(AllocationNotFound(allocation_id))
            return None
        if not self.backend.may_touch(found.extra):
            self.fail(
                GpushareError(
                    f"allocation {allocation_id!r} belongs to a kernel of another Jupyter server",
                    code="not_permitted",
                    status=403,
                )
            )
            return None
        return found


class GpusHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        gpus, problem = await self.inventory()
        allocations = await (await self.ledger()).list()  # everyone's: what is free
        rows = gpu_usage(gpus, allocations)
        body: dict[str, Any] = {
            "simulated": self.gpushare.simulated or any(g.simulated for g in gpus),
            "gpus": rows,
            "types": type_summary(rows),
        }
        if problem:
            body["message"] = problem
        self.finish(json.dumps(body))


class AllocationsHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        allocations = [
            a for a in await (await self.ledger()).list() if self.backend.may_touch(a.extra)
        ]
        self.finish(json.dumps({"allocations": [a.to_json() for a in allocations]}))


class AllocationHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self, allocation_id: str) -> None:
        found = await self.own_allocation(allocation_id)
        if found is not None:
            self.finish(json.dumps(found.to_json()))

    @web.authenticated
    @authorized
    async def delete(self, allocation_id: str) -> None:
        """Release the share; the kernel keeps running (its node daemon forgets the share, the
        interposer frees its GPU memory and refuses further CUDA work; on Kubernetes the kernel
        pod stays, with its CPU state)."""
        if await self.own_allocation(allocation_id) is None:
            return None
        released = await (await self.ledger()).release(allocation_id)
        if released is None:
            return self.fail(AllocationNotFound(allocation_id))
        actor = getattr(self.current_user, "username", None) or "REST"
        self.log.info(
            "gpushare: allocation %s (kernel %s) released over REST by %s",
            allocation_id,
            released.kernel_id,
            actor,
        )
        problem = await confirm_applied(
            self.gpushare, allocation_id, None, self.settings.get("gpushare_agent_watch")
        )
        if problem is not None:  # released in the ledger; the agent is not there to see it
            return self.fail(_not_applied(problem))
        self.set_status(204)
        self.finish()

    @web.authenticated
    @authorized
    async def patch(self, allocation_id: str) -> None:
        """Live resize: ``{"gpu_request"?, "gpu_limit"?, "gpu_memory"?}`` -> 200 with the
        changed allocation; 400 invalid share; 409 ``no_fit`` (not on its current GPU) or
        ``below_use`` (memory cap below current use, with ``memory_used``); 503
        ``usage_unknown`` (a lower cap while the node's usage report is stale, Kubernetes);
        403 another server's; 404. The change is a compare-and-swap on the ledger; the node
        daemon applies it to the running kernel (see :mod:`jupyter_gpushare.resize`)."""
        change = self.json_body()
        if change is None:
            return None
        if not change:
            return self.fail(_bad_json("give gpu_request, gpu_limit and/or gpu_memory"))
        actor = getattr(self.current_user, "username", None) or "REST"
        if await self.own_allocation(allocation_id) is None:
            return None
        try:
            _before, after = await resize(
                await self.ledger(),
                allocation_id,
                change,
                await self.backend.usage(),
                actor,
                self.log,
            )
        except GpushareError as exc:  # unknown, bad share, no fit, below use, usage unknown, busy
            return self.fail(exc)
        problem = await confirm_applied(
            self.gpushare, allocation_id, after, self.settings.get("gpushare_agent_watch")
        )
        if problem is not None:  # 200 only for a share the node agent enforces
            return self.fail(_not_applied(problem))
        self.finish(json.dumps(after.to_json()))


class PresetsHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.finish(
            json.dumps(
                {
                    "default": self.gpushare.default_spec().to_json(),
                    "presets": self.gpushare.presets,
                    "simulated": self.gpushare.simulated,
                }
            )
        )


class KernelsHandler(GpushareHandler):
    """Start a kernel holding a chosen share (``POST /api/kernels`` has no room for one)."""

    @web.authenticated
    @authorized
    @authorized(resource="kernels")  # it starts a kernel, as POST /api/kernels does
    async def post(self) -> None:
        """``{"name": a gpushare kernelspec, "path"?: str, "share"?: {…}, "wait"?: seconds}``
        -> 201 with the kernel model and its ``allocation``; 400 naming the field for anything
        else. ``wait``: how long this start waits in the queue when its share does not fit now
        (0 to ``GpuShare.start_wait_max``; absent: the provisioner's ``queue_wait``)."""
        body = self.json_body()
        if body is None:
            return None
        unknown = sorted(set(body) - {"name", "path", "share", "wait"})
        if unknown:
            return self.fail(
                _field_error(
                    key_name(unknown[0]),
                    body[unknown[0]],
                    "known keys are name, path, share, wait",
                )
            )
        wait = body.get("wait")
        bound = self.gpushare.start_wait_max
        if wait is not None and (
            isinstance(wait, bool)
            or not isinstance(wait, (int, float))
            or not math.isfinite(wait)
            or not 0 <= wait <= bound
        ):
            allowed = (
                f"seconds to wait in the queue, a number from 0 to {bound:g} "
                "(GpuShare.start_wait_max), or absent"
                if bound > 0
                else "absent or 0: this server lets no start wait (GpuShare.start_wait_max = 0)"
            )
            return self.fail(_field_error("wait", wait, allowed))
        if not await self.check_kernel_name(body.get("name")):
            return None
        path = body.get("path")
        if path is not None and not isinstance(path, str):
            return self.fail(
                _field_error("path", path, "a path under the server's root (a string), or absent")
            )
        share = body.get("share")
        if share is None:
            share = {}
        try:
            spec = ShareSpec.from_mapping(share, defaults=self.gpushare.default_spec())
            gpus, problem = await self.inventory()
            if problem and not gpus:
                return self.fail(GpushareError(problem, code="no_gpu", status=409))
            check_spec(spec, gpus, self.gpushare.aliases())
        except ShareError as exc:
            return self.fail(exc)
        km = self.kernel_manager
        # the notebook's path, as jupyter_server's sessions give it to a kernel they start
        # (JPY_SESSION_NAME): the provisioner records it, `jupyter gpushare status` shows it
        extra: dict[str, Any] = {}
        if wait is not None:
            extra["gpushare_wait"] = float(wait)
        if path:
            session_manager: Any = self.session_manager  # typed with jupyter_server's NewTypes
            extra["env"] = session_manager.get_kernel_env(path, os.path.basename(path))
        try:
            kernel_id = await km.start_kernel(
                kernel_name=body.get("name"), path=body.get("path"), gpushare_share=share, **extra
            )
        except ShareRefused as exc:
            return self.fail(exc.error)
        except LedgerConflict as exc:
            return self.fail(exc)
        model = await _maybe_await(km.kernel_model(kernel_id))
        allocation = await _allocation_of(self.gpushare, kernel_id)
        model["allocation"] = allocation.to_json() if allocation else None
        location = url_path_join(self.base_url, "api", "kernels", kernel_id)
        self.set_header("Location", location)
        self.set_status(201)
        self.finish(json.dumps(model, default=str))


async def _allocation_of(settings: GpuShare, kernel_id: str) -> Allocation | None:
    for a in await (await settings.ledger()).list():
        if a.kernel_id == kernel_id:
            return a
    return None


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value


#: the kernel provisioner a gpushare kernelspec names
PROVISIONER = "gpushare-provisioner"


def _field_error(field: str, value: object, allowed: str) -> GpushareError:
    """A request field outside the share, refused by name (400, the shape of ShareError's)."""
    shown = shown_value(value)
    return GpushareError(
        f"{field}={shown!r} is not allowed: {allowed}",
        code="invalid_request",
        status=400,
        field=field,
        value=shown,
        allowed=allowed,
    )


def _bad_json(message: str) -> GpushareError:
    return GpushareError(message, code="bad_json", status=400)


def _not_applied(problem: str) -> GpushareError:
    """Recorded in the ledger, not (yet) enforced by the node agent (see confirm_applied)."""
    return GpushareError(problem, code="not_applied", status=503)


def _json_int(text: str) -> int | str:
    """A JSON integer; one of more digits than Python converts (4,300) stays its text, so the
    field it was given for refuses it by name (no value here has that many digits)."""
    return int(text) if len(text) <= 4000 else text


def _json_kind(value: object) -> str:
    return {
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


def handlers(base_url: str) -> list[tuple[str, type]]:
    api = url_path_join(base_url, "gpushare", "api")
    return [
        (url_path_join(api, "gpus"), GpusHandler),
        (url_path_join(api, "allocations"), AllocationsHandler),
        (
            url_path_join(api, "allocations", r"(?P<allocation_id>[A-Za-z0-9_.-]+)"),
            AllocationHandler,
        ),
        (url_path_join(api, "presets"), PresetsHandler),
        (url_path_join(api, "kernels"), KernelsHandler),
    ]
