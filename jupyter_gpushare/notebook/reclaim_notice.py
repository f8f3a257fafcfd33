"""Inside a gpushare kernel: idle reclaim's warning and release, printed before the next cell.

The server's idle reclaim (:mod:`jupyter_gpushare.reclaim`) writes its warning into the
allocation; the node daemon's status carries it to the kernel, and :class:`ReclaimNotice` (a
``pre_run_cell`` hook installed with the ``%gpushare`` magics) prints it once per warning, and the
release once.

Installed on every gpushare kernel's start, so the agent's client and :mod:`.actions` are
imported at the first cell, not at load (issue 12, kernel cold start).
"""

from __future__ import annotations

import os
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
        warning = mine.get("reclaim_warning")
        if warning and warning.get("warned_at") != self.shown_warning:
            self.shown_warning = warning.get("warned_at")
            return str(warning.get("message"))
        if not warning:
            self.shown_warning = None
        return None

    def __call__(self, *_args: Any) -> None:
        text = self.check()
        if text:
            print(text, flush=True)


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
