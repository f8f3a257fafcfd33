"""The kernel side of the driver check (``notebook/reclaim_notice.py``): what the node agent's
``status`` says it did to this kernel's share is printed before the next cell, once per event.

The agent's reply is a stub here (a dict as ``DaemonClient.status`` returns it): the agent's own
side, with real users, is ``tests/test_driver_check_attacks.py``.
"""

from __future__ import annotations

import time
from typing import Any

from jupyter_gpushare.notebook.reclaim_notice import ReclaimNotice


class Reply:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def status(self, allocation: str) -> dict[str, Any]:
        check = {"events": list(self.events), "paused_on": []} if self.events else None
        return {"ok": True, "allocations": [{"id": allocation, "driver_check": check}]}


def event(when: float, action: str = "paused", **extra: Any) -> dict[str, Any]:
    return {
        "time": when,
        "gpu": "GPU-1",
        "cause": "over_limit",
        "action": action,
        "pids": [123],
        "reason": "it ran 99% of the GPU's time over the last seconds, over its limit of 30%",
        **extra,
    }


def test_each_event_is_printed_once_with_its_reason() -> None:
    notice = ReclaimNotice("a-1", "/nonexistent")
    reply = Reply()
    notice._client = reply  # type: ignore[assignment]
    assert notice.check() is None
    now = time.time()
    reply.events.append(event(now, paused_s=2.0))
    text = notice.check()
    assert text is not None
    assert "paused process(es) 123 of this GPU share for 2.0 s" in text
    assert "over its limit of 30%" in text
    assert notice.check() is None  # shown once
    reply.events.append(event(now + 1, action="stopped", cause="memory"))
    text = notice.check()
    assert text is not None and "stopped process(es) 123" in text and text.count("\n") == 0


def test_an_old_event_is_not_shown_to_a_new_kernel() -> None:
    reply = Reply()
    reply.events.append(event(time.time() - 3600))
    notice = ReclaimNotice("a-1", "/nonexistent")
    notice._client = reply  # type: ignore[assignment]
    assert notice.check() is None
