"""The driver's own figures against the shares (DESIGN: "The preload is the fast path; the
driver's own figures are the check").

The interposer is cooperative: a process that clears ``LD_PRELOAD``, writes its own account
(``mem_used``) or its own lease on the board escapes it. So the node agent also asks the driver
what each process holds and runs (NVML: ``nvmlDeviceGetComputeRunningProcesses`` (_v3) for
memory, ``nvmlDeviceGetProcessUtilization`` for device time; on the simulator its
``libnvidia-ml.so.1`` answers both from its own accounting), maps every process to a share
itself, and acts:

- **memory**: a share whose processes together hold more than its cap (plus a margin) loses
  its largest processes first until the rest fit, as a memory cgroup's OOM killer does
  (``SIGKILL``);
- **no share**: a process of a user who holds no share on that GPU (``LD_PRELOAD`` cleared and
  never registered) is stopped the same way; one of a user who holds a share there is charged
  to that share (the cap and the limit then count it);
- **compute**: a share whose processes ran beyond its limit over the check's window (plus a
  margin), or above its request and outside the leases the agent granted it while another
  share stayed below its own request and waited, loses the board: its processes are stopped
  (``SIGSTOP``) for a while, then resumed (``SIGCONT``); each repeat within a minute doubles
  the fence (2 s up to 32 s).

Who a process is, the agent finds out itself: the driver's pid, then ``/proc`` (real uid, start
time, parent) read twice around a pidfd, which is what every signal goes through (a pid that
changed hands is never signalled). A process belongs to a share when it is connected to the
agent for it (its ``hello``, same uid), descends from the share's recorded process (same start
time), runs in the share's kernel pod, or, failing all that, is a process of the share's user
on that GPU. Processes of uid 0, of the agent's own uid and of admins are never acted on.

Every action is told: the share's status carries it (``driver_check`` in the agent's ``status``;
the notebook prints it before the next cell), the agent logs it (at most once a minute per share
and kind, with a count) and counts it (``gpushare_allocation_memory_kills_total``,
``..._compute_fences_total``, ``gpushare_daemon_unshared_kills_total``).

:func:`decide` is the pure decision over plain figures; :class:`DriverCheck` samples NVML (in a
worker thread), identifies processes and applies the actions on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..ledger.reconcile import START_TOLERANCE, process_identity
from .identity import lineage, pod_uid_of
from .nvml import processes as nvml_processes
from .ratelog import RateLimitedLog, RateLimitedLogs
from .shm import monotonic_ns

if TYPE_CHECKING:
    from ..ledger import Allocation
    from .gpu_loop import GpuLoop
    from .server import Daemon

log = logging.getLogger("jupyter_gpushare.daemon")

MiB = 2**20

#: causes of an action (the status' ``cause``)
MEMORY = "memory"
NO_SHARE = "no_share"
OVER_LIMIT = "over_limit"
TOOK_REQUEST = "took_request"


# -- the decision (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Process:
    """One process the driver reports on one GPU, as the agent identified it."""

    pid: int
    uid: int
    #: its start time (``psutil``'s ``create_time``): with ``uid``, what every signal checks
    start: float
    #: bytes the driver says it holds on the GPU
    memory: int
    #: the allocation it belongs to (found by the agent, never written by a user); None: none
    share: str | None = None
    #: its share of the device over the last sample (the driver's figure)
    busy: float = 0.0


@dataclass(frozen=True)
class Share:
    """One share on one GPU with the figures of the check's window."""

    allocation: str
    request: float
    limit: float
    memory_cap: int
    #: device time its processes ran over the window, from the driver (fraction of the window;
    #: None until the window is covered)
    used: float | None = None
    #: device time the agent charged it for leases over the same window (its own accounting)
    granted: float = 0.0
    #: it waited for a lease through most of the window (from the board: its own word)
    waiting: bool = False


@dataclass(frozen=True)
class Margins:
    """What the driver may report beyond a share's cap and limit before the agent acts."""

    #: memory beyond the cap: the larger of these two ...
    memory_bytes: int = 64 * MiB
    memory_fraction: float = 1 / 32
    #: ... plus this much per process (what the driver counts for a context; 0 on the simulator)
    context_bytes: int = 0
    #: device time beyond the limit (or the request), as a fraction of the window
    compute: float = 0.1


@dataclass(frozen=True)
class Action:
    kind: str  # "kill" (SIGKILL) or "fence" (SIGSTOP for a while, then SIGCONT)
    cause: str  # MEMORY, NO_SHARE, OVER_LIMIT or TOOK_REQUEST
    gpu: str
    allocation: str | None
    processes: tuple[Process, ...]
    reason: str  # in the user's words


def memory_allowed(share: Share, processes: int, margins: Margins) -> int:
    """The most memory the driver may report for ``share``'s ``processes`` before it acts."""
    slack = max(margins.memory_bytes, int(share.memory_cap * margins.memory_fraction))
    return share.memory_cap + slack + margins.context_bytes * processes


def decide(
    gpu: str,
    shares: Sequence[Share],
    processes: Sequence[Process],
    margins: Margins = Margins(),
    stop_unshared: bool = True,
) -> list[Action]:
    """What to do on ``gpu``: at most one action per share (memory first: a killed process
    also stops running), and a kill of each process no share holds when ``stop_unshared``.
    ``processes`` are those that may be acted on (exempt uids already left out)."""
    actions: list[Action] = []
    by_share: dict[str, list[Process]] = {}
    for p in processes:
        if p.share is None:
            # a context alone is no use of the GPU (a kernel whose share was released keeps
            # its process, and the driver lists it while its context lives)
            using = p.memory > margins.memory_bytes + margins.context_bytes
            if stop_unshared and (using or p.busy > margins.compute):
                actions.append(
                    Action(
                        "kill",
                        NO_SHARE,
                        gpu,
                        None,
                        (p,),
                        f"process {p.pid} used GPU {gpu} without a GPU share on it "
                        f"({_gib(p.memory)} of device memory, {p.busy:.0%} of its time): "
                        "stopped",
                    )
                )
            continue
        by_share.setdefault(p.share, []).append(p)
    for share in shares:
        mine = by_share.get(share.allocation, [])
        killed = _over_memory(share, mine, margins)
        if killed:
            held = sum(p.memory for p in mine)
            actions.append(
                Action(
                    "kill",
                    MEMORY,
                    gpu,
                    share.allocation,
                    tuple(killed),
                    f"its processes held {_gib(held)} of GPU memory, over its cap of "
                    f"{_gib(share.memory_cap)}: the driver reports it although the cap "
                    f"refuses it (the process escaped the cap); stopped "
                    + ", ".join(f"process {p.pid} ({_gib(p.memory)})" for p in killed),
                )
            )
            continue
        why = _over_compute(share, shares, margins)
        if why is not None and mine:
            cause, text = why
            actions.append(Action("fence", cause, gpu, share.allocation, tuple(mine), text))
    return actions


def _over_memory(share: Share, mine: list[Process], margins: Margins) -> list[Process]:
    """The processes to kill, largest first, until the rest fit its cap (with the margin)."""
    left = sorted(mine, key=lambda p: (-p.memory, p.pid))
    held = sum(p.memory for p in left)
    killed: list[Process] = []
    while left and held > memory_allowed(share, len(left), margins):
        biggest = left.pop(0)
        killed.append(biggest)
        held -= biggest.memory
    return killed


def _over_compute(
    share: Share, shares: Sequence[Share], margins: Margins
) -> tuple[str, str] | None:
    used = share.used
    if used is None:
        return None
    m = margins.compute
    if share.limit < 1.0 and used > share.limit + m:
        return (
            OVER_LIMIT,
            f"it ran {used:.0%} of the GPU's time over the last seconds, over its limit of "
            f"{share.limit:.0%}: the driver reports it although the lease board does not "
            "grant it (the process escaped the schedule); its processes are paused for a while",
        )
    if used <= share.request + m:
        return None
    for other in shares:
        if other.allocation == share.allocation or other.used is None or not other.waiting:
            continue
        if other.used >= other.request - m:
            continue
        # it ran beyond the leases the agent granted it (their own figure: the lease loop adopts
        # from the board only handoffs and extensions it offered). The other's waiting is its
        # own word: it alone never gets a share that kept to its leases paused
        if used > share.granted + m:
            return (
                TOOK_REQUEST,
                f"it ran {used:.0%} of the GPU's time (request {share.request:.0%}) while "
                f"another share waited at {other.used:.0%} of its request of "
                f"{other.request:.0%}, outside the schedule's leases; its processes are paused "
                "for a while",
            )
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# -- the driver's figures over a window ---------------------------------------------------------


class Window:
    """Cumulative figures sampled over time (device ns run, ns granted, samples waiting): the
    rate over the last ``width_ns``. Pure (times are passed in)."""

    def __init__(self, width_ns: int) -> None:
        self.width_ns = width_ns
        #: (time, driver device ns so far, granted ns so far, waiting now)
        self.points: deque[tuple[int, float, int, bool]] = deque()
        self.driver_ns = 0.0

    def add(self, now: int, busy_fraction: float, interval_ns: int, granted_ns: int, waiting: bool):
        """A sample at ``now``: the share ran ``busy_fraction`` of the last ``interval_ns``
        (the driver's figure), has been granted ``granted_ns`` so far (the agent's), waits."""
        self.driver_ns += max(0.0, min(1.0, busy_fraction)) * max(0, interval_ns)
        self.points.append((now, self.driver_ns, granted_ns, waiting))
        while len(self.points) > 2 and self.points[1][0] <= now - self.width_ns:
            self.points.popleft()

    def figures(self, now: int) -> tuple[float, float, bool] | None:
        """(used, granted, waiting) over the window, or None while less than half of it is
        covered."""
        if len(self.points) < 2:
            return None
        t0, d0, g0, _ = self.points[0]
        t1, d1, g1, _ = self.points[-1]
        span = t1 - t0
        if span < self.width_ns // 2 or now - t1 > self.width_ns:
            return None
        waiting = sum(1 for p in list(self.points)[1:] if p[3]) * 2 >= len(self.points) - 1
        return (d1 - d0) / span, max(0, g1 - g0) / span, waiting


# -- identifying processes ----------------------------------------------------------------------


#: what the check did to shares that left the ledger is kept for this many of them (the oldest go)
KEEP_GONE = 1024


def open_identified(pid: int, uid: int, start: float) -> int | None:
    """A pidfd of ``pid`` if it is still the process of ``uid`` that started at ``start`` (checked
    after the pidfd is open: from then on it can name only that process), else None."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    found = process_identity(pid)
    if found is None or found[1] != uid or abs(found[0] - start) > START_TOLERANCE:
        os.close(fd)
        return None
    return fd


def send(fd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(fd, sig)
    except OSError:
        return False
    return True


@dataclass
class _Fence:
    until_ns: int
    fds: list[int] = field(default_factory=list)
    #: (pid, uid, start) of each paused process
    who: list[tuple[int, int, float]] = field(default_factory=list)


@dataclass
class _Record:
    """What the check did to one share (its status' ``driver_check``)."""

    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=8))
    counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (gpu, cause) -> n
    fences: int = 0  # in a row (the next fence is 2 s x 2^fences)
    last_fence_ns: int = 0


class DriverCheck:
    """Samples the driver every ``interval`` s and applies :func:`decide` (module doc)."""

    #: first fence, and the longest
    FENCE_NS = 2_000_000_000
    MAX_FENCE_NS = 32_000_000_000
    #: a share fenced again within this long gets a fence twice as long
    REPEAT_NS = 60_000_000_000

    def __init__(
        self,
        daemon: Daemon,
        library: str | None,
        interval: float = 0.25,
        window_ns: int = 2_000_000_000,
        margins: Margins | None = None,
        stop_unshared: bool = True,
        sampler: Callable[[str | None, dict[str, int]], dict[str, list[dict[str, Any]]]]
        | None = None,
    ) -> None:
        self.daemon = daemon
        self.library = library
        self.interval = interval
        self.window_ns = window_ns
        self.margins = margins or Margins()
        self.stop_unshared = stop_unshared
        self.sampler = sampler or nvml_processes
        self.windows: dict[tuple[str, str], Window] = {}  # (gpu, allocation)
        self.records: dict[str, _Record] = {}
        self.fences: dict[tuple[str, str], _Fence] = {}
        self.unshared_kills = 0
        self.sample_log = RateLimitedLog(log, "reading the driver's process figures failed")
        self.check_log = RateLimitedLog(log, "the driver check failed", first_traceback=True)
        self.action_logs = RateLimitedLogs(log, "driver check:")  # per share (or uid) and cause
        self._last_ns = 0
        self._last_seen: dict[str, int] = {}  # NVML's sample time stamps, per GPU
        #: (pid, start, uid, shares on its GPU) -> the share found up its process tree, for the
        #: agent's allocations as they are (held: a new dict is a change)
        self._found: dict[tuple[int, float, int, tuple[str, ...]], str | None] = {}
        self._found_for: object = None
        self._resume_left_over()
        self._exempt: set[int] = {0, os.geteuid()}

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                self._resume_due(monotonic_ns())  # whether or not the driver answers now
                try:
                    readings, read_at = await asyncio.to_thread(self._read)
                except Exception as exc:  # no NVML here, or it failed once: keep trying
                    self.sample_log.failed(f"{type(exc).__name__}: {exc}", exc)
                    continue
                self.sample_log.ok()
                try:
                    self.check(readings, read_at)
                except Exception as exc:  # a bug must not stop the check (nor the agent)
                    self.check_log.failed(f"{type(exc).__name__}: {exc}", exc)
                else:
                    self.check_log.ok()
        finally:
            self.resume_all()

    def _read(self) -> tuple[dict[str, list[dict[str, Any]]], int]:
        """The driver's figures and when they were read. A sample's share of the device covers
        the time since the previous read, so the check counts it over the time between reads,
        taken here in the reading thread: the event loop may resume long after the read on a
        busy machine, and a busy share's figure counted over that longer interval read as a
        share beyond its limit."""
        readings = self.sampler(self.library, self._last_seen)
        return readings, monotonic_ns()

    def check(self, readings: dict[str, list[dict[str, Any]]], now: int) -> list[Action]:
        """One pass over the driver's figures (``{uuid: [{"pid", "memory", "busy"}]}``, busy a
        fraction of the interval or None); returns the actions applied."""
        self._resume_due(now)
        # a sample stands for the time since the last one, at most a few intervals (a reading
        # after the driver did not answer for a while is no figure for all that time)
        step = int(self.interval * 1e9)
        interval = min(now - self._last_ns, 4 * step) if self._last_ns else step
        self._last_ns = now
        applied: list[Action] = []
        clients = self._clients()
        for uuid, rows in readings.items():
            gpu = self.daemon.gpus.get(uuid)  # None: no share on it (yet)
            processes, busy = self._identify(uuid, rows, clients)
            shares = self._shares(uuid, gpu, busy, interval, now) if gpu is not None else []
            acting = [p for p in processes if not self._exempt_uid(p.uid)]
            for action in decide(uuid, shares, acting, self.margins, self.stop_unshared):
                if self._fenced(action, now):
                    continue
                if self._apply(action, gpu, clients, now):
                    applied.append(action)
        live = set(self.daemon.allocations)
        for key in [k for k in self.windows if k[1] not in live]:
            del self.windows[key]
        # a released share's record is kept a while (its status after a restart), oldest first out
        gone = [a for a in self.records if a not in live and a not in self._fenced_shares()]
        excess = len(gone) - KEEP_GONE
        for allocation in gone:
            if excess > 0 or not self.records[allocation].events:
                del self.records[allocation]
                excess -= 1
        return applied

    def _fenced_shares(self) -> set[str]:
        return {allocation for _gpu, allocation in self.fences}

    # -- who is who ---------------------------------------------------------------------------

    def _exempt_uid(self, uid: int) -> bool:
        if uid in self._exempt:
            return True
        admins = getattr(self.daemon, "admins", None)
        return bool(admins is not None and admins.gid is not None and admins.admits(uid, -1))

    def _clients(self) -> dict[int, tuple[int, str]]:
        """pid -> (uid, allocation) of every process connected for a share (``hello``)."""
        found: dict[int, tuple[int, str]] = {}
        for client in self.daemon.clients:
            if client.allocation is not None:
                found[client.pid] = (client.uid, client.allocation)
        return found

    def _identify(
        self, uuid: str, rows: list[dict[str, Any]], clients: dict[int, tuple[int, str]]
    ) -> tuple[list[Process], dict[str, float]]:
        """The driver's processes on ``uuid`` with the share each belongs to, and each share's
        busy fraction (the sum of its processes')."""
        processes: list[Process] = []
        busy: dict[str, float] = {}
        on_gpu = [a for a in self.daemon.allocations.values() if uuid in a.gpus]
        for row in rows:
            pid = row.get("pid")
            if not isinstance(pid, int) or pid <= 0:
                continue
            found = process_identity(pid)
            if found is None:
                continue
            start, uid = found
            share = self._share_of(pid, uid, start, on_gpu, clients)
            memory = row.get("memory")
            fraction = row.get("busy")
            ran = max(0.0, min(1.0, float(fraction))) if isinstance(fraction, (int, float)) else 0
            processes.append(
                Process(pid, uid, start, memory if isinstance(memory, int) else 0, share, ran)
            )
            if share is not None:
                busy[share] = busy.get(share, 0.0) + ran
        return processes, busy

    def _share_of(
        self,
        pid: int,
        uid: int,
        start: float,
        on_gpu: list[Allocation],
        clients: dict[int, tuple[int, str]],
    ) -> str | None:
        ids = {a.id for a in on_gpu}
        connected = clients.get(pid)
        if connected is not None and connected[0] == uid and connected[1] in ids:
            return connected[1]
        # the rest (a walk up the process tree) is the same while the process and the ledger
        # are: kept per process (pid and start time) until the agent's allocations change
        if self._found_for is not self.daemon.allocations or len(self._found) > 4096:
            self._found.clear()  # (the daemon replaces its dict whenever the ledger changed)
            self._found_for = self.daemon.allocations
        key = (pid, start, uid, tuple(sorted(ids)))
        if key not in self._found:
            self._found[key] = self._share_by_tree(pid, uid, on_gpu)
        return self._found[key]

    def _share_by_tree(self, pid: int, uid: int, on_gpu: list[Allocation]) -> str | None:
        pod = None
        if any(a.extra.get("k8s_pod") for a in on_gpu):
            pod = pod_uid_of(pid)
        for a in on_gpu:
            if a.extra.get("k8s_pod") and pod is not None and pod == a.extra.get("k8s_pod_uid"):
                return a.id
        by_pid = {
            a.pid: a
            for a in on_gpu
            if not a.extra.get("k8s_pod")
            and a.pid is not None
            and a.pid_start is not None
            # a record names its own user's processes only
            and a.extra.get("uid") in (None, uid)
        }
        for ancestor, started in lineage(pid).items():  # the nearest recorded ancestor
            found = by_pid.get(ancestor)
            if found is not None and abs(started - (found.pid_start or 0.0)) <= START_TOLERANCE:
                return found.id
        # a process of a share's user that is not the share's (LD_PRELOAD cleared, started
        # elsewhere): charged to that user's share on this GPU, the largest cap first
        theirs = [a for a in on_gpu if a.extra.get("uid") == uid]
        if theirs:
            return max(theirs, key=lambda a: (a.memory, a.id)).id
        return None

    def _shares(
        self, uuid: str, gpu: GpuLoop, busy: dict[str, float], interval: int, now: int
    ) -> list[Share]:
        shares = []
        for allocation, tenant in list(gpu.tenants.items()):
            window = self.windows.get((uuid, allocation))
            if window is None:
                window = self.windows[(uuid, allocation)] = Window(self.window_ns)
            granted = tenant.window.total_ns
            if gpu.holder is tenant and now > gpu.lease_start:
                granted += now - gpu.lease_start
            try:
                waiting = int(gpu.shm.board[tenant.slot].waiters) > 0
            except (IndexError, AttributeError):
                waiting = False
            if (uuid, allocation) in self.fences:
                waiting = False  # its own processes are stopped
            window.add(now, busy.get(allocation, 0.0), interval, granted, waiting)
            figures = window.figures(now)
            used, given, waits = figures if figures is not None else (None, 0.0, False)
            shares.append(
                Share(
                    allocation,
                    tenant.request,
                    tenant.limit,
                    tenant.memory,
                    used=used,
                    granted=given,
                    waiting=waits,
                )
            )
        return shares

    # -- acting -------------------------------------------------------------------------------

    def _fenced(self, action: Action, now: int) -> bool:
        """A fence of a share fenced already (its processes are stopped) is not renewed."""
        return action.kind == "fence" and (action.gpu, action.allocation or "") in self.fences

    def _apply(
        self, action: Action, gpu: GpuLoop | None, clients: dict[int, tuple[int, str]], now: int
    ) -> bool:
        targets = list(action.processes)
        if action.kind == "fence" and action.allocation is not None:
            # and every process connected for the share (they hold the board)
            seen = {p.pid for p in targets}
            for pid, (uid, allocation) in clients.items():
                if allocation == action.allocation and pid not in seen:
                    found = process_identity(pid)
                    if found is not None and found[1] == uid and not self._exempt_uid(uid):
                        targets.append(Process(pid, uid, found[0], 0, allocation))
        fds = []
        for p in targets:
            fd = open_identified(p.pid, p.uid, p.start)
            if fd is not None:
                fds.append((p, fd))
        if not fds:
            return False
        signalled: list[Process] = []
        if action.kind == "kill":
            for p, fd in fds:
                if send(fd, signal.SIGKILL):
                    signalled.append(p)
                os.close(fd)
        else:
            kept = []
            for p, fd in fds:
                if send(fd, signal.SIGSTOP):
                    signalled.append(p)
                    kept.append(fd)
                else:
                    os.close(fd)
            who = [(p.pid, p.uid, p.start) for p in signalled]
            if not kept:
                return False
            record = self._record(action.allocation or "")
            if now - record.last_fence_ns > self.REPEAT_NS:
                record.fences = 0
            length = min(self.MAX_FENCE_NS, self.FENCE_NS << min(record.fences, 8))
            record.fences += 1
            record.last_fence_ns = now
            self.fences[(action.gpu, action.allocation or "")] = _Fence(now + length, kept, who)
            self._save_fences()
            if gpu is not None:
                self._take_board(gpu, action.allocation or "")
        if not signalled:
            return False
        self._tell(action, signalled, now)
        return True

    def _take_board(self, gpu: GpuLoop, allocation: str) -> None:
        """The fenced share's lease ends now and it gets none while fenced."""
        fence = getattr(gpu, "fence", None)
        if fence is not None:
            fence(allocation, True)

    # -- fences outlive no agent ---------------------------------------------------------------

    #: the processes paused now, in the agent's private state directory: an agent that died
    #: (kill -9) while it paused some is replaced by one that resumes them first
    FENCES_FILE = "driver_check.fences"

    def _state_dir_fd(self) -> int | None:
        state = getattr(self.daemon, "state", None)
        fd = getattr(state, "fd", -1)
        return fd if isinstance(fd, int) and fd >= 0 else None

    def _save_fences(self) -> None:
        dir_fd = self._state_dir_fd()
        if dir_fd is None:
            return
        paused = [list(p) for fence in self.fences.values() for p in fence.who]
        if not paused:
            with contextlib.suppress(OSError):
                os.unlink(self.FENCES_FILE, dir_fd=dir_fd)
            return
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        tmp = self.FENCES_FILE + ".tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as f:
                json.dump(paused, f)
            os.replace(tmp, self.FENCES_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            log.warning("driver check: could not record the paused processes: %s", exc)

    def _resume_left_over(self) -> None:
        """Resume what an earlier agent paused and could not resume (it died meanwhile)."""
        dir_fd = self._state_dir_fd()
        if dir_fd is None:
            return
        try:
            fd = os.open(
                self.FENCES_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
            )
            with os.fdopen(fd) as f:
                paused = json.load(f)
        except (OSError, ValueError):
            return
        for entry in paused if isinstance(paused, list) else []:
            try:
                pid, uid, start = int(entry[0]), int(entry[1]), float(entry[2])
            except (TypeError, ValueError, IndexError):
                continue
            pidfd = open_identified(pid, uid, start)
            if pidfd is not None:
                send(pidfd, signal.SIGCONT)
                os.close(pidfd)
                log.info("driver check: resumed process %d, paused by an earlier agent", pid)
        with contextlib.suppress(OSError):
            os.unlink(self.FENCES_FILE, dir_fd=dir_fd)

    def _resume_due(self, now: int) -> None:
        for key, fence in list(self.fences.items()):
            if fence.until_ns <= now:
                self._resume(key, fence)

    def _resume(self, key: tuple[str, str], fence: _Fence) -> None:
        for fd in fence.fds:
            send(fd, signal.SIGCONT)
            with contextlib.suppress(OSError):
                os.close(fd)
        fence.fds.clear()
        self.fences.pop(key, None)
        self._save_fences()
        gpu = self.daemon.gpus.get(key[0])
        fenced = getattr(gpu, "fence", None)
        if fenced is not None:
            fenced(key[1], False)

    def resume_all(self) -> None:
        """Every fenced process goes on (the agent stops: nothing would resume them later)."""
        for key, fence in list(self.fences.items()):
            self._resume(key, fence)

    def _record(self, allocation: str) -> _Record:
        record = self.records.get(allocation)
        if record is None:
            record = self.records[allocation] = _Record()
        return record

    def _tell(self, action: Action, signalled: Iterable[Process], now: int) -> None:
        pids = sorted(p.pid for p in signalled)
        event = {
            "time": time.time(),
            "gpu": action.gpu,
            "cause": action.cause,
            "action": "stopped" if action.kind == "kill" else "paused",
            "pids": pids,
            "reason": action.reason,
        }
        fence = self.fences.get((action.gpu, action.allocation or ""))
        if fence is not None:
            event["paused_s"] = round((fence.until_ns - now) / 1e9, 1)
        if action.allocation is None:
            self.unshared_kills += len(pids)
            who = f"uid {next(iter(signalled)).uid}"
        else:
            record = self._record(action.allocation)
            record.events.append(event)
            key = (action.gpu, action.cause)
            record.counts[key] = record.counts.get(key, 0) + len(pids)
            who = f"share {action.allocation}"
        self.action_logs.failed((who, action.cause), who, f"{action.reason} (pids {pids})")

    # -- status -------------------------------------------------------------------------------

    def report(self, allocation: str) -> dict[str, Any] | None:
        """What the check did to ``allocation``: its last events (newest last) and whether it is
        paused now; None when nothing."""
        record = self.records.get(allocation)
        paused = [g for (g, a) in self.fences if a == allocation]
        if record is None and not paused:
            return None
        return {
            "events": list(record.events) if record else [],
            "paused_on": paused,
        }

    def counts(self, allocation: str, gpu: str) -> dict[str, int]:
        """``memory_kills`` and ``compute_fences`` of ``allocation`` on ``gpu`` (metrics)."""
        record = self.records.get(allocation)
        counts = record.counts if record else {}
        return {
            "memory_kills": counts.get((gpu, MEMORY), 0),
            "compute_fences": counts.get((gpu, OVER_LIMIT), 0) + counts.get((gpu, TOOK_REQUEST), 0),
        }
