"""Inside a gpushare kernel: idle reclaim's warning and release, and what the node agent's
driver check did to the share (processes stopped or paused, and why), printed before the next
cell.

The server's idle reclaim (:mod:`jupyter_gpushare.reclaim`) writes its warning into the
allocation; the node daemon's status carries it to the kernel, and :class:`ReclaimNotice` (a
``pre_run_cell`` hook installed with the ``%gpushare`` magics) prints it once per warning, and the
release once.

Installed on every gpushare kernel's start, so the agent's client and :mod:`.actions` are
imported at the first cell, not at load (issue 12, kernel cold start).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..daemon.client import DaemonClient


class ReclaimNotice:
    """Prints the reclaim warning (once per warning) and the release (once) before a cell runs.

    Installed by the notebook extension (``%load_ext jupyter_gpushare``) as a ``pre_run_cell``
    hook; one status request on the daemon's unix socket per cell (~1 ms), silent when no
    daemon answers."""

    def __init__(self, allocation_id: str, socket_path: str) -> None:
        self.allocation_id = allocation_id
        self.socket_path = socket_path
        self._client: DaemonClient | None = None
        self.shown_warning: float | None = None
        #: the driver check's events up to this time were shown (or are too old to matter: an
        #: event of the last minutes is shown to a restarted kernel, it may be why it restarted)
        self.shown_check = time.time() - RECENT_CHECK_S
        self.held = True

    @property
    def client(self) -> DaemonClient:
        """The node agent's client, made at the first cell (imported then: module doc)."""
        if self._client is None:
            from ..daemon.client import DaemonClient

            self._client = DaemonClient(self.socket_path, timeout=0.5)
        return self._client

    def check(self) -> str | None:
        """The text to print now, if any."""
        if not self.held:
            return None
        try:
            status = self.client.status(self.allocation_id)
        except (OSError, ValueError):  # DaemonUnreachable is an OSError
            return None
        if not status.get("ok"):
            if status.get("error") != "unknown_allocation":
                return None
            self.held = False
            if not (status.get("reclaimed") or self.shown_warning):
                return None  # released otherwise (Release, REST): the panel says so
            # the daemon knew the share (it says so): record the release, so that
            # `%gpushare request` reserves a new share for the restart
            from . import actions  # only here: module doc

            actions.note_released_by_daemon()
            return (
                f"gpushare: this kernel's GPU share {self.allocation_id} was released by "
                "idle-GPU reclaim after its warning; the kernel and its variables are still "
                "here. GPU work needs a new share: `%gpushare request …`, then restart the "
                "kernel."
            )
        [mine] = status.get("allocations") or [{}]
        checked = self._driver_check(mine.get("driver_check"))
        if checked:
            return checked
        warning = mine.get("reclaim_warning")
        if warning and warning.get("warned_at") != self.shown_warning:
            self.shown_warning = warning.get("warned_at")
            return str(warning.get("message"))
        if not warning:
            self.shown_warning = None
        return None

    def _driver_check(self, report: Any) -> str | None:
        """The driver check's events not shown yet, one line each."""
        if not isinstance(report, dict):
            return None
        lines = []
        for event in report.get("events") or []:
            when = event.get("time")
            if not isinstance(when, (int, float)) or when <= self.shown_check:
                continue
            self.shown_check = when
            lines.append(driver_check_line(event))
        return "\n".join(lines) or None

    def __call__(self, *_args: Any) -> None:
        text = self.check()
        if text:
            print(text, flush=True)


#: how old a driver check event a kernel's first cell still shows (s)
RECENT_CHECK_S = 600.0


def driver_check_line(event: dict[str, Any]) -> str:
    """One driver check event in the user's words."""
    what = "stopped" if event.get("action") == "stopped" else "paused"
    pids = ", ".join(str(p) for p in event.get("pids") or [])
    when = time.strftime("%H:%M:%S", time.localtime(float(event.get("time") or 0)))
    line = f"gpushare: at {when} the node agent {what} process(es) {pids} of this GPU share"
    if what == "paused" and event.get("paused_s"):
        line += f" for {event['paused_s']} s"
    return f"{line}: {event.get('reason')}"


def install_notice(ipython: Any) -> ReclaimNotice | None:
    """Register :class:`ReclaimNotice` as a ``pre_run_cell`` hook in a gpushare kernel."""
    allocation_id = os.environ.get("GPUSHARE_ALLOCATION_ID")
    socket_path = os.environ.get("GPUSHARE_SOCKET")
    if not allocation_id or not socket_path:
        return None
    for callback in ipython.events.callbacks["pre_run_cell"]:
        if isinstance(callback, ReclaimNotice):  # loaded twice
            return callback
    notice = ReclaimNotice(allocation_id, socket_path)
    ipython.events.register("pre_run_cell", notice)
    return notice


__all__ = ["ReclaimNotice", "install_notice"]
