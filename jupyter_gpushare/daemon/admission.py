"""Who is on the other end of the agent's socket, and whether the agent lets them in (box 6).

The trust edge of the node agent's control socket. :func:`read_peer` is the one place a caller's
identity is read: the kernel's credentials of the connecting process (``SO_PEERCRED``: PID, uid,
gid), its start time (read at once, through a pidfd of that process where the kernel has
``SO_PEERPIDFD``: what tells it from a later process on its PID), the kernel pod it runs in (its
cgroups, :func:`.identity.pod_uid_of`) and whether it is an admin (uid 0, the agent's own uid or
a member of the admin group; never a process in a kernel pod). Everything behind it
(:class:`Admission`, the status filter, the peer checks) takes the :class:`Peer` it returns.

:class:`Admission` keeps one client from taking the agent's descriptors from the others: at most
``per_uid`` connections per uid (uid 0 and the agent's own uid are exempt) and ``per_pod`` per
kernel pod (pods often share one uid, so a pod is counted as itself); and once fewer than
``reserve`` descriptors are free, only admins and peers that hold a share on this node may open a
connection. A refused connection is closed at once.

:class:`Listener` accepts connections itself rather than through asyncio's server, one at a time,
so that each is admitted or refused (and closed) before the next is accepted: asyncio's server
accepts a whole backlog first, which can run the agent out of descriptors before any admission
check runs, and then stops accepting, honest clients too, for a second at a time.
"""

from __future__ import annotations

import asyncio
import errno
import grp
import logging
import os
import pwd
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .identity import connector_start, pod_uid_of
from .ratelog import RateLimitedLog

log = logging.getLogger("jupyter_gpushare.daemon")

#: how long a uid's user name and group list are cached (s)
NAME_CACHE_S = 30.0


@dataclass(frozen=True)
class Peer:
    """The checked identity of a connected process."""

    pid: int
    uid: int
    gid: int
    #: UID of the kernel pod it runs in (None: not in a pod, or in the agent's own pod)
    pod: str | None
    #: uid 0, the agent's own uid or a member of the admin group, and not in a kernel pod
    admin: bool
    #: the start time of the process that connected, read when it was accepted
    #: (:func:`.identity.connector_start`); None when it was gone by then, or not read (an
    #: in-process caller): such a peer is never taken for a share's process
    start: float | None = None

    @property
    def counted_as(self) -> str:
        """What the connection caps count it under: its pod, else its uid."""
        return f"pod {self.pod}" if self.pod else f"uid {self.uid}"


class Admins:
    """Who is an admin of this agent: uid 0, the agent's own uid, members of ``group``."""

    def __init__(self, group: str | None = None) -> None:
        self.euid = os.geteuid()
        self.own_pod = pod_uid_of(os.getpid())
        self.group = group or None
        self.gid: int | None = None
        if self.group is not None:
            try:
                self.gid = grp.getgrnam(self.group).gr_gid
            except KeyError:
                raise ValueError(f"--admin-group {self.group!r}: no such group") from None
        self._groups: dict[int, tuple[float, frozenset[int]]] = {}

    def admits(self, uid: int, gid: int) -> bool:
        if uid in (0, self.euid):
            return True
        if self.gid is None:
            return False
        return gid == self.gid or self.gid in self._groups_of(uid)

    def _groups_of(self, uid: int) -> frozenset[int]:
        now = time.monotonic()
        cached = self._groups.get(uid)
        if cached is not None and now - cached[0] < NAME_CACHE_S:
            return cached[1]
        try:
            entry = pwd.getpwuid(uid)
            groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
        except (KeyError, OSError):
            groups = frozenset()
        if len(self._groups) > 4096:
            self._groups.clear()
        self._groups[uid] = (now, groups)
        return groups


def read_peer(sock: socket.socket, admins: Admins) -> Peer:
    """The identity of the process at the other end of ``sock`` (a unix stream socket), from the
    kernel, not from anything the process says."""
    pid, uid, gid = struct.unpack(
        "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    start = connector_start(sock, pid)
    pod = pod_uid_of(pid)
    if pod is not None and pod == admins.own_pod:
        pod = None  # the agent's own pod (or container) is its local side
    return Peer(pid, uid, gid, pod, admin=pod is None and admins.admits(uid, gid), start=start)


def user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class Admission:
    """Connection caps and the descriptor reserve (see the module's doc)."""

    def __init__(
        self,
        per_uid: int,
        per_pod: int,
        reserve: int,
        fd_limit: Callable[[], int] | None = None,
        open_fds: Callable[[], int] | None = None,
    ) -> None:
        self.per_uid = per_uid
        self.per_pod = per_pod
        self.reserve = reserve
        self.exempt = {0, os.geteuid()}
        self.connections: Counter[str] = Counter()
        self.refused = 0
        self._fd_limit = fd_limit or (lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        self._open_fds = open_fds or _count_open_fds
        self._measured = 0  # open descriptors at the last count
        self._measured_with = 0  # connections open then
        self._measured_at = -1e9

    @property
    def total(self) -> int:
        return sum(self.connections.values())

    def admit(self, peer: Peer, holds_share: Callable[[], bool]) -> str | None:
        """Counts ``peer``'s new connection and returns None, or says why it is refused.
        ``holds_share`` is asked only under the descriptor reserve."""
        key = peer.counted_as
        if peer.pod is not None:
            cap: int | None = self.per_pod
        else:
            cap = None if peer.uid in self.exempt else self.per_uid
        if cap is not None and self.connections[key] >= cap:
            self.refused += 1
            return (
                f"{key} already has {self.connections[key]} connections to the gpushare agent "
                f"(at most {cap}); close some"
            )
        if not peer.admin and self.free_fds() < self.reserve and not holds_share():
            self.refused += 1
            return (
                "the gpushare agent is short of file descriptors; its last "
                f"{self.reserve} are kept for processes that hold a GPU share"
            )
        self.connections[key] += 1
        return None

    def left(self, peer: Peer) -> None:
        key = peer.counted_as
        self.connections[key] -= 1
        if self.connections[key] <= 0:
            del self.connections[key]

    def free_fds(self) -> int:
        """Descriptors still free (estimated between counts: a count of ``/proc/self/fd`` costs
        a directory read, so it is redone only every second or near the limit)."""
        limit = self._fd_limit()
        total = self.total
        estimate = self._measured + (total - self._measured_with)
        now = time.monotonic()
        if now - self._measured_at > 1.0 or limit - estimate < 4 * self.reserve + 128:
            self._measured = self._open_fds()
            self._measured_with = total
            self._measured_at = now
            estimate = self._measured
        return limit - estimate


def _count_open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class Listener:
    """The agent's listening unix socket; ``accepted`` gets each new connection (non-blocking)
    and must admit it or close it before returning."""

    #: connections accepted per turn of the event loop (then the others get a turn)
    PER_TURN = 64

    def __init__(
        self,
        path: str,
        backlog: int,
        accepted: Callable[[socket.socket], None],
        mode: int = 0o666,
        gid: int | None = None,
    ) -> None:
        """``mode`` and ``gid`` are the socket file's before it listens, so no process ever
        finds it with another mode (0666: callers are known by their credentials; 0660 with a
        group: only its members may connect)."""
        self.loop = asyncio.get_running_loop()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(path)
            if gid is not None:
                os.chown(path, 0 if os.geteuid() == 0 else -1, gid)
            os.chmod(path, mode)
            self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.accepted = accepted
        self.short = RateLimitedLog(log, "accepting a connection failed")
        self.closed = False
        self.loop.add_reader(self.sock.fileno(), self._ready)

    def _ready(self) -> None:
        for _ in range(self.PER_TURN):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                self.short.ok()
                return
            except OSError as exc:
                if exc.errno not in (
                    errno.EMFILE,
                    errno.ENFILE,
                    errno.ENOBUFS,
                    errno.ENOMEM,
                    errno.ECONNABORTED,
                ):
                    raise
                self.short.failed(str(exc))
                if exc.errno != errno.ECONNABORTED:  # out of resources: try again shortly
                    self.loop.remove_reader(self.sock.fileno())
                    self.loop.call_later(0.05, self._resume)
                    return
                continue
            conn.setblocking(False)
            try:
                self.accepted(conn)
            except Exception:  # a bug: this connection is lost, the listener goes on
                log.exception("admitting a connection failed")
                conn.close()

    def _resume(self) -> None:
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._ready)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
