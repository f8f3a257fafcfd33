"""A log line for a failure that may repeat many times a second (a broken ledger read every
250 ms, a flood of refused connections): the first one is logged with its reason, then at most one
line per ``every`` seconds while it goes on (saying how many happened since), the traceback only at
debug level (or once, first, for a failure that is a bug: ``first_traceback``), and one line when
it is over."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RateLimitedLog:
    logger: logging.Logger
    what: str
    every: float = 60.0
    level: int = logging.ERROR
    first_traceback: bool = False
    clock: Callable[[], float] = time.monotonic
    failing: bool = field(default=False, init=False)
    since_line: int = field(default=0, init=False)  # failures not logged since the last line
    last_line: float = field(default=0.0, init=False)

    def failed(self, reason: object, exc: BaseException | None = None) -> None:
        """One more failure; ``reason`` is the text logged (an exception's ``str``)."""
        now = self.clock()
        if not self.failing:
            self.failing = True
            self.since_line = 0
            self.last_line = now
            self.logger.log(
                self.level,
                "%s: %s",
                self.what,
                reason,
                exc_info=exc
                if self.first_traceback or self.logger.isEnabledFor(logging.DEBUG)
                else None,
            )
            return
        if exc is not None and self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("%s: %s", self.what, reason, exc_info=exc)
        self.since_line += 1
        if now - self.last_line >= self.every:
            self.logger.log(
                self.level,
                "%s: %s (%d times in the last %.0f s)",
                self.what,
                reason,
                self.since_line,
                now - self.last_line,
            )
            self.since_line = 0
            self.last_line = now

    def ok(self) -> None:
        """The failure is over (logged once, if it was failing)."""
        if self.failing:
            self.failing = False
            self.logger.log(max(logging.INFO, self.level - 20), "%s: working again", self.what)


@dataclass
class RateLimitedLogs:
    """A :class:`RateLimitedLog` per key (a uid and a kind of refusal: one user's flood never
    hides another's first line), each at most one line per ``every`` seconds with the count
    since; at most ``keys`` keys are remembered (the oldest is forgotten first), so neither the
    log nor the agent's memory grows with what a user sends."""

    logger: logging.Logger
    what: str
    every: float = 60.0
    level: int = logging.WARNING
    keys: int = 4096
    clock: Callable[[], float] = time.monotonic
    _logs: dict[object, RateLimitedLog] = field(default_factory=dict, init=False, repr=False)

    def failed(self, key: object, label: str, reason: object) -> None:
        """One more refusal for ``key``; ``label`` names it in the line (``uid 1003 (bob)``)."""
        found = self._logs.get(key)
        if found is None:
            while len(self._logs) >= self.keys:
                self._logs.pop(next(iter(self._logs)))
            found = self._logs[key] = RateLimitedLog(
                self.logger, f"{self.what} {label}", self.every, self.level, clock=self.clock
            )
        found.failed(reason)
