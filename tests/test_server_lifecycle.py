"""The server's own lifecycle with gpushare: a refused share leaves nothing behind that stops the
server from stopping (issue 13)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest
from support import wait_for

from jupyter_gpushare.ledger.sqlite import SQLiteLedger


@pytest.mark.parametrize(
    "manager",
    [
        "jupyter_gpushare.pools.PoolKernelManager",  # ours (``jupyter gpushare lab``)
        "jupyter_server.services.kernels.kernelmanager.AsyncMappingKernelManager",  # plain server
    ],
)
def test_a_refused_start_then_sigterm_stops_the_server_quickly(jupyter_server, manager):
    server = jupyter_server("1xA100", f"--ServerApp.kernel_manager_class={manager}")
    whole = server.start_kernel("gpushare-python-whole")
    refused = server.post("/api/kernels", {"name": "gpushare-python-whole"})
    assert refused.status_code == 409, refused.text
    # nothing of the refused start is left: one kernel, one allocation
    assert [k["id"] for k in server.get("/api/kernels").json()] == [whole["id"]]
    wait_for(lambda: len(server.allocations()) == 1)
    assert server.proc is not None
    began = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(5)  # the promise (it takes ~0.7 s on a loaded 2-core machine)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not stop on SIGTERM:\n{server.log()}") from None
    took = time.monotonic() - began
    print(f"{manager}: stopped {took:.2f} s after SIGTERM")
    assert took < 5, took
    log = server.log()
    assert "Kernel does not exist" not in log, log
    assert "Task was destroyed but it is pending" not in log, log
    # its kernel was shut down and its share released on the way out
    ledger = SQLiteLedger(server.env["GPUSHARE_LEDGER"])
    assert asyncio.run(ledger.list()) == []
