"""The backend seam: where kernels run and where their shares are recorded, one interface.

- :class:`Backend` is one deployment's answer for one Jupyter server (or a process outside one):
  its ledger, the GPUs placement may use, where live usage comes from, how a kernel is
  launched (:meth:`Backend.kernel_backend`), which records this server may touch, and closing
  what it holds. ``local`` (processes on this machine, the node agent beside the server) and
  ``kubernetes`` (a pod per kernel; directly, or through the cluster's controller) implement it
  in :mod:`jupyter_gpushare.backends.local` and :mod:`.kubernetes`; they are found by entry
  point (:mod:`jupyter_gpushare.backends`), and no caller names one.
- :class:`KernelBackend` is the launcher of one kernel. The gpushare provisioner owns the share:
  it validates the spec, reserves it in the backend's ledger before launch and releases it on
  every exit path. A :class:`KernelBackend` owns the kernel: it launches it with the
  allocation's GPU made visible, watches it, signals it and cleans up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from jupyter_client.connect import KernelConnectionInfo

if TYPE_CHECKING:
    from ..config import GpuShare
    from ..inventory import Gpu
    from ..ledger import Allocation, Ledger
    from ..provisioner import GpushareProvisioner
    from ..usage import UsageSource


class Backend(ABC):
    """Where one server's kernels run and their shares are recorded (one instance per
    :class:`~jupyter_gpushare.config.GpuShare` and backend name: ``GpuShare.get_backend()``)."""

    #: the name it is registered under (entry point group ``jupyter_gpushare.backends``), also
    #: the value of ``c.GpuShare.backend``, a kernelspec's ``backend`` key and
    #: ``Allocation.backend``
    name: ClassVar[str]
    #: whether the node agent that enforces this backend's shares runs beside the server, on
    #: this machine: the server then starts and watches it, and acknowledges a change of a share
    #: only once that agent enforces it (elsewhere the nodes' agents follow the ledger)
    agent_beside_server: ClassVar[bool] = False

    def __init__(self, settings: GpuShare) -> None:
        self.settings = settings

    @abstractmethod
    async def ledger(self) -> Ledger:
        """The ledger this backend's allocations live in (shared by all kernels of a server)."""

    @abstractmethod
    async def inventory(self) -> tuple[list[Gpu], str | None]:
        """The GPUs placement may choose from, and why there are none when there are none."""

    @abstractmethod
    async def usage(self) -> UsageSource:
        """Where live use (achieved share, memory, idle time) of the allocations comes from."""

    @abstractmethod
    def kernel_backend(self, provisioner: GpushareProvisioner) -> KernelBackend:
        """The launcher of ``provisioner``'s kernel."""

    def server_id(self) -> str | None:
        """This server's id in a ledger that many servers share (None: the ledger is this
        server's machine's, and every record in it is this server's to act on)."""
        return None

    def may_touch(self, record: Mapping[str, Any]) -> bool:
        """Whether this server may show and act on a record: an allocation's ``extra`` or a
        usage entry (both carry the server a kernel belongs to where servers share a ledger)."""
        return True

    async def records(self, ledger: Ledger) -> list[Allocation]:
        """The records this server acts on by itself (idle reclaim)."""
        return [a for a in await ledger.list() if self.may_touch(a.extra)]

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop what this backend holds for the server (watches, Leases, clients): at server
        shutdown, once its kernels are down."""


class KernelBackend(ABC):
    """How one gpushare kernel runs. One instance per provisioner (reused across restarts)."""

    #: the value of the provisioner's ``backend`` key that selects this backend
    name: ClassVar[str]

    def __init__(self, provisioner: GpushareProvisioner) -> None:
        self.provisioner = provisioner
        self.log = provisioner.log

    def record_extra(self) -> dict[str, Any]:
        """Fields this backend adds to a new record's ``extra`` (e.g. the local user's uid,
        by which the node agent shows a user their own shares)."""
        return {}

    # -- the share's world ---------------------------------------------------------------------

    @abstractmethod
    async def ledger(self) -> Ledger:
        """The ledger this backend's allocations live in (shared by all kernels of a server)."""

    @abstractmethod
    async def inventory(self) -> Sequence[Gpu]:
        """The GPUs placement may choose from."""

    # -- the kernel's lifecycle (same meaning as jupyter_client's provisioner methods) ----------

    @abstractmethod
    async def pre_launch(self, allocation: Allocation, **kwargs: Any) -> dict[str, Any]:
        """Prepare the launch of a kernel holding ``allocation``; return kwargs with ``cmd``."""

    @abstractmethod
    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the kernel; return its connection info."""

    async def post_launch(self, **kwargs: Any) -> None:  # noqa: B027 - optional hook
        """After launch (optional)."""

    @abstractmethod
    def process_identity(self) -> tuple[int | None, float | None]:
        """``(pid, start_time)`` of the kernel process where the backend can see it, for
        reconciliation and the node daemon's peer check; ``(None, None)`` otherwise."""

    @property
    @abstractmethod
    def has_process(self) -> bool: ...

    @abstractmethod
    async def poll(self) -> int | None: ...

    @abstractmethod
    async def wait(self) -> int | None: ...

    @abstractmethod
    async def send_signal(self, signum: int) -> None: ...

    @abstractmethod
    async def kill(self, restart: bool = False) -> None: ...

    @abstractmethod
    async def terminate(self, restart: bool = False) -> None: ...

    @abstractmethod
    async def cleanup(self, restart: bool = False) -> None: ...

    async def shutdown_requested(self, restart: bool = False) -> None:  # noqa: B027
        """A graceful shutdown was asked for (optional)."""

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return recommended

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        return recommended

    async def get_provisioner_info(self) -> dict[str, Any]:
        return {}

    async def load_provisioner_info(self, info: dict[str, Any]) -> None:  # noqa: B027
        """Restore state saved by :meth:`get_provisioner_info` (optional)."""

    def resolve_path(self, path_str: str) -> str | None:
        return None


__all__ = ["Backend", "KernelBackend"]
