"""The daemon's side of the per-GPU shared-memory files (layout in :mod:`.wire`).

The daemon writes whole 8-byte aligned words (single stores on the 64-bit platforms we support)
and wakes waiters with a shared ``FUTEX_WAKE``; the clients do the atomic read-modify-writes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

from . import wire

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine, 202)
_FUTEX_WAKE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock of every timestamp in the shared files."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def futex_wake(address: int) -> None:
    _libc.syscall(
        ctypes.c_long(_SYS_FUTEX),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(2**31 - 1),
        None,
        None,
        ctypes.c_int(0),
    )


class GpuShm:
    """One GPU's shared-memory file, created or (after a daemon restart) reused."""

    def __init__(self, path: Path, uuid: str, quantum_ns: int, window_ns: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            os.fchmod(fd, 0o666)  # kernels may run as other users on a shared node
            reused = os.fstat(fd).st_size == wire.FILE_SIZE
            if not reused:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, wire.FILE_SIZE)
            self._map = mmap.mmap(fd, wire.FILE_SIZE, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.header = wire.Header.from_buffer(self._map, 0)
        self.slots = [
            wire.Slot.from_buffer(self._map, wire.HEADER_SIZE + i * wire.SLOT_SIZE)
            for i in range(wire.SLOTS)
        ]
        h = self.header
        self.reused = reused and h.magic == wire.MAGIC and h.version == wire.VERSION
        if not self.reused:
            ctypes.memset(ctypes.addressof(h), 0, wire.FILE_SIZE)
        h.slot_count = wire.SLOTS
        h.slot_size = wire.SLOT_SIZE
        h.daemon_pid = os.getpid()
        h.epoch = h.epoch + 1
        h.quantum_ns = quantum_ns
        h.window_ns = window_ns
        h.uuid = uuid.encode()[:63]
        h.holder = 0
        h.waiting_slots = 0
        h.next_slot = h.next_other = 0  # a dead daemon's pick is no handoff target
        for slot in self.slots:  # leases do not survive a daemon; memory reservations do
            slot.lease_until_ns = 0
            slot.joined = 0
            slot.waiters = 0
            slot.runahead_ns = 0
        self.heartbeat()
        h.version = wire.VERSION
        h.magic = wire.MAGIC  # last: a client checks it before anything else

    def heartbeat(self) -> None:
        self.header.heartbeat_ns = monotonic_ns()

    def wake(self, index: int) -> None:
        slot = self.slots[index]
        slot.grant_seq = (slot.grant_seq + 1) & 0xFFFFFFFF
        futex_wake(ctypes.addressof(slot) + wire.Slot.grant_seq.offset)

    def slot_of(self, allocation_id: str) -> int | None:
        key = allocation_id.encode()
        for i, slot in enumerate(self.slots):
            if slot.state != wire.STATE_FREE and slot.allocation == key:
                return i
        return None

    def claim(self, allocation_id: str, request: float, limit: float, memory: int,
              busy: set[int]) -> int | None:
        """A slot for a new allocation: a free one, else a released one nobody maps."""
        order = sorted(
            range(wire.SLOTS),
            key=lambda i: (self.slots[i].state != wire.STATE_FREE, self.slots[i].generation),
        )
        for i in order:
            slot = self.slots[i]
            if slot.state == wire.STATE_ACTIVE or i in busy:
                continue
            slot.generation += 1
            slot.allocation = allocation_id.encode()[:31]
            slot.mem_used = 0
            slot.mem_peak = 0
            slot.used_ns = 0
            slot.lease_waits = slot.wait_ns = slot.oom_count = slot.launches = 0
            slot.lease_until_ns = 0
            slot.joined = slot.waiters = 0
            self.configure(i, request, limit, memory)
            slot.state = wire.STATE_ACTIVE
            return i
        return None

    def configure(self, index: int, request: float, limit: float, memory: int) -> None:
        slot = self.slots[index]
        slot.request_ppm = wire.ppm(request)
        slot.limit_ppm = wire.ppm(limit)
        slot.mem_cap = memory

    def release(self, index: int) -> None:
        slot = self.slots[index]
        slot.state = wire.STATE_RELEASED
        slot.lease_until_ns = 0
        self.wake(index)

    def close(self) -> None:
        self.header = None  # type: ignore[assignment]
        self.slots = []
        try:
            self._map.close()
        except BufferError:  # a ctypes view is still alive; the mapping goes with the process
            pass
