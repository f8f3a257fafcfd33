"""The gpushare kernel provisioner (DEVELOPING.md "Layout", box 5), entry point
``gpushare-provisioner``.

It owns the share of one kernel: resolves the spec (server default < kernelspec config < the
user's choice passed as ``start_kernel(gpushare_share=...)``), refuses bad specs before anything is
reserved, reserves in the ledger, hands launching to the configured backend's
:class:`~jupyter_gpushare.backends.base.KernelBackend` (``GpuShare.get_backend(name)``, found by
entry point: :mod:`jupyter_gpushare.backends`), and releases the share on every exit path:

- shutdown and kill: released in :meth:`cleanup`;
- the kernel process dies (crash, ``kill -9``): jupyter_client's restarter restarts the kernel;
  the dead process's allocation is released and the new process reserves again;
- a user's restart keeps the allocation (same id, same GPU);
- the server dies: reconciliation (:mod:`jupyter_gpushare.ledger.reconcile`) releases it.

Kernelspec ``metadata.kernel_provisioner.config`` keys are the traits below; any other key is
refused by name (jupyter_client would otherwise drop a misspelled key silently).
"""

from __future__ import annotations

import asyncio
import functools
import getpass
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from tornado.web import HTTPError
from traitlets import Any as AnyTrait
from traitlets import Float, Unicode

from .. import backends
from ..backends.base import KernelBackend
from ..bound import ENV_MAX, apply_user_bound, share_from_environment
from ..config import GpuShare
from ..errors import GpushareError
from ..inventory import check_spec
from ..ledger import Allocation, AllocationNotFound, Ledger
from ..ledger.reconcile import process_start_time
from ..placement import allocate
from ..progress import report as report_phase
from ..share import SHARE_FIELDS, ShareError, ShareSpec


class ShareReleasedWhileStarting(GpushareError):
    """The kernel's share was released after it was placed and before the kernel process was
    recorded as its holder (the notebook panel's or the dashboard's Release, ``DELETE
    /gpushare/api/allocations/<id>``, idle reclaim): a user's action, not a fault. The start
    stops, a kernel process already started is stopped (:meth:`GpushareProvisioner.launch_kernel`),
    and nothing of it is kept; starting the kernel again places a new share."""

    code = "share_released"
    status = 409

    def __init__(self, allocation_id: str) -> None:
        super().__init__(
            f"the GPU share {allocation_id} was released while this kernel was starting, so "
            "the kernel was not started (nothing of it is kept); start the kernel again to get "
            "a new share",
            allocation=allocation_id,
        )


class ShareRefused(HTTPError):
    """A refused share (invalid, nothing fits, or released while its kernel was starting) as an
    HTTP error, so that jupyter_server's own ``POST /api/kernels`` answers 400/409 with our
    message instead of "Unhandled error"."""

    def __init__(self, error: GpushareError) -> None:
        body = error.to_json()
        super().__init__(error.status, log_message=body["message"], reason=body["error"])
        self.error = error
        self.body = body
        self.logged = False  # RefusalLoggedOnce: said once already


class RefusalLoggedOnce(logging.Filter):
    """A refused share is the user's answer, not a server fault, yet jupyter_client logs a failed
    start with its traceback in each kernel-manager layer (twice in jupyter_server). On the
    server's log this filter lets the first record of one refusal through as one warning line
    without the traceback, and drops the others (:func:`log_refusals_once` installs it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        refusal = record.exc_info[1] if record.exc_info else None
        if not isinstance(refusal, ShareRefused):
            return True
        if refusal.logged:
            return False
        refusal.logged = True
        record.msg = "gpushare: kernel start refused (%s %s): %s"
        record.args = (refusal.status_code, refusal.body["error"], refusal.body["message"])
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def log_refusals_once(log: Any) -> None:
    """Install :class:`RefusalLoggedOnce` on ``log`` (a logger or an adapter), once."""
    logger = getattr(log, "logger", log)
    if isinstance(logger, logging.Logger) and not any(
        isinstance(f, RefusalLoggedOnce) for f in logger.filters
    ):
        logger.addFilter(RefusalLoggedOnce())


@functools.cache
def _own_start_time(pid: int) -> float | None:
    """This process's start time (recorded with each allocation it makes, to tell it from a later
    process with its pid): read once per pid, not on every kernel start (a forked child asks
    with its own pid)."""
    return process_start_time(pid)


_BASE_KWARGS = {"kernel_id", "kernel_spec", "parent", "config", "log"}
#: seconds a failed start waits for the kernel process it stopped (SIGKILL) to be gone
STOP_WAIT_S = 10.0
CONFIG_KEYS = (*SHARE_FIELDS, "backend")


def _share_trait(help: str) -> AnyTrait:
    return AnyTrait(None, allow_none=True, config=True, help=help)


class GpushareProvisioner(KernelProvisionerBase):
    """Launches a kernel holding a share of a GPU."""

    gpu_request = _share_trait("Guaranteed fraction of one GPU, in (0, 1].")
    gpu_limit = _share_trait("Most of one GPU the kernel may use when others are idle, (0, 1].")
    gpu_memory = _share_trait("GPU memory cap, bytes or with a unit (10GiB, 512Mi).")
    gpu_type = _share_trait("GPU type alias (A100, H100, T4, ...); any type when unset.")
    gpu_count = _share_trait("Whole GPUs (>1 means that many whole GPUs).")
    gpu_labels = _share_trait("Locality labels: {affinity, anti_affinity, exclusive}.")
    backend = Unicode(
        None,
        allow_none=True,
        config=True,
        help="An installed backend ('local', 'kubernetes', ...); default: the server's.",
    )
    queue_wait = Float(
        0.0,
        config=True,
        help="Seconds a kernel start whose share does not fit now waits in the node agent's "
        "queue (DESIGN box 13: fair between users, started by itself when a share is freed; "
        "the start's progress, GET /gpushare/api/starts, shows its position and ETA) before it "
        "is refused with the queue's reason (409 no_fit). 0: refused at once. A start that "
        "asks its own wait (\"wait\" of POST /gpushare/api/kernels, the Lab picker's 'Wait "
        "in line'; at most GpuShare.start_wait_max) waits that long instead. A share that "
        "can never fit is refused at once either way. Needs a ledger owner with a queue: a "
        "node agent that serves the ledger (a system agent, `jupyter gpushare daemon "
        "--system`) or, on Kubernetes, the controller (controller mode: no kernel pod exists "
        "while the start waits); elsewhere starts are refused at once.",
    )

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _BASE_KWARGS - set(CONFIG_KEYS))
        problem = None
        if unknown:
            problem = ShareError(
                f"kernel_provisioner.config.{unknown[0]}",
                kwargs[unknown[0]],
                "known keys are " + ", ".join(CONFIG_KEYS),
            )
        elif kwargs.get("backend") is not None:
            try:
                backends.check_name(kwargs["backend"])
            except ShareError as exc:
                problem = exc
        if problem is not None:
            raise ShareRefused(problem) from problem
        super().__init__(**kwargs)
        self.connection_info: KernelConnectionInfo = {}  # the base class's is shared
        self.allocation: Allocation | None = None
        self._kernel_backend: KernelBackend | None = None
        self._crashed = False
        self._ran = False  # a kernel process of this provisioner ran (later starts: restarts)
        self._shutdown_asked = False
        self._owner = "kernel"  # "pool" for a warm pool kernel (see jupyter_gpushare.pools)
        self._settings: GpuShare | None = None
        self._pool: str | None = None
        self._wait: float | None = None
        self._notebook: str | None = None  # the session's notebook path (status shows it)

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def settings(self) -> GpuShare:
        """The settings of the server whose kernel manager started this kernel (found through
        the parents: KernelManager -> MultiKernelManager -> ServerApp); without a server, the
        process's ``GpuShare.instance()``."""
        if self._settings is None:
            self._settings = GpuShare.of(self.parent)
        return self._settings

    @property
    def kernel_backend(self) -> KernelBackend:
        if self._kernel_backend is None:
            backend = self.settings.get_backend(self.backend or None)
            self._kernel_backend = backend.kernel_backend(self)
        return self._kernel_backend

    def kernelspec_spec(self) -> ShareSpec:
        """Server default overlaid with this kernelspec's config."""
        given = {key: getattr(self, key) for key in SHARE_FIELDS if getattr(self, key) is not None}
        return ShareSpec.from_mapping(given, defaults=self.settings.default_spec())

    def resolve_spec(self, user_share: dict[str, Any] | None) -> ShareSpec:
        spec = self.kernelspec_spec()
        if user_share:
            spec = ShareSpec.from_mapping(user_share, defaults=spec)
        return apply_user_bound(spec, share_from_environment(ENV_MAX))  # JupyterHub's bound

    async def _ledger(self) -> Ledger:
        return await self.kernel_backend.ledger()

    async def _release(self, why: str) -> None:
        if self.allocation is None:
            return
        allocation, self.allocation = self.allocation, None
        released = await (await self._ledger()).release(allocation.id)
        if released is not None:
            self.log.info(
                "gpushare: released %s of kernel %s (%s)", allocation.id, self.kernel_id, why
            )

    async def _reserve(self, spec: ShareSpec) -> Allocation:
        backend = self.kernel_backend
        ledger = await backend.ledger()
        if self.allocation is not None:  # a restart: keep the share if it is still held
            try:
                return await ledger.get(self.allocation.id)
            except AllocationNotFound:
                self.allocation = None
        fields: dict[str, Any] = {
            "owner": self._owner,
            "kernel_id": self.kernel_id,
            "backend": backend.name,
            "server_pid": os.getpid(),
            "user": getpass.getuser(),
            "extra": {
                "server_start": _own_start_time(os.getpid()),
                **backend.record_extra(),
                **({"pool": self._pool} if self._pool else {}),
                **({"notebook": self._notebook} if self._notebook else {}),  # status shows it
            },
        }
        waiting = getattr(ledger, "reserve_waiting", None)
        wait = self.queue_wait if self._wait is None else self._wait
        if wait > 0 and waiting is not None and self._owner != "pool":
            allocation: Allocation = await waiting(
                spec,
                self.settings.policy(),
                wait,
                self._queued,
                **{k: v for k, v in fields.items() if k != "user"},
            )
        else:
            allocation = await allocate(
                ledger, spec, await backend.inventory(), self.settings.policy(), **fields
            )
        self.log.info(
            "gpushare: kernel %s holds %s on %s %s",
            self.kernel_id,
            spec.describe(),
            allocation.node,
            ",".join(allocation.gpus),
        )
        return allocation

    def _queued(self, entry: dict[str, Any]) -> None:
        """A view of this start's place in the node agent's queue: its position and ETA in
        the start's progress (the Lab picker shows it)."""
        if entry.get("state") == "waiting":
            self._phase("placing", f"waiting: {entry.get('message', '')}")
        elif entry.get("state") == "started":
            self._phase("placing", "a share was freed: starting")

    # -- KernelProvisionerBase -------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        log_refusals_once(self.log)  # a refusal below: one line on the server's log
        user_share = kwargs.pop("gpushare_share", None)
        self._owner = kwargs.pop("gpushare_owner", None) or "kernel"  # pools start warm kernels
        # this start's own wait in the queue (POST /gpushare/api/kernels "wait", checked there
        # against GpuShare.start_wait_max); None: queue_wait
        wait = kwargs.pop("gpushare_wait", None)
        self._wait = float(wait) if wait is not None else None
        self._pool = kwargs.pop("gpushare_pool", None)
        # the notebook this kernel runs for: jupyter_server's sessions pass its path
        session = (kwargs.get("env") or {}).get("JPY_SESSION_NAME")
        self._notebook = str(session)[:1024] if session else None
        self._shutdown_asked = False
        if self._crashed:
            await self._release("the kernel process died; reserving again for its restart")
            self._crashed = False
        self._phase(
            "placing",
            "placing the GPU share",
            kernel_name=str(getattr(self.parent, "kernel_name", "") or ""),
            path=kwargs.get("cwd"),
        )
        try:
            spec = self.resolve_spec(user_share)  # refused before anything is reserved
            spec = check_spec(spec, await self.kernel_backend.inventory(), self.settings.aliases())
            self.allocation = await self._reserve(spec)
        except GpushareError as exc:  # a bad share, nothing fits, the ledger busy or away:
            self._forget_refused_start()  # the user's answer (one log line), not a fault
            self._phase("failed", str(exc))
            raise ShareRefused(exc) from exc
        where = f"{self.allocation.node} {','.join(self.allocation.gpus)}"
        self._phase("placed", f"holds {self.allocation.spec.describe()} on {where}")
        held = self.allocation.id
        try:
            return await self.kernel_backend.pre_launch(self.allocation, **kwargs)
        except BaseException as exc:
            released = self._released_while_starting(exc, held)
            why = released.body["message"] if released else f"launch preparation failed: {exc}"
            self._phase("failed", why)
            await self._release("launch preparation failed")
            if released is None:
                raise
            self._forget_refused_start()
            raise released from exc

    def _phase(self, phase: str, message: str = "", **fields: Any) -> None:
        """Report how far this kernel's start has got (``GET /gpushare/api/starts``, the Lab
        picker and status bar; :mod:`jupyter_gpushare.progress`)."""
        report_phase(self.settings, self.kernel_id, phase, message, **fields)

    def _forget_refused_start(self) -> None:
        """Let a refused start leave nothing pending in the server's kernel manager.

        jupyter_client's ``MultiKernelManager`` keeps a failed start's task in
        ``_pending_kernels``; its ``shutdown_all`` then fails on that id (jupyter_server: 404
        "Kernel does not exist") and the server hangs on Ctrl-C/SIGTERM. Once the start task
        is done, drop it, unless the kernel joined the map (pending kernels, or a restart)."""
        manager = getattr(self.parent, "parent", None)  # KernelManager -> MultiKernelManager
        pending = getattr(manager, "_pending_kernels", None)
        task = pending.get(self.kernel_id) if isinstance(pending, dict) else None
        if not isinstance(task, asyncio.Future) or manager is None or pending is None:
            return
        kernel_id = self.kernel_id

        def forget(done: asyncio.Future[Any]) -> None:
            if kernel_id not in manager and pending.get(kernel_id) is done:
                pending.pop(kernel_id, None)

        task.add_done_callback(forget)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel and record its process as the share's holder.

        The record is a compare-and-swap on the share placed in :meth:`pre_launch`, so a share
        released in between (a user's Release, idle reclaim) is seen here, once, whenever the
        release came: the process just started is stopped, what the launch took (ports, the
        connection file, a pod) is given back, and the start is refused with 409
        ``share_released`` (:class:`ShareReleasedWhileStarting`). Any other failure of the
        launch or the record stops the process the same way (never a kernel nobody manages)
        and is raised as it is."""
        self._phase("launching", "starting the kernel")
        assert self.allocation is not None
        held = self.allocation.id
        try:
            self.connection_info = await self.kernel_backend.launch_kernel(cmd, **kwargs)
            await self._record_process()
        except BaseException as exc:
            released = self._released_while_starting(exc, held)
            why = released.body["message"] if released else f"the kernel did not start: {exc}"
            self._phase("failed", why)
            await self._undo_launch()
            await self._release("launch failed")
            if released is None:
                raise
            self._forget_refused_start()
            raise released from exc
        self._ran = True
        self._phase("starting", "the kernel process runs; connecting")
        return self.connection_info

    def _released_while_starting(self, error: BaseException, held: str) -> ShareRefused | None:
        """``error`` as the user's refusal when it says that ``held``, this start's share, is
        no longer in the ledger (released while the kernel was starting); else None."""
        if isinstance(error, AllocationNotFound) and error.allocation_id == held:
            self.log.info(
                "gpushare: share %s of kernel %s was released while the kernel was starting",
                held,
                self.kernel_id,
            )
            return ShareRefused(ShareReleasedWhileStarting(held))
        return None

    async def _undo_launch(self) -> None:
        """After a failed launch: stop the process (or pod) it started and give back what it
        took (the ports; for a first start also the connection file, which holds the kernel's
        key), so that nothing of the start is left. A restart keeps them for the next try, as
        jupyter_client does (the kernel manager removes them at shutdown)."""
        backend, restart = self.kernel_backend, self._ran
        try:
            if backend.has_process:
                await backend.kill(restart)
                await asyncio.wait_for(backend.wait(), STOP_WAIT_S)
            await backend.cleanup(restart)
        except Exception as exc:  # the start's own error is the one to report
            self.log.warning(
                "gpushare: cleaning up the failed start of kernel %s: %s", self.kernel_id, exc
            )
        remove = getattr(self.parent, "cleanup_connection_file", None)
        if not restart and callable(remove):
            remove()

    async def _record_process(self) -> None:
        assert self.allocation is not None
        pid, start = self.kernel_backend.process_identity()

        def running(current: Allocation, _others: list[Allocation]) -> Allocation:
            return replace(current, state="active", pid=pid, pid_start=start)

        self.allocation = await (await self._ledger()).update(self.allocation.id, running)

    async def post_launch(self, **kwargs: Any) -> None:
        await self.kernel_backend.post_launch(**kwargs)
        self._phase("ready", "kernel ready")

    @property
    def has_process(self) -> bool:
        return self._kernel_backend is not None and self._kernel_backend.has_process

    async def poll(self) -> int | None:
        return await self.kernel_backend.poll()

    async def wait(self) -> int | None:
        return await self.kernel_backend.wait()

    async def send_signal(self, signum: int) -> None:
        await self.kernel_backend.send_signal(signum)

    async def kill(self, restart: bool = False) -> None:
        if restart and not self._shutdown_asked and await self.kernel_backend.poll() is not None:
            self._crashed = True  # the restarter is replacing a process that died by itself
        await self.kernel_backend.kill(restart)

    async def terminate(self, restart: bool = False) -> None:
        await self.kernel_backend.terminate(restart)

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._shutdown_asked = True  # a process that exits from now on did not crash
        if restart:  # before the process exits, so reconciliation does not take it for gone
            await self._mark_restarting()
        await self.kernel_backend.shutdown_requested(restart)

    async def cleanup(self, restart: bool = False) -> None:
        try:
            await self.kernel_backend.cleanup(restart)
        finally:
            if not restart:
                await self._release("kernel shut down")
            elif self._crashed:
                await self._release("the kernel process died")
            else:
                await self._mark_restarting()

    async def abandon(self, why: str) -> None:
        """A start cancelled before its kernel ran (a pool's start when the server stops):
        release what it reserved, also a record whose reservation completed in its worker
        thread after the cancel (found by this kernel id)."""
        await self._release(why)
        ledger = await self._ledger()
        for leftover in await ledger.list():
            if leftover.kernel_id == self.kernel_id and leftover.state == "reserved":
                if await ledger.release(leftover.id, if_unchanged=leftover) is not None:
                    self.log.info(
                        "gpushare: released %s of kernel %s (%s)", leftover.id, self.kernel_id, why
                    )

    async def claim_from_pool(self, pool: str, notebook: str | None = None) -> Allocation:
        """A warm pool kernel is handed to a user (:mod:`jupyter_gpushare.pools`): its share is
        the kernel's from now on (owner ``kernel``), and a later re-reservation is a user's;
        ``notebook``: the session's notebook path, recorded as a cold start records it."""
        if self.allocation is None:
            raise AllocationNotFound("(none)")

        def claimed(current: Allocation, _others: list[Allocation]) -> Allocation:
            extra = {k: v for k, v in current.extra.items() if k != "pool"}
            extra["claimed_from_pool"] = pool
            if notebook:  # jupyter gpushare status shows it
                extra["notebook"] = str(notebook)[:1024]
            return replace(current, owner="kernel", extra=extra)

        self.allocation = await (await self._ledger()).update(self.allocation.id, claimed)
        self._owner, self._pool = "kernel", None
        return self.allocation

    async def _mark_restarting(self) -> None:
        if self.allocation is None:
            return

        def restarting(current: Allocation, _others: list[Allocation]) -> Allocation:
            return replace(current, state="reserved", pid=None, pid_start=None)

        try:
            self.allocation = await (await self._ledger()).update(self.allocation.id, restarting)
        except AllocationNotFound:  # released from the notebook; maybe it reserved the next one
            self.allocation = await self._adopt_reserved(restarting)

    async def _adopt_reserved(
        self, change: Callable[[Allocation, list[Allocation]], Allocation]
    ) -> Allocation | None:
        """A share the kernel reserved for its restart after releasing its own
        (``%gpushare request``, through the node daemon): the restart uses it."""
        ledger = await self._ledger()
        for candidate in await ledger.list():
            if candidate.kernel_id == self.kernel_id:
                try:
                    return await ledger.update(candidate.id, change)
                except AllocationNotFound:
                    continue
        return None

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return self.kernel_backend.get_shutdown_wait_time(recommended)

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        return self.kernel_backend.get_stable_start_time(recommended)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update(await self.kernel_backend.get_provisioner_info())
        info["gpushare_allocation"] = self.allocation.to_json() if self.allocation else None
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        await self.kernel_backend.load_provisioner_info(provisioner_info)
        data = provisioner_info.get("gpushare_allocation")
        self.allocation = Allocation.from_json(data) if data else None

    def bind_cwd(self, cwd: str) -> None:
        """A warm pool kernel was bound to a session working in ``cwd``
        (:mod:`jupyter_gpushare.pools.binding`): paths resolve there from now on, as for a
        kernel started there (jupyter_server's ``/api/resolvePath``). The local backend's
        process provisioner keeps the working directory; a pod's has none to change."""
        process = getattr(self.kernel_backend, "process", None)
        if process is not None and hasattr(process, "cwd"):
            process.cwd = cwd

    def resolve_path(self, path_str: str) -> str | None:
        return self.kernel_backend.resolve_path(path_str)


__all__ = ["CONFIG_KEYS", "GpushareProvisioner", "ShareRefused", "ShareReleasedWhileStarting"]
