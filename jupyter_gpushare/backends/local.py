"""The ``local`` backend: kernels are processes on this machine (the embedded default).

The ledger is the machine's (the SQLite file, or the system agent's over its socket:
``GpuShare.local_ledger()``), the GPUs are this machine's (published to that ledger first), live
usage comes from the node agent's status on its unix socket (:class:`~jupyter_gpushare.usage.
DaemonUsage`), and that agent runs beside the server, which starts and watches it. Every record
of the ledger is this server's to act on (one user's workstation, or a machine whose system agent
already shows each user only their own).
"""

from __future__ import annotations

from typing import Any

from ..inventory import Gpu, NoGpuError
from ..ledger import Allocation, Ledger
from ..provisioner.local import LocalKernelBackend
from ..usage import DaemonUsage, UsageSource
from .base import Backend, KernelBackend


class LocalBackend(Backend):
    name = "local"
    agent_beside_server = True

    async def ledger(self) -> Ledger:
        return self.settings.local_ledger()

    async def inventory(self) -> tuple[list[Gpu], str | None]:
        ledger = self.settings.local_ledger()
        try:
            await self.settings.local_gpus()
        except NoGpuError as exc:
            return await ledger.gpus(), str(exc)
        return await ledger.gpus(), None

    async def usage(self) -> UsageSource:
        return DaemonUsage(str(self.settings.socket_path), str(self.settings.node_name))

    def kernel_backend(self, provisioner: Any) -> KernelBackend:
        return LocalKernelBackend(provisioner)

    async def records(self, ledger: Ledger) -> list[Allocation]:
        return await ledger.list(self.settings.node_name)


__all__ = ["LocalBackend"]
