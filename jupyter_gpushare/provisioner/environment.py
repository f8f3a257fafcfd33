"""The environment of a process that holds a share on this machine (kernel or ``gpushare run``).

See DEVELOPING.md, "Inside a gpushare kernel". The simulator's and the interposer's variables are
added when those libraries are built and, for the interposer, when enforcement is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import paths
from ..inventory import Gpu, simulator_device_list

if TYPE_CHECKING:
    from ..config import GpuShare
    from ..ledger import Allocation


def kernel_environment(
    allocation: Allocation, inventory: Sequence[Gpu], settings: GpuShare
) -> dict[str, str]:
    env = {
        "GPUSHARE_ALLOCATION_ID": allocation.id,
        "GPUSHARE_SOCKET": settings.socket_path,
        "GPUSHARE_NODE": allocation.node,
        "CUDA_VISIBLE_DEVICES": ",".join(allocation.gpus),
    }
    node_gpus = [g for g in inventory if g.node == allocation.node]
    if any(g.simulated for g in node_gpus):
        env.update(simulator_environment(node_gpus))
    interposer = paths.lib_dir() / "libgpushare.so"
    if settings.enforce and interposer.exists():
        env["LD_PRELOAD"] = str(interposer)
    return env


def simulator_environment(gpus: Sequence[Gpu]) -> dict[str, str]:
    """Variables that point CUDA and NVML at the simulator for ``gpus`` (all on one node)."""
    env = {"GPUSHARE_SIMULATED": "1", "GPUSHARE_SIM_DEVICES": simulator_device_list(gpus)}
    sim_dir = paths.lib_dir() / "sim"
    if (sim_dir / "libcuda.so.1").exists():
        import os

        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(sim_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p
        )
    return env
