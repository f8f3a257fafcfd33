"""The ``local`` backend: the kernel is a process on this machine (the embedded default).

Launching, signalling and waiting are jupyter_client's :class:`LocalProvisioner`'s; this backend
adds the share: the GPU made visible (``CUDA_VISIBLE_DEVICES=<UUID>``), the allocation named in
the environment, and — with enforcement on — the interposer preloaded and the node daemon's socket,
the daemon started first when none answers (a kernel started without a Jupyter server: nbclient,
papermill, ``jupyter console``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.local_provisioner import LocalProvisioner

from ..backends.base import KernelBackend
from ..daemon.env import local_kernel_env
from ..daemon.supervisor import enforcing, ensure_agent
from ..inventory import Gpu
from ..ledger import Allocation, Ledger
from ..ledger.reconcile import process_start_time


class LocalKernelBackend(KernelBackend):
    name = "local"

    def __init__(self, provisioner: Any) -> None:
        super().__init__(provisioner)
        self.process = LocalProvisioner(
            kernel_id=provisioner.kernel_id,
            kernel_spec=provisioner.kernel_spec,
            parent=provisioner.parent,
        )

    def record_extra(self) -> dict[str, Any]:
        return {"uid": os.getuid()}  # the node agent's status shows a user their own shares

    async def ledger(self) -> Ledger:
        return self.provisioner.settings.local_ledger()

    async def inventory(self) -> Sequence[Gpu]:
        return await self.provisioner.settings.local_gpus()

    async def pre_launch(self, allocation: Allocation, **kwargs: Any) -> dict[str, Any]:
        settings = self.provisioner.settings
        inventory = await self.inventory()
        # the agent check (a ping in a thread) runs alongside the launch preparation below: the
        # kernel's environment does not depend on it (issue 12, kernel start)
        agent = asyncio.ensure_future(self._ensure_agent(inventory))
        try:
            env = dict(kwargs.get("env") or os.environ)
            env.update(local_kernel_env(allocation, inventory, settings))
            kwargs["env"] = env
            given = list(kwargs.get("extra_arguments", []))
            kwargs["extra_arguments"] = given + [
                a for a in settings.extra_kernel_args if a not in given
            ]
            prepared = await self.process.pre_launch(**kwargs)
        finally:
            await agent  # before the kernel starts, as before
        return prepared

    async def _ensure_agent(self, inventory: Sequence[Gpu]) -> None:
        """The node agent answers before the kernel starts, whoever starts it: a Jupyter server
        has started one already (a ping, ~1 ms), nbclient, papermill or ``jupyter console``
        start it here. One that does not come up is logged; the kernel then runs under its
        interposer's fail-static limits."""
        settings = self.provisioner.settings
        if not enforcing(settings):
            return
        try:
            await ensure_agent(settings, inventory, self.provisioner.log)
        except (RuntimeError, OSError) as exc:  # it did not start, or its directory is unusable
            self.provisioner.log.error("gpushare: no node agent: %s", exc)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        return await self.process.launch_kernel(cmd, **kwargs)

    def process_identity(self) -> tuple[int | None, float | None]:
        pid = self.process.pid
        return pid, process_start_time(pid) if pid else None

    @property
    def has_process(self) -> bool:
        return self.process.has_process

    async def poll(self) -> int | None:
        return await self.process.poll()

    async def wait(self) -> int | None:
        return await self.process.wait()

    async def send_signal(self, signum: int) -> None:
        await self.process.send_signal(signum)

    async def kill(self, restart: bool = False) -> None:
        await self.process.kill(restart)

    async def terminate(self, restart: bool = False) -> None:
        await self.process.terminate(restart)

    async def cleanup(self, restart: bool = False) -> None:
        await self.process.cleanup(restart)

    async def shutdown_requested(self, restart: bool = False) -> None:
        await self.process.shutdown_requested(restart)

    async def get_provisioner_info(self) -> dict[str, Any]:
        return await self.process.get_provisioner_info()

    async def load_provisioner_info(self, info: dict[str, Any]) -> None:
        await self.process.load_provisioner_info(info)

    def resolve_path(self, path_str: str) -> str | None:
        return self.process.resolve_path(path_str)
