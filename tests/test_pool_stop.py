"""A server that stops while a pool kernel starts leaves nothing behind (issue 13): the share
released, the kernel process gone, no connection file or zmq socket open, nothing pending in
jupyter_client's kernel map; and the reconciler frees a ``pool`` record in ``reserved`` state
whose start was abandoned, while its server lives."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.kernelspec import KernelSpecManager

from jupyter_gpushare.config import GpuShare
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import allocate
from jupyter_gpushare.pools.kernel_manager import PoolKernelManager
from jupyter_gpushare.provisioner.local import LocalKernelBackend
from jupyter_gpushare.serverext import Reconciler
from jupyter_gpushare.share import ShareSpec

SMALL = {"gpu_request": 0.25, "gpu_limit": 0.5}


@pytest.fixture
async def pool_km(
    gpushare_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[PoolKernelManager]:
    """In-process: a PoolKernelManager with one pool of one warm kernel (real kernels, real
    ledger; enforcement off, so no daemon)."""
    for key, value in gpushare_env.items():
        monkeypatch.setenv(key, value)
    GpuShare.clear_instance()
    GpuShare.instance(
        simulate="1xA100",
        enforce=False,
        pools=[{"name": "warm", "kernelspec": "gpushare-python", "share": SMALL, "size": 1}],
    )
    km = PoolKernelManager(root_dir=str(tmp_path), kernel_spec_manager=KernelSpecManager())
    yield km
    await km.shutdown_all(now=True)
    GpuShare.clear_instance()


async def _held(owner: str | None = None) -> list[Allocation]:
    return [
        a
        for a in await GpuShare.instance().local_ledger().list()
        if owner is None or a.owner == owner
    ]


async def _until(predicate: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


def _kernel_processes(connection_dir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "ipykernel_launcher" in cmdline and connection_dir in cmdline:
            found.append(proc)
    return found


def _connection_files(connection_dir: str) -> list[Path]:
    return list(Path(connection_dir).glob("kernel-*.json"))


async def _nothing_left(km: PoolKernelManager) -> None:
    assert await _held() == []
    assert km._pending_kernels == {}  # what made shutdown_all fail ("Kernel does not exist")
    assert km.list_kernel_ids() == [] and km._managers_starting == {}
    assert _connection_files(km.connection_dir) == []
    gone = await asyncio.to_thread(psutil.wait_procs, _kernel_processes(km.connection_dir), 10)
    assert gone[1] == [], gone


async def test_stop_after_the_share_is_reserved_before_the_launch(pool_km, monkeypatch):
    prepared = asyncio.Event()
    original = LocalKernelBackend.pre_launch
    sockets: list[Any] = []

    async def slow_pre_launch(self: Any, allocation: Allocation, **kwargs: Any) -> Any:
        result = await original(self, allocation, **kwargs)  # connection file written
        sockets.append(self.provisioner.parent)  # the KernelManager
        prepared.set()
        await asyncio.sleep(3600)  # the launch never comes: the server stops first
        return result

    monkeypatch.setattr(LocalKernelBackend, "pre_launch", slow_pre_launch)
    pool_km.pools.start()
    await asyncio.wait_for(prepared.wait(), 60)
    [reserved] = await _held("pool")
    assert reserved.state == "reserved" and reserved.pid is None
    [kernel_id] = pool_km.pools.unclaimed()
    assert kernel_id in pool_km._pending_kernels
    await asyncio.wait_for(pool_km.shutdown_all(now=True), 30)  # pools.stop() cancels the start
    await _nothing_left(pool_km)
    [manager] = sockets
    assert manager._control_socket is None  # closed
    assert manager.context.closed or not manager._created_context


async def test_stop_while_the_warm_kernel_is_launched_but_not_ready(pool_km, monkeypatch):
    launched = asyncio.Event()
    original = LocalKernelBackend.post_launch

    async def slow_post_launch(self: Any, **kwargs: Any) -> None:
        await original(self, **kwargs)
        launched.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(LocalKernelBackend, "post_launch", slow_post_launch)
    pool_km.pools.start()
    await asyncio.wait_for(launched.wait(), 60)
    [active] = await _held("pool")
    assert active.state == "active" and active.pid
    await asyncio.wait_for(pool_km.shutdown_all(now=True), 30)
    await _nothing_left(pool_km)
    assert not psutil.pid_exists(active.pid) or psutil.Process(active.pid).status() == "zombie"


async def test_the_reconciler_frees_an_abandoned_pool_reservation(pool_km):
    settings = GpuShare.instance()
    ledger = settings.local_ledger()
    gpus = await settings.local_gpus()

    async def reserve(kernel_id: str) -> Allocation:
        return await allocate(
            ledger,
            ShareSpec.from_mapping(SMALL),
            gpus,
            settings.policy(),
            owner="pool",
            kernel_id=kernel_id,
            backend="local",
            server_pid=os.getpid(),
            extra={"pool": "warm"},
        )

    abandoned = await reserve(str(uuid.uuid4()))
    starting = str(uuid.uuid4())
    pool_km.pools._starting_ids.add(starting)  # a start under way keeps its reservation
    kept = await reserve(starting)
    reconciler = Reconciler(settings, pool_km, pool_km.log)
    freed = await reconciler.free_abandoned_pool_starts(ledger)
    assert [a.id for a in freed] == [abandoned.id]
    assert [a.id for a in await _held()] == [kept.id]
    pool_km.pools._starting_ids.discard(starting)
    assert [a.id for a in await reconciler.free_abandoned_pool_starts(ledger)] == [kept.id]
