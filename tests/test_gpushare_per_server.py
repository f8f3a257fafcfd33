"""``GpuShare`` belongs to its Jupyter server: two ServerApps in one process (jupyter_server's own
tests, a Hub-less multi-server host) each see their own configuration, ledger and kernels' shares;
outside a server ``GpuShare.instance()`` is the process's one (the CLI)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from jupyter_server.serverapp import ServerApp
from support import add_kernelspec
from traitlets.config import Config

from jupyter_gpushare.config import GpuShare
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.periodic import PeriodicTask
from jupyter_gpushare.serverext import stop_tasks


def _server(tmp_path: Path, name: str, request: float, simulate: str) -> ServerApp:
    config = Config()
    config.ServerApp.jpserver_extensions = {"jupyter_gpushare": True}
    config.ServerApp.kernel_manager_class = "jupyter_gpushare.pools.PoolKernelManager"
    config.ServerApp.root_dir = str(tmp_path)
    config.ServerApp.open_browser = False
    config.ServerApp.allow_root = True
    config.GpuShare.simulate = simulate
    config.GpuShare.enforce = False  # bookkeeping only: no node daemon needed here
    config.GpuShare.ledger_path = str(tmp_path / f"{name}.sqlite")
    config.GpuShare.default_share = {"gpu_request": request, "gpu_limit": 1.0}
    config.GpuShare.node_name = name
    app = ServerApp(config=config)
    app.initialize(argv=[], new_httpserver=False)
    return app


async def test_two_servers_in_one_process_each_use_their_own_settings(
    gpushare_env, tmp_path, monkeypatch
):
    for key, value in gpushare_env.items():
        monkeypatch.setenv(key, value)
    add_kernelspec(gpushare_env, "gs-default", {})  # the server's default share
    GpuShare.clear_instance()
    one = _server(tmp_path, "one", 0.25, "1xA100")
    two = _server(tmp_path, "two", 0.5, "2xT4")
    try:
        s1, s2 = one.web_app.settings["gpushare"], two.web_app.settings["gpushare"]
        assert s1 is not s2
        assert (s1.simulate, s1.node_name, s1.parent) == ("1xA100", "one", one)
        assert (s2.simulate, s2.node_name, s2.parent) == ("2xT4", "two", two)
        assert one.kernel_manager.gpushare is s1 and two.kernel_manager.gpushare is s2
        assert not GpuShare.initialized()  # no process-wide singleton was made by either
        # each server's kernels hold shares by its own settings, in its own ledger
        started = {}
        for app, name in ((one, "one"), (two, "two")):
            started[name] = await app.kernel_manager.start_kernel(kernel_name="gs-default")
        held = {
            name: await SQLiteLedger(tmp_path / f"{name}.sqlite").list() for name in ("one", "two")
        }
        assert [(a.kernel_id, a.node, a.spec.gpu_request) for a in held["one"]] == [
            (started["one"], "one", 0.25)
        ]
        assert [(a.kernel_id, a.node, a.spec.gpu_request) for a in held["two"]] == [
            (started["two"], "two", 0.5)
        ]
        provisioner = two.kernel_manager.get_kernel(started["two"]).provisioner
        assert provisioner.settings is s2
    finally:
        for app in (one, two):
            settings = app.web_app.settings
            start = settings.get("gpushare_start_task")
            if start is not None:  # (it made the periodic tasks)
                await asyncio.wait([start], timeout=30)
            tasks = [v for v in settings.values() if isinstance(v, PeriodicTask)]
            await stop_tasks(app)
            await app.kernel_manager.shutdown_all(now=True)
            # nothing of the extension outlives its server
            assert start is not None and start.done()
            assert tasks and all(task._task is None for task in tasks)
    # outside a server (the CLI): the process's own, from the environment
    assert GpuShare.of(None) is GpuShare.instance()
    GpuShare.clear_instance()


@pytest.mark.parametrize("where", ["kernel manager", "nothing"])
def test_of_finds_the_server_through_parents_or_falls_back(where, tmp_path):
    app = ServerApp()
    try:
        if where == "kernel manager":
            from traitlets.config import LoggingConfigurable

            manager = LoggingConfigurable(parent=app)
            child = LoggingConfigurable(parent=manager)
            assert GpuShare.of(child) is GpuShare.for_server(app)
            assert GpuShare.of(child).parent is app
        else:
            assert GpuShare.of(object()) is GpuShare.instance()
    finally:
        GpuShare.clear_instance()
