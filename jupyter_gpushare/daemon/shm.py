"""The daemon's side of the per-GPU shared-memory files (layout in :mod:`.wire`).

The daemon writes whole 8-byte aligned words (single stores on the 64-bit platforms we support)
and wakes waiters with a shared ``FUTEX_WAKE``; the clients do the atomic read-modify-writes.

The files live in the agent's private state directory (:class:`StateDir`): mode 0700, owned by
the agent, checked with ``lstat``/``fstat`` before use; every file in it is opened relative to the
directory's descriptor with ``O_NOFOLLOW`` (``O_EXCL`` when created), mode 0600, and checked by
``fstat`` before it is reused. No path leaves the agent: clients get the memory as descriptors
over the socket (``SCM_RIGHTS``, see :mod:`.wire`).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import socket
import stat
import tempfile
import time
from pathlib import Path

from . import wire

log = logging.getLogger("jupyter_gpushare.daemon")

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


class StateDirError(RuntimeError):
    """The agent's state directory is not safe to use (the message names the path and why)."""


def _owner_name(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private_dir(path: Path) -> os.stat_result:
    """``path`` is a real directory (not a symlink) owned by this process's euid with no group
    or other permission bits; else :class:`StateDirError` naming the path and its owner."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise StateDirError(f"state directory {path}: {exc.strerror}") from exc
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"is not owned by the agent ({_owner_name(os.geteuid())})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o} (need 0700: no group/other access)"
    if problem:
        raise StateDirError(
            f"refusing state directory {path}: it {problem}; owner "
            f"{_owner_name(st.st_uid)}. Remove it or pass another --state-dir."
        )
    return st


def is_private_dir(path: Path) -> bool:
    try:
        check_private_dir(path)
    except StateDirError:
        return False
    return True


def make_private_dir(path: Path) -> Path:
    """Creates ``path`` with mode 0700 (its missing parents with the default mode) unless it
    exists, then checks it (:func:`check_private_dir`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateDirError(f"state directory {path}: {exc.strerror}") from exc
    check_private_dir(path)
    return path


def fallback_state_dir(base: Path, name: str, alternative: Path) -> Path:
    """``base/name`` made private to us; when someone else prepared that name, a fresh directory
    with an unpredictable name in ``base`` (``tempfile.mkdtemp``: mode 0700, ``O_EXCL``); without
    a writable ``base``, ``alternative``."""
    if not (base.is_dir() and os.access(base, os.W_OK)):
        return alternative
    candidate = base / name
    try:
        return make_private_dir(candidate)
    except StateDirError as exc:
        fresh = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
        log.warning(
            "%s Using %s instead (lease memory of an earlier agent is not reused).", exc, fresh
        )
        return fresh


class StateDir:
    """The agent's private directory, held open: files are opened relative to its descriptor,
    so nothing done to the path after the check (a rename, a symlink swap) reaches them."""

    def __init__(self, path: Path) -> None:
        self.path = make_private_dir(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)  # what we hold, whatever the path names now
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise StateDirError(
                f"refusing state directory {path}: it changed while it was "
                f"opened (owner {_owner_name(st.st_uid)}, mode "
                f"{stat.S_IMODE(st.st_mode):04o})"
            )
        self.fd = fd

    def open_file(self, name: str, size: int, *, fresh: bool = False) -> tuple[int, bool]:
        """``(fd, reused)`` of the file ``name`` (``size`` bytes, mode 0600, read-write). An
        existing one is reused when it is a regular file of ours with that size (and ``fresh``
        is not set); anything else under that name is unlinked (never followed) and a new file
        created with ``O_EXCL``."""
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise StateDirError(f"state file name {name!r}: a plain file name is allowed")
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        if not fresh:
            try:
                fd = os.open(name, flags, dir_fd=self.fd)
            except FileNotFoundError:
                fd = -1
            except OSError:  # a symlink (ELOOP) or something we cannot open: replace it
                fd = -1
            if fd >= 0:
                st = os.fstat(fd)
                if (
                    stat.S_ISREG(st.st_mode)
                    and st.st_uid == os.geteuid()
                    and st.st_nlink == 1
                    and st.st_size == size
                ):
                    if stat.S_IMODE(st.st_mode) != 0o600:
                        os.fchmod(fd, 0o600)  # our own file, through its descriptor
                    return fd, True
                os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self.fd)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd, False

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def remove_if_empty(self) -> None:
        """Removes the directory when nothing is left in it (a ``--state-dir`` shared with other
        files stays)."""
        with contextlib.suppress(OSError):
            os.rmdir(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def send_line(transport: asyncio.Transport, line: bytes, fds: list[int]) -> None:
    """Writes ``line`` to a client; ``fds`` go with its first byte (``SCM_RIGHTS`` in one
    ``sendmsg``), so the client gets them with exactly this reply. That needs the transport's
    buffer to be empty (else the line would overtake earlier replies): a client that has not
    read its earlier replies, or whose socket buffer is full, is disconnected instead."""
    if not fds:
        transport.write(line)
        return
    if transport.get_write_buffer_size():
        log.debug("closing a connection: replies unread before a reply with descriptors")
        transport.abort()
        return
    raw = socket.socket(
        socket.AF_UNIX, socket.SOCK_STREAM, fileno=transport.get_extra_info("socket").fileno()
    )
    try:
        sent = raw.sendmsg(
            [line], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        )
    except OSError as exc:  # EAGAIN: its buffer is full of unread replies; or it is gone
        log.debug("closing a connection: sending descriptors failed: %s", exc)
        transport.abort()
        return
    finally:
        raw.detach()  # the transport owns the descriptor
    if sent < len(line):
        transport.write(line[sent:])


def reopen_readonly(fd: int) -> int:
    """A new read-only open file description of ``fd``'s file: a client given it cannot map it
    writable (``mmap(PROT_WRITE, MAP_SHARED)`` fails with ``EACCES``)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class GpuShm:
    """One GPU's lease memory (layouts in :mod:`.wire`), created or, after an agent restart,
    reused (memory already reserved is kept). Three kinds of file in the private state directory,
    each kept open: what a client's ``hello`` reply carries.

    - ``<uuid>.board``: the lease board, read-write for every tenant of the GPU (the direct
      handoff needs it): the header and each slot's lease fields.
    - ``<uuid>.policy``: per slot the allocation, state, generation, cap, request, limit and
      runahead bound; written by the agent only, given to clients read-only
      (:func:`reopen_readonly`).
    - ``<uuid>.<slot>.account``: one slot's memory account and wait counters, given only to the
      processes of the allocation that holds the slot; a new file for every new allocation, so a
      former holder's mapping cannot touch its successor's account.
    """

    def __init__(self, state: StateDir, uuid: str, quantum_ns: int, window_ns: int) -> None:
        self.state = state
        self.uuid = uuid
        self.path = state.path
        self.board_fd, board_reused = state.open_file(f"{uuid}.board", wire.FILE_SIZE)
        self.policy_fd, policy_reused = state.open_file(f"{uuid}.policy", wire.FILE_SIZE)
        self.policy_ro_fd = reopen_readonly(self.policy_fd)
        self._board_map = mmap.mmap(self.board_fd, wire.FILE_SIZE, mmap.MAP_SHARED)
        self._policy_map = mmap.mmap(self.policy_fd, wire.FILE_SIZE, mmap.MAP_SHARED)
        self.header = wire.Header.from_buffer(self._board_map, 0)
        self.policy_header = wire.Header.from_buffer(self._policy_map, 0)
        self.board = _slots(self._board_map)
        self.policy = _slots(self._policy_map)
        self._accounts: dict[int, tuple[int, mmap.mmap, wire.Slot]] = {}
        h, ph = self.header, self.policy_header
        self.reused = policy_reused and ph.magic == wire.MAGIC and ph.version == wire.LAYOUT_VERSION
        if not self.reused:
            ctypes.memset(ctypes.addressof(ph), 0, wire.FILE_SIZE)
        if not (board_reused and h.magic == wire.MAGIC and h.version == wire.LAYOUT_VERSION):
            ctypes.memset(ctypes.addressof(h), 0, wire.FILE_SIZE)
        # the policy's epoch is the agent's own; the board's is the tenants' to write (only a
        # fresh policy file takes it, bounded, so that epochs still move on after a restart)
        epoch = (int(ph.epoch) if self.reused else min(int(h.epoch), 2**48)) + 1
        for header in (h, ph):
            header.slot_count = wire.SLOTS
            header.slot_size = wire.SLOT_SIZE
            header.daemon_pid = os.getpid()
            header.epoch = epoch
            header.quantum_ns = quantum_ns
            header.window_ns = window_ns
            header.uuid = uuid.encode()[:63]
        h.holder = 0
        h.waiting_slots = 0
        h.next_slot = h.next_other = 0  # a dead daemon's pick is no handoff target
        for i, slot in enumerate(self.board):  # leases do not survive an agent; memory does
            slot.lease_until_ns = 0
            slot.joined = 0
            slot.waiters = 0
            self.policy[i].runahead_ns = 0
            if self.policy[i].state == wire.STATE_ACTIVE:
                self.account(i)  # its account as it was (the memory its processes hold)
        self.heartbeat()
        for header in (ph, h):
            header.version = wire.LAYOUT_VERSION
            header.magic = wire.MAGIC  # last: a client checks it before anything else

    def heartbeat(self) -> None:
        self.header.heartbeat_ns = monotonic_ns()

    def wake(self, index: int) -> None:
        slot = self.board[index]
        slot.grant_seq = (slot.grant_seq + 1) & 0xFFFFFFFF
        futex_wake(ctypes.addressof(slot) + wire.Slot.grant_seq.offset)

    # -- accounts ----------------------------------------------------------------------------

    def account(self, index: int) -> wire.Slot:
        """Slot ``index``'s memory account (opened on first use: reused after a restart)."""
        if index not in self._accounts:
            self._open_account(index, fresh=False)
        return self._accounts[index][2]

    def account_fd(self, index: int) -> int:
        self.account(index)
        return self._accounts[index][0]

    def _open_account(self, index: int, fresh: bool) -> None:
        self._close_account(index)
        fd, _reused = self.state.open_file(
            f"{self.uuid}.{index}.account", wire.ACCOUNT_SIZE, fresh=fresh
        )
        mapping = mmap.mmap(fd, wire.ACCOUNT_SIZE, mmap.MAP_SHARED)
        self._accounts[index] = (fd, mapping, wire.Slot.from_buffer(mapping, 0))

    def _close_account(self, index: int) -> None:
        held = self._accounts.pop(index, None)
        if held is None:
            return
        fd, mapping, view = held
        del view, held
        with contextlib.suppress(BufferError):  # a view still alive: it goes with the process
            mapping.close()
        os.close(fd)

    # -- slots -------------------------------------------------------------------------------

    def slot_of(self, allocation_id: str) -> int | None:
        key = allocation_id.encode()
        for i, slot in enumerate(self.policy):
            if slot.state != wire.STATE_FREE and slot.allocation == key:
                return i
        return None

    def claim(
        self, allocation_id: str, request: float, limit: float, memory: int, busy: set[int]
    ) -> int | None:
        """A slot for a new allocation: a free one, else a released one nobody maps. It gets a
        new account file (a former holder's processes keep only the old one)."""
        order = sorted(
            range(wire.SLOTS),
            key=lambda i: (self.policy[i].state != wire.STATE_FREE, self.policy[i].generation),
        )
        for i in order:
            policy = self.policy[i]
            if policy.state == wire.STATE_ACTIVE or i in busy:
                continue
            policy.generation += 1
            policy.allocation = allocation_id.encode()[:31]
            policy.used_ns = 0
            policy.runahead_ns = 0
            self._open_account(i, fresh=True)
            board = self.board[i]
            board.launches = 0
            board.lease_until_ns = 0
            board.joined = board.waiters = 0
            self.configure(i, request, limit, memory)
            policy.state = wire.STATE_ACTIVE
            return i
        return None

    def configure(self, index: int, request: float, limit: float, memory: int) -> None:
        policy = self.policy[index]
        policy.request_ppm = wire.ppm(request)
        policy.limit_ppm = wire.ppm(limit)
        policy.mem_cap = memory

    def release(self, index: int) -> None:
        self.policy[index].state = wire.STATE_RELEASED
        self.board[index].lease_until_ns = 0
        self.wake(index)

    def idle(self) -> bool:
        """No slot holds an active share (nothing a restarted agent would need to keep)."""
        return all(slot.state != wire.STATE_ACTIVE for slot in self.policy)

    def discard(self) -> None:
        """Closes and unlinks this GPU's files (processes that still map them keep their
        copies); only when :meth:`idle`."""
        names = [
            f"{self.uuid}.board",
            f"{self.uuid}.policy",
            *(f"{self.uuid}.{i}.account" for i in range(wire.SLOTS)),
        ]
        self.close()
        for name in names:
            self.state.unlink(name)

    def fds(self, index: int) -> tuple[int, int, int]:
        """What a process of slot ``index``'s allocation gets: the board (read-write), the
        policy (read-only) and its own account (read-write)."""
        return self.board_fd, self.policy_ro_fd, self.account_fd(index)

    def close(self) -> None:
        self.header = self.policy_header = None  # type: ignore[assignment]
        self.board = []
        self.policy = []
        for index in list(self._accounts):
            self._close_account(index)
        for mapping in (self._board_map, self._policy_map):
            with contextlib.suppress(BufferError):  # a view still alive: goes with the process
                mapping.close()
        for fd in (self.board_fd, self.policy_fd, self.policy_ro_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _slots(mapping: mmap.mmap) -> list[wire.Slot]:
    return [
        wire.Slot.from_buffer(mapping, wire.HEADER_SIZE + i * wire.SLOT_SIZE)
        for i in range(wire.SLOTS)
    ]
