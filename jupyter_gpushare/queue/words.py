"""Position and ETA in the user's words. Pure (the wall clock is given)."""

from __future__ import annotations

import time

from .eta import Eta


def ordinal(n: int) -> str:
    """``1`` -> ``'1st'``, ``2`` -> ``'2nd'``, ``11`` -> ``'11th'``, ``23`` -> ``'23rd'``."""
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def duration(seconds: float) -> str:
    """``42`` -> ``'42 s'``, ``250`` -> ``'4 min'``, ``5400`` -> ``'1.5 h'``."""
    if seconds < 90:
        return f"{max(0, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def span(lo: float, hi: float) -> str:
    """A range in one unit where it can: ``'4–12 min'``."""
    a, b = duration(lo), duration(hi)
    unit_a, unit_b = a.split(" ")[1], b.split(" ")[1]
    if unit_a == unit_b:
        if a == b:
            return b
        return f"{a.split(' ')[0]}–{b}"
    return f"{a}–{b}"


def clock(at: float) -> str:
    return time.strftime("%H:%M", time.localtime(at))


def describe(position: int, what: str, eta: Eta | None) -> str:
    """``'3rd in line for 0.5 of an A100; expected within 4–12 min (2 idle shares are reclaimed
    by 14:32)'``. ``what``: the share in words (``ShareSpec.describe``)."""
    text = f"{ordinal(position)} in line for {what}"
    if eta is None or eta.hi is None:
        return text + "; no estimate yet (no release seen lately and no idle share due for reclaim)"
    if eta.lo is None:
        text += f"; expected by {clock(eta.now + eta.hi)}"
    else:
        text += f"; expected within {span(eta.lo, eta.hi)}"
    if eta.by is not None:
        n = eta.reclaims
        text += (
            f" ({n} idle share{'s are' if n != 1 else ' is'} reclaimed by "
            f"{clock(eta.now + eta.by)})"
        )
    elif eta.basis:
        text += f" ({eta.basis[0]})"
    return text
