"""A pytest plugin that runs jupyter_server's own tests with gpushare, without editing them.

Loaded with ``-p gpushare_plugin`` (this folder on ``PYTHONPATH``) into a pytest run of the tests
from jupyter_server's sdist (``.ci/setup.d/jupyter_server_tests.sh``); used by
``tests/test_jupyter_server_suite.py``. ``GPUSHARE_JSTESTS_MODE`` selects:

- ``plain``: jupyter_server as it is (the reference run);
- ``gpushare``: every ServerApp loads the gpushare extension, its kernel manager
  ``AsyncMappingKernelManager`` is replaced by :class:`~jupyter_gpushare.pools.PoolKernelManager`
  (a subclass), and every test kernel is a gpushare kernel: the default kernelspec name
  (``python3``, ipykernel's) is a gpushare kernelspec on simulated GPUs
  (``GPUSHARE_JSTESTS_SIMULATE``, default ``4xA100``), with its own ledger and node daemon per
  test;
- ``pool``: as ``gpushare``, plus one warm pool of ``python3`` kernels holding the default share
  (so the tests' kernel starts are warm claims, and each server stops with a pool start under way
  or a warm kernel unclaimed).

A test that sets the synchronous ``MappingKernelManager`` keeps it (PoolKernelManager is async);
its kernels are gpushare kernels all the same.

``GPUSHARE_JSTESTS_REPORT`` names a JSON file the plugin writes at the end: the node ids that
failed or errored (``failed``), how many passed, the "Task was destroyed but it is pending"
messages asyncio logged (``destroyed_pending``), and in ``pool`` mode how many kernel starts got
a warm kernel (``warm_claims``) or found none ready (``cold_starts_with_pools``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ipykernel.kernelspec import get_kernel_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from support import stop_daemons

MODES = ("plain", "gpushare", "pool")
MODE = os.environ.get("GPUSHARE_JSTESTS_MODE", "plain")
if MODE not in MODES:
    raise pytest.UsageError(f"GPUSHARE_JSTESTS_MODE={MODE!r}: allowed are {', '.join(MODES)}")
SIMULATE = os.environ.get("GPUSHARE_JSTESTS_SIMULATE", "4xA100")
#: longest a ``pool`` mode kernel start waits for its server's first warm kernel to be ready
WARM_WAIT_S = 30.0
#: the warm pool of ``pool`` mode: the default kernelspec with the server's default share
POOL = {"name": "jstests", "kernelspec": "python3", "share": {}, "size": 1}


#: what the pools did (pool mode): warm kernels handed out, starts that found none ready
COUNTS = {"warm_claims": 0, "cold_starts_with_pools": 0}


class _DestroyedPending(logging.Handler):
    """Counts asyncio's "Task was destroyed but it is pending!" (a task outlived its loop), and
    a cleanup that ran after its loop ("no running event loop", any logger)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Task was destroyed but it is pending" in message or "no running event loop" in message:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?")
            self.messages.append(f"{message[:300]} (logged during {test})")


class _Report:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.failed: dict[str, str] = {}
        self.passed = 0
        self.seconds: dict[str, float] = {}  # per test file: setup + call + teardown
        self.destroyed = _DestroyedPending()
        # asyncio's and the servers' logs propagate to the root logger
        logging.getLogger().addHandler(self.destroyed)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        where = report.nodeid.split("::")[0]
        self.seconds[where] = self.seconds.get(where, 0.0) + report.duration
        if report.failed:
            self.failed.setdefault(report.nodeid, report.when)
        elif report.passed and report.when == "call":
            self.passed += 1

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.path:
            return
        Path(self.path).write_text(
            json.dumps(
                {
                    "mode": MODE,
                    "failed": sorted(self.failed),
                    "failed_when": self.failed,
                    "passed": self.passed,
                    "destroyed_pending": self.destroyed.messages,
                    **COUNTS,
                    "seconds_by_file": {k: round(v, 1) for k, v in sorted(self.seconds.items())},
                },
                indent=1,
            )
        )


def _swap_in_gpushare() -> None:
    """Every ServerApp: the gpushare extension on, PoolKernelManager as its async kernel
    manager, and in ``pool`` mode one warm pool (config the tests' own config leaves alone)."""
    from jupyter_server.serverapp import ServerApp
    from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
    from traitlets.utils.importstring import import_item

    from jupyter_gpushare.pools import PoolKernelManager

    link = ServerApp.init_server_extensions
    configure = ServerApp.init_configurables

    def init_server_extensions(self: Any) -> None:
        self.jpserver_extensions = {**self.jpserver_extensions, "jupyter_gpushare": True}
        link(self)

    def init_configurables(self: Any) -> None:
        # the configured class, read from the config (reading the trait this early would run its
        # default, which needs the gateway config init_configurables makes first)
        configured = self.config.ServerApp.get("kernel_manager_class")
        if isinstance(configured, str):
            configured = import_item(configured)
        if configured in (None, AsyncMappingKernelManager):
            self.kernel_manager_class = PoolKernelManager
        if MODE == "pool" and "pools" not in self.config.GpuShare:
            self.config.GpuShare.pools = [dict(POOL)]
        configure(self)

    ServerApp.init_server_extensions = init_server_extensions  # type: ignore[method-assign]
    ServerApp.init_configurables = init_configurables  # type: ignore[method-assign]

    from jupyter_gpushare.pools.manager import PoolManager

    claim = PoolManager.claim

    async def counted_claim(self: Any, *args: Any, **kwargs: Any) -> str | None:
        # a test starts its kernel moments after its server: let the server's first warm kernel
        # get ready (the tests that start no kernel never wait; every test's server still stops
        # with a warm kernel unclaimed or starting)
        for _ in range(int(WARM_WAIT_S / 0.05)):
            pools = list(self.pools.values())
            if any(p.ready for p in pools) or any(p.failures for p in pools):
                break
            await asyncio.sleep(0.05)
        kernel_id = await claim(self, *args, **kwargs)
        COUNTS["warm_claims" if kernel_id else "cold_starts_with_pools"] += 1
        return kernel_id

    PoolManager.claim = counted_claim  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(
        _Report(os.environ.get("GPUSHARE_JSTESTS_REPORT")), "gpushare_report"
    )
    if MODE != "plain":
        _swap_in_gpushare()


#: every test's socket directory, for the last sweep at the end of the session
_SOCKET_DIRS: list[Path] = []


def pytest_unconfigure(config: pytest.Config) -> None:
    """A server whose pool start outlived its test may have started an agent after that test's
    teardown: end those too, so that no run leaves agents behind."""
    for folder in _SOCKET_DIRS:
        stop_daemons(str(folder / "daemon.sock"))
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def gpushare_kernels(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """The default kernelspec is a gpushare one; this test's own ledger and daemon socket."""
    if MODE == "plain":
        yield
        return
    kernel_dir: str = request.getfixturevalue("jp_kernel_dir")
    spec = Path(kernel_dir) / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    native = get_kernel_dict()  # ipykernel's own python3 spec, as the tests know it
    native["metadata"] = {
        **native.get("metadata", {}),
        "kernel_provisioner": {"provisioner_name": "gpushare-provisioner", "config": {}},
    }
    (spec / "kernel.json").write_text(json.dumps(native))
    short = Path(tempfile.mkdtemp(prefix="gsjs-", dir="/tmp"))  # unix socket paths are short
    _SOCKET_DIRS.append(short)
    socket_path = str(short / "daemon.sock")
    monkeypatch.setenv("GPUSHARE_SIMULATE", SIMULATE)
    monkeypatch.setenv("GPUSHARE_LEDGER", str(tmp_path / "gpushare-ledger.sqlite"))
    monkeypatch.setenv("GPUSHARE_SOCKET", socket_path)
    yield
    stop_daemons(socket_path)
    shutil.rmtree(short, ignore_errors=True)
