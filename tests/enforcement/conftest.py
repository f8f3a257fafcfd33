"""Fixtures for the enforcement tests (helpers: enforcement_support.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from enforcement_support import NODE, DaemonProc, build_c, start_daemon

from jupyter_gpushare.inventory import Gpu, simulated_gpus
from jupyter_gpushare.ledger.sqlite import SQLiteLedger


@pytest.fixture(scope="session")
def built() -> None:
    build_c()


@pytest.fixture
def gpus() -> list[Gpu]:
    return simulated_gpus("1xA100", NODE)


@pytest.fixture
def daemon(built: None, tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def ledger(daemon: DaemonProc) -> SQLiteLedger:
    return SQLiteLedger(daemon.ledger_path)
