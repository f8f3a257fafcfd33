"""Server-wide gpushare configuration (traitlets) and the per-process objects it implies.

There is one ``GpuShare`` per Jupyter server: :meth:`GpuShare.for_server` creates it with the
server's config (``parent=serverapp``) on first use (the kernel manager or the server extension,
whichever comes first), and every provisioner, handler and task of that server finds that one
through its parents (:meth:`GpuShare.of`), so a second ServerApp in the same process keeps its
own configuration, ledger and node. Outside a server (``jupyter console``, nbclient, the CLI)
``GpuShare.instance()`` is the process's one, created from the environment
(``GPUSHARE_SIMULATE``, ``GPUSHARE_LEDGER``, …).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from traitlets import Bool, Dict, Float, List, Unicode, default, observe, validate
from traitlets.config import SingletonConfigurable

from . import backends, paths
from .backends import Backend
from .bound import ENV_DEFAULT, ENV_MAX, share_from_environment
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
from .ledger.agent import AgentLedger
from .ledger.sqlite import SQLiteLedger
from .placement import Policy
from .placement.config import GpusharePlacement
from .pools.config import parse_pools  # a pure parser (share spec only): refuses bad pools at once
from .share import SHARE_FIELDS, ShareError, ShareSpec

#: the attribute of a ServerApp that holds its own settings (see GpuShare.for_server)
_ATTRIBUTE = "_gpushare_settings"


def _is_server_app(obj: object) -> bool:
    serverapp = sys.modules.get("jupyter_server.serverapp")
    return serverapp is not None and isinstance(obj, serverapp.ServerApp)


class GpuShare(SingletonConfigurable):
    """GPU sharing for this Jupyter server: backend, default share, GPU types, simulation."""

    @classmethod
    def for_server(cls, serverapp: Any) -> GpuShare:
        """``serverapp``'s own settings, created with its config on first use (kept on the
        server app itself, so they go with it)."""
        settings = getattr(serverapp, _ATTRIBUTE, None)
        if not isinstance(settings, cls):
            settings = cls(parent=serverapp)
            setattr(serverapp, _ATTRIBUTE, settings)
        return settings

    @classmethod
    def of(cls, configurable: Any) -> GpuShare:
        """The settings that apply to ``configurable`` (a provisioner, a kernel manager): those of
        the Jupyter server among its parents; outside a server, :meth:`instance`."""
        node = configurable
        while node is not None:
            if _is_server_app(node):
                return cls.for_server(node)
            node = getattr(node, "parent", None)
        return cls.instance()

    backend = Unicode(
        backends.DEFAULT,
        config=True,
        help="Where kernels run by default: 'local' (processes on this machine, the embedded "
        "default), 'kubernetes' (one pod per kernel), or another backend installed in the "
        "entry point group 'jupyter_gpushare.backends'. A kernelspec's `backend` key overrides.",
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
    start_wait_max = Float(
        1800.0,
        config=True,
        help="Most seconds one kernel start may ask to wait in the queue for a share that does "
        "not fit now (the Lab picker's 'Wait in line'; \"wait\" in the body of POST "
        '/gpushare/api/kernels); a larger "wait" is refused with 400 naming this bound. '
        "0: no start may ask to wait. Starts that ask nothing wait "
        "GpushareProvisioner.queue_wait. Waiting needs a ledger owner with a queue (a system "
        "node agent, or the controller on Kubernetes).",
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

    @validate("backend")
    def _check_backend(self, proposal: dict) -> str:
        return backends.check_name(proposal["value"])  # ShareError naming what is installed

    @validate("pools")
    def _check_pools(self, proposal: dict) -> list:
        parse_pools(proposal["value"])  # raises PoolConfigError naming the pool and key
        return [dict(p) for p in proposal["value"]]

    @default("default_share")
    def _default_default_share(self) -> dict:
        picked = share_from_environment(ENV_DEFAULT)  # the share picked in JupyterHub
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
        self._ledger: Ledger | None = None
        self._system_agent: tuple[str, bool] | None = None  # (socket, a system agent serves it)
        # one lock per event loop (see local_gpus), and one for the blocking discovery
        self._gpu_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._discover_lock = threading.Lock()
        self._published = False
        self._backends: dict[str, Backend] = {}
        # built from the configuration once, again only after it changes (_derived_config_changed)
        self._placement: GpusharePlacement | None = None
        self._policy: Policy | None = None
        self._aliases: TypeAliases | None = None

    # -- derived objects -------------------------------------------------------------------------

    def aliases(self) -> TypeAliases:
        """The GPU type aliases (:attr:`type_aliases`), built once per value."""
        if self._aliases is None:
            self._aliases = TypeAliases(self.type_aliases)
        return self._aliases

    @property
    def placement(self) -> GpusharePlacement:
        """The placement configuration (``c.GpusharePlacement.*``) read from this server's
        config; a trait set on it at run time applies to the next :meth:`policy`."""
        if self._placement is None:
            placement = GpusharePlacement(parent=self)
            placement.observe(self._placement_changed)
            self._placement = placement
        return self._placement

    def policy(self) -> Policy:
        """The deployment's placement policy (``c.GpusharePlacement.*``) with these aliases.

        Every kernel start places with it, so it is built once (reading the config and
        validating the orders costs ~0.1-0.5 ms) and again only after what it is built from
        changes the traitlets way: this object's config (:meth:`update_config`, a new
        ``config``), its :attr:`type_aliases`, or a trait of :attr:`placement` (observers; a
        ``Config`` changed in place is no change event, for traitlets either)."""
        if self._policy is None:
            self._policy = self.placement.policy(self.aliases())
        return self._policy

    def update_config(self, config: Any) -> None:
        """traitlets' merge of ``config`` (it changes ``self.config`` in place, with no change
        event), then the policy is built again from the merged config."""
        super().update_config(config)
        self._forget_derived()

    @observe("config", "type_aliases")
    def _derived_config_changed(self, change: Any) -> None:
        self._forget_derived(placement=change["name"] == "config")

    def _forget_derived(self, placement: bool = True) -> None:
        """Build the aliases and the policy again on next use; with ``placement`` the
        placement configuration too (a GpusharePlacement reads its parent's config when it is
        made)."""
        if placement:
            self._placement = None
        self._aliases = None
        self._policy = None

    def _placement_changed(self, change: Any) -> None:
        self._policy = None

    def default_spec(self) -> ShareSpec:
        return ShareSpec.from_mapping(
            {k: v for k, v in self.default_share.items() if k in SHARE_FIELDS}
        )

    def get_backend(self, name: str | None = None) -> Backend:
        """The backend ``name`` (default: :attr:`backend`) for this server, one instance each
        (found by entry point, :mod:`jupyter_gpushare.backends`). Raises ShareError naming the
        installed backends for an unknown name."""
        name = self.backend if name is None else name
        found = self._backends.get(name)
        if found is None:
            found = self._backends[name] = backends.backend_class(name)(self)
        return found

    async def close_backends(self) -> None:
        """Close what this server's backends hold (server shutdown, once kernels are down)."""
        used, self._backends = list(self._backends.values()), {}
        for backend in used:
            await backend.close()

    async def ledger(self) -> Ledger:
        """The ledger of this server's backend: the local SQLite ledger (or the system agent's),
        or with backend ``kubernetes`` the cluster's (one per event loop)."""
        return await self.get_backend().ledger()

    def system_agent(self) -> bool:
        """Whether the machine's system agent serves ``socket_path`` (``paths.find_agent``; its
        ping says so). Asked once per socket path: a ping of about a millisecond."""
        if self._system_agent is None or self._system_agent[0] != self.socket_path:
            found = paths.find_agent()
            system = (
                found.system
                if found.socket == Path(self.socket_path)
                else paths.is_system_agent(Path(self.socket_path))
            )
            self._system_agent = (self.socket_path, system)
        return self._system_agent[1]

    def local_ledger(self) -> Ledger:
        """This machine's ledger: the system agent's (an :class:`AgentLedger` on its socket,
        with JupyterHub's per-user bound) when one serves ``socket_path``, else the SQLite file
        ``ledger_path`` (a per-user agent follows it)."""
        if self.system_agent():
            if not (
                isinstance(self._ledger, AgentLedger)
                and self._ledger.socket_path == Path(self.socket_path)
            ):
                self._ledger = AgentLedger(self.socket_path, share_from_environment(ENV_MAX))
            return self._ledger
        if not (
            isinstance(self._ledger, SQLiteLedger) and self._ledger.path == Path(self.ledger_path)
        ):
            self._ledger = SQLiteLedger(self.ledger_path)
        return self._ledger

    def discover_gpus(self) -> list[Gpu]:
        """This machine's GPUs (blocking: NVML). Raises NoGpuError with a clear message."""
        with self._discover_lock:
            if self._gpus is None:
                self._gpus = discover_local(self.simulate or None, self.aliases(), self.node_name)
            return self._gpus

    async def local_gpus(self) -> Sequence[Gpu]:
        """This machine's GPUs, discovered once and published to the ledger.

        Any event loop may ask: jupyter_client runs a synchronous kernel manager's start on a
        loop of its own thread while the server's loop waits for it, so a lock shared across
        loops would wait for a task of the blocked loop (a deadlock). Each loop has its own lock;
        two loops may both publish, which is idempotent."""
        loop = asyncio.get_running_loop()
        lock = self._gpu_locks.setdefault(loop, asyncio.Lock())
        async with lock:
            if not self._published:
                ledger = self.local_ledger()
                if isinstance(ledger, AgentLedger):  # the system agent publishes its GPUs
                    published = [g for g in await ledger.gpus() if g.node == self.node_name]
                    if not published:
                        raise NoGpuError(
                            f"the gpushare system agent on {self.socket_path} "
                            f"publishes no GPUs of node {self.node_name}"
                        )
                    with self._discover_lock:
                        self._gpus = published
                else:
                    gpus = await asyncio.to_thread(self.discover_gpus)
                    await ledger.put_gpus(self.node_name, gpus)
                self._published = True
            return list(self._gpus or [])

    @property
    def simulated(self) -> bool:
        return bool(self.simulate)


__all__ = ["GpuShare", "NoGpuError"]
