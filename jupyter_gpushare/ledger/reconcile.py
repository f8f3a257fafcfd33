"""Reconciliation for locally run holders: release allocations whose holder is gone.

Run at server start and periodically (the server extension), and by ``jupyter gpushare status``.
An allocation is stale when its process is gone (``pid``/``pid_start`` no longer name a live
process: a crash, ``kill -9``), or when the process that manages it (``server_pid``: the Jupyter
server or ``gpushare run``) died. Orphaned kernels of a dead server are unreachable (their
connection files went with the server), so they are stopped too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection

import psutil

from . import Allocation, Ledger

log = logging.getLogger(__name__)

#: how long a new kernel may be missing from its server's kernel list while it starts
STARTING_GRACE_S = 120.0


def process_alive(pid: int | None, start: float | None) -> bool:
    """True when ``pid`` names a live process started at ``start`` (guards against PID reuse)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return start is None or abs(proc.create_time() - start) < 0.5
    except psutil.Error:
        return False


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def stale_reason(
    allocation: Allocation,
    my_server_pid: int | None = None,
    live_kernel_ids: Collection[str] | None = None,
) -> str | None:
    """Why ``allocation`` is stale, or None when its holder may still be alive."""
    if allocation.backend != "local":
        return None
    server_pid = allocation.server_pid
    server_start = allocation.extra.get("server_start")
    if server_pid and server_pid != my_server_pid and not process_alive(server_pid, server_start):
        return f"its manager (pid {server_pid}) is gone"
    if allocation.pid and not process_alive(allocation.pid, allocation.pid_start):
        return f"its process (pid {allocation.pid}) is gone"
    if (
        live_kernel_ids is not None
        and server_pid == my_server_pid
        and allocation.owner == "kernel"
        and allocation.kernel_id not in live_kernel_ids
        and allocation.state == "active"
        # a kernel joins the server's list only once it answers: leave starting ones alone
        and time.time() - allocation.created > STARTING_GRACE_S
    ):
        return f"kernel {allocation.kernel_id} is no longer running in this server"
    return None


async def reconcile(
    ledger: Ledger,
    node: str,
    my_server_pid: int | None = None,
    live_kernel_ids: Collection[str] | None = None,
    logger: logging.Logger | logging.LoggerAdapter | None = None,
) -> list[Allocation]:
    """Release the stale allocations on ``node``; returns what was released."""
    logger = logger or log
    released = []
    for allocation in await ledger.list(node):
        reason = stale_reason(allocation, my_server_pid, live_kernel_ids)
        if reason is None:
            continue
        if await ledger.release(allocation.id, if_unchanged=allocation) is not None:
            logger.info("gpushare: released %s (%s): %s", allocation.id, allocation.owner, reason)
            released.append(allocation)
        _stop_orphan(allocation)
    return released


def _stop_orphan(allocation: Allocation) -> None:
    orphan = allocation.owner in ("kernel", "pool")
    if orphan and process_alive(allocation.pid, allocation.pid_start):
        with contextlib.suppress(OSError):
            os.kill(allocation.pid or 0, signal.SIGTERM)
