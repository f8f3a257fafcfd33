"""The wire format between the node daemon and the interposer (boxes 6 and 7): control version 4
(served from version 3), shared-memory layout 3.

Two channels: newline-delimited JSON on the agent's unix socket (``hello``, ``want``, ``done``,
``status``, …; the lease memory comes as descriptors over it, never as a path), and shared memory
split by who may write it (the lease board per GPU, the read-only policy per GPU, the account per
share). The specification of both — every message, every field and who writes it, fail static,
the direct handoff, the runahead bound, drain, lease extension, backfill, idle handback, the
refusals a CUDA program sees, and when each version must change and how long an old one is
served — is the developer guide's ``docs/develop/wire.md``; change it with this module.

This module holds what both sides build on: the constants, the :class:`Header` and :class:`Slot`
layouts and :func:`negotiate`. The C side is ``csrc/include/gpushare_wire.h`` and must match it
(the tests compare the two: ``tests/enforcement/test_wire.py``).
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

#: the control version this agent speaks (``hello``'s ``v``); when it must change:
#: docs/develop/wire.md, "Versions and upgrades"
VERSION = 4
#: the oldest control version this agent still serves
OLDEST_VERSION = 3
#: the shared-memory layout (``Header.version`` of the board and policy files)
LAYOUT_VERSION = 3
MAGIC = 0x48535047  # "GPSH"
SLOTS = 64
HEADER_SIZE = 256
SLOT_SIZE = 256
FILE_SIZE = HEADER_SIZE + SLOTS * SLOT_SIZE
#: An account file is one slot (only its account fields are used).
ACCOUNT_SIZE = SLOT_SIZE
MAX_LINE = 65536
#: A client goes fail-static when the daemon's heartbeat is older than this.
HEARTBEAT_STALE_NS = 2_000_000_000

STATE_FREE = 0
STATE_ACTIVE = 1
STATE_RELEASED = 2

#: Error codes of refusals on the control socket.
E_NOT_PERMITTED = "not_permitted"
E_UNKNOWN_ALLOCATION = "unknown_allocation"
E_BAD_VERSION = "bad_version"
E_BAD_REQUEST = "bad_request"


class Header(ctypes.Structure):
    """The first 256 bytes of a GPU's shared-memory file (``gpushare_wire_header`` in C)."""

    _pack_ = 8
    _fields_ = [
        ("magic", ctypes.c_uint32),  # 0
        ("version", ctypes.c_uint32),  # 4
        ("slot_count", ctypes.c_uint32),  # 8
        ("slot_size", ctypes.c_uint32),  # 12
        ("daemon_pid", ctypes.c_uint64),  # 16
        ("epoch", ctypes.c_uint64),  # 24: bumped by every daemon start
        ("heartbeat_ns", ctypes.c_uint64),  # 32: CLOCK_MONOTONIC, refreshed every ~100 ms
        ("quantum_ns", ctypes.c_uint64),  # 40
        ("window_ns", ctypes.c_uint64),  # 48
        ("holder", ctypes.c_uint32),  # 56: slot index + 1 of the lease holder, 0 none
        ("waiting_slots", ctypes.c_uint32),  # 60: slots other than the holder that wait
        ("uuid", ctypes.c_char * 64),  # 64
        ("next_slot", ctypes.c_uint32),  # 128: slot + 1 the holder may hand the GPU to, 0 none
        ("next_other", ctypes.c_uint32),  # 132: the best of the others (holder idle), 0 none
        ("next_lease_ns", ctypes.c_uint64),  # 136: the lease to give it
        ("direct_handoffs", ctypes.c_uint64),  # 144: handoffs done by clients (atomic add)
        ("backfill_until_ns", ctypes.c_uint64),  # 152: a backfill runs until then (clients, CAS)
        ("backfills", ctypes.c_uint64),  # 160: backfill launches (clients, atomic add)
        ("_pad", ctypes.c_uint8 * 88),  # 168
    ]


class Slot(ctypes.Structure):
    """One (allocation, GPU) slot (``gpushare_wire_slot`` in C)."""

    _pack_ = 8
    _fields_ = [
        ("lease_until_ns", ctypes.c_uint64),  # 0   atomic; 0 = no lease
        ("lease_start_ns", ctypes.c_uint64),  # 8
        ("grant_seq", ctypes.c_uint32),  # 16  atomic; futex word
        ("state", ctypes.c_uint32),  # 20  atomic; STATE_*
        ("joined", ctypes.c_uint32),  # 24  atomic; processes that launched under the lease
        ("waiters", ctypes.c_uint32),  # 28  atomic; threads blocked for a lease
        ("mem_cap", ctypes.c_uint64),  # 32
        ("mem_used", ctypes.c_uint64),  # 40  atomic (CAS reserve, fetch_sub release)
        ("used_ns", ctypes.c_uint64),  # 48  device time charged so far (daemon)
        ("drain_end_ns", ctypes.c_uint64),  # 56  atomic max (clients)
        ("request_ppm", ctypes.c_uint32),  # 64  request in millionths of the GPU
        ("limit_ppm", ctypes.c_uint32),  # 68
        ("lease_waits", ctypes.c_uint64),  # 72  atomic add (clients): slow-path waits
        ("wait_ns", ctypes.c_uint64),  # 80  atomic add (clients): time spent waiting
        ("oom_count", ctypes.c_uint64),  # 88  atomic add (clients): refused allocations
        ("mem_peak", ctypes.c_uint64),  # 96  atomic max (clients)
        ("generation", ctypes.c_uint64),  # 104
        ("allocation", ctypes.c_char * 32),  # 112 allocation id, NUL-padded
        ("launches", ctypes.c_uint64),  # 144 atomic add (clients), batched per lease
        ("first_launch_ns", ctypes.c_uint64),  # 152 atomic min (clients): first join of a lease
        ("drain_eta_ns", ctypes.c_uint64),  # 160 (clients): a draining holder's expected end
        ("runahead_ns", ctypes.c_uint64),  # 168 (daemon): device time it may queue ahead, 0 any
        ("fs_next_ns", ctypes.c_uint64),  # 176 account, CAS (clients): last fail-static turn
        ("queued_until_ns", ctypes.c_uint64),  # 184 board, atomic max (holder): its queue's end
        ("backfill_cap_ns", ctypes.c_uint64),  # 192 policy (daemon): backfill_ns may reach this
        ("backfill_ns", ctypes.c_uint64),  # 200 account, atomic add (clients): time backfilled
        ("idle_ns", ctypes.c_uint64),  # 208 account, atomic add (clients): device idle in leases
        ("_pad", ctypes.c_uint8 * 40),  # 216
    ]


assert ctypes.sizeof(Header) == HEADER_SIZE
assert ctypes.sizeof(Slot) == SLOT_SIZE

#: Offsets the C header must reproduce (checked by the tests against ``gpushare_wire.h``).
HEADER_OFFSETS = {name: getattr(Header, name).offset for name, *_ in Header._fields_}
SLOT_OFFSETS = {name: getattr(Slot, name).offset for name, *_ in Slot._fields_}


def negotiate(message: dict[str, Any]) -> tuple[int, None] | tuple[None, dict[str, Any]]:
    """The control version to speak with a client whose ``hello`` is ``message`` (the newest
    one both sides speak), or a ``bad_version`` refusal naming the client's versions and the
    range this agent serves."""
    asked, oldest = message.get("v"), message.get("v_min", message.get("v"))
    served = f"this agent serves versions {OLDEST_VERSION} to {VERSION}"
    if not isinstance(asked, int) or not isinstance(oldest, int):
        why = f"hello: v and v_min must be wire versions (integers); got v={asked!r}, "
        why += f"v_min={oldest!r}; {served}"
    elif not (_is_version(asked) and _is_version(oldest) and oldest <= asked):
        why = f"hello: v={asked!r}, v_min={oldest!r} is not a range of wire versions; {served}"
    else:
        chosen = min(asked, VERSION)
        if chosen >= max(oldest, OLDEST_VERSION):
            return chosen, None
        spoken = f"version {asked}" if oldest == asked else f"versions {oldest} to {asked}"
        spoken = f"the gpushare interposer speaks wire {spoken}; {served}"
        if asked < OLDEST_VERSION:
            why = f"{spoken}: restart the kernel to load the interposer installed with this agent"
        else:
            why = f"{spoken} (it is older than the interposer): upgrade the agent"
    refused = refusal(E_BAD_VERSION, why)
    refused["oldest"], refused["current"] = OLDEST_VERSION, VERSION
    return None, refused


def _is_version(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31


class Encoded:
    """A JSON array whose items are encoded already: :func:`encode` splices them into the line
    as they are. The agent's snapshot replies use it (a record is encoded once and sent in
    every snapshot until it changes), which keeps JSON encoding off the placement path."""

    __slots__ = ("items",)

    def __init__(self, items: list[bytes]) -> None:
        self.items = items


def encode(message: dict[str, Any]) -> bytes:
    """One control message as a line (values that are :class:`Encoded` are spliced in)."""
    spliced = [(k, v) for k, v in message.items() if isinstance(v, Encoded)]
    if not spliced:
        return json.dumps(message, separators=(",", ":")).encode() + b"\n"
    rest = {k: v for k, v in message.items() if not isinstance(v, Encoded)}
    parts = [json.dumps(rest, separators=(",", ":")).encode()[:-1]]  # without its "}"
    for i, (key, value) in enumerate(spliced):
        if i or rest:
            parts.append(b",")
        parts += [json.dumps(key).encode(), b":[", b",".join(value.items), b"]"]
    parts.append(b"}\n")
    return b"".join(parts)


def decode(line: bytes) -> dict[str, Any]:
    """One control line as a message; raises ``ValueError`` on anything but a JSON object."""
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a control message is a JSON object")
    return message


def refusal(error: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": error, "message": message}


def ppm(fraction: float) -> int:
    return max(0, min(1_000_000, round(fraction * 1_000_000)))
