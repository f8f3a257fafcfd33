"""Where gpushare keeps its state on a machine; each path can be overridden by an env variable."""

from __future__ import annotations

import os
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir, jupyter_runtime_dir


def ledger_path() -> Path:
    """The local SQLite ledger (``GPUSHARE_LEDGER``)."""
    env = os.environ.get("GPUSHARE_LEDGER")
    return Path(env) if env else Path(jupyter_data_dir()) / "gpushare" / "ledger.sqlite"


def socket_path() -> Path:
    """The node daemon's unix socket (``GPUSHARE_SOCKET``)."""
    env = os.environ.get("GPUSHARE_SOCKET")
    return Path(env) if env else Path(jupyter_runtime_dir()) / "gpushare" / "daemon.sock"


def lib_dir() -> Path:
    """The built C libraries: ``libgpushare.so`` and ``sim/`` (the simulated driver and NVML)."""
    return Path(__file__).resolve().parent / "_lib"
