"""A preemption wakes the holder's agents at once (wire.py, ``revoked``): the agent no longer
looks at its board every 0.25 ms while it may be preempted (tests/enforcement/test_drain_cpu.py
counts its CPU time), so the daemon tells it. A client that does not read its socket must not
make the daemon buffer lines for it without bound."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

from jupyter_gpushare.daemon.server import Daemon


@dataclass(eq=False)
class FakeTransport:
    """What _tell_revoked uses of an asyncio transport."""

    buffered: int = 0
    closing: bool = False
    written: list[bytes] = field(default_factory=list)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        self.written.append(data)


@dataclass(eq=False)
class FakeClient:
    transport: FakeTransport
    tenants: list


def _client(gpu, tenant, **transport) -> FakeClient:
    return FakeClient(FakeTransport(**transport), [(gpu, tenant)])


def test_only_the_revoked_tenants_reading_clients_are_told():
    gpu = SimpleNamespace(uuid="GPU-1")
    holder, other = object(), object()
    reading = _client(gpu, holder)
    second_process = _client(gpu, holder)
    not_reading = _client(gpu, holder, buffered=4096)  # replies unread: nothing more
    closing = _client(gpu, holder, closing=True)
    neighbour = _client(gpu, other)
    daemon = SimpleNamespace(clients={reading, second_process, not_reading, closing, neighbour})
    Daemon._tell_revoked(daemon, gpu, holder)  # type: ignore[arg-type]
    for told in (reading, second_process):
        (line,) = told.transport.written
        assert line.endswith(b"\n") and json.loads(line) == {"op": "revoked", "gpu": "GPU-1"}
    for untold in (not_reading, closing, neighbour):
        assert untold.transport.written == []
