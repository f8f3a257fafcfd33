"""A small synchronous client of the daemon's control socket (status, refresh, ping).

Used by the server extension, ``jupyter gpushare status`` and the notebook panel. Each call opens
its own connection (cheap on a unix socket), so an instance is safe to share between threads.
Async callers: run it with ``asyncio.to_thread``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from . import wire


class DaemonUnreachable(ConnectionError):
    """Nothing answers on the node agent's socket (the notebook side's refusal of the same name
    subclasses it)."""


class DaemonClient:
    def __init__(self, socket_path: str | Path, timeout: float = 5.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            try:
                sock.connect(str(self.socket_path))
            except OSError as exc:
                raise DaemonUnreachable(
                    f"no gpushare daemon answers on {self.socket_path}: {exc}"
                ) from exc
            sock.sendall(wire.encode(message))
            data = bytearray()
            while b"\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise DaemonUnreachable("the gpushare daemon closed the connection")
                data += chunk
            return wire.decode(bytes(data[: data.index(b"\n")]))
        finally:
            sock.close()

    def status(self, allocation_id: str | None = None) -> dict[str, Any]:
        """The daemon's status: ``{"ok", "daemon", "allocations": [...], "gpus": [...]}``;
        with ``allocation_id`` only that allocation (``ok`` false if unknown)."""
        message: dict[str, Any] = {"op": "status"}
        if allocation_id is not None:
            message["allocation"] = allocation_id
        return self.request(message)

    def refresh(self) -> None:
        """Make the daemon re-read the ledger now (after an allocation changed)."""
        self.request({"op": "refresh"})

    # -- a kernel's own share (see :mod:`.kernel_ops`; the daemon checks the caller's process) --

    def release(self, allocation_id: str) -> dict[str, Any]:
        """Give the calling process's share back: ``{"ok", "released"}`` or a refusal."""
        return self.request({"op": "release", "allocation": allocation_id})

    def resize(self, allocation_id: str, share: dict[str, Any]) -> dict[str, Any]:
        """Change the calling process's share live on its GPU (request, limit, memory)."""
        return self.request({"op": "resize", "allocation": allocation_id, "share": share})

    def reserve(self, share: dict[str, Any]) -> dict[str, Any]:
        """A new share for the kernel of a process that released its share here."""
        return self.request({"op": "reserve", "share": share})

    def gpus(self) -> dict[str, Any]:
        """Every GPU in the ledger with its free capacity."""
        return self.request({"op": "gpus"})

    def ping(self) -> dict[str, Any]:
        return self.request({"op": "ping"})

    def alive(self) -> bool:
        try:
            return bool(self.ping().get("ok"))
        except (DaemonUnreachable, OSError, ValueError):
            return False
