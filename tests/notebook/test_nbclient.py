"""A notebook executed by nbclient on a gpushare kernelspec with no Jupyter server anywhere: the
provisioner starts the node agent itself, the simulator's state directory is there on a fresh
machine, the magics and the panel reach the agent, ``release()`` frees the share and the kernel
lives on."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

from jupyter_gpushare.daemon.client import DaemonClient

#: The driver: nbclient in a process of its own (the provisioner reads GPUSHARE_* from the
#: environment, as it does under papermill or ``jupyter execute``). After each cell it records
#: which allocations the ledger holds, so the test sees the release happen mid-notebook.
DRIVER = r'''
import asyncio, json, os, sys
import nbformat
from nbclient import NotebookClient
from jupyter_gpushare.ledger.sqlite import SQLiteLedger

CELLS = [
    "import os; print('ALLOC', os.environ['GPUSHARE_ALLOCATION_ID'])",
    "%gpushare status",
    """
import time, jupyter_gpushare
p = jupyter_gpushare.panel()
deadline = time.monotonic() + 20
while not p.last_status and time.monotonic() < deadline:
    time.sleep(0.05)
print("PANEL", p.last_status.get("state"), p.last_status.get("allocation_id"))
""",
    """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
print("CUDA", cu.cuInit(0), cu.cuDeviceGet(ctypes.byref(dev), 0),
      cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))
""",
    "import jupyter_gpushare; print('RELEASED', jupyter_gpushare.release()['released']['id'])",
    "print(1+1)",
]
nb = nbformat.v4.new_notebook()
nb.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
seen = []

async def after_cell(cell, cell_index, execute_reply):
    ledger = SQLiteLedger(os.environ["GPUSHARE_LEDGER"])
    try:
        seen.append([a.id for a in await ledger.list()])
    finally:
        await ledger.close()

client = NotebookClient(nb, kernel_name="gpushare-python", timeout=120, startup_timeout=120,
                        on_cell_executed=after_cell)
client.execute()
outputs = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
print(json.dumps({"outputs": outputs, "ledger": seen}))
'''


def test_nbclient_without_a_server_reaches_the_agent_and_releases(gpushare_env, tmp_path):
    # a fresh machine: not even the runtime directory of the agent's socket (and the
    # simulator's state next to it) exists yet (the fixture's teardown stops this socket's agent)
    socket = Path(gpushare_env["GPUSHARE_SOCKET"]).parent / "fresh" / "gpushare" / "daemon.sock"
    gpushare_env["GPUSHARE_SOCKET"] = str(socket)
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    assert not socket.parent.exists()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run(
        [sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=240
    )
    log = socket.parent / "daemon.log"
    assert done.returncode == 0, (
        done.stderr[-3000:],
        log.read_text()[-3000:] if log.exists() else "no agent log",
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    allocation_line, status, panel, cuda, released, last = result["outputs"]
    allocation = allocation_line.split()[1]

    assert "GPU share: active [simulated GPU]" in status and allocation in status, status
    assert "unreachable" not in status
    assert panel.split() == ["PANEL", "active", allocation]  # the panel reaches the agent too
    assert cuda.split() == ["CUDA", "0", "0", "0", "0"], cuda  # no 304: the state dir exists
    assert released.split() == ["RELEASED", allocation]
    assert last.strip() == "2"  # the kernel lives on after its release

    ledger = result["ledger"]
    assert allocation in ledger[0] and allocation in ledger[3]  # held while the cells ran
    assert allocation not in ledger[4] and allocation not in ledger[5]  # freed by release()
    assert DaemonClient(socket).alive()  # the agent the provisioner started outlives nbclient
    assert stat.S_IMODE(socket.parent.stat().st_mode) == 0o700  # with the simulator's state
    assert (socket.parent / "sim.state").exists()
