"""Reconciliation for locally run holders: release allocations whose holder is gone.

Run at server start and periodically (the server extension), and by ``jupyter gpushare status``.
An allocation is stale when its process is gone (``pid``/``pid_start`` no longer name a live
process: a crash, ``kill -9``), or when the process that manages it (``server_pid``: the Jupyter
server or ``gpushare run``) died. Orphaned kernels of a dead server are unreachable (their
connection files went with the server), so they are stopped too.

A process is signalled only once it is identified (:func:`signal_identified`): its start time
as recorded (``pid_start``, stamped by the agent when the record was made) and, where the record
names its owner's uid, that uid; the signal goes through a pidfd opened before the check, so a
PID reused between the check and the signal is never hit. A record without a start time is
released when stale, but its process is never signalled (the system agent runs as root: a PID
a user recorded and then freed may since name another user's process).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Collection

import psutil

from ..errors import GpushareError
from . import Allocation, AllocationNotFound, Ledger, LedgerConflict, LedgerUnavailable

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


#: recorded vs live start time of a process: the most they may differ and still name it (s)
START_TOLERANCE = 0.05


def process_identity(pid: int) -> tuple[float, int] | None:
    """``(start time, real uid)`` of the live process ``pid`` as /proc says, read so that both
    belong to one process (the start time is read before and after the uid), or None when it
    is gone, a zombie, or the PID changed hands in between."""
    try:
        proc = psutil.Process(pid)
        start = proc.create_time()
        uid = proc.uids().real
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        again = psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None
    return (start, uid) if again == start else None


def signal_identified(pid: int | None, start: float | None, uid: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is the process that started at ``start`` (and, when
    ``uid`` is given, runs as ``uid``); True when it was sent. Through a pidfd opened before the
    check: once the check passes, the signal can only reach that very process."""
    if not pid or pid <= 0 or start is None:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        found = process_identity(pid)
        if found is None or abs(found[0] - start) > START_TOLERANCE:
            return False
        if uid is not None and found[1] != uid:
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


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
        try:
            gone = await ledger.release(allocation.id, if_unchanged=allocation)
        except (AllocationNotFound, LedgerConflict) as exc:  # another won the race; next pass
            logger.info("gpushare: %s not released now: %s", allocation.id, exc)
            continue
        except LedgerUnavailable:
            raise  # the whole pass fails: its caller logs that, and the next pass retries
        except GpushareError as exc:  # refused (e.g. by the agent): one line, the rest go on
            logger.warning("gpushare: could not release %s (%s): %s", allocation.id, reason, exc)
            continue
        if gone is not None:
            logger.info("gpushare: released %s (%s): %s", allocation.id, allocation.owner, reason)
            released.append(allocation)
        _stop_orphan(allocation)
    return released


def _stop_orphan(allocation: Allocation) -> None:
    """SIGTERM to a dead server's kernel, once identified: its recorded start time and owner."""
    if allocation.owner in ("kernel", "pool"):
        uid = allocation.extra.get("uid")
        owner = uid if isinstance(uid, int) and not isinstance(uid, bool) else None
        signal_identified(allocation.pid, allocation.pid_start, owner, signal.SIGTERM)
