"""Keep a node agent answering on this machine's socket (workstation mode), and confirm that
it applied a change.

- :func:`ensure_daemon` starts an agent as a child process when none answers. It is synchronous
  (a few ms when one answers; up to ``timeout`` s to start one); async callers use
  :func:`ensure_agent` (the settings' socket, ledger and GPUs; the call in a thread). Every way a
  share is used calls it first: the server extension at start, the provisioner before each local
  kernel launch (nbclient, papermill, ``jupyter console`` have no server), ``jupyter gpushare
  run``. The agent is started detached (its own session), so it outlives the process that
  started it and keeps enforcing for kernels that still run; a thread of the starting process
  waits for it (it is reaped when it exits, and its ``Popen`` is never collected while it runs:
  no ``ResourceWarning``). :func:`stop` ends one we started. Several starters at once are safe:
  the agent takes a lock on its socket and a second one exits 0 (``daemon/lock.py``).
- :class:`AgentWatch` is the server's supervision: every few seconds it pings the agent and
  starts a new one when it died (``kill -9``, a crash), so the server needs no restart.
- :func:`await_applied` is how a change is acknowledged only once it is in force: it asks the
  agent to re-read the ledger and checks the agent's ``status`` for the allocation shows the
  new request, limit and memory cap (or no longer shows a released one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traitlets import Float, TraitError, validate
from traitlets.config import Configurable

from .. import paths
from ..inventory import Gpu, simulate_text
from ..periodic import PeriodicTask
from .client import DaemonClient, DaemonUnreachable
from .env import enforcing, interposer_path

if TYPE_CHECKING:
    from ..config import GpuShare
    from ..ledger import Allocation

_log = logging.getLogger("jupyter_gpushare.daemon")

#: how long :func:`await_applied` waits for the agent to show a change (s)
APPLY_TIMEOUT_S = 1.0
#: ... and how long once it answers: an agent that is there but slow (a loaded host) is waited
#: for, where one that is not there is reported after APPLY_TIMEOUT_S
APPLY_ANSWERING_TIMEOUT_S = 5.0


def ensure_daemon(
    socket_path: Path,
    ledger_path: Path,
    simulate_devices: Sequence[Gpu] | None,
    node: str,
    log: logging.Logger | logging.LoggerAdapter | None = None,
    *,
    extra_args: Sequence[str] = (),
    log_file: Path | None = None,
    timeout: float = 20.0,
) -> subprocess.Popen[bytes] | None:
    """Make sure a daemon answers on ``socket_path``; returns the process we started, or None
    when one was already running. Raises ``RuntimeError`` when the started one never answers."""
    log = log or _log
    client = DaemonClient(socket_path, timeout=2.0)
    if client.alive():
        return None
    socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the user's alone
    cmd = [
        sys.executable,
        "-m",
        "jupyter_gpushare.daemon",
        "--socket",
        str(socket_path),
        "--ledger",
        str(ledger_path),
        "--node",
        node,
        *extra_args,
    ]
    if simulate_devices:
        cmd += ["--simulate-devices", simulate_text(simulate_devices)]
    log_file = log_file or socket_path.parent / "daemon.log"
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the daemon itself is never interposed
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    _reap_when_done(proc)
    log.info("started gpushare daemon (pid %d) on %s, log %s", proc.pid, socket_path, log_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.alive():
            return proc if proc.poll() is None else None
        if proc.poll() not in (None, 0):
            break  # it failed; 0: another agent took the socket's lock first and is starting
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"the gpushare daemon did not start; see {log_file}")


def _reap_when_done(proc: subprocess.Popen[bytes]) -> None:
    """Wait for ``proc`` in a daemon thread: it is reaped as soon as it exits (no zombie is
    left), and the thread keeps the ``Popen`` referenced while the detached agent runs, so it is
    never collected with its process still running (``ResourceWarning``)."""
    threading.Thread(target=proc.wait, name=f"gpushare-agent-{proc.pid}", daemon=True).start()


def _system_socket(socket_path: Path) -> bool:
    """The machine's system agent's socket: systemd starts and restarts that one, not us."""
    return Path(socket_path) == paths.SYSTEM_SOCKET


async def ensure_agent(
    settings: GpuShare,
    gpus: Sequence[Gpu],
    log: logging.Logger | logging.LoggerAdapter | Any = None,
) -> bool:
    """Make sure this machine's node agent answers (start one unless one does; the blocking
    part in a thread, never on the event loop). False when enforcement is off (logged); raises
    ``RuntimeError`` when no agent comes up (shares then fall back to the interposer's fail-static
    mode)."""
    log = log or _log
    if not enforcing(settings):
        log.warning(
            "gpushare: enforcement is off (enforce=%s, interposer %s); shares are bookkeeping only",
            settings.enforce,
            interposer_path(),
        )
        return False
    socket_path = Path(settings.socket_path)
    if _system_socket(socket_path):
        if not await asyncio.to_thread(DaemonClient(socket_path, timeout=2.0).alive):
            raise RuntimeError(
                f"the machine's gpushare agent does not answer on {socket_path} "
                "(it is a system service: systemctl status jupyter-gpushare-agent)"
            )
        return True
    await asyncio.to_thread(
        ensure_daemon,
        socket_path,
        Path(settings.ledger_path),
        [g for g in gpus if g.simulated] or None,
        settings.node_name,
        log,
    )
    return True


class AgentSupervision(Configurable):
    """How a Jupyter server supervises its node agent (``--AgentSupervision.interval=…``)."""

    interval = Float(
        2.0,
        config=True,
        help="Seconds between the server's checks that its node agent answers; an agent that "
        "died is started again (kernels keep running meanwhile under their interposer's "
        "fail-static limits). 0: no checks (the agent is supervised elsewhere, e.g. systemd).",
    )

    @validate("interval")
    def _valid_interval(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not (value == 0 or 0.1 <= value <= 3600):
            raise TraitError(
                f"AgentSupervision.interval: {value!r} is not allowed; give 0 "
                "(no checks) or 0.1 to 3600 seconds"
            )
        return value


class AgentWatch(PeriodicTask):
    """The server's supervision of its node agent: every ``interval`` seconds
    (:class:`AgentSupervision`) a ping, and a new agent when none answers (it rebuilds its
    state from the ledger and the shared lease files; kernels keep running meanwhile, at their
    request, in fail-static mode)."""

    what = "node agent supervision"

    def __init__(self, settings: GpuShare, log: Any, interval: float = 2.0) -> None:
        super().__init__(log)
        self.settings = settings
        self.interval_s = interval
        self.restarts = 0
        self._failed: str | None = None  # the last reason a start failed (logged once)
        self._lock = asyncio.Lock()
        self._kick: asyncio.Task[None] | None = None

    def interval(self) -> float:
        return self.interval_s

    def enabled(self) -> bool:
        return self.interval_s > 0 and enforcing(self.settings)

    async def run_once(self) -> bool:
        """One check; True when an agent had to be started. An agent that cannot be started
        is logged once per reason (no traceback every interval), and tried again next time."""
        async with self._lock:  # the periodic pass and a kick never start two at once
            client = DaemonClient(self.settings.socket_path, timeout=2.0)
            if await asyncio.to_thread(client.alive):
                self._failed = None
                return False
            if self._failed is None:  # once, not at every try while starting it fails
                self.log.warning(
                    "gpushare: the node agent on %s does not answer; starting a new one",
                    self.settings.socket_path,
                )
            try:
                await ensure_agent(self.settings, await self.settings.local_gpus(), self.log)
            except (RuntimeError, OSError) as exc:
                if str(exc) != self._failed:
                    self.log.error("gpushare: could not start the node agent again: %s", exc)
                self._failed = str(exc)
                return False
            self._failed = None
            self.restarts += 1
            return True

    def kick(self) -> None:
        """Check at once, in the background (a change could not be confirmed)."""
        if self._task is not None and self.enabled() and (self._kick is None or self._kick.done()):
            self._kick = asyncio.ensure_future(self._check_now())

    async def _check_now(self) -> None:
        try:
            await self.run_once()
        except Exception:  # the periodic pass keeps trying
            self.log.exception("gpushare: checking the node agent failed")

    async def stop(self) -> None:
        if self._kick is not None and not self._kick.done():
            self._kick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._kick
        self._kick = None
        await super().stop()


class NotApplied(RuntimeError):
    """The agent did not confirm a change in time (dead, or it does not see the ledger)."""


def await_applied(
    socket_path: str | Path,
    allocation_id: str,
    expected: Allocation | None,
    timeout: float = APPLY_TIMEOUT_S,
) -> None:
    """Block until the agent on ``socket_path`` enforces ``expected`` for ``allocation_id``
    (its ``status`` shows the same request, limit and memory cap; ``None``: the allocation was
    released and the agent no longer holds it), asking it to re-read the ledger first. Raises
    :class:`NotApplied` with the reason after ``timeout`` s, or after
    :data:`APPLY_ANSWERING_TIMEOUT_S` once the agent answers (on a loaded host a live agent's
    refresh took over a second, and a release that went through was answered 503). Blocking:
    async callers use ``asyncio.to_thread``."""
    start = time.monotonic()
    deadline = start + timeout
    answering = start + max(timeout, APPLY_ANSWERING_TIMEOUT_S)  # the deadline once it answers
    reason: str | None = "it did not answer"
    while True:
        client = DaemonClient(socket_path, timeout=max(0.05, deadline - time.monotonic()))
        try:
            client.refresh()
            deadline = answering
            status = client.status(allocation_id)
            reason = _mismatch(status, expected)
            if reason is None:
                return
        except DaemonUnreachable as exc:  # nobody accepts on the socket, or it hung up
            reason = f"it does not answer ({exc})"
        except (OSError, ValueError) as exc:  # it accepted and is slow (or garbled): there
            deadline = answering
            reason = f"it does not answer ({exc})"
        if time.monotonic() >= deadline:
            raise NotApplied(
                f"the node agent on {socket_path} has not applied the change: {reason}"
            )
        time.sleep(0.05)


async def confirm_applied(
    settings: GpuShare,
    allocation_id: str,
    expected: Allocation | None,
    watch: AgentWatch | None = None,
) -> str | None:
    """After a change of ``allocation_id`` in the ledger (``expected``: the record now, None
    when released): None once the local agent enforces it, or right away where nothing is to
    be confirmed here (enforcement off; Kubernetes, where the node's agent follows its
    GpuLedger). Otherwise the reason, for a 503: the change stays recorded in the ledger and
    is enforced as soon as an agent is back, which ``watch`` (the server's supervision) is
    asked to see to at once."""
    if not settings.get_backend().agent_beside_server or not enforcing(settings):
        return None
    try:
        await asyncio.to_thread(await_applied, settings.socket_path, allocation_id, expected)
        return None
    except NotApplied as exc:
        reason = str(exc)
    if watch is not None:
        watch.kick()
    return (
        f"{reason}. The change is recorded and will be enforced as soon as the node agent "
        "is back (the server is starting it again); until then the kernel runs under its "
        "interposer's fail-static limits"
    )


def _mismatch(status: dict[str, Any], expected: Allocation | None) -> str | None:
    """Why ``status`` (the agent's answer about one allocation) does not show ``expected``."""
    shown = [a for a in status.get("allocations") or [] if isinstance(a, dict)]
    if expected is None:
        return None if not status.get("ok") or not shown else "it still holds the share"
    if not status.get("ok") or not shown:
        return str(status.get("message") or "it does not know the share")
    held = shown[0]
    if (held.get("request"), held.get("limit"), held.get("memory_cap")) != (
        expected.request,
        expected.limit,
        expected.memory,
    ):
        return (
            f"it enforces request {held.get('request')}, limit {held.get('limit')}, memory "
            f"{held.get('memory_cap')} (the ledger: {expected.request}, {expected.limit}, "
            f"{expected.memory})"
        )
    return None


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """Stop a daemon started by :func:`ensure_daemon` (SIGTERM, then SIGKILL)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
