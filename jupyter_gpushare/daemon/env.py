"""What a process that holds a share *on this machine* needs in its environment (a local
kernel, ``gpushare run``; DEVELOPING.md, "Inside a gpushare kernel").

The variables themselves are built once, by :func:`jupyter_gpushare.kernel_env.share_environment`
(also used for kernel pods and by the device plugin); this module supplies this machine's part:
the agent's socket, the interposer's path after what is already preloaded, the simulator's
state next to the socket (:func:`kernel_env`), and, for the server's own settings, the ledger
path and whether the interposer is preloaded at all (:func:`local_kernel_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import paths
from ..inventory import Gpu
from ..kernel_env import INTERPOSER, Simulated, preload_last, share_environment
from ..ledger import Allocation
from ..simulator import SIM_STATE_NAME, ensure_state_dir, simulator_env

if TYPE_CHECKING:
    from ..config import GpuShare


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
    *,
    preload: bool = True,
) -> dict[str, str]:
    """Variables to add to a kernel's environment so that ``libgpushare.so`` enforces
    ``allocation``: ``gpus`` are the node's GPUs (simulated or not); only the allocation's ones
    are made visible. ``LD_PRELOAD`` keeps what ``base`` (default: this process) preloads;
    ``preload=False`` leaves it out (enforcement off)."""
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
        interposer=(
            preload_last(str(interposer_path()), base.get("LD_PRELOAD", "")) if preload else None
        ),
        fail_static=(allocation.request, allocation.memory),
        simulated=simulated,
    )


def enforcing(settings: GpuShare) -> bool:
    """Whether shares are enforced here: enforcement on and the interposer built (without it
    there is nothing for an agent to enforce)."""
    return bool(settings.enforce) and interposer_path().exists()


def local_kernel_env(
    allocation: Allocation, inventory: Sequence[Gpu], settings: GpuShare
) -> dict[str, str]:
    """:func:`kernel_env` for a process the server starts here (a local kernel, ``gpushare
    run``), from the server's settings: its node's GPUs out of ``inventory``, the ledger's path
    (so a kernel without an agent can release its own share), the interposer only where
    :func:`enforcing`; on simulated GPUs the simulator's state directory is made (private to
    the user) wherever a kernel may start, with or without a node agent running."""
    node_gpus = [g for g in inventory if g.node == allocation.node]
    env = kernel_env(allocation, Path(settings.socket_path), node_gpus, preload=enforcing(settings))
    env["GPUSHARE_LEDGER"] = settings.ledger_path
    if env.get("GPUSHARE_SIM_STATE"):
        ensure_state_dir(env["GPUSHARE_SIM_STATE"])
    return env
