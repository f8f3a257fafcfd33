"""The wire format between the node daemon and the interposer (boxes 6 and 7): control version 4
(served from version 3, see "Versions and upgrades"), shared-memory layout 3.

Written down once here; the C side is ``csrc/include/gpushare_wire.h`` and must match it (the
tests compare the two: ``tests/enforcement/test_wire.py``).

Two channels
============

1. **Control: the daemon's unix stream socket** (``GPUSHARE_SOCKET``). Newline-delimited JSON,
   one object per line, UTF-8, at most :data:`MAX_LINE` bytes. Every request has ``"op"``;
   requests that expect an answer get exactly one reply line, in order. Replies carry ``"ok"``;
   refusals are ``{"ok": false, "error": <code>, "message": <text>}``.

   ``hello`` (client → daemon, first message of an interposed process)::

       {"op": "hello", "v": 4, "v_min": 3, "allocation": "a-…", "pid": 1234, "gpus": ["GPU-…", …]}

   ``v`` is the newest control version the client speaks, ``v_min`` (optional, default ``v``)
   the oldest; the daemon answers in the newest version both sides speak and names it in the
   reply's ``v`` (:func:`negotiate`).

   The daemon checks the peer's credentials (``SO_PEERCRED``): the connecting pid must be the
   allocation's ``pid`` (with a matching ``pid_start``) or one of its descendants, still the
   process that connected (its start time as read when the connection was accepted), and run
   as the share's owner (``extra.uid``) unless it is an admin. A record without ``pid_start`` is
   trusted only while the process on its ``pid`` runs as its owner; the agent then records that
   process's start time (``Daemon._check_peer``). Reply::

       {"ok": true, "v": 4, "epoch": 7, "quantum_ns": …, "window_ns": …,
        "gpus": [{"uuid": "GPU-…", "board": 0, "policy": 1, "account": 2, "slot": 3,
                  "generation": 12}, …]}

   or ``{"ok": false, "error": "not_permitted" | "unknown_allocation" | "bad_version", …}``
   (``bad_version`` also carries ``"oldest"`` and ``"current"``, the versions this daemon
   serves, and its message names the client's version and that range).
   **No path crosses the socket**: the lease memory comes as file descriptors (``SCM_RIGHTS``)
   sent in the same ``sendmsg`` as the first byte of this reply line; ``"board"``, ``"policy"``
   and ``"account"`` are indexes into that array (see 2. below). The client receives them with
   ``recvmsg`` while it reads the line, maps them and closes them. The files behind them live in
   the agent's private state directory (mode 0700, files 0600, opened ``O_NOFOLLOW``/``O_EXCL``
   relative to the directory's descriptor; :mod:`.shm`), which no client can open.

   ``want`` (no reply): ``{"op": "want", "gpu": "GPU-…"}`` — a thread of this process is blocked
   waiting for a lease on that GPU (it already incremented the slot's ``waiters``).

   ``done`` (no reply): ``{"op": "done", "gpu": "GPU-…", "lease": <lease_until_ns>}`` — this
   process drained the streams it used under that lease (it already stored ``drain_end_ns`` and
   decremented ``joined``), or hands the lease back early because it went idle.

   From the agent, unasked: ``{"op": "revoked", "gpu": "GPU-…"}`` — the lease of this process's
   slot was ended early (a waiter below its request preempted it: ``lease_until_ns`` is 0 on the
   board). It only wakes the process's agent thread, which then sees the board and drains at once
   instead of at its next look (every millisecond while it holds a lease); clients read and
   discard whatever comes after the ``hello`` reply, so older clients are unaffected. It is not
   sent to a client with replies unread (the look finds the revocation then).

   ``status`` → ``{"ok": true, "allocations": […], "gpus": […], "daemon": {…}}`` (optionally
   ``"allocation": id`` to get one): only the caller's own shares (by its uid, user name,
   process or pod; admins see all); each GPU entry counts every share on it (``shares``,
   ``reserved_request``, ``free_request``, ``reserved_memory``) but names only the caller's
   (``allocations``, ``holder``). ``refresh`` → re-reads the ledger, ``{"ok": true}``;
   ``ping`` → ``{"ok": true, "v": 4, "v_min": 3, "epoch": …}`` (the control versions served).

   Limits per connection (DEVELOPING.md, "The agent's socket"): a line of at most
   :data:`MAX_LINE` bytes; the agent stops reading a client with 32 requests unanswered or 64 KiB
   of replies unread; 16 refused or unreadable requests in a row, or (before a ``hello``) no
   request for the idle timeout, close the connection; connections per uid and per pod are
   capped. A refused connection gets one refusal line and is closed.

   A kernel's own share (peer-checked like ``hello``; :mod:`.kernel_ops`): ``release``
   (``"allocation"``), ``resize`` (``"allocation"``, ``"share"``), ``reserve`` (``"share"``, after
   a release) and ``gpus`` (every GPU with its free capacity and number of ``shares``, naming
   only the caller's own ``allocations``).

   ``pids`` (``"allocation"``) → ``{"ok": true, "pids": [1234, …], "pid": 1240}``: the pids, as
   the agent sees them (``SO_PEERCRED``; host pids where the agent runs with hostPID), of the
   processes connected (``hello``) for that allocation, and the caller's own (a caller whose
   ``getpid()`` differs runs in a pid namespace of its own, a pod, and tells its processes in
   NVML's lists apart by this list only). Peer-checked like ``hello``, and a connection
   that said ``hello`` may ask only for its own allocation; another allocation's pids are never
   answered (``not_permitted``). The interposer asks on a connection of its own, at most about
   once a second, so that NVML's process lists inside a kernel pod (host pids, which the pod's
   /proc cannot see) show the share's own processes. A new request, not a new version: an older
   agent answers ``bad_request`` (unknown op), which the interposer takes as no pids.

2. **Hot state: shared memory, split by who may write it** (created by the agent, passed as
   descriptors, ``mmap``-ed ``MAP_SHARED``). One layout, :class:`Slot`, is used by three
   mappings; each uses only its own fields of it:

   - the **lease board**, one per GPU: a 256-byte :class:`Header` followed by :data:`SLOTS`
     slots of 256 bytes, one per (allocation, GPU). Read-write for every tenant of the GPU (the
     direct handoff below needs it): the header and the lease fields ``lease_until_ns``,
     ``lease_start_ns``, ``grant_seq``, ``joined``, ``waiters``, ``drain_end_ns``,
     ``first_launch_ns``, ``drain_eta_ns``, ``launches``.
   - the **policy**, one per GPU, same size: per slot ``state``, ``generation``, ``mem_cap``,
     ``request_ppm``, ``limit_ppm``, ``runahead_ns``, ``allocation`` and ``used_ns``. Written only
     by the agent; clients get a read-only descriptor (a new open of the file ``O_RDONLY``), so
     they cannot map it writable (``EACCES``), and the file is 0600 of the agent's user. The
     GPU's tenants can read it (each other's allocation id, state, cap, request and limit on
     that GPU; not their memory use, which is in the accounts).
   - the **account**, one per (allocation, GPU), one slot long (:data:`ACCOUNT_SIZE`):
     ``mem_used``, ``mem_peak``, ``oom_count``, ``lease_waits``, ``wait_ns``, ``fs_next_ns``
     (fail static, below). Given read-write only to the allocation's own authenticated
     processes; a slot reused by a new allocation gets a new file, so a former holder's mapping
     cannot touch it.

   What a hostile co-tenant on the same GPU can do: write the lease board, i.e. disturb
   time-sharing of that GPU (as it could by leaving the interposer). What it cannot do: change
   another share's state (release it), cap, request or limit, or its memory account — those
   descriptors never reach it. All integers are little-endian, naturally aligned; fields marked
   *atomic* are only accessed with atomic operations.

   The fast path of a launch is ``now < slot.lease_until_ns`` (one atomic load and a vDSO
   ``clock_gettime(CLOCK_MONOTONIC)``; no system call, no lock). Leases are exclusive per GPU: the
   daemon grants one slot at a time ``lease_until_ns = now + lease``, bumps ``grant_seq`` and
   wakes waiters with ``FUTEX_WAKE`` on it (a shared, non-private futex). To end a lease early it
   stores ``0`` (revoke). A process that launched under a lease ("joined": ``joined += 1`` once
   per lease) records an event on every stream it used, waits for them, stores
   ``drain_end_ns = max(drain_end_ns, now)``, decrements ``joined`` and sends ``done``. The daemon
   charges the slot ``drain_end_ns - lease_start_ns`` of device time and picks the next holder.

   Memory: the account's ``mem_used`` is reserved before every allocation with a compare-and-swap
   loop that never lets it exceed the policy's ``mem_cap`` and is given back with ``fetch_sub``
   when the driver call fails or the memory is freed. One account per (allocation, GPU) is shared
   by all processes of the allocation, forked children included, so they share one budget.

   ``state``: 0 free, 1 active, 2 released (the allocation left the ledger: launches and
   allocations fail with ``CUDA_ERROR_NOT_PERMITTED``). ``generation`` changes when a slot is
   reused; a client whose generation differs treats its share as released.

Fail static: when the socket breaks or ``heartbeat_ns`` is older than :data:`HEARTBEAT_STALE_NS`,
the share's processes grant its slot leases of one ``quantum`` themselves and keep reconnecting.
Each lease is charged as the agent would (``drain_end_ns - lease_start_ns``, once ``joined`` is back
to 0; at least ``quantum + runahead_ns`` when its drain ran past its end by more than a quarter
quantum: work queued at its end), and the next is due that time / ``request_ppm`` after the last one
was due. The pacing is the share's: the account's ``fs_next_ns`` (when its last lease was due; 0
none yet) is moved with a compare-and-swap by whichever process takes the turn, and the others join
that lease (paced per process, a share of N processes got about N times its request). ``fs_next_ns``
took 8 bytes of the slot's padding, which was always zero and which older clients neither read nor
write, so the layout version did not change. One share at a time: a share takes the GPU by moving
the header's ``holder`` to its slot, only from a holder whose lease is over and drained (``joined``
0, or 0.5 s past its end); a restarted agent clears ``holder``. Processes of one share that never
reached an agent (started while none answered) have no board or account yet and pace alone;
interposers from before ``fs_next_ns`` pace per process and ignore ``holder``. A restarted daemon
reuses the files in its state directory (same slots, same accounts: memory already reserved is kept;
a reconnecting client sees the same files by ``st_dev``/``st_ino`` and keeps its mappings), bumps
``epoch`` and clears leases.

Direct handoff (the daemon sets policy, the processes do the handoffs): while a lease runs the
daemon publishes in the header who should run next as if the lease ended now, ``next_slot`` (the
holder included) and ``next_other`` (the best of the others), with ``next_lease_ns``. The last
process of the holder to drain (``joined == 1``) hands the GPU over itself: to ``next_slot``, or
to ``next_other`` when it is ``next_slot`` itself but stopped launching (idle). It stores the next
slot's ``lease_start_ns``/``drain_end_ns``, moves ``holder`` with a compare-and-swap from its
own slot, clears ``next_slot``/``next_other``, stores the new ``lease_until_ns``, bumps its
``grant_seq`` and wakes it, then sends ``done`` with ``"handoff": slot``; the daemon adopts the
new holder when it sees ``holder`` moved. Without a published next holder it sends a plain
``done`` and the daemon grants. The board is the tenants' to write, so the daemon adopts only
what it offered: a handoff to a slot, or an extension by the holder, that it published as
``next_slot``/``next_other`` during that lease (any other move of ``holder`` is put back and the
lease written for it cleared; a holder outside the slots too), and a lease it adopts ends at
most one window after it saw it. A lease a tenant writes into its own slot therefore is no
grant: its device time shows in the driver's figures as time outside its leases, and the
agent's driver check pauses its processes (``daemon/driver_check.py``).

Runahead bound: the daemon publishes a slot's ``runahead_ns`` while the GPU has other tenants or
the slot has a limit below 1: an eighth of the quantum while the slot uses more than its request
in the window (it runs on time others may claim back: only such a holder is preempted), else one
quantum; 0 means no bound. Its processes then keep at most that much device time queued per stream
ahead of the device (estimated from timing events recorded before launches: device time per
launch from intervals in which the stream was busy; until that is known, nothing queued behind a
running launch), so a lease ends with at most that much work left to drain and is not charged for
seconds of work queued under it, a revoked lease drains in about ``runahead_ns``, and a waiter
below its request that preempts the holder runs within a fraction of a quantum. No launch is
queued whose work would end more than ``runahead_ns`` past the lease while work is in flight: a
lease of kernels longer than the quantum runs one of them. A lease that runs past its end is
charged the device time it took and the tenant's limit credit carries the debt
(scheduler.LimitCredit).

Drain end: every process records timing events ("marks") on its streams about every millisecond
of device work (more often under a runahead bound); from them the agent of a draining holder knows
when its queued work should be done (the newest completed mark's device time, anchored by the
lease's first event, plus the launches after it times the device time per launch). It stores that
in ``drain_eta_ns`` (for observers) and sleeps in the driver on its streams' blocking-sync events
until the device signals them (no polling: a thread spinning on a busy host is preempted for
milliseconds right at the handoff), so it grants the next holder one wake-up after the device's
end. The next holder sleeps on its ``grant_seq`` futex until the grant wakes it (a poller there
would share a CPU with the draining agent on a small host and delay it). A waiter sends ``want``
when it starts waiting and again at most every 10 ms.

Lease extension: when the daemon published the holder itself as ``next_slot`` (nobody else may
run now), the holder's agent does not drain at the end of its lease: it charges the old lease up
to now (``drain_end_ns``), stores ``lease_start_ns`` and a new ``lease_until_ns`` with a
compare-and-swap from the old value and sends ``done`` with ``"extended": true``. The daemon
waits ``EXTEND_GRACE_NS`` for that before it revokes a lease whose holder is next.

Backfill (sharing costs no device time): while the holder's host works (a sync per step: its
queue is empty), other shares' kernels fill the gaps, as they would without gpushare. The
holder's processes say when their queued work should be done, ``queued_until_ns`` on their
board slot (an atomic max, at each slow admission while others wait or once backfills began: the
known backlog, or now, plus the launches they may make before they look again times the device
time per launch; 0: a holder that does not say, an older interposer, which is never backfilled).
The agent publishes in each share's policy ``backfill_cap_ns``: its account's ``backfill_ns``
may grow up to it (``scheduler.backfill_allowance``: limit credit, the burst for an unlimited
share; shares above their request only when not ahead of a holder above its own, unless the
holder is host-bound, more than ``gpu_loop.IDLE_PART`` of its leases idle or backfilled;
renewed at every lease and tick; 0 more while no lease runs). A share waiting for a lease whose next launch
is known to take at most its ``runahead_ns`` and fits its allowance launches ONE kernel once
what is queued on the device (the holder's queue, then ``backfill_until_ns`` in the header, the
last backfill's expected end) is at most that launch long: it queues behind it and fills the
gap that follows however late its thread woke up; it moves ``backfill_until_ns`` with a
compare-and-swap. The holder's next launch waits behind it: at most the bound. The backfill is
timed on the device (an event before the launch on the share's idle stream, one after it; from
``backfill_until_ns``'s old value or the event's time, whichever is later) and added to the
account's ``backfill_ns``; the agent charges that to the share (window and limit credit) and
takes what others backfilled during a lease off its holder's charge. A process's next backfill
waits until the previous one is done and charged. A lease is charged the device time it used,
not its length: a holder process alone on one stream whose every launch is timed (a sync per
launch, or the bound's one at a time) adds to its account's ``idle_ns`` the time from one
launch's end to the next launch (less another share's backfill in between), and the agent takes
what it added during a lease off that lease; so a limited share alone gets min(limit, what it
uses without gpushare). The fields took padding that was always zero and that older clients
neither read nor write (like ``fs_next_ns``): an older agent publishes no allowance (no
backfill), an older holder publishes no ``queued_until_ns`` (not backfilled), so the layout
version did not change.

Idle handback: while other slots wait (``waiting_slots`` > 0), a holder whose process has not
launched for 1 ms and has no queued work left hands its lease back early (stores 0, drains, sends
``done``). A lease nobody launched under is taken back by the daemon after 3 ms.

Refusals as the CUDA program sees them: a process whose ``hello`` is refused, or whose slot turns
``released`` (the allocation left the ledger), gets ``CUDA_ERROR_NOT_PERMITTED`` (800) from every
launch and allocation path (and from context creation), with one line on stderr saying why
(``gpushare: GPU work refused (CUDA_ERROR_NOT_PERMITTED): …``); the interposer never exits or
aborts the process. Allocations over the cap return ``CUDA_ERROR_OUT_OF_MEMORY`` (2).

Versions and upgrades
=====================

Two numbers, changed for different reasons:

* :data:`VERSION` (``GPUSHARE_WIRE_VERSION`` in C), the **control** version: it must change
  when a message either side sends changes shape or meaning in a way the other side relies
  on (a field that becomes required, one removed or renamed, a value read differently, a new
  step in the ``hello`` exchange). Adding an optional field that the other side may ignore
  does not change it. Versions: 3, descriptors instead of paths (the board/policy/account
  split); 4, the ``hello`` names the range it speaks (``v_min``) and the reply names the
  version chosen.
* :data:`LAYOUT_VERSION` (``GPUSHARE_WIRE_LAYOUT_VERSION``; ``Header.version`` of the board
  and policy files), the **shared-memory layout**: it changes with the header/slot layout or
  the meaning of a field in it. A client refuses a board or policy whose ``magic`` or
  ``version`` differ (or whose policy slot names another allocation or generation). Since one
  file is mapped by every tenant of a GPU, an agent cannot serve two layouts from one file:
  a new layout needs a control version whose ``hello`` hands out files of that layout while
  the agent keeps the old files for old clients, and until an agent does that the layout
  stays.

**An agent serves a range of control versions**, [:data:`OLDEST_VERSION`, :data:`VERSION`]
(:func:`negotiate`): kernels keep the interposer they started with for their whole life, and
a node's agent is replaced under them (a DaemonSet rollout, a package upgrade of the system
service), after which every running interposer reconnects and says ``hello`` again at its own
version. **How long an old version is served**: :data:`OLDEST_VERSION` is raised only in a
release that comes at least one release after the one that moved :data:`VERSION` past it,
so an upgrade by one release never strands a running kernel (from N to N+1 an agent of N+1
serves every interposer of N; a kernel that outlives two upgrades must be restarted). The
other direction is covered too: a new interposer whose ``hello`` an agent from before version
ranges refuses with ``bad_version`` (a refusal without ``"current"``) says ``hello`` again at its
own oldest version (``GPUSHARE_WIRE_OLDEST_VERSION``), so kernels started on a node whose agent
has not been replaced yet keep working; an agent that serves ranges chose from ``v_min``
already. A ``hello`` outside the range is refused with ``bad_version``, whose message names the
client's versions and the range served (the interposer prints it with the
``CUDA_ERROR_NOT_PERMITTED`` of its launches). Tests: ``tests/enforcement/test_agent_upgrade.py``.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

#: the control version this agent speaks (``hello``'s ``v``); see "Versions and upgrades"
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
