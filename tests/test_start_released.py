"""A kernel's share released while the kernel is starting (a user's Release, REST ``DELETE``,
idle reclaim): the start is refused with 409 ``share_released`` naming the share, on every start
path (jupyter_server's ``POST /api/kernels`` and ``/api/sessions``, ours), and nothing of it is
left: no ledger record, no kernel process, no connection file, nothing in the node agent or its
state directory; the server goes on starting kernels.

The release lands at one fixed point, deterministically: a server extension loaded only here
(``HOOK``) holds each start, once its share is placed and its launch prepared, right before the
kernel process is started, until the share is gone from the ledger; the test releases it over
REST (the real release, confirmed by the node agent) while the start waits.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from support import wait_for

from jupyter_gpushare.config import GpuShare
from jupyter_gpushare.daemon import wire
from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.daemon.server import default_state_dir
from jupyter_gpushare.ledger import LedgerUnavailable
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.provisioner import ShareRefused
from jupyter_gpushare.provisioner.local import LocalKernelBackend

HOOK = '''
"""Test hook (tests/test_start_released.py): while the file `hold` exists in $GS_HOOK_DIR, a
gpushare kernel start waits right before its process starts until its share is released."""
import asyncio, json, os, time
from pathlib import Path
from jupyter_gpushare.provisioner.local import LocalKernelBackend

_launch = LocalKernelBackend.launch_kernel
_DIR = Path(os.environ["GS_HOOK_DIR"])


async def launch_kernel(self, cmd, **kwargs):
    if (_DIR / "hold").exists():
        held = self.provisioner.allocation.id
        placed = {"allocation": held, "kernel": self.provisioner.kernel_id}
        (_DIR / "placed.tmp").write_text(json.dumps(placed))
        os.replace(_DIR / "placed.tmp", _DIR / "placed")
        ledger = await self.ledger()
        deadline = time.monotonic() + 60
        while (await ledger.snapshot()).find(held) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    return await _launch(self, cmd, **kwargs)


LocalKernelBackend.launch_kernel = launch_kernel


def _jupyter_server_extension_points():
    return [{"module": __name__}]


def _load_jupyter_server_extension(serverapp):
    pass
'''

SESSION = {"path": "race.ipynb", "name": "race.ipynb", "type": "notebook"}


@pytest.fixture
def server(jupyter_server: Any, gpushare_env: dict[str, str], tmp_path: Path) -> Any:
    (tmp_path / "gs_release_hook.py").write_text(HOOK)
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    gpushare_env["PYTHONPATH"] = f"{tmp_path}:{gpushare_env.get('PYTHONPATH', '')}"
    gpushare_env["GS_HOOK_DIR"] = str(hook_dir)
    srv = jupyter_server("1xA100", "--ServerApp.jpserver_extensions=gs_release_hook=True")
    srv.hook_dir = hook_dir
    return srv


def _kernel_processes(kernel_id: str) -> list[psutil.Process]:
    """Live processes started for ``kernel_id`` (its connection file is on their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(kernel_id in arg for arg in proc.info["cmdline"] or []):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.NoSuchProcess:
                pass
    return found


def _held_slots(server: Any) -> list[str]:
    """The allocations holding a slot of lease memory in the node agent's state directory (in
    /dev/shm or the runtime dir): each GPU's ``.policy`` file, read as the interposer maps it."""
    state = default_state_dir(Path(server.env["GPUSHARE_SOCKET"]))
    held = []
    for policy in state.glob("*.policy"):
        data = policy.read_bytes()
        for i in range(wire.SLOTS):
            slot = wire.Slot.from_buffer_copy(data, wire.HEADER_SIZE + i * wire.SLOT_SIZE)
            if slot.state == wire.STATE_ACTIVE:
                held.append(slot.allocation.decode())
    return held


def _start_released_midway(server: Any, path: str, body: dict[str, Any]) -> None:
    """POST ``body`` to ``path``; release the share while the start waits before its process;
    the start is refused with 409 naming the share and leaves nothing behind."""
    hook: Path = server.hook_dir
    (hook / "placed").unlink(missing_ok=True)
    (hook / "hold").touch()
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(server.post, path, body)
        placed = wait_for(lambda: (hook / "placed").exists() or started.done(), timeout=60)
        assert placed and not started.done(), started.result().text
        held = json.loads((hook / "placed").read_text())
        (hook / "hold").unlink()
        released = server.delete(f"/gpushare/api/allocations/{held['allocation']}")
        assert released.status_code == 204, released.text  # the node agent confirmed it
        response = started.result(timeout=90)

    assert response.status_code == 409, (path, response.text)
    body = response.json()
    message = body["message"]
    assert held["allocation"] in message and "released while this kernel was starting" in message
    assert "start the kernel again" in message
    # jupyter_server's /api/kernels keeps its shape (the code is its reason), ours add fields
    assert body.get("error", body.get("reason")) == "share_released", body
    assert "Traceback" not in response.text

    # nothing of the start is left, as the answer arrives
    assert _kernel_processes(held["kernel"]) == []
    runtime = Path(server.env["JUPYTER_RUNTIME_DIR"])
    assert not (runtime / f"kernel-{held['kernel']}.json").exists()
    assert server.allocations() == []
    assert server.get("/api/kernels").json() == []
    agent = DaemonClient(server.env["GPUSHARE_SOCKET"]).status()  # the agent's own view
    assert [a for a in agent.get("allocations") or [] if a.get("id") == held["allocation"]] == []
    assert _held_slots(server) == []  # no slot of lease memory held for it


def test_a_share_released_while_its_kernel_starts_refuses_the_start_and_leaves_nothing(
    server: Any,
) -> None:
    starts = [
        ("/api/kernels", {"name": "gpushare-python"}),
        ("/api/sessions", {**SESSION, "kernel": {"name": "gpushare-python"}}),
        ("/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.5}}),
    ]
    for path, body in starts:
        _start_released_midway(server, path, body)
    assert server.get("/api/sessions").json() == []

    # the server is healthy: the next start gets a share and a running kernel
    kernel = server.start_kernel("gpushare-python")
    [allocation] = server.allocations()
    assert allocation["kernel_id"] == kernel["id"] and allocation["state"] == "active"
    assert psutil.pid_exists(allocation["pid"])
    DaemonClient(server.env["GPUSHARE_SOCKET"]).refresh()  # the agent reads the ledger now
    # a held share is what the slot check above looks for
    wait_for(lambda: _held_slots(server) == [allocation["id"]], timeout=30)
    client = server.client(kernel["id"])
    assert client.execute("print(6 * 7)").strip() == "42"
    client.close()
    assert server.delete(f"/api/kernels/{kernel['id']}").status_code == 204
    wait_for(lambda: server.allocations() == [], timeout=30)
    ledger = SQLiteLedger(server.env["GPUSHARE_LEDGER"])
    assert asyncio.run(ledger.list()) == []
    log = server.log_text()
    assert "Unhandled error" not in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert log.count("kernel start refused (409 share_released)") == len(starts), log[-4000:]


# -- in process: the provisioner under jupyter_client's kernel manager, no server -----------------


@pytest.fixture
def settings(gpushare_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process's gpushare settings on a simulated A100 (enforcement off: no agent)."""
    for key, value in gpushare_env.items():
        monkeypatch.setenv(key, value)
    GpuShare.clear_instance()
    yield GpuShare.instance(simulate="1xA100", enforce=False)
    GpuShare.clear_instance()


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the kernel processes the local backend starts from now on."""
    pids: list[int] = []
    real = LocalKernelBackend.launch_kernel

    async def launch(self: LocalKernelBackend, cmd: list[str], **kwargs: Any) -> Any:
        info = await real(self, cmd, **kwargs)
        pids.append(self.process.pid)
        return info

    monkeypatch.setattr(LocalKernelBackend, "launch_kernel", launch)
    return pids


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_failed_record_of_the_kernel_process_stops_that_process(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger cannot record the started kernel's process (a full disk): that error is the
    start's answer (503 ``ledger_unavailable``), and the process, its connection file and its
    share are gone with it (before, the process ran on, managed by nobody)."""
    pids = _launches(monkeypatch)

    async def unavailable(self: SQLiteLedger, allocation_id: str, change: Any) -> Any:
        raise LedgerUnavailable(str(self.path), "database or disk is full")

    monkeypatch.setattr(SQLiteLedger, "update", unavailable)
    km = AsyncKernelManager(kernel_name="gpushare-python", kernel_spec_manager=KernelSpecManager())
    with pytest.raises(LedgerUnavailable, match="disk is full"):
        await km.start_kernel()
    [pid] = pids
    assert _gone(pid)
    assert not await asyncio.to_thread(os.path.exists, km.connection_file)
    assert await settings.local_ledger().list() == []


async def test_a_release_seen_while_the_launch_is_prepared_refuses_the_start(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that writes the share while it prepares the launch (the Kubernetes backend
    records the pod's name there) finds it released: 409 ``share_released`` as well, and no
    process was started."""
    pids = _launches(monkeypatch)
    real = LocalKernelBackend.pre_launch

    async def release_first(self: LocalKernelBackend, allocation: Any, **kwargs: Any) -> Any:
        ledger = await self.ledger()
        await ledger.release(allocation.id)  # the user's Release, just before
        await ledger.update(allocation.id, lambda current, _others: current)  # the backend's CAS
        return await real(self, allocation, **kwargs)

    monkeypatch.setattr(LocalKernelBackend, "pre_launch", release_first)
    km = AsyncKernelManager(kernel_name="gpushare-python", kernel_spec_manager=KernelSpecManager())
    with pytest.raises(ShareRefused) as refused:
        await km.start_kernel()
    assert refused.value.status_code == 409 and refused.value.body["error"] == "share_released"
    assert refused.value.body["allocation"] in refused.value.body["message"]
    assert pids == []
    assert await settings.local_ledger().list() == []
