"""What ``jupyter gpushare status`` shows: the GPUs, and per share whose it is, what runs under
it (notebook path or command), its request and limit, and its live use — as rich tables (redrawn
in place by ``--watch``, like nvitop) or as JSON.

:func:`share_rows` and :func:`gpu_rows` are pure (a status document in, rows of text out), so the
wording is tested without a terminal; :func:`render` lays them out with ``rich``.

The status document (``status --json``) is ``{"simulated", "gpus": [GPU usage rows as REST
/gpushare/api/gpus], "allocations": [Allocation JSON + "usage"], "usage_message"?, "message"?}``;
an allocation's ``usage`` is the node agent's live reading (``achieved_share``, ``memory_used``,
…) or null when no agent reported it. A caller sees its own shares; a system agent shows other
users' shares as capacity only (``extra.redacted``).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .share import format_bytes, format_share

#: the columns of the shares table, in order
SHARE_COLUMNS = (
    "share",
    "user",
    "notebook / command",
    "GPU",
    "request",
    "limit",
    "achieved",
    "memory used / cap",
    "state",
)
#: the columns of the GPU table, in order
GPU_COLUMNS = ("GPU", "type", "shares", "reserved", "free", "memory reserved / total")
#: the longest command line a row shows
COMMAND_CHARS = 60


def printable(text: str) -> str:
    """``text`` safe to print on someone's terminal: control characters (escape sequences a
    user could put in a command line or a notebook name that an admin's ``status`` shows)
    written out as ``\\x1b``."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def gpu_label(gpu: Mapping[str, Any], several_nodes: bool) -> str:
    """``0 A100`` (``node:0 A100`` when the status spans several nodes)."""
    where = f"{gpu['node']}:{gpu['index']}" if several_nodes else str(gpu["index"])
    return f"{where} {gpu['type']}"


def what_runs(allocation: Mapping[str, Any]) -> str:
    """The notebook path or the command a share is held for, in the user's words."""
    extra = allocation.get("extra") or {}
    if extra.get("redacted"):
        return "–"
    if allocation.get("owner") == "pool":
        return f"warm pool kernel (pool {extra.get('pool', '?')})"
    if extra.get("notebook"):
        text = str(extra["notebook"])
    elif extra.get("command"):
        text = shlex.join(str(part) for part in extra["command"])
        if len(text) > COMMAND_CHARS:
            text = text[: COMMAND_CHARS - 1] + "…"
    elif allocation.get("kernel_id"):
        text = f"kernel {allocation['kernel_id']}"
    else:
        text = f"{allocation.get('owner', '?')} pid {allocation.get('pid')}"
    if extra.get("claimed_from_pool"):
        text += f" (from pool {extra['claimed_from_pool']})"
    return printable(text)


def share_rows(status: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """One row per share, in :data:`SHARE_COLUMNS` order."""
    gpus = {g["uuid"]: g for g in status.get("gpus") or []}
    several = len({g["node"] for g in gpus.values()}) > 1
    rows: list[tuple[str, ...]] = []
    for a in status.get("allocations") or []:
        extra = a.get("extra") or {}
        usage = a.get("usage") or {}
        on = ", ".join(gpu_label(gpus[u], several) if u in gpus else u for u in a.get("gpus") or [])
        used = usage.get("memory_used")
        memory = (
            f"{'–' if used is None else format_bytes(int(used))} / {format_bytes(a['gpu_memory'])}"
        )
        state = str(a.get("state", ""))
        if extra.get("reclaim_warning"):
            state += ", idle: reclaim warned"
        rows.append(
            (
                str(a["id"]),
                "another user" if extra.get("redacted") else printable(str(a.get("user") or "–")),
                what_runs(a),
                on,
                format_share(a["gpu_request"]),
                format_share(a["gpu_limit"]),
                format_share(usage.get("achieved_share")) if usage else "–",
                memory,
                state,
            )
        )
    return rows


def gpu_rows(status: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """One row per GPU, in :data:`GPU_COLUMNS` order."""
    gpus = status.get("gpus") or []
    several = len({g["node"] for g in gpus}) > 1
    rows: list[tuple[str, ...]] = []
    for g in gpus:
        kind = f"{g['name']} (simulated)" if g.get("simulated") else str(g["name"])
        if not g.get("healthy", True):
            kind += ", unhealthy"
        if g.get("cordoned"):
            kind += ", cordoned"
        rows.append(
            (
                gpu_label(g, several),
                kind,
                str(len(g.get("allocations") or [])),
                format_share(g["allocated_request"]),
                f"{format_share(g['free_request'])}, {format_bytes(g['free_memory'])}",
                f"{format_bytes(g['allocated_memory'])} / {format_bytes(g['memory'])}",
            )
        )
    return rows


def render(status: Mapping[str, Any], watching: float | None = None) -> Any:
    """The status as one rich renderable: a GPU table and a shares table, with what is missing
    said in words. ``watching``: the refresh interval (seconds), shown with the time."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    if status.get("message") and not status.get("gpus"):
        parts.append(Text(str(status["message"]), style="yellow"))
    gpus = Table(title="GPUs", title_justify="left", expand=False)
    for name in GPU_COLUMNS:
        gpus.add_column(name, overflow="fold", justify="right" if name == "shares" else "left")
    for row in gpu_rows(status):
        gpus.add_row(*(Text(cell) for cell in row))  # as written: never console markup
    if status.get("gpus"):
        parts.append(gpus)
    shares = Table(title="Shares", title_justify="left", expand=False)
    for name in SHARE_COLUMNS:
        right = name in ("request", "limit", "achieved")
        shares.add_column(name, overflow="fold", justify="right" if right else "left")
    rows = share_rows(status)
    for row in rows:
        shares.add_row(*(Text(cell) for cell in row))
    parts.append(shares if rows else Text("no shares"))
    if status.get("usage_message") and rows:
        parts.append(Text(f"live use not shown: {status['usage_message']}", style="yellow"))
    if watching is not None:
        parts.append(
            Text(
                f"{time.strftime('%H:%M:%S')} · every {watching:g} s · Ctrl-C to stop",
                style="dim",
            )
        )
    return Group(*parts)


def with_usage(
    status: dict[str, Any], usage: Mapping[str, Mapping[str, Any]], message: str | None
) -> dict[str, Any]:
    """``status`` with each allocation's live ``usage`` (None where none was reported)."""
    allocations: Sequence[Mapping[str, Any]] = status.get("allocations") or []
    out = dict(status)
    out["allocations"] = [{**a, "usage": usage.get(a["id"])} for a in allocations]
    if message:
        out["usage_message"] = message
    return out
