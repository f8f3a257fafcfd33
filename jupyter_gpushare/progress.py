"""How far each kernel start of a Jupyter server has got, for the UI (``GET /gpushare/api/starts``).

A start goes through phases, in this order (some backends skip some):

- ``placing``: the share is being placed and recorded in the ledger;
- ``placed``: it holds a share (``message`` names the GPU);
- ``launching``: the kernel process is being started (locally), or its pod created (Kubernetes);
- ``scheduling``: the kernel pod waits for the Kubernetes scheduler (``message``: the cluster's
  words, e.g. "0/3 nodes are available: …");
- ``pulling``: the pod is on its node, its image is being pulled or its container created
  (``message``: the kubelet's reason and words, e.g. ``ErrImagePull: …``);
- ``starting``: the kernel process runs and is connecting;
- ``ready``: the kernel is up; ``failed``: the start failed (``message``: why).

The provisioner reports the phases (:func:`report`); the server extension answers with the
starts of the last minute (:func:`starts`). One :class:`StartBoard` per server, kept beside its
:class:`~jupyter_gpushare.config.GpuShare` settings; pure data, no I/O.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

#: every phase, in order (the UI shows a step list from it)
PHASES = ("placing", "placed", "launching", "scheduling", "pulling", "starting", "ready")
#: a start that ended (ready or failed) is still listed this long, so a UI that polls sees it
KEEP_S = 60.0
#: at most this many starts are remembered per server (the oldest ended ones go first)
MAX_STARTS = 200
#: at most this many steps are kept per start (a pod that changes often repeats its phase)
MAX_STEPS = 20


@dataclass(frozen=True)
class Start:
    kernel_id: str
    kernel_name: str
    path: str | None
    since: float  # when the start began (time.time())
    updated: float  # when this phase was last reported
    #: the phases seen so far, in order, with their words and times (repeats folded; never
    #: empty: the last is the phase the start is in now)
    steps: tuple[tuple[str, str, float], ...]

    @property
    def phase(self) -> str:
        return self.steps[-1][0]

    @property
    def message(self) -> str:
        return self.steps[-1][1]

    @property
    def ended(self) -> bool:
        return self.phase in ("ready", "failed")

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["steps"] = [{"phase": p, "message": m, "at": t} for p, m, t in self.steps]
        return {**body, "phase": self.phase, "message": self.message, "ended": self.ended}


class StartBoard:
    """The starts of one server, by kernel id."""

    def __init__(self) -> None:
        self._starts: dict[str, Start] = {}

    def report(
        self,
        kernel_id: str,
        phase: str,
        message: str = "",
        kernel_name: str | None = None,
        path: str | None = None,
        now: float | None = None,
    ) -> Start:
        if phase not in PHASES and phase != "failed":
            raise ValueError(f"unknown start phase {phase!r}")
        now = time.time() if now is None else now
        known = self._starts.get(kernel_id)
        if known is None or (known.ended and phase == "placing"):  # a new start (or restart)
            first = ((phase, message, now),)
            start = Start(kernel_id, kernel_name or "", path, now, now, first)
        else:
            steps = known.steps
            if steps and steps[-1][:2] == (phase, message):
                pass  # the same news again (a pod update that changed nothing we show)
            elif steps and steps[-1][0] == phase:
                steps = (*steps[:-1], (phase, message, now))  # new words for the same phase
            else:
                steps = (*steps, (phase, message, now))[-MAX_STEPS:]
            start = replace(
                known,
                updated=now,
                kernel_name=kernel_name or known.kernel_name,
                path=path if path is not None else known.path,
                steps=steps,
            )
        self._starts[kernel_id] = start
        self._forget(now)
        return start

    def starts(self, now: float | None = None) -> list[Start]:
        """The starts under way and those that ended less than :data:`KEEP_S` ago, oldest
        first."""
        now = time.time() if now is None else now
        self._forget(now)
        return sorted(self._starts.values(), key=lambda s: s.since)

    def _forget(self, now: float) -> None:
        for kid in [k for k, s in self._starts.items() if s.ended and now - s.updated > KEEP_S]:
            del self._starts[kid]
        if len(self._starts) > MAX_STARTS:
            oldest = sorted(self._starts.values(), key=lambda s: (not s.ended, s.updated))
            for s in oldest[: len(self._starts) - MAX_STARTS]:
                del self._starts[s.kernel_id]


_BOARDS: weakref.WeakKeyDictionary[Any, StartBoard] = weakref.WeakKeyDictionary()


def board(settings: Any) -> StartBoard:
    """The start board of the server whose settings (``GpuShare``) these are."""
    found = _BOARDS.get(settings)
    if found is None:
        found = _BOARDS[settings] = StartBoard()
    return found


def pod_phase(pod: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """The start phase of a kernel pod and the cluster's words for it, or None when the pod
    says nothing yet (pure; from the pod's ``status``)."""
    if not pod:
        return None
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    if not spec.get("nodeName") and scheduled.get("status") != "True":
        words = scheduled.get("message") or scheduled.get("reason") or ""
        return "scheduling", str(words)
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if "running" in state:
            return "starting", f"running on {spec.get('nodeName', 'its node')}"
        waiting = state.get("waiting")
        if waiting is not None:
            reason = str(waiting.get("reason") or "")
            words = str(waiting.get("message") or "")
            return "pulling", f"{reason}: {words}" if reason and words else reason or words
    return "pulling", f"scheduled on {spec.get('nodeName', 'a node')}"


def report(
    settings: Any, kernel_id: Any, phase: str, message: str = "", **fields: Any
) -> Start | None:
    """Record a phase of kernel ``kernel_id``'s start on its server's board (no kernel id: a
    start outside a server, nothing to show)."""
    if not kernel_id:
        return None
    return board(settings).report(str(kernel_id), phase, message, **fields)


__all__ = ["KEEP_S", "PHASES", "Start", "StartBoard", "board", "pod_phase", "report"]
