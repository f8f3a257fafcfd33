"""Who a process is, as the node agent reads it itself: which pod it runs in, and the process
behind a PID (its start time, uids and parent), so the agent never acts on a process by its PID
alone (a PID is reused once its process exits).

Processes: :func:`identify` reads a live process's start time, parent and uids from /proc (the
start time before and after, so all belong to one process); :func:`connector_start` reads the
start time of the process that connected a unix socket, through a pidfd of that very process
where the kernel hands one out (``SO_PEERPIDFD``, Linux 6.5); :func:`lineage` is a process and
its ancestors with their start times. Start times are ``psutil``'s ``create_time``: the boot
time plus the start in clock ticks (1/100 s), so two processes on one PID differ unless both
started within one tick.

Pods:

A kernel in a pod has no host PID in its allocation record (the server cannot know it), so the
daemon identifies the pod instead: the kubelet puts every container's processes into a cgroup
whose path carries the pod's UID — ``…/kubepods/burstable/pod<uid>/<container>`` with the
cgroupfs driver, ``…/kubepods-burstable-pod<uid_with_underscores>.slice/…`` with the systemd
driver, in cgroup v1 and v2 alike. The path is set by the kubelet, not by the process, so a
process cannot claim another pod's identity. The daemon must see the node's processes
(``hostPID: true``) for the PID from ``SO_PEERCRED`` to mean a host process.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


def pod_uid_from_cgroups(text: str) -> str | None:
    """The pod UID in the text of a ``/proc/<pid>/cgroup`` file, or None (not in a pod)."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        match = _POD_UID.search(path)
        if match:
            return match.group(1).replace("_", "-")
    return None


def pod_uid_of(pid: int) -> str | None:
    """The UID of the pod process ``pid`` runs in; None when it is in none or is gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="ascii", errors="replace") as f:
            return pod_uid_from_cgroups(f.read())
    except OSError:
        return None


# -- processes ----------------------------------------------------------------------------------

#: ``SO_PEERPIDFD`` (Linux 6.5; Python names it from 3.13 on some platforms only)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)

_boot_time: float | None = None


def _stat(pid: int) -> tuple[float, int, bytes] | None:
    """``(start time, parent pid, state)`` from ``/proc/<pid>/stat``, or None (gone)."""
    global _boot_time
    if _boot_time is None:
        import psutil  # its boot time, so start times here are its create_time()

        _boot_time = psutil.boot_time()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return _boot_time + int(fields[19]) / os.sysconf("SC_CLK_TCK"), int(fields[1]), fields[0]
    except (OSError, IndexError, ValueError):
        return None


def identify(pid: int) -> tuple[float, int, frozenset[int]] | None:
    """``(start time, parent pid, {real uid, effective uid})`` of the live process ``pid``, or
    None when it is gone, a zombie, or the PID changed hands while it was read."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    first = _stat(pid)
    if first is None or first[2] == b"Z":
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            line = next(x for x in f if x.startswith(b"Uid:"))
        real, effective = (int(x) for x in line.split()[1:3])
    except (OSError, StopIteration, ValueError):
        return None
    again = _stat(pid)
    if again is None or again[0] != first[0]:
        return None
    return first[0], first[1], frozenset((real, effective))


def lineage(pid: int) -> dict[int, float]:
    """``pid`` and its ancestors, each with its start time (empty when it is gone)."""
    found: dict[int, float] = {}
    while pid > 0 and pid not in found and len(found) < 256:
        stat = _stat(pid)
        if stat is None:
            break
        found[pid] = stat[0]
        pid = stat[1]
    return found


def connector_start(sock: socket.socket, pid: int) -> float | None:
    """The start time of the process that connected ``sock`` (``pid``: its ``SO_PEERCRED``
    pid), or None when that process is gone. Where the kernel hands out a pidfd of the
    connecting process (``SO_PEERPIDFD``), the start time is read while that pidfd is held and
    kept only if its process is still alive after the read: it is then that very process's,
    even if another process held the PID before. Elsewhere it is the start time of the process
    on that PID at this moment (read right after the connection is accepted); the uid check of
    the agent's peer check tells apart another user's process that took the PID in between."""
    pidfd: int | None = None
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno not in (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP):
            return None  # ESRCH: the process that connected is gone
    try:
        stat = _stat(pid)
        if stat is None or stat[2] == b"Z":
            return None
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except PermissionError:
                pass  # alive, another user's (an agent that is not root)
            except OSError:
                return None
        return stat[0]
    finally:
        if pidfd is not None:
            os.close(pidfd)
