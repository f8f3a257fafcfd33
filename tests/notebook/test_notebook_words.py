"""What the notebook side says, without a kernel: the import users try for the panel, where a
share's waits come from, and ``%gpushare status`` lines that wrap between words."""

from __future__ import annotations

import subprocess
import sys

from jupyter_gpushare.notebook import actions
from jupyter_gpushare.notebook.magics import WIDTH, _status_text

UUID = "GPU-5f3c2a1e-9b8d-4c7e-a6f5-0123456789ab"
ACTIVE = {
    "state": "active",
    "simulated": True,
    "allocation_id": "a-0123456789abcdef",
    "allocation": {
        "request": 0.25,
        "limit": 0.5,
        "achieved_share": 0.5,
        "memory_used": 0,
        "memory_cap": 10 << 30,
        "lease_wait_seconds": 7.693,
        "lease_waits": 360,
    },
    "gpu": {"type": "A100", "uuid": UUID, "kernels": 1, "nvml": {"utilization_gpu": 50}},
    "daemon": {"window_ms": 1000},
}


def test_panel_from_the_notebook_package_is_callable() -> None:
    """``from jupyter_gpushare.notebook import panel; panel()`` (issue 24, item 12): the module
    it imports makes the panel as ``jupyter_gpushare.panel()`` does (it raised "'module' object
    is not callable")."""
    code = (
        "from jupyter_gpushare.notebook import panel\n"
        "import jupyter_gpushare.notebook.panel as module\n"
        "calls = []\n"
        "module.GpuPanel = lambda interval: type('P', (), {'start': lambda self: calls.append("
        "interval) or 'panel'})()\n"
        "print(panel(), panel(2.0), calls, callable(panel))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.split() == ["panel", "panel", "[1.0,", "2.0]", "True"]


def test_waits_say_whether_they_come_from_the_limit_or_from_other_shares() -> None:
    """Item 9: "waited for its turn" next to "1 share on this GPU" read as contention."""
    alone = actions.wait_cause({"limit": 0.5}, 1)
    assert "its own limit (50 %)" in alone and "no other share" in alone
    assert "other shares' turns (2 other shares)" in actions.wait_cause({"limit": 1.0}, 3)
    both = actions.wait_cause({"limit": 0.5}, 2)
    assert "own limit (50 %)" in both and "other shares" in both
    text = _status_text(ACTIVE)
    assert "from its own limit (50 %)" in " ".join(text.split())


def test_status_lines_wrap_between_words() -> None:
    """Item 10: long lines of ``%gpushare status`` broke mid-word in an output area ("ru /
    nning", a UUID split): each line now fits WIDTH and breaks only between words."""
    released = {
        "state": "released",
        "simulated": True,
        "released": {
            "id": "a-0123456789abcdef",
            "gpu_request": 0.25,
            "gpu_limit": 0.5,
            "gpu_type": "A100",
            "gpu_memory": 10 << 30,
            "gpus": [UUID],
        },
        "message": "It was released from outside this kernel. " + actions.RELEASED_MESSAGE,
    }
    for status in (ACTIVE, released):
        text = _status_text(status)
        lines = text.splitlines()
        assert all(len(line) <= WIDTH for line in lines), text
        assert any(UUID in word for word in text.split()), text  # never split
        for line in lines[1:]:
            assert line.startswith("  "), text  # continuations are indented under the text
    joined = " ".join(_status_text(released).split())
    assert " ".join(released["message"].split()) in joined  # every word, none cut
