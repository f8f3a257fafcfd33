"""The Jupyter server extension (box 10 of DESIGN.md): config, REST API and reconciliation.

On load it creates the :class:`~jupyter_gpushare.config.GpuShare` settings from the server's
config, discovers this machine's GPUs (or simulated ones) and publishes them to the ledger,
releases allocations left behind by dead kernels or servers, and keeps doing so periodically.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import GpuShare
from ..daemon.env import interposer_path
from ..daemon.supervisor import ensure_daemon
from ..inventory import Gpu, NoGpuError
from ..ledger.reconcile import reconcile
from ..periodic import PeriodicTask
from .admin_handlers import admin_handlers, start_admin_tasks
from .handlers import handlers
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
        return len(released)


async def start_node_daemon(settings: GpuShare, gpus: Sequence[Gpu], log: Any) -> None:
    """Start this machine's node daemon unless one answers already (enforcement on, and the
    interposer built: without it there is nothing for a daemon to enforce)."""
    if not (settings.enforce and interposer_path().exists()):
        log.warning("gpushare: enforcement is off (enforce=%s, interposer %s); shares are "
                    "bookkeeping only", settings.enforce, interposer_path())
        return
    await asyncio.to_thread(
        ensure_daemon,
        Path(settings.socket_path),
        Path(settings.ledger_path),
        [g for g in gpus if g.simulated] or None,
        settings.node_name,
        log,
    )


async def _start(serverapp: Any, settings: GpuShare) -> None:
    try:
        gpus = await settings.local_gpus()
        kind = "simulated " if settings.simulated else ""
        serverapp.log.info("gpushare: %d %sGPU(s) on %s: %s", len(gpus), kind,
                           settings.node_name, ", ".join(f"{g.index}:{g.type}" for g in gpus))
        await start_node_daemon(settings, gpus, serverapp.log)
    except NoGpuError as exc:
        serverapp.log.warning("gpushare: %s", exc)
    except RuntimeError as exc:  # the daemon did not come up: kernels still run, fail static
        serverapp.log.error("gpushare: %s", exc)
    reconciler = Reconciler(settings, serverapp.kernel_manager, serverapp.log)
    serverapp.web_app.settings["gpushare_reconciler"] = reconciler
    reconciler.start()
    start_admin_tasks(serverapp, settings)  # warm pools, idle reclaim


def _close_after_kernels(serverapp: Any) -> None:
    """At shutdown, once the kernels are down, stop the Kubernetes backend's pod watch and
    delete the server's Lease (module extensions get no unload hook, and the Lease must outlive
    the kernel pods it owns)."""
    cleanup_kernels = serverapp.cleanup_kernels

    async def cleanup_kernels_then_close() -> None:
        await cleanup_kernels()
        k8s = sys.modules.get("jupyter_gpushare.k8s.backend")
        if k8s is not None:
            await k8s.close_context(delete_lease=True)

    serverapp.cleanup_kernels = cleanup_kernels_then_close


def _load_jupyter_server_extension(serverapp: Any) -> None:
    settings = GpuShare.instance(parent=serverapp)
    web_app = serverapp.web_app
    web_app.settings["gpushare"] = settings
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(".*$", admin_handlers(base_url) + handlers(base_url)
                         + ui_handlers(base_url))
    serverapp.io_loop.call_later(0, lambda: asyncio.ensure_future(_start(serverapp, settings)))
    _close_after_kernels(serverapp)
    serverapp.log.info("gpushare: backend %s, ledger %s", settings.backend, settings.ledger_path)


load_jupyter_server_extension = _load_jupyter_server_extension
