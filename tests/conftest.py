"""Shared fixtures: isolated Jupyter dirs and gpushare state, and a factory of real
jupyter_server processes with gpushare on simulated GPUs (helpers in support.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import JupyterServer, isolated_env, stop_daemons


@pytest.fixture
def gpushare_env(tmp_path: Path) -> dict[str, str]:
    """Isolated Jupyter dirs and gpushare state for one test; the gpushare kernelspecs installed."""
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # unix socket paths must be short
    env = isolated_env(tmp_path, short)
    yield env
    stop_daemons(env["GPUSHARE_SOCKET"])
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def jupyter_server(gpushare_env: dict[str, str]) -> Iterator[Any]:
    """Factory: ``jupyter_server(simulate="1xA100", *extra_args)`` -> a started server."""
    servers: list[JupyterServer] = []

    def start(simulate: str = "1xA100", *extra: str) -> JupyterServer:
        server = JupyterServer(gpushare_env, simulate, *extra).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
