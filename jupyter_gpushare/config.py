"""Server-wide gpushare configuration (traitlets) and the per-process objects it implies.

``GpuShare`` is a singleton: the server extension creates it with the server's config, and every
provisioner of that server reads the same instance. Outside a server (``jupyter console``, the
CLI) it is created from the environment (``GPUSHARE_SIMULATE``, ``GPUSHARE_LEDGER``, …).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

from traitlets import Bool, Dict, Enum, Float, List, Unicode, default, validate
from traitlets.config import SingletonConfigurable

from . import paths
from .inventory import (
    DEFAULT_TYPE_ALIASES,
    Gpu,
    NoGpuError,
    TypeAliases,
    discover_local,
    local_node_name,
    parse_simulate,
)
from .ledger import Ledger
from .ledger.sqlite import SQLiteLedger
from .placement import Policy
from .placement.config import GpusharePlacement
from .share import SHARE_FIELDS, ShareError, ShareSpec


class GpuShare(SingletonConfigurable):
    """GPU sharing for this Jupyter server: backend, default share, GPU types, simulation."""

    backend = Enum(
        ["local", "kubernetes"],
        default_value="local",
        config=True,
        help="Where kernels run by default: 'local' (processes on this machine, the embedded "
        "default) or 'kubernetes' (one pod per kernel). A kernelspec's `backend` key overrides.",
    )
    default_share = Dict(
        default_value={"gpu_request": 0.25, "gpu_limit": 0.5},
        config=True,
        help="The share a kernel gets for the keys its kernelspec and the user leave out; keys "
        "as in kernelspecs: gpu_request, gpu_limit, gpu_memory, gpu_type, gpu_count, gpu_labels.",
    )
    type_aliases = Dict(
        default_value=DEFAULT_TYPE_ALIASES,
        config=True,
        help="GPU type alias -> list of case-insensitive patterns matched as whole tokens "
        "against NVML product names and `nvidia.com/gpu.product` labels, e.g. "
        "{'A100': ['A100'], 'T4': ['T4']}.",
    )
    simulate = Unicode(
        "",
        config=True,
        help="Run on simulated GPUs instead of real ones, e.g. '2xA100' or '1xA100,2xT4' "
        "(also GPUSHARE_SIMULATE). Simulated GPUs are labelled as such everywhere.",
    )
    ledger_path = Unicode(
        config=True,
        help="The local SQLite ledger of allocations (also GPUSHARE_LEDGER).",
    )
    socket_path = Unicode(
        config=True,
        help="The node daemon's unix socket (also GPUSHARE_SOCKET).",
    )
    node_name = Unicode(
        config=True, help="This machine's node name in the ledger (default: the host name)."
    )
    reconcile_interval = Float(
        10.0,
        config=True,
        help="Seconds between reconciliations that release allocations whose kernel is gone.",
    )
    enforce = Bool(
        True,
        config=True,
        help="Start the node daemon and preload the CUDA interposer into kernels, so that "
        "shares are enforced. Without it shares are bookkeeping only.",
    )
    presets = List(
        Dict(),
        default_value=[
            {"name": "Small", "gpu_request": 0.25, "gpu_limit": 0.5},
            {"name": "Half", "gpu_request": 0.5, "gpu_limit": 1.0},
            {"name": "Whole", "gpu_request": 1.0, "gpu_limit": 1.0},
        ],
        config=True,
        help="Shares offered as one-click choices in the GPU picker: a list of objects with a "
        "'name' and share keys (gpu_request, gpu_limit, gpu_memory, gpu_type).",
    )
    extra_kernel_args = List(
        Unicode(),
        default_value=["--ext=jupyter_gpushare"],
        config=True,
        help="Arguments appended to gpushare kernels' command line (the default loads the "
        "%gpushare magics into IPython kernels).",
    )
    pools = List(
        Dict(),
        default_value=[],
        config=True,
        help="Kernel pools: warm kernels started ahead of time and handed to a matching kernel "
        "start at once. A list of objects: name, kernelspec, share ({gpu_request, gpu_limit, "
        "gpu_memory, gpu_type}), backend, size (warm kernels kept), schedule ([{days: "
        "'mon-fri', hours: '08:00-18:00', size: 4}]). Needs ServerApp.kernel_manager_class = "
        "jupyter_gpushare.pools.PoolKernelManager. See jupyter_gpushare.pools.config.",
    )
    reclaim_idle_after = Float(
        0.0,
        config=True,
        help="Idle-GPU reclaim: seconds a kernel may hold a GPU share without launching GPU "
        "work before it is warned (0: never). The share is released reclaim_grace seconds "
        "after the warning unless the kernel uses the GPU again; the kernel keeps running.",
    )
    reclaim_grace = Float(
        300.0,
        config=True,
        help="Seconds between the idle warning and the release of the share.",
    )
    reclaim_interval = Float(
        10.0,
        config=True,
        help="Seconds between idle-reclaim checks.",
    )
    reclaim_exempt_users = List(
        Unicode(),
        default_value=[],
        config=True,
        help="Users whose kernels are never reclaimed.",
    )
    reclaim_exempt_profiles = List(
        Unicode(),
        default_value=[],
        config=True,
        help="Kernelspec names and pool names whose kernels are never reclaimed.",
    )

    @default("simulate")
    def _default_simulate(self) -> str:
        return os.environ.get("GPUSHARE_SIMULATE", "")

    @default("ledger_path")
    def _default_ledger_path(self) -> str:
        return str(paths.ledger_path())

    @default("socket_path")
    def _default_socket_path(self) -> str:
        return str(paths.socket_path())

    @default("node_name")
    def _default_node_name(self) -> str:
        return local_node_name()

    @validate("simulate")
    def _check_simulate(self, proposal: dict) -> str:
        value = str(proposal["value"] or "")
        if value:
            parse_simulate(value)  # raises ShareError naming the value and what is allowed
        return value

    @validate("presets")
    def _check_presets(self, proposal: dict) -> list:
        checked = []
        for i, preset in enumerate(proposal["value"]):
            share = {k: v for k, v in preset.items() if k != "name"}
            try:
                ShareSpec.from_mapping(share)
            except ShareError as exc:
                raise ShareError(f"presets[{i}].{exc.field}", exc.value, exc.allowed) from None
            checked.append(dict(preset))
        return checked

    @validate("pools")
    def _check_pools(self, proposal: dict) -> list:
        from .pools.config import parse_pools

        parse_pools(proposal["value"])  # raises PoolConfigError naming the pool and key
        return [dict(p) for p in proposal["value"]]

    @default("default_share")
    def _default_default_share(self) -> dict:
        from .hub import ENV_DEFAULT, share_from_environment  # the share picked in JupyterHub

        picked = share_from_environment(ENV_DEFAULT)
        if picked is None:
            return {"gpu_request": 0.25, "gpu_limit": 0.5}
        return {k: v for k, v in picked.to_json().items() if v is not None}

    @validate("default_share")
    def _check_default_share(self, proposal: dict) -> dict:
        value = dict(proposal["value"])
        ShareSpec.from_mapping(value)  # raises ShareError naming the bad key
        return value

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._gpus: list[Gpu] | None = None
        self._ledger: SQLiteLedger | None = None
        self._gpu_lock = asyncio.Lock()

    # -- derived objects -------------------------------------------------------------------------

    def aliases(self) -> TypeAliases:
        return TypeAliases(self.type_aliases)

    def policy(self) -> Policy:
        """The deployment's placement policy (``c.GpusharePlacement.*``) with these aliases."""
        return GpusharePlacement(parent=self).policy(self.aliases())

    def default_spec(self) -> ShareSpec:
        return ShareSpec.from_mapping(
            {k: v for k, v in self.default_share.items() if k in SHARE_FIELDS}
        )

    async def ledger(self) -> Ledger:
        """The ledger of this server's backend: the local SQLite ledger, or with backend
        ``kubernetes`` the API server's (the provisioner's :class:`KubernetesLedger`, from the
        Kubernetes context this event loop shares: one client, pod watch and Lease)."""
        if self.backend != "kubernetes":
            return self.local_ledger()
        from .k8s.backend import get_context
        from .k8s.config import KubernetesBackendConfig

        config = KubernetesBackendConfig.instance(config=self.config)
        return (await get_context(config, self.aliases())).ledger

    def local_ledger(self) -> SQLiteLedger:
        if self._ledger is None or self._ledger.path != Path(self.ledger_path):
            self._ledger = SQLiteLedger(self.ledger_path)
        return self._ledger

    def discover_gpus(self) -> list[Gpu]:
        """This machine's GPUs (blocking: NVML). Raises NoGpuError with a clear message."""
        if self._gpus is None:
            self._gpus = discover_local(self.simulate or None, self.aliases(), self.node_name)
        return self._gpus

    async def local_gpus(self) -> Sequence[Gpu]:
        """This machine's GPUs, discovered once and published to the ledger."""
        async with self._gpu_lock:
            if self._gpus is None:
                gpus = await asyncio.to_thread(self.discover_gpus)
                await self.local_ledger().put_gpus(self.node_name, gpus)
            return list(self._gpus or [])

    @property
    def simulated(self) -> bool:
        return bool(self.simulate)


__all__ = ["GpuShare", "NoGpuError"]
