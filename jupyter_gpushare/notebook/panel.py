"""The live GPU panel: ``jupyter_gpushare.panel()`` (box 9 of DESIGN.md).

An ipywidgets ``VBox`` showing this kernel's share (GPU type and UUID, request / limit, achieved
share over the daemon's window, memory used / cap, time spent waiting for leases), its GPU (NVML
utilisation, memory, temperature, power, how many shares it holds), a history plot of the last
minutes (an SVG drawn here: no plotting library in the kernel), a "simulated GPU" label when it
is one, and a Release button with a confirmation step.

Updates come from a daemon thread about once a second, so they keep flowing while another cell
runs (an asyncio task would go silent during a blocking cell); each round's changes are batched
with ``hold_sync()``; the thread only sets widget traits (never writes to an ``Output`` widget).
When the kernel holds no share or the daemon is unreachable, the panel says so and keeps trying.
"""

from __future__ import annotations

import html
import threading
import time
import weakref
from collections import deque
from typing import Any

import ipywidgets as widgets

from ..share import format_bytes
from . import actions

#: Seconds between two updates.
INTERVAL = 1.0
#: Seconds of history in the plot.
HISTORY_SECONDS = 300

_STYLE = """<style>
.gpushare-panel table { border-collapse: collapse; font-size: 12px; }
.gpushare-panel td { padding: 1px 10px 1px 0; vertical-align: top; }
.gpushare-panel td.k { color: #666; }
.gpushare-sim { background: #f4b400; color: #000; border-radius: 3px; padding: 0 5px;
                font-size: 11px; font-weight: bold; margin-left: 6px; }
.gpushare-msg { font-size: 12px; }
</style>"""


def _cell(field: str, value: str) -> str:
    return f'<td data-field="{field}">{html.escape(value)}</td>'


def _row(label: str, *cells: str) -> str:
    return f'<tr><td class="k">{html.escape(label)}</td>{"".join(cells)}</tr>'


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def share_table(status: dict[str, Any]) -> str:
    """The allocation and GPU facts of a :func:`actions.status` answer as an HTML table whose
    cells carry ``data-field`` names (what tests and screenshots read)."""
    a, g = status.get("allocation"), status.get("gpu") or {}
    if not a:
        return ""
    nvml = g.get("nvml") or {}
    uuid = g.get("uuid") or (a["gpus"][0]["gpu"] if a.get("gpus") else "")
    kind = f"{g.get('type') or 'GPU'} ({g.get('name', '')})".replace(" ()", "")
    window = (status.get("daemon") or {}).get("window_ms", 0) / 1000

    def maybe(value: Any, fmt: str = "{}") -> str:
        return "–" if value is None else fmt.format(value)

    def size(value: Any) -> str:
        return "–" if value is None else format_bytes(int(value))

    rows = [
        ("GPU", ("gpu_type", kind), ("gpu_uuid", uuid)),
        ("request / limit", ("request", f"{a['request']:g}"), ("limit", f"{a['limit']:g}")),
        (
            "achieved share",
            ("achieved_share", _pct(a.get("achieved_share"))),
            ("window", f"over the last {window:g} s"),
        ),
        (
            "memory used / cap",
            ("memory_used", size(a.get("memory_used") or 0)),
            ("memory_cap", size(a.get("memory_cap") or 0)),
        ),
        (
            "waiting for leases",
            ("lease_wait_seconds", f"{float(a.get('lease_wait_seconds') or 0):.3f} s"),
            ("lease_waits", f"{a.get('lease_waits', 0)} waits"),
        ),
        (
            "GPU utilisation",
            ("gpu_utilization", maybe(nvml.get("utilization_gpu"), "{}%")),
            ("kernels", f"{g.get('kernels', 0)} share(s) on this GPU"),
        ),
        (
            "GPU memory used / total",
            ("gpu_memory_used", size(nvml.get("memory_used"))),
            ("gpu_memory_total", size(nvml.get("memory_total"))),
        ),
        (
            "temperature / power",
            ("temperature", maybe(nvml.get("temperature_c"), "{} °C")),
            ("power", maybe(nvml.get("power_w"), "{:g} W")),
        ),
    ]
    body = "".join(_row(label, *(_cell(f, v) for f, v in cells)) for label, *cells in rows)
    return f"<table>{body}</table>"


def sparkline(
    points: list[tuple[float, float, float]],
    request: float,
    limit: float,
    width: int = 360,
    height: int = 70,
    span: float = HISTORY_SECONDS,
) -> str:
    """An SVG of ``(t, share, memory fraction)`` points over the last ``span`` seconds: share
    (blue) and memory (green) on 0–1, request and limit as dashed lines."""
    if not points:
        return ""
    now = points[-1][0]
    span = min(span, max(60.0, now - points[0][0]))  # fill the width while history is short

    def xy(t: float, v: float) -> str:
        x = width * (1 - (now - t) / span)
        y = height - 2 - (height - 4) * max(0.0, min(1.0, v))
        return f"{x:.1f},{y:.1f}"

    share = " ".join(xy(t, s) for t, s, _ in points)
    memory = " ".join(xy(t, m) for t, _, m in points)
    lines = "".join(
        f'<line x1="0" x2="{width}" y1="{xy(now, v).split(",")[1]}" '
        f'y2="{xy(now, v).split(",")[1]}" stroke="{c}" stroke-dasharray="3,3"/>'
        for v, c in ((request, "#9ab"), (limit, "#d88"))
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'style="background:#fafafa;border:1px solid #ddd">{lines}'
        f'<polyline fill="none" stroke="#1a73e8" stroke-width="1.5" points="{share}"/>'
        f'<polyline fill="none" stroke="#188038" stroke-width="1.5" points="{memory}"/></svg>'
        f'<div style="font-size:11px;color:#666">last {_span_text(span)}: '
        f'<span style="color:#1a73e8">share</span>, <span style="color:#188038">memory / cap'
        f"</span>, dashed: request / limit</div>"
    )


def _span_text(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


class GpuPanel(widgets.VBox):
    """The panel widget; :func:`panel` makes one and starts its update thread."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.title = widgets.HTML()
        self.info = widgets.HTML()
        self.plot = widgets.HTML()
        self.message = widgets.HTML()
        self.release_button = widgets.Button(
            description="Release",
            button_style="warning",
            icon="eject",
            tooltip="Give this kernel's GPU back",
        )
        self.confirm_button = widgets.Button(description="Yes, release", button_style="danger")
        self.cancel_button = widgets.Button(description="Cancel")
        self.confirm_text = widgets.HTML(
            "Release the GPU? Its memory is freed and other kernels can use it; this kernel "
            "keeps running but cannot use a GPU again until it is restarted."
        )
        self.confirm = widgets.HBox([self.confirm_text, self.confirm_button, self.cancel_button])
        self.confirm.layout.display = "none"
        super().__init__(
            [
                widgets.HTML(_STYLE),
                self.title,
                self.info,
                self.plot,
                self.message,
                widgets.HBox([self.release_button]),
                self.confirm,
            ]
        )
        self.add_class("gpushare-panel")
        self.interval = interval
        self.history: deque[tuple[float, float, float]] = deque(
            maxlen=int(HISTORY_SECONDS / interval) + 1
        )
        self.last_status: dict[str, Any] = {}
        self.updates = 0
        self.note = ""  # the outcome of a failed Release, shown until the next one
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.release_button.on_click(lambda _: self._ask_confirmation(True))
        self.cancel_button.on_click(lambda _: self._ask_confirmation(False))
        self.confirm_button.on_click(lambda _: self.do_release())
        self.refresh()

    # -- updating ------------------------------------------------------------------------------

    def start(self) -> GpuPanel:
        ref = weakref.ref(self)  # the thread must not keep a closed panel alive
        stop = self._stop
        thread = threading.Thread(
            target=_run, args=(ref, stop, self.interval), name="gpushare-panel", daemon=True
        )
        thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        super().close()

    def refresh(self) -> None:
        """Read the status once and show it (one batched sync per widget)."""
        status = actions.status()
        with self._lock:
            self.last_status = status
            self._record(status)
            views = self._render(status)
            with (
                self.title.hold_sync(),
                self.info.hold_sync(),
                self.plot.hold_sync(),
                self.message.hold_sync(),
                self.release_button.hold_sync(),
            ):
                self.title.value, self.info.value, self.plot.value, self.message.value = views
                self.release_button.disabled = status["state"] not in ("active", "unenforced")
            self.updates += 1

    def _record(self, status: dict[str, Any]) -> None:
        a = status.get("allocation")
        if a:
            cap = a.get("memory_cap") or 0
            memory = (a.get("memory_used") or 0) / cap if cap else 0.0
            self.history.append((time.time(), float(a.get("achieved_share") or 0.0), memory))

    def _render(self, status: dict[str, Any]) -> tuple[str, str, str, str]:
        sim = (
            '<span class="gpushare-sim" data-field="simulated">simulated GPU</span>'
            if status.get("simulated")
            else ""
        )
        title = f"<b>GPU share</b>{sim}"
        stamp = time.strftime("%H:%M:%S")
        state = status["state"]
        if state == "active":
            a = status["allocation"]
            plot = sparkline(list(self.history), a["request"], a["limit"])
            msg = (
                f'<span class="gpushare-msg" data-field="state">active</span> '
                f'<span class="gpushare-msg">· {html.escape(status["allocation_id"])} · '
                f"updated {stamp}</span>"
            )
            if a.get("reclaim_warning"):  # idle reclaim (jupyter_gpushare.reclaim)
                msg += (
                    ' <span class="gpushare-msg" data-field="reclaim_warning" '
                    'style="color:#b06000">'
                    f"{html.escape(str(a['reclaim_warning'].get('message')))}</span>"
                )
            return title, share_table(status), plot, msg
        text = html.escape(status.get("message") or state)
        if state == "released":
            freed = status.get("memory_freed")
            gone = f" {format_bytes(freed)} of GPU memory freed." if freed else ""
            text = f"Released {html.escape(actions.describe(status['released']))}.{gone} " + text
        if self.note:
            text += " " + html.escape(self.note)
        if state == "released" and status.get("reserved"):
            text += (
                " Reserved for the restart: "
                + html.escape(actions.describe(status["reserved"]))
                + "."
            )
        color = "#b06000" if state == "unreachable" else "#555"
        msg = (
            f'<span class="gpushare-msg" data-field="state">{state}</span> '
            f'<span class="gpushare-msg" style="color:{color}">{text} '
            f"(checked {stamp})</span>"
        )
        return title, "", "", msg

    # -- Release --------------------------------------------------------------------------------

    def _ask_confirmation(self, show: bool) -> None:
        self.confirm.layout.display = "flex" if show else "none"

    def do_release(self) -> None:
        """What "Yes, release" does: release, then show the outcome."""
        self._ask_confirmation(False)
        try:
            actions.release()
            self.note = ""
        except actions.GpushareError as exc:
            self.note = f"Release failed: {exc}"
        self.refresh()


def _run(ref: weakref.ref[GpuPanel], stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        panel = ref()
        if panel is None:
            return
        try:
            panel.refresh()
        except Exception as exc:  # keep trying; show why
            try:
                panel.message.value = (
                    f'<span class="gpushare-msg" data-field="state">error'
                    f"</span> {html.escape(repr(exc))} (retrying)"
                )
            except Exception:
                return  # the widget is gone (closed comm)
        del panel


def panel(interval: float = INTERVAL) -> GpuPanel:
    """A live panel of this kernel's GPU share; display it (last expression of a cell)."""
    return GpuPanel(interval).start()
