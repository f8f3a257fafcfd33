"""Fixtures for the browser tests (helpers in labdriver.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labdriver import LabServer, driver_missing
from support import ARTIFACTS


@pytest.fixture
def lab_server(gpushare_env: dict[str, str]) -> Iterator[Any]:
    """Factory: ``lab_server(simulate="1xA100,1xT4")`` -> a started JupyterLab."""
    reason = driver_missing()
    if reason:
        if os.environ.get("CI", "").lower() == "true":  # never a silent pass in CI
            pytest.fail(f"the browser tests need Chromium under CI: {reason}")
        pytest.skip(reason)
    servers: list[LabServer] = []

    def start(simulate: str = "1xA100", *extra: str) -> LabServer:
        server = LabServer(gpushare_env, simulate, *extra).start(timeout=90)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Path:
    """test-artifacts/lab/<test name>/ for screenshots and driver logs."""
    path = ARTIFACTS / "lab" / request.node.name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
