"""What the Jupyter server knows about allocations beyond the ledger, per backend.

- **Live use** (:class:`UsageView`): per allocation the achieved share, memory in use, idle time,
  … as the node daemons measure them. Locally the server asks its node daemon over the unix
  socket (:class:`DaemonUsage`); on Kubernetes the daemons are on other machines, so each one
  publishes its node's usage into a ConfigMap that the server reads
  (:class:`jupyter_gpushare.k8s.usage.KubernetesUsage`). ``GET /gpushare/api/usage``, idle
  reclaim and the below-use check of a live resize all read it through the server's backend
  (``GpuShare.get_backend().usage()``, :mod:`jupyter_gpushare.backends`).
- **Scope** (``Backend.may_touch``): which records are this server's to list and act on. Locally,
  every record of the machine's ledger (one user's workstation). On Kubernetes the ledger is the
  cluster's and every user's Jupyter server shares it, so a server lists, resizes, releases and
  reclaims only the records of its own kernels (``extra.k8s_server`` is its id); the GPU
  inventory (``/gpus``) still counts everyone's shares, by id only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .daemon.client import DaemonClient, DaemonUnreachable

#: The per-allocation fields of a usage entry (REST ``/gpushare/api/usage``, the usage
#: ConfigMaps); all but ``id``/``kernel_id`` come from the node daemon's status.
USAGE_KEYS = (
    "id",
    "kernel_id",
    "achieved_share",
    "memory_used",
    "memory_cap",
    "request",
    "limit",
    "connected",
    "lease_waits",
    "lease_wait_seconds",
    "idle_s",
    "last_launch_ago_s",
)


@dataclass(frozen=True)
class UsageView:
    """Live use of the allocations some node daemons know, read at one moment.

    ``nodes``: the nodes whose usage is current (an allocation on such a node that is missing
    from ``allocations`` is unknown to its daemon); ``stale``: nodes whose last report is too old
    to act on, with its age in seconds; ``message``: why some or all usage is missing."""

    source: str  # "daemon" (local) | "kubernetes"
    allocations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    nodes: frozenset[str] = frozenset()
    stale: Mapping[str, float] = field(default_factory=dict)
    message: str | None = None

    def covers(self, node: str) -> bool:
        return node in self.nodes

    def get(self, allocation_id: str) -> Mapping[str, Any] | None:
        return self.allocations.get(allocation_id)

    def memory_used(self, allocation_id: str) -> int | None:
        found = self.allocations.get(allocation_id)
        return (
            None if found is None or found.get("memory_used") is None else int(found["memory_used"])
        )


class UsageSource(Protocol):
    async def read(self, fresh: bool = False) -> UsageView:
        """The usage now; ``fresh``: bypass any cache (a decision that needs the latest)."""

    async def changed(self) -> None:
        """The ledger changed (resize, warning, release): let the daemon see it soon."""


class DaemonUsage:
    """Local backend: this machine's node daemon, over its unix socket (calls in a thread)."""

    def __init__(self, socket_path: str, node: str) -> None:
        self.socket_path = socket_path
        self.node = node

    def _client(self) -> DaemonClient:
        return DaemonClient(self.socket_path, timeout=2.0)

    async def read(self, fresh: bool = False) -> UsageView:
        try:
            status = await asyncio.to_thread(self._client().status)
        except (DaemonUnreachable, OSError, ValueError) as exc:
            return UsageView("daemon", message=f"no node daemon answers: {exc}")
        return UsageView(
            "daemon",
            allocations={
                a["id"]: {**{k: a.get(k) for k in USAGE_KEYS}, "node": self.node}
                for a in status.get("allocations", [])
            },
            nodes=frozenset({self.node}),
        )

    async def changed(self) -> None:
        """Ask the daemon to re-read the ledger now (it re-reads every ~250 ms anyway)."""

        def refresh() -> None:
            try:
                self._client().refresh()
            except (DaemonUnreachable, OSError, ValueError):
                pass

        await asyncio.to_thread(refresh)


__all__ = [
    "USAGE_KEYS",
    "DaemonUsage",
    "UsageSource",
    "UsageView",
]
