"""A pass that the server repeats in the background (reconciliation, idle reclaim)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from .errors import GpushareError
from .ledger import LedgerUnavailable


class PeriodicTask:
    """Runs :meth:`run_once` on the event loop every :meth:`interval` seconds until stopped.

    A failing pass is logged and the next one runs; :meth:`enabled` lets a subclass skip passes
    while its feature is switched off."""

    #: what a pass does, for the log
    what = "background pass"

    def __init__(self, log: Any) -> None:
        self.log = log
        self._task: asyncio.Task[None] | None = None

    def interval(self) -> float:
        raise NotImplementedError

    def enabled(self) -> bool:
        return True

    async def run_once(self) -> Any:
        raise NotImplementedError

    async def _loop(self) -> None:
        while True:
            if self.enabled():
                try:
                    await self.run_once()
                except LedgerUnavailable:
                    pass  # the ledger logs that itself, one line a minute; the next pass retries
                except GpushareError as exc:  # a refusal (the agent's, a busy ledger): expected
                    self.log.warning("gpushare: %s failed: %s", self.what, exc)
                except Exception:  # keep going; report
                    self.log.exception("gpushare: %s failed", self.what)
            await asyncio.sleep(max(0.1, self.interval()))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
