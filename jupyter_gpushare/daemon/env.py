"""What a kernel process needs in its environment for enforcement (DEVELOPING.md, "Inside a
gpushare kernel")."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .. import paths
from ..inventory import Gpu
from ..kernel_env import INTERPOSER, Simulated, preload_last, share_environment
from ..ledger import Allocation
from ..simulator import SIM_STATE_NAME, simulator_env


def interposer_path() -> Path:
    return paths.lib_dir() / INTERPOSER


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
    simulated = None
    if any(g.simulated for g in gpus):
        sim = simulator_environ(gpus, socket_path)
        simulated = Simulated(
            sim["GPUSHARE_SIM_DEVICES"], sim["GPUSHARE_SIM_STATE"], sim["LD_LIBRARY_PATH"]
        )
    return share_environment(  # the one builder (jupyter_gpushare.kernel_env)
        allocation_id=allocation.id,
        node=allocation.node,
        socket=str(socket_path),
        visible=("CUDA_VISIBLE_DEVICES", ",".join(allocation.gpus)),
        interposer=preload_last(str(interposer_path()), base.get("LD_PRELOAD", "")),
        fail_static=(allocation.request, allocation.memory),
        simulated=simulated,
    )
