"""The ``kubernetes`` backend: each kernel is a pod on the node and GPU placement chose.

Two faces, one choice (``c.KubernetesBackendConfig.controller_url``):

- direct (:mod:`jupyter_gpushare.k8s.backend`): the server holds Kubernetes rights, keeps a
  context per event loop (client, the cluster's :class:`~jupyter_gpushare.k8s.ledger.
  KubernetesLedger`, pod watch, the server's Lease) and creates kernel pods itself; live usage
  comes from the usage ConfigMaps the node agents write (:mod:`jupyter_gpushare.k8s.usage`);
- controller mode (:mod:`jupyter_gpushare.controller.client`, :mod:`jupyter_gpushare.controller.
  backend`): the server holds no rights and is a thin client of the cluster's controller, which
  places, records and launches for it.

Either way the ledger is the cluster's, shared by every user's server: a server acts only on the
records of its own kernels (``extra.k8s_server`` is its id); the node agents follow their
GpuLedgers, so nothing is confirmed with an agent beside the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..controller.backend import ControllerKernelBackend
from ..controller.client import close_controller_context, controller_context
from ..controller.usage import ControllerModeUsage
from ..inventory import Gpu
from ..k8s.backend import KubernetesKernelBackend, close_context, kube_context
from ..k8s.config import KubernetesBackendConfig
from ..k8s.usage import server_usage
from ..ledger import Ledger
from ..usage import UsageSource
from .base import Backend, KernelBackend

NO_GPU_NODES = (
    "no GPU nodes in the cluster (no Node publishes gpushare GPUs: is the node daemon's "
    "DaemonSet running?)"
)


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.config = KubernetesBackendConfig.instance(config=settings.config)

    @property
    def through_controller(self) -> bool:
        return bool(self.config.controller_url)

    async def ledger(self) -> Ledger:
        if self.through_controller:
            return (await controller_context(self.config)).ledger
        return (await kube_context(self.config, self.settings.aliases())).ledger

    async def inventory(self) -> tuple[list[Gpu], str | None]:
        gpus = await (await self.ledger()).gpus()
        return gpus, None if gpus else NO_GPU_NODES

    async def usage(self) -> UsageSource:
        if self.through_controller:
            return ControllerModeUsage(self.config)
        ctx = await kube_context(self.config, self.settings.aliases())
        return server_usage(ctx.kube, ctx.config.namespace)

    def kernel_backend(self, provisioner: Any) -> KernelBackend:
        if self.through_controller:
            return ControllerKernelBackend(provisioner)
        return KubernetesKernelBackend(provisioner)

    def server_id(self) -> str | None:
        return str(self.config.server_id)

    def may_touch(self, record: Mapping[str, Any]) -> bool:
        return record.get("k8s_server") == self.server_id()

    async def close(self) -> None:
        await close_context(delete_lease=True)
        await close_controller_context()


__all__ = ["KubernetesBackend"]
