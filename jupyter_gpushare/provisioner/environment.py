"""The environment of a process that holds a share on this machine (kernel or ``gpushare run``).

The variables are the node daemon's contract (:func:`jupyter_gpushare.daemon.env.kernel_env`,
DEVELOPING.md "Inside a gpushare kernel"); here we decide whether the interposer is preloaded
(when enforcement is on and ``libgpushare.so`` is built) and, on simulated GPUs, make sure the
simulator's state directory exists (private to the user) wherever a kernel may start, with or
without a node agent running.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..daemon.env import kernel_env
from ..daemon.supervisor import enforcing
from ..inventory import Gpu
from ..simulator import ensure_state_dir

if TYPE_CHECKING:
    from ..config import GpuShare
    from ..ledger import Allocation


def kernel_environment(
    allocation: Allocation, inventory: Sequence[Gpu], settings: GpuShare
) -> dict[str, str]:
    node_gpus = [g for g in inventory if g.node == allocation.node]
    env = kernel_env(allocation, Path(settings.socket_path), node_gpus)
    env["GPUSHARE_LEDGER"] = settings.ledger_path
    if not enforcing(settings):
        env.pop("LD_PRELOAD", None)
    if env.get("GPUSHARE_SIM_STATE"):
        ensure_state_dir(env["GPUSHARE_SIM_STATE"])
    return env
