"""The live GPU panel: ``jupyter_gpushare.panel()`` (DEVELOPING.md, box 9).

An ipywidgets ``VBox`` showing this kernel's share (GPU type and UUID, request / limit, achieved
share over the daemon's window, memory used / cap, time spent waiting for its turn on the GPU),
its GPU (NVML utilisation, memory, temperature, power, how many shares it holds), a history plot
of the last minutes (an SVG drawn here, with axes and a legend: no plotting library in the
kernel), a "simulated GPU" label when it is one, and a Release button with a confirmation step
(gone once the share is released).

Units: compute is a share of the GPU in percent, written by :func:`~jupyter_gpushare.share.
format_share` ("49 %") like every other view. Colours are JupyterLab's CSS variables (with
fallbacks for other front ends), so the panel reads well in light and dark themes.

Updates come from a daemon thread about once a second, so they keep flowing while another cell
runs (an asyncio task would go silent during a blocking cell); each round's changes are batched
with ``hold_sync()``; the thread only sets widget traits (never writes to an ``Output`` widget).
When the kernel holds no share or the daemon is unreachable, the panel says so and keeps trying.
"""

from __future__ import annotations

import html
import sys
import threading
import time
import types
import weakref
from collections import deque
from typing import Any

import ipywidgets as widgets

from ..share import format_bytes, format_share
from . import actions

#: Seconds between two updates.
INTERVAL = 1.0
#: Seconds of history in the plot.
HISTORY_SECONDS = 300

#: JupyterLab theme variables the panel draws with (fallbacks: JupyterLab's light theme)
FG = "var(--jp-ui-font-color1, rgba(0,0,0,.87))"
FG_DIM = "var(--jp-ui-font-color2, rgba(0,0,0,.54))"
BORDER = "var(--jp-border-color2, #e0e0e0)"
#: the plot's series: (data-series name, colour, dash pattern, legend text)
SERIES = (
    ("share", "var(--jp-brand-color1, #1976d2)", "", "achieved share"),
    ("memory", "var(--jp-success-color1, #388e3c)", "", "memory used / cap"),
    ("request", "var(--jp-info-color1, #0097a7)", "6,3", "request"),
    ("limit", "var(--jp-error-color1, #d32f2f)", "2,3", "limit"),
)

_STYLE = f"""<style>
.gpushare-panel {{ color: {FG}; }}
.gpushare-panel table {{ border-collapse: collapse; font-size: 12px; color: {FG}; }}
.gpushare-panel td {{ padding: 1px 10px 1px 0; vertical-align: top; }}
.gpushare-panel td.k {{ color: {FG_DIM}; }}
.gpushare-sim {{ border: 1px solid var(--jp-warn-color1, #f57c00); color: {FG};
                border-radius: 3px; padding: 0 5px; font-size: 11px; font-weight: bold;
                margin-left: 6px; }}
.gpushare-msg {{ font-size: 12px; color: {FG}; }}
.gpushare-note {{ border-left: 3px solid var(--jp-warn-color1, #f57c00); padding-left: 4px; }}
.gpushare-legend {{ font-size: 11px; color: {FG_DIM}; }}
.gpushare-legend span {{ margin-right: 10px; white-space: nowrap; }}
.gpushare-panel code {{ font-family: var(--jp-code-font-family, monospace); }}
.gpushare-confirm-text {{ font-size: 12px; max-width: 560px; color: {FG}; }}
</style>"""


def _cell(field: str, value: str) -> str:
    return f'<td data-field="{field}">{html.escape(value)}</td>'


def _row(label: str, *cells: str) -> str:
    return f'<tr><td class="k">{html.escape(label)}</td>{"".join(cells)}</tr>'


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


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

    rows: list[tuple[Any, ...]] = [
        ("GPU", ("gpu_type", kind), ("gpu_uuid", uuid)),
        (
            "request / limit",
            ("request", format_share(a["request"])),
            ("limit", format_share(a["limit"])),
        ),
        (
            "achieved share",
            ("achieved_share", format_share(a.get("achieved_share"))),
            ("window", f"over the last {window:g} s"),
        ),
        (
            "memory used / cap",
            ("memory_used", size(a.get("memory_used") or 0)),
            ("memory_cap", size(a.get("memory_cap") or 0)),
        ),
        (
            "waited for its turn on the GPU",
            ("lease_wait_seconds", f"{float(a.get('lease_wait_seconds') or 0):.3f} s"),
            ("lease_waits", _plural(int(a.get("lease_waits") or 0), "time")),
        ),
        ("waits come from", ("wait_cause", actions.wait_cause(a, int(g.get("kernels") or 0)))),
        (
            "GPU busy (all shares)",
            ("gpu_utilization", maybe(nvml.get("utilization_gpu"), "{} %")),
            ("kernels", _plural(int(g.get("kernels") or 0), "share") + " on this GPU"),
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
    height: int = 96,
    span: float = HISTORY_SECONDS,
) -> str:
    """An SVG plot of ``(t, share, memory fraction)`` points over the last ``span`` seconds, with
    a y axis in percent (0, 50, 100 %), an x axis in time before now, and below it a legend of
    the four series: achieved share and memory used / cap (solid), request and limit (dashed)."""
    if not points:
        return ""
    now = points[-1][0]
    span = min(span, max(60.0, now - points[0][0]))  # fill the width while history is short
    left, bottom, top, right = 36, 20, 8, 8
    inner_w, inner_h = width - left - right, height - top - bottom

    def x_of(t: float) -> float:
        return left + inner_w * (1 - (now - t) / span)

    def y_of(v: float) -> float:
        return top + inner_h * (1 - max(0.0, min(1.0, v)))

    def text(x: float, y: float, label: str, anchor: str) -> str:
        return (
            f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" '
            f'style="fill:{FG_DIM};font-size:10px">{html.escape(label)}</text>'
        )

    axes = []
    for v in (0.0, 0.5, 1.0):  # y axis: gridlines and their scale
        y = y_of(v)
        axes.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" '
            f'style="stroke:{BORDER};stroke-width:1"/>'
        )
        axes.append(text(left - 4, y + 3.5, format_share(v), "end"))
    for frac in (0.0, 0.5, 1.0):  # x axis: time before now
        x = left + inner_w * frac
        ago = span * (1 - frac)
        label = "now" if ago == 0 else f"−{_span_text(ago)}"
        anchor = "start" if frac == 0 else ("end" if frac == 1 else "middle")
        axes.append(text(x, height - 3, label, anchor))
    axes.append(
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + inner_h}" '
        f'style="stroke:{FG_DIM};stroke-width:1"/>'
    )
    series = []
    for name, colour, dash, _label in SERIES:
        style = f"fill:none;stroke:{colour};stroke-width:1.5"
        if dash:
            style += f";stroke-dasharray:{dash}"
        if name in ("request", "limit"):
            y = y_of(request if name == "request" else limit)
            series.append(
                f'<line data-series="{name}" x1="{left}" x2="{width - right}" '
                f'y1="{y:.1f}" y2="{y:.1f}" style="{style}"/>'
            )
        else:
            column = 1 if name == "share" else 2
            line = " ".join(f"{x_of(p[0]):.1f},{y_of(p[column]):.1f}" for p in points)
            series.append(f'<polyline data-series="{name}" points="{line}" style="{style}"/>')
    legend = "".join(
        f'<span><svg width="18" height="8" aria-hidden="true"><line x1="0" x2="18" y1="4" '
        f'y2="4" style="stroke:{colour};stroke-width:2'
        + (f";stroke-dasharray:{dash}" if dash else "")
        + f'"/></svg> {html.escape(label)}</span>'
        for _name, colour, dash, label in SERIES
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="achieved share and memory over the last {_span_text(span)}" '
        f'style="background:transparent;border:1px solid {BORDER}">'
        f"{''.join(axes)}{''.join(series)}</svg>"
        f'<div class="gpushare-legend">{legend}</div>'
    )


def released_text(status: dict[str, Any]) -> str:
    """The panel's words (HTML) for a released share: what was released, the memory freed (said
    once), and what the kernel can do now."""
    freed = status.get("memory_freed")
    gone = f"{format_bytes(freed)} of GPU memory freed." if freed else "Its GPU memory is freed."
    outside = (status.get("message") or "").startswith("It was released from outside")
    how = " from outside this kernel" if outside else ""
    return (
        f"Released {html.escape(actions.describe(status['released']))}{how}. {gone} "
        + html.escape(actions.AFTER_RELEASE).replace(
            "%gpushare request", "<code>%gpushare request</code>"
        )
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
        self.release_button = widgets.Button(  # the theme's own button colours: readable
            description="Release",
            icon="eject",
            tooltip="Give this kernel's GPU back",
        )
        self.confirm_button = widgets.Button(description="Yes, release", button_style="danger")
        self.cancel_button = widgets.Button(description="Cancel")
        self.confirm_text = widgets.HTML(
            '<div class="gpushare-confirm-text">Release the GPU? Its memory is freed and other '
            "kernels can use it; this kernel keeps running but cannot use a GPU again until it "
            "is restarted.</div>"
        )
        # the question above its two buttons (side by side, the text wrapped around them)
        self.confirm = widgets.VBox(
            [self.confirm_text, widgets.HBox([self.confirm_button, self.cancel_button])]
        )
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
                usable = status["state"] in ("active", "unenforced", "unreachable")
                self.release_button.disabled = status["state"] not in ("active", "unenforced")
                # nothing to release (never had a share, or released it): no button at all
                self.release_button.layout.display = None if usable else "none"
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
                    ' <span class="gpushare-msg gpushare-note" data-field="reclaim_warning">'
                    f"{html.escape(str(a['reclaim_warning'].get('message')))}</span>"
                )
            return title, share_table(status), plot, msg
        if state == "released":
            text = released_text(status)
        else:
            text = html.escape(status.get("message") or state)
        if self.note:
            text += " " + html.escape(self.note)
        if state == "released" and status.get("reserved"):
            text += (
                " Reserved for the restart: "
                + html.escape(actions.describe(status["reserved"]))
                + "."
            )
        note = " gpushare-note" if state == "unreachable" else ""
        msg = (
            f'<b class="gpushare-msg" data-field="state">{state}</b> '
            f'<span class="gpushare-msg{note}">· {text} (checked {stamp})</span>'
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


class _CallableModule(types.ModuleType):
    """This module, callable: ``from jupyter_gpushare.notebook import panel; panel()`` imports
    the module (``jupyter_gpushare.notebook.panel``), and calling it makes the panel as
    ``jupyter_gpushare.panel()`` does."""

    def __call__(self, interval: float = INTERVAL) -> GpuPanel:
        return panel(interval)


sys.modules[__name__].__class__ = _CallableModule
