"""Kernel pools (the pools issue): warm GPU kernels started ahead of time and handed out at once.

- :mod:`.config` — the admin's pool profiles (``c.GpuShare.pools``), parsed and validated;
- :mod:`.manager` — :class:`PoolManager`: keeps the warm kernels, hands them out, refills;
- :mod:`.binding` — binds a warm kernel to the user's session (cwd, environment);
- :mod:`.kernel_manager` — :class:`PoolKernelManager`, the server's kernel manager with pools.
"""

from __future__ import annotations

from .config import PoolConfigError, PoolProfile, ScheduleWindow, parse_pools

__all__ = ["PoolConfigError", "PoolKernelManager", "PoolProfile", "ScheduleWindow", "parse_pools"]


def __getattr__(name: str) -> object:
    # the kernel manager imports jupyter_server; load it only when asked for
    if name == "PoolKernelManager":
        from .kernel_manager import PoolKernelManager

        return PoolKernelManager
    raise AttributeError(name)
