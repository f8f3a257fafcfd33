"""The interface between the gpushare provisioner and where a kernel runs.

:class:`~jupyter_gpushare.provisioner.GpushareProvisioner` owns the share: it validates the spec,
reserves it in the backend's ledger before launch and releases it on every exit path. A
:class:`KernelBackend` owns the kernel: it launches it with the allocation's GPU made visible,
watches it, signals it and cleans up. ``local`` (a process on this machine) and ``kubernetes`` (a
pod) are siblings behind this interface; neither knows of the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from jupyter_client.connect import KernelConnectionInfo

if TYPE_CHECKING:
    from ..inventory import Gpu
    from ..ledger import Allocation, Ledger
    from . import GpushareProvisioner


class KernelBackend(ABC):
    """How one gpushare kernel runs. One instance per provisioner (reused across restarts)."""

    #: the value of the provisioner's ``backend`` key that selects this backend
    name: ClassVar[str]

    def __init__(self, provisioner: GpushareProvisioner) -> None:
        self.provisioner = provisioner
        self.log = provisioner.log

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
