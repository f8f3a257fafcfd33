"""Expected refusals log one line, no traceback (issue 23, item 12): a kernel start the ledger
refuses (jupyter_client logs a failed start with its traceback in each kernel-manager layer),
and a server's background pass that the agent refuses."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpushare.ledger.agent import AgentRefused
from jupyter_gpushare.periodic import PeriodicTask


def test_a_start_refused_by_an_unavailable_ledger_logs_one_line(
    jupyter_server: Any, gpushare_env: dict[str, str], tmp_path: Path
) -> None:
    """jupyter_server's own ``POST /api/kernels`` with a ledger that cannot be read: 503 with
    the reason, and on the server's log one line (it was two tracebacks per start)."""
    from support import wait_for
    from test_ledger_failures import corrupt

    ledger = tmp_path / "ledger.sqlite"
    gpushare_env["GPUSHARE_LEDGER"] = str(ledger)
    server = jupyter_server("1xA100", "--GpuShare.enforce=False")
    corrupt(ledger)
    for _ in range(2):
        refused = server.post("/api/kernels", {"name": "gpushare-python"})
        assert refused.status_code == 503, refused.text
        assert "file is not a database" in refused.text, refused.text

    def said() -> list[str]:
        return [line for line in server.log().splitlines() if "kernel start refused" in line]

    lines = wait_for(lambda: len(said()) >= 2 and said(), timeout=10)
    log = server.log()
    assert len(lines) == 2 and all("503" in line for line in lines), lines
    assert "Traceback" not in log, log[-4000:]


class Refused(PeriodicTask):
    what = "reconciliation"

    def interval(self) -> float:
        return 0.05

    async def run_once(self) -> Any:
        raise AgentRefused("not_permitted", "allocation a-1 belongs to another user")


def test_a_background_pass_the_agent_refuses_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("gpushare-test-periodic")

    async def go() -> None:
        task = Refused(log)
        task.start()
        await asyncio.sleep(0.12)
        await task.stop()

    with caplog.at_level(logging.INFO, logger=log.name):
        asyncio.run(go())
    records = [r for r in caplog.records if r.name == log.name]
    assert records and all(r.exc_info is None for r in records), records
    assert all(r.levelno == logging.WARNING for r in records)
    said = records[0].getMessage()
    assert "reconciliation failed: allocation a-1 belongs to another user" in said, said
