"""Where gpushare keeps its state on a machine; each path can be overridden by an env variable.

Finding the node agent (:func:`find_agent`, one function for every caller: users' servers,
``jupyter gpushare run``, the provisioner, kernels): ``GPUSHARE_SOCKET`` when it is set; else the
system agent's socket (:data:`SYSTEM_SOCKET`) when a system agent answers there (its ``ping``
says ``"system": true``, or nothing answers on that root-owned socket yet: the service is
restarting), or when this machine has a system agent at all (:func:`has_system_agent`: its
state directory or its systemd unit exists), running or not; else this user's own socket
(:func:`user_socket_path`), where a per-user agent is started on demand. With a system agent
nobody starts a per-user agent, and the ledger is the agent's
(:class:`~jupyter_gpushare.ledger.agent.AgentLedger`): while it is stopped, callers wait a
while for it and then fail with the reason, never keep a private ledger beside it (two ledgers
would book the same GPUs twice).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir, jupyter_runtime_dir

#: the system agent's socket and ledger (``jupyter gpushare daemon --system``)
SYSTEM_SOCKET = Path("/run/gpushare/daemon.sock")
SYSTEM_LEDGER = Path("/var/lib/gpushare/ledger.sqlite")
#: where an installed systemd unit of the system agent may be (deploy/systemd)
SYSTEM_UNITS = (
    Path("/etc/systemd/system/jupyter-gpushare-agent.service"),
    Path("/lib/systemd/system/jupyter-gpushare-agent.service"),
    Path("/usr/lib/systemd/system/jupyter-gpushare-agent.service"),
)

#: how long one discovery is reused (s): a ping per call would add a round trip to each
FIND_CACHE_S = 5.0


def ledger_path() -> Path:
    """The local SQLite ledger (``GPUSHARE_LEDGER``)."""
    env = os.environ.get("GPUSHARE_LEDGER")
    return Path(env) if env else Path(jupyter_data_dir()) / "gpushare" / "ledger.sqlite"


def user_socket_path() -> Path:
    """This user's own agent's socket (the per-user agent, started on demand)."""
    return Path(jupyter_runtime_dir()) / "gpushare" / "daemon.sock"


def socket_path() -> Path:
    """The node agent's unix socket: :func:`find_agent`'s (``GPUSHARE_SOCKET`` first)."""
    return find_agent().socket


@dataclass(frozen=True)
class AgentAddress:
    """Where the node agent for this process is, and whether it is the machine's system agent
    (then it owns the ledger: use :class:`~jupyter_gpushare.ledger.agent.AgentLedger`)."""

    socket: Path
    system: bool


_found: dict[str, tuple[float, AgentAddress]] = {}
_found_lock = threading.Lock()


def find_agent(*, fresh: bool = False) -> AgentAddress:
    """The agent this process should use (see the module docstring). Blocking (a ping of at
    most ~1 s on a unix socket); async callers run it in a thread or call it once at start."""
    env = os.environ.get("GPUSHARE_SOCKET", "")
    with _found_lock:
        cached = _found.get(env)
        if cached is not None and not fresh and time.monotonic() - cached[0] < FIND_CACHE_S:
            return cached[1]
    if env:
        found = AgentAddress(Path(env), is_system_agent(Path(env)))
    elif _root_owned(SYSTEM_SOCKET) and (
        is_system_agent(SYSTEM_SOCKET) or not _answers(SYSTEM_SOCKET)
    ):
        # the system service's own socket: while it restarts (nothing answers yet) callers
        # wait for it rather than start a private agent and ledger beside it
        found = AgentAddress(SYSTEM_SOCKET, True)
    elif has_system_agent():  # stopped (its socket removed): still the machine's only ledger
        found = AgentAddress(SYSTEM_SOCKET, True)
    else:
        found = AgentAddress(user_socket_path(), False)
    with _found_lock:
        _found[env] = (time.monotonic(), found)
    return found


def has_system_agent() -> bool:
    """Whether this machine has a system agent, running or not: its state directory (the
    ledger's, root's and private) or its systemd unit exists. Checked by ``lstat`` (a user
    cannot look inside the 0700 state directory, only see that it is there)."""
    try:
        state = os.lstat(SYSTEM_LEDGER.parent)
    except OSError:
        state = None
    if state is not None and state.st_uid == 0 and not state.st_mode & 0o022:
        return True
    return any(os.path.exists(unit) for unit in SYSTEM_UNITS)


def _root_owned(socket: Path) -> bool:
    """The socket and its directory belong to root and nobody else may write the directory
    (so what answers there is the system service, not something a user put in its place)."""
    try:
        directory, entry = os.lstat(socket.parent), os.lstat(socket)
    except OSError:
        return False
    return directory.st_uid == 0 and entry.st_uid == 0 and not directory.st_mode & 0o022


def _answers(path: Path) -> bool:
    """Whether anything accepts a connection on ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(1.0)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def is_system_agent(path: Path, timeout: float = 1.0) -> bool:
    """Whether a system agent answers on ``path`` (``ping`` says ``"system": true``), or serves
    it but not this user: a root-owned socket in a root-owned directory that refuses to connect
    (``--group``, and this user is not in the group). Such a user gets the agent's refusal, not
    a private agent of their own beside it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except PermissionError:
            return _root_owned(path)
        sock.sendall(b'{"op":"ping"}\n')
        data = b""
        while b"\n" not in data and len(data) < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                return False
            data += chunk
        reply = json.loads(data.split(b"\n", 1)[0])
        return isinstance(reply, dict) and reply.get("ok") is True and reply.get("system") is True
    except (OSError, ValueError):
        return False
    finally:
        sock.close()


def lib_dir() -> Path:
    """The built C libraries: ``libgpushare.so`` and ``sim/`` (the simulated driver and NVML)."""
    return Path(__file__).resolve().parent / "_lib"
