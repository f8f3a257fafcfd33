"""Exactly one node agent per socket: an exclusive ``flock`` on ``<socket>.lock``.

An agent takes the lock before it unlinks and binds its socket, and holds it (an open descriptor)
until it exits, so however many agents start at once on one socket — a system service, eight
``jupyter gpushare run`` started together, a server and a notebook — one serves it and the others
exit 0 naming the pid that serves it. The kernel drops the lock with the process, so a crashed
agent never leaves a stale lock.

Nothing is created through a path another user could have prepared: the socket's directory must
be a real directory (not a symlink) owned by this user or root and writable by nobody else, and
the lock file is opened ``O_NOFOLLOW`` with mode 0600.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path


class UnsafeDirectory(RuntimeError):
    """The socket's (or ledger's) directory could have been prepared by another user."""


def ensure_private_dir(path: Path, mode: int, exact: bool = True) -> None:
    """Make ``path`` a directory with ``mode`` (create it, or set the mode of one of ours; with
    ``exact`` false only take group and other write away); refuse one that is a symlink, not a
    directory, or owned by another user."""
    try:
        path.mkdir(parents=True, mode=mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        wanted = mode if exact else stat.S_IMODE(st.st_mode) & ~0o022
        if stat.S_IMODE(st.st_mode) != wanted:
            os.chmod(path, wanted)
    check_dir(path)


def check_dir(path: Path) -> None:
    """Refuse a directory another user could write in (or one that is a symlink)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a symlink or a file)")
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirectory(
            f"{path} is owned by uid {st.st_uid}, not by uid {os.geteuid()} or root"
        )
    if st.st_mode & 0o022:
        raise UnsafeDirectory(
            f"{path} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}); the agent's socket needs a "
            "directory only its owner can write"
        )


def lock_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".lock")


def take(socket_path: Path) -> int | None:
    """Take the agent lock of ``socket_path``: the open descriptor (keep it for the life of the
    agent), or None when another agent holds it. Raises :class:`UnsafeDirectory`."""
    check_dir(socket_path.parent)
    fd = os.open(
        lock_path(socket_path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()):
            raise UnsafeDirectory(f"{lock_path(socket_path)} is not a file of this user")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def holder(socket_path: Path) -> int | None:
    """The pid written by the agent that holds the lock (None when unreadable: another user's
    agent, whose lock file this user may not open)."""
    try:
        text = lock_path(socket_path).read_text()
        return int(text.strip()) if text.strip() else None
    except (OSError, ValueError):
        return None
