"""One default-limit rule (issue 24, item 11): without a limit, a share's limit is the larger of
its request and the default share's limit. ``run --help`` states it with the figures the share
validator gives; the Lab picker applies and states the same rule (tests/lab/test_share_flow.py)."""

from __future__ import annotations

import subprocess
import sys

from jupyter_gpushare.share import ShareSpec


def test_run_help_states_the_rule_the_share_follows() -> None:
    for request, limit in ((0.3, 0.5), (0.75, 0.75)):
        assert ShareSpec.from_mapping({"gpu_request": request}).gpu_limit == limit
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    text = " ".join(out.split())
    assert "the larger of the request and the default share's limit, 0.5" in text, text
    assert "--gpu-request 0.3 gets limit 0.5, --gpu-request 0.75 gets 0.75" in text, text
