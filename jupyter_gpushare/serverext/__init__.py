"""The Jupyter server extension (DEVELOPING.md, box 10): config, REST API and reconciliation.

On load it creates the :class:`~jupyter_gpushare.config.GpuShare` settings from the server's
config, discovers this machine's GPUs (or simulated ones) and publishes them to the ledger,
releases allocations left behind by dead kernels or servers, and keeps doing so periodically.
It starts this machine's node agent unless one answers, and supervises it
(:class:`~jupyter_gpushare.daemon.supervisor.AgentWatch`: a dead agent is started again within
``AgentSupervision.interval`` seconds, no server restart needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

from traitlets import TraitError

from ..config import GpuShare
from ..daemon.supervisor import AgentSupervision, AgentWatch, ensure_agent
from ..inventory import Gpu, NoGpuError
from ..ledger.reconcile import reconcile
from ..periodic import PeriodicTask
from .admin_handlers import admin_handlers, start_admin_tasks
from .dashboard_handlers import dashboard_handlers
from .handlers import handlers
from .queue_handlers import queue_handlers
from .session_handlers import session_handlers
from .ui_handlers import ui_handlers


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "jupyter_gpushare.serverext"}]


class Reconciler(PeriodicTask):
    """Periodically releases allocations whose kernel or server is gone."""

    what = "reconciliation"

    def __init__(self, settings: GpuShare, kernel_manager: Any, log: Any) -> None:
        super().__init__(log)
        self.settings = settings
        self.kernel_manager = kernel_manager

    def interval(self) -> float:
        return float(self.settings.reconcile_interval)

    async def run_once(self) -> int:
        ledger = self.settings.local_ledger()
        released = await reconcile(
            ledger,
            self.settings.node_name,
            my_server_pid=os.getpid(),
            live_kernel_ids=set(self.kernel_manager.list_kernel_ids()),
            logger=self.log,
        )
        return len(released) + len(await self.free_abandoned_pool_starts(ledger))

    async def free_abandoned_pool_starts(self, ledger: Any) -> list[Any]:
        """Release this server's ``pool`` records still ``reserved`` whose warm start is no
        longer under way and whose kernel is not in the kernel manager (a start cancelled
        while its reservation was being written), although the server lives."""
        pools = getattr(self.kernel_manager, "pools", None)
        if pools is None:
            return []
        released = []
        for allocation in await ledger.list(self.settings.node_name):
            if (
                allocation.owner == "pool"
                and allocation.state == "reserved"
                and allocation.server_pid == os.getpid()
                and allocation.kernel_id not in pools.unclaimed()
                and allocation.kernel_id not in self.kernel_manager
            ):
                if await ledger.release(allocation.id, if_unchanged=allocation) is not None:
                    self.log.info(
                        "gpushare: released %s of pool %s: its start (kernel %s) was abandoned",
                        allocation.id,
                        allocation.extra.get("pool"),
                        allocation.kernel_id,
                    )
                    released.append(allocation)
        return released


async def start_node_daemon(settings: GpuShare, gpus: Sequence[Gpu], log: Any) -> None:
    """Start this machine's node daemon unless one answers already (enforcement on, and the
    interposer built: without it there is nothing for a daemon to enforce); see
    :func:`jupyter_gpushare.daemon.supervisor.ensure_agent`."""
    await ensure_agent(settings, gpus, log)


def agent_check_interval(serverapp: Any) -> float:
    """``AgentSupervision.interval`` from the server's config (a bad value: logged, default)."""
    try:
        return float(AgentSupervision(parent=serverapp).interval)
    except TraitError as exc:
        serverapp.log.error(
            "gpushare: %s; checking the node agent every %g s",
            exc,
            AgentSupervision.interval.default_value,
        )
        return float(AgentSupervision.interval.default_value)


async def _start(serverapp: Any, settings: GpuShare) -> None:
    has_gpus = False
    try:
        gpus = await settings.local_gpus()
        has_gpus = True
        kind = "simulated " if settings.simulated else ""
        serverapp.log.info(
            "gpushare: %d %sGPU(s) on %s: %s",
            len(gpus),
            kind,
            settings.node_name,
            ", ".join(f"{g.index}:{g.type}" for g in gpus),
        )
        await start_node_daemon(settings, gpus, serverapp.log)
    except NoGpuError as exc:
        serverapp.log.warning("gpushare: %s", exc)
    except RuntimeError as exc:  # the daemon did not come up: kernels still run, fail static
        serverapp.log.error("gpushare: %s", exc)
    reconciler = Reconciler(settings, serverapp.kernel_manager, serverapp.log)
    serverapp.web_app.settings["gpushare_reconciler"] = reconciler
    reconciler.start()
    interval = agent_check_interval(serverapp)
    beside = settings.get_backend().agent_beside_server  # else the nodes' agents (DaemonSet)
    if has_gpus and beside and interval > 0:  # a dead agent is started again
        watch = AgentWatch(settings, serverapp.log, interval)
        serverapp.web_app.settings["gpushare_agent_watch"] = watch
        watch.start()
    start_admin_tasks(serverapp, settings)  # warm pools, idle reclaim


async def stop_tasks(serverapp: Any) -> None:
    """Stop what the extension runs in the background for ``serverapp``: the start task (if it
    is still discovering GPUs or starting the daemon) and every periodic task kept in the web
    app's settings (reconciliation, idle reclaim, …), awaiting each, so that none outlives its
    server ("Task was destroyed but it is pending" when the loop closes)."""
    settings = serverapp.web_app.settings
    handle = settings.pop("gpushare_start_handle", None)
    if handle is not None:
        serverapp.io_loop.remove_timeout(handle)  # not begun yet: never will
    start = settings.pop("gpushare_start_task", None)
    if start is not None and not start.done():
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await start
    for task in [v for v in settings.values() if isinstance(v, PeriodicTask)]:
        await task.stop()


def _close_after_kernels(serverapp: Any) -> None:
    """At shutdown: stop the background tasks before the kernels go down (no reconciliation or
    reclaim of kernels being shut down), and once the kernels are down stop the Kubernetes
    backend's pod watch and delete the server's Lease (module extensions get no unload hook,
    and the Lease must outlive the kernel pods it owns)."""
    cleanup_kernels = serverapp.cleanup_kernels

    async def cleanup_kernels_then_close() -> None:
        await stop_tasks(serverapp)
        await cleanup_kernels()
        await GpuShare.for_server(serverapp).close_backends()

    serverapp.cleanup_kernels = cleanup_kernels_then_close


def _load_jupyter_server_extension(serverapp: Any) -> None:
    settings = GpuShare.for_server(serverapp)  # this server's own (not the process's)
    web_app = serverapp.web_app
    web_app.settings["gpushare"] = settings
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(
        ".*$",
        admin_handlers(base_url)
        + handlers(base_url)
        + ui_handlers(base_url)
        + dashboard_handlers(base_url)
        + queue_handlers(base_url)
        + session_handlers(base_url),
    )

    def begin() -> None:
        web_app.settings.pop("gpushare_start_handle", None)
        web_app.settings["gpushare_start_task"] = asyncio.ensure_future(_start(serverapp, settings))

    web_app.settings["gpushare_start_handle"] = serverapp.io_loop.call_later(0, begin)
    _close_after_kernels(serverapp)
    serverapp.log.info("gpushare: backend %s, ledger %s", settings.backend, settings.ledger_path)


load_jupyter_server_extension = _load_jupyter_server_extension
