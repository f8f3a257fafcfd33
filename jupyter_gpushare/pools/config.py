"""Kernel pool profiles: the admin's declaration, parsed and validated once (pure, no I/O).

An admin declares pools in the server config::

    c.GpuShare.pools = [{
        "name": "small",                       # unique; shown in status and REST
        "kernelspec": "gpushare-python",       # which kernelspec the warm kernels run
        "share": {"gpu_request": 0.25, "gpu_limit": 0.5, "gpu_memory": "10GiB"},
        "backend": "local",                    # optional: the kernelspec's / server's default
        "size": 2,                             # warm kernels kept ready
        "schedule": [                          # optional: other sizes at other times
            {"days": "mon-fri", "hours": "08:00-18:00", "size": 4},
        ],
    }]

A kernel start whose kernelspec and *resolved* share (server default < kernelspec config < the
user's choice) equal a profile's is handed one of its warm kernels. Every refusal names the pool,
the key, the value and what is allowed, so a bad config stops the server with a clear message.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from traitlets import TraitError

from .. import backends
from ..share import SHARE_FIELDS, ShareError, ShareSpec

#: Most warm kernels one pool may keep (each holds a real share and a process).
MAX_POOL_SIZE = 64
PROFILE_KEYS = ("name", "kernelspec", "share", "backend", "size", "schedule")
WINDOW_KEYS = ("days", "hours", "size")
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class PoolConfigError(TraitError, ValueError):
    """A pool declaration that cannot be used; the message says which pool and key, and why.
    A :class:`TraitError`, so that a server refuses to start with "Bad config encountered"."""


@dataclass(frozen=True)
class ScheduleWindow:
    """``size`` warm kernels on ``days`` (weekday numbers, Monday 0) between ``start`` and
    ``end`` minutes after midnight, local time (``end`` may be past midnight: ``22:00-06:00``)."""

    days: frozenset[int]
    start: int
    end: int
    size: int

    def covers(self, when: _dt.datetime) -> bool:
        minute = when.hour * 60 + when.minute
        if self.start <= self.end:
            return when.weekday() in self.days and self.start <= minute < self.end
        if minute >= self.start:  # the evening part of an overnight window
            return when.weekday() in self.days
        return (when.weekday() - 1) % 7 in self.days and minute < self.end


@dataclass(frozen=True)
class PoolProfile:
    """One pool: warm kernels of ``kernelspec`` holding ``share`` (as the admin wrote it; the
    kernel manager resolves it against the kernelspec and server default)."""

    name: str
    kernelspec: str
    share: Mapping[str, Any]
    size: int
    backend: str | None = None
    schedule: tuple[ScheduleWindow, ...] = field(default_factory=tuple)

    def target(self, when: _dt.datetime | None = None) -> int:
        """How many warm kernels to keep at ``when`` (now by default): the first schedule
        window covering it, else ``size``."""
        when = when or _dt.datetime.now()
        for window in self.schedule:
            if window.covers(when):
                return window.size
        return self.size

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kernelspec": self.kernelspec,
            "share": dict(self.share),
            "backend": self.backend,
            "size": self.size,
            "schedule": [
                {
                    "days": sorted(w.days),
                    "hours": f"{_hhmm(w.start)}-{_hhmm(w.end)}",
                    "size": w.size,
                }
                for w in self.schedule
            ],
        }


def parse_pools(value: Sequence[Mapping[str, Any]]) -> list[PoolProfile]:
    """Validate ``c.GpuShare.pools``; raises :class:`PoolConfigError` naming what is wrong."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise PoolConfigError(f"GpuShare.pools must be a list of pool objects, not {value!r}")
    profiles = [parse_profile(i, item) for i, item in enumerate(value)]
    seen: set[str] = set()
    for profile in profiles:
        if profile.name in seen:
            raise PoolConfigError(
                f"GpuShare.pools: two pools are named {profile.name!r}; names must be unique"
            )
        seen.add(profile.name)
    return profiles


def parse_profile(index: int, item: Mapping[str, Any]) -> PoolProfile:
    where = f"GpuShare.pools[{index}]"
    if not isinstance(item, Mapping):
        raise PoolConfigError(f"{where} must be an object with keys {', '.join(PROFILE_KEYS)}")
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise PoolConfigError(f"{where}.name: {name!r} is not a name (a non-empty string)")
    where = f"pool {name!r} ({where})"
    unknown = sorted(set(item) - set(PROFILE_KEYS))
    if unknown:
        raise PoolConfigError(
            f"{where}: unknown key {unknown[0]!r}; known keys are " + ", ".join(PROFILE_KEYS)
        )
    kernelspec = item.get("kernelspec")
    if not isinstance(kernelspec, str) or not kernelspec:
        raise PoolConfigError(f"{where}.kernelspec: {kernelspec!r} is not a kernelspec name")
    backend = item.get("backend")
    if backend is not None and backend not in backends.names():
        raise PoolConfigError(f"{where}.backend: {backend!r}; allowed: {backends.allowed()}")
    return PoolProfile(
        name=name,
        kernelspec=kernelspec,
        share=_parse_share(where, item.get("share") or {}),
        size=_parse_size(f"{where}.size", item.get("size", 1)),
        backend=backend,
        schedule=tuple(
            _parse_window(f"{where}.schedule[{i}]", w)
            for i, w in enumerate(item.get("schedule") or ())
        ),
    )


def _parse_share(where: str, share: Any) -> dict[str, Any]:
    if not isinstance(share, Mapping):
        raise PoolConfigError(
            f"{where}.share must be an object of share keys "
            f"({', '.join(SHARE_FIELDS)}), not {share!r}"
        )
    try:
        ShareSpec.from_mapping(share)  # the field-by-field check, refusals named
    except ShareError as exc:
        raise PoolConfigError(
            f"{where}.share.{exc.field}: {exc.value!r} is not allowed (allowed: {exc.allowed})"
        ) from None
    return dict(share)


def _parse_size(where: str, size: Any) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_POOL_SIZE:
        raise PoolConfigError(
            f"{where}: {size!r}; allowed: a whole number from 0 to {MAX_POOL_SIZE}"
        )
    return size


def _parse_window(where: str, window: Any) -> ScheduleWindow:
    if not isinstance(window, Mapping):
        raise PoolConfigError(f"{where} must be an object with keys {', '.join(WINDOW_KEYS)}")
    unknown = sorted(set(window) - set(WINDOW_KEYS))
    if unknown:
        raise PoolConfigError(
            f"{where}: unknown key {unknown[0]!r}; known keys are " + ", ".join(WINDOW_KEYS)
        )
    if "size" not in window:
        raise PoolConfigError(f"{where}.size is missing (warm kernels in this window)")
    start, end = _parse_hours(f"{where}.hours", window.get("hours", "00:00-24:00"))
    return ScheduleWindow(
        days=_parse_days(f"{where}.days", window.get("days", "mon-sun")),
        start=start,
        end=end,
        size=_parse_size(f"{where}.size", window["size"]),
    )


def _parse_days(where: str, days: Any) -> frozenset[int]:
    """``"mon-fri"``, ``"sat,sun"``, ``"mon-wed,fri"`` or a list of day names."""
    parts = days if isinstance(days, (list, tuple)) else str(days).split(",")
    chosen: set[int] = set()
    for part in parts:
        first, _, last = str(part).strip().lower().partition("-")
        if first not in _DAYS or (last and last not in _DAYS):
            raise PoolConfigError(
                f"{where}: {days!r}; allowed: day names {', '.join(_DAYS)} "
                "and ranges such as 'mon-fri', separated by commas"
            )
        lo, hi = _DAYS.index(first), _DAYS.index(last or first)
        chosen.update(range(lo, hi + 1) if lo <= hi else [*range(lo, 7), *range(0, hi + 1)])
    return frozenset(chosen)


def _parse_hours(where: str, hours: Any) -> tuple[int, int]:
    """``"08:00-18:00"`` -> minutes after midnight (``24:00`` allowed as an end)."""
    try:
        first, last = str(hours).split("-")
        start, end = _minutes(first), _minutes(last)
    except ValueError:
        raise PoolConfigError(
            f"{where}: {hours!r}; allowed: 'HH:MM-HH:MM', e.g. '08:00-18:00'"
        ) from None
    if start == end or start >= 24 * 60:
        raise PoolConfigError(f"{where}: {hours!r} is an empty window")
    return start, end


def _minutes(text: str) -> int:
    hh, mm = text.strip().split(":")
    hours, minutes = int(hh), int(mm)
    if not (0 <= hours <= 24 and 0 <= minutes < 60) or (hours == 24 and minutes):
        raise ValueError(text)
    return hours * 60 + minutes


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"
