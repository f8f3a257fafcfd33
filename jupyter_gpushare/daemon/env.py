"""What a kernel process needs in its environment for enforcement (DEVELOPING.md, "Inside a
gpushare kernel")."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import paths
from ..inventory import Gpu
from ..ledger import Allocation
from ..simulator import SIM_STATE_NAME, simulator_env


def interposer_path() -> Path:
    return paths.lib_dir() / "libgpushare.so"


def sim_state_path(socket_path: Path) -> Path:
    """The simulator's shared state file: ``GPUSHARE_SIM_STATE`` if set, else next to the
    daemon's socket (so the daemon, its NVML sampler and every kernel see one device)."""
    env = os.environ.get("GPUSHARE_SIM_STATE")
    return Path(env) if env else Path(socket_path).parent / SIM_STATE_NAME


def simulator_environ(gpus: Sequence[Gpu], socket_path: Path) -> dict[str, str]:
    """The simulator's variables for simulated ``gpus`` (all of the node's simulated GPUs),
    with the shared state next to the daemon's socket."""
    return simulator_env(gpus, sim_state_path(socket_path))


def kernel_env(
    allocation: Allocation,
    socket_path: Path,
    gpus: Sequence[Gpu],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Variables to add to a kernel's environment so that ``libgpushare.so`` enforces
    ``allocation``: ``gpus`` are the node's GPUs (simulated or not); only the allocation's ones
    are made visible. ``LD_PRELOAD`` keeps what ``base`` (default: this process) preloads."""
    base = os.environ if base is None else base
    env = {
        "GPUSHARE_ALLOCATION_ID": allocation.id,
        "GPUSHARE_SOCKET": str(socket_path),
        "GPUSHARE_NODE": allocation.node,
        "CUDA_VISIBLE_DEVICES": ",".join(allocation.gpus),
        # what the interposer enforces on its own while the daemon is unreachable (fail static)
        "GPUSHARE_GPU_REQUEST": repr(float(allocation.request)),
        "GPUSHARE_GPU_MEMORY": str(int(allocation.memory)),
    }
    # last: libgpushare defines dlsym, and a dlsym(RTLD_NEXT, …) that goes through it resolves
    # after libgpushare; preloads that look themselves up that way must come before it
    ours = str(interposer_path())
    preload = [p for p in base.get("LD_PRELOAD", "").split(":") if p and p != ours]
    env["LD_PRELOAD"] = ":".join([*preload, ours])
    if any(g.simulated for g in gpus):
        env.update(simulator_environ(gpus, socket_path))
    return env
