"""The node daemon (box 6): control socket, ledger follower, per-GPU lease loops, status.

One asyncio event loop; SQLite runs in worker threads (inside the ledger); the lease loops
(:mod:`.gpu`) are plain callbacks on the loop. State is rebuildable: allocations come from the
ledger (polled, plus ``refresh`` requests), the shared-memory files are reused after a restart,
and clients reconnect on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import pwd
import re
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..ledger import Allocation, Ledger
from ..ledger.sqlite import UNREADABLE
from . import wire
from .admission import Admins, Admission, Listener, Peer, raise_fd_limit, read_peer, user_name
from .driver_check import DriverCheck
from .gpu_loop import GpuLoop, Tenant
from .identity import identify, lineage, pod_uid_of
from .ratelog import RateLimitedLog
from .shm import GpuShm, StateDir, fallback_state_dir, is_private_dir, monotonic_ns, send_line

log = logging.getLogger("jupyter_gpushare.daemon")

#: ``pid_start`` recorded in the ledger vs the process's create time: allowed difference (s).
PID_START_TOLERANCE = 0.05
#: how long a kernel pod's hello waits for the server to record the pod's UID
POD_RECORD_WAIT_NS = 2_500_000_000  # within the interposer's 3 s hello timeout

# One connection's bounds (see ``_Protocol``): requests read but not answered yet, and their bytes;
# the reply bytes the client has not read yet before the agent stops reading its requests; how
# many refused or unreadable requests in a row close the connection; requests handled before the
# connection gives the others a turn.
MAX_QUEUED = 32
MAX_QUEUED_BYTES = 128 * 1024
WRITE_HIGH_WATER = 64 * 1024
MAX_BAD_IN_A_ROW = 16
BATCH = 16
#: connections waiting to be accepted: a client's non-blocking connect fails at once (EAGAIN)
#: when this is full, so it is deep enough for a burst of connects from an abuser
LISTEN_BACKLOG = 1024


def default_state_dir(socket_path: Path) -> Path:
    """Where the agent's lease memory lives (a private directory, see :class:`.shm.StateDir`):
    ``$XDG_RUNTIME_DIR/gpushare/<digest>`` when that runtime directory is private to us, else
    ``/dev/shm/gpushare-<uid>-<digest>`` when it is ours or can be made ours; when someone else
    prepared that name, a fresh unpredictable directory in /dev/shm (or ``state/`` next to the
    socket without /dev/shm). ``<digest>`` names the socket, so one agent per socket finds its
    files again after a restart."""
    digest = hashlib.sha1(str(socket_path.resolve()).encode()).hexdigest()[:12]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_absolute() and is_private_dir(Path(runtime)):
        return Path(runtime) / "gpushare" / digest
    return fallback_state_dir(
        Path("/dev/shm"), f"gpushare-{os.geteuid()}-{digest}", socket_path.parent / "state"
    )


@dataclass
class DaemonSettings:
    socket_path: Path
    node: str
    quantum_ns: int = 20_000_000
    window_ns: int = 1_000_000_000
    poll_ns: int = 250_000_000
    state_dir: Path | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    nvml_library: str | None = None
    #: connection caps (``daemon/admission.py``); uid 0 and the agent's own uid are not capped
    max_connections_per_uid: int = 256
    max_connections_per_pod: int = 64
    #: descriptors kept for admins and processes that hold a share
    fd_reserve: int = 64
    #: a connection that holds no share is closed after this long without a request (0: never)
    idle_timeout_s: float = 60.0
    #: members of this group see every share in ``status`` (as uid 0 and the agent's uid do)
    admin_group: str | None = None
    #: the socket is 0660 with this group (only its members reach the agent); None: 0666
    socket_gid: int | None = None
    #: check the driver's per-process figures against the shares and act (driver_check.py;
    #: the command turns it on for the system agent and on Kubernetes)
    driver_check: bool = False
    #: stop processes of users without a share on the GPU they use (else only shares count)
    stop_unshared: bool = True


@dataclass(eq=False)
class Client:
    """One connected process."""

    transport: asyncio.Transport
    pid: int
    uid: int
    allocation: str | None = None
    tenants: list[tuple[GpuLoop, Tenant]] = field(default_factory=list)
    #: the checked identity (``admission.read_peer``); None only for in-process callers
    peer: Peer | None = None
    #: descriptors that go with the next reply line (the ``hello`` reply's lease memory)
    send_fds: list[int] = field(default_factory=list)


class Daemon:
    def __init__(self, ledger: Ledger, settings: DaemonSettings) -> None:
        self.ledger = ledger
        self.settings = settings
        self.state_dir = settings.state_dir or default_state_dir(settings.socket_path)
        #: opened and checked now: an unsafe directory stops the agent (StateDirError)
        self.state = StateDir(self.state_dir)
        self.gpus: dict[str, GpuLoop] = {}
        self.allocations: dict[str, Allocation] = {}
        self.clients: set[Client] = set()
        self.server: Listener | None = None
        self.epoch = 0
        self.started_ns = monotonic_ns()
        self.refused = 0
        #: ids of this node's ledger rows that cannot be read (kept taken until an admin acts)
        self.unreadable: list[str] = []
        self.accepted = 0  # connections accepted (an on-demand agent's idle watch, idle_exit.py)
        #: allocations released by their own process (``kernel_ops.release``), for ``reserve``
        self.released: dict[str, Allocation] = {}
        #: idle-reclaim warnings of allocations that left the ledger (told to their kernels)
        self.reclaimed: dict[str, dict[str, Any]] = {}
        self.metrics_port: int | None = None
        self.nvml: dict[str, dict[str, Any]] = {}
        self.driver_check: DriverCheck | None = None
        #: one GPU's lease loop failing must not stop another's (logged at most once a minute)
        self.gpu_log = RateLimitedLog(log, "a GPU's lease loop failed", first_traceback=True)
        self._tasks: list[asyncio.Task[Any]] = []
        self._refresh_lock = asyncio.Lock()
        self._reads_begun = 0  # ledger reads begun by ``refresh``, and the last one finished
        self._read_done = 0
        self._stopping = asyncio.Event()
        self.admins = Admins(settings.admin_group)
        self.admission = Admission(
            settings.max_connections_per_uid, settings.max_connections_per_pod, settings.fd_reserve
        )
        self.ledger_log = RateLimitedLog(log, "reading the ledger failed")
        self.refused_log = RateLimitedLog(log, "refused a connection", level=logging.WARNING)
        self.request_log = RateLimitedLog(log, "a request failed", first_traceback=True)
        self.refused_peer_log = RateLimitedLog(
            log, "refused a process", level=logging.WARNING, every=10.0
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        path = self.settings.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd_limit = raise_fd_limit()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # the caller checked that no live daemon answers on it
        hold = getattr(self.ledger, "hold_open", None)
        if hold is not None:  # SQLite: no checkpoint + fsync on each caller's close (sqlite.py)
            try:
                await asyncio.to_thread(hold)
            except Exception as exc:  # reading it is retried (and its failures logged) below
                log.warning("could not hold the ledger open: %s", exc)
        # the first read before the socket answers: a caller that sees the agent alive finds
        # the shares it enforces (and a ledger broken after that is a poll's failure, logged
        # and retried, not a failed start)
        await self.refresh()
        gid = self.settings.socket_gid  # otherwise peers are known by credentials, not by mode
        mode = 0o666 if gid is None else 0o660
        self.server = Listener(str(path), LISTEN_BACKLOG, self._accepted, mode, gid)
        follow = self._watch_ledger if hasattr(self.ledger, "watch_node") else self._poll_ledger
        self._tasks.append(asyncio.create_task(follow()))
        self._tasks.append(asyncio.create_task(self._tick()))
        if self.settings.nvml_library is not None or os.environ.get("GPUSHARE_SIMULATED"):
            self._tasks.append(asyncio.create_task(self._sample_nvml()))
        if self.settings.driver_check and (
            self.settings.nvml_library is not None or _has_nvml()
        ):  # the driver's own figures against the shares (driver_check.py)
            from .driver_check import DriverCheck

            self.driver_check = DriverCheck(
                self, self.settings.nvml_library, stop_unshared=self.settings.stop_unshared
            )
            self._tasks.append(asyncio.create_task(self.driver_check.run()))
        # what start built (modules, the ledger, the GPUs' state) lives as long as the agent:
        # the garbage collector's full passes need not scan it again (a pause of milliseconds
        # in some request's way otherwise; issue 12's p99)
        gc.freeze()
        log.info(
            "gpushare daemon on %s (node %s, quantum %.0f ms, window %.0f ms, state %s)",
            path,
            self.settings.node,
            self.settings.quantum_ns / 1e6,
            self.settings.window_ns / 1e6,
            self.state_dir,
        )
        log.info(
            "connections: at most %d per uid, %d per pod, idle timeout %g s, %d of %d "
            "descriptors kept for share holders",
            self.settings.max_connections_per_uid,
            self.settings.max_connections_per_pod,
            self.settings.idle_timeout_s,
            self.settings.fd_reserve,
            fd_limit,
        )

    async def serve_forever(self) -> None:
        await self._stopping.wait()

    def stop(self) -> None:
        self._stopping.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.server is not None:
            self.server.close()
        for client in list(self.clients):
            client.transport.close()
        with contextlib.suppress(FileNotFoundError):
            self.settings.socket_path.unlink()
        for gpu in self.gpus.values():
            gpu.shm.heartbeat()
        if all(gpu.shm.idle() for gpu in self.gpus.values()):  # no share left to keep
            for gpu in self.gpus.values():
                gpu.shm.discard()
            self.state.remove_if_empty()

    # -- ledger -------------------------------------------------------------------------------

    async def _poll_ledger(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_ns / 1e9)
            try:
                await self.refresh()
            except Exception as exc:  # a busy or missing ledger must not stop the daemon
                self.ledger_log.failed(f"{type(exc).__name__}: {exc}", exc)
            else:
                self.ledger_log.ok()

    async def _watch_ledger(self) -> None:
        """Kubernetes: the node's GpuLedger is watched, each change applied as it comes."""
        while True:
            try:
                watch = self.ledger.watch_node  # type: ignore[attr-defined]
                async for found in watch(self.settings.node):
                    async with self._refresh_lock:
                        self._sync({a.id: a for a in found})
                    self.ledger_log.ok()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server away: keep enforcing what we know, re-watch
                self.ledger_log.failed(f"watching: {type(exc).__name__}: {exc}", exc)
                await asyncio.sleep(1.0)

    async def refresh(self) -> None:
        """Re-read the ledger now (start, a ``refresh`` request, a peer check's second look).
        Callers that wait while a read runs share the next one: a read begun after the call is
        as fresh as the caller needs, so a flood of ``refresh`` or refused ``hello`` requests
        costs one read at a time, not one each."""
        called_after = self._reads_begun
        async with self._refresh_lock:
            if self._read_done > called_after:
                return  # a read that began after this call has finished meanwhile
            self._reads_begun += 1
            number = self._reads_begun
            snap = await self.ledger.snapshot()
            mine = snap.on_node(self.settings.node)
            # a ledger row that cannot be read holds its GPUs for placement (ledger/sqlite.py)
            # but is no share to enforce: no slot, no lease; status reports it to admins
            self.unreadable = sorted(a.id for a in mine if a.backend == UNREADABLE)
            self._sync({a.id: a for a in mine if a.backend != UNREADABLE})
            self._read_done = number

    def _sync(self, current: dict[str, Allocation]) -> None:
        """Follow the ledger: new allocations get slots, changed ones new shares, gone ones are
        released."""
        if current == self.allocations:
            return
        for allocation in current.values():
            known = self.allocations.get(allocation.id)
            # the agent's own cached ledger hands out the same objects until they change
            if known is not allocation and known != allocation:
                self._apply(allocation)
        for gone in set(self.allocations) - set(current):
            for gpu in self.gpus.values():
                gpu.forget(gone)
            warning = self.allocations[gone].extra.get("reclaim_warning")
            if warning:  # idle reclaim released it, as a Release would: ``reserve`` works
                self.reclaimed[gone] = warning
                self.released[gone] = self.allocations[gone]
                while len(self.reclaimed) > 1024:
                    self.reclaimed.pop(next(iter(self.reclaimed)))
        self.allocations = current

    def _apply(self, allocation: Allocation) -> None:
        busy = self._busy_slots()
        for uuid in allocation.gpus:
            gpu = self._gpu(uuid)
            gpu.upsert(
                allocation.id,
                allocation.request,
                allocation.limit,
                allocation.memory,
                busy.get(uuid, set()),
            )
        for gpu in self.gpus.values():  # an allocation moved off a GPU (not expected)
            if gpu.uuid not in allocation.gpus:
                gpu.forget(allocation.id)

    def _busy_slots(self) -> dict[str, set[int]]:
        """Slots still mapped by connected clients (not to be reused)."""
        busy: dict[str, set[int]] = {}
        for client in self.clients:
            for gpu, tenant in client.tenants:
                busy.setdefault(gpu.uuid, set()).add(tenant.slot)
        return busy

    def _gpu(self, uuid: str) -> GpuLoop:
        gpu = self.gpus.get(uuid)
        if gpu is None:
            shm = GpuShm(self.state, uuid, self.settings.quantum_ns, self.settings.window_ns)
            self.epoch = max(self.epoch, shm.header.epoch)
            gpu = GpuLoop(uuid, shm, self.settings.quantum_ns, self.settings.window_ns)
            gpu.on_revoked = functools.partial(self._tell_revoked, gpu)
            self.gpus[uuid] = gpu
        return gpu

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            for gpu in list(self.gpus.values()):
                try:
                    gpu.tick()
                except Exception as exc:  # a bug one GPU's board hit: the others go on
                    self.gpu_log.failed(f"GPU {gpu.uuid}: {type(exc).__name__}: {exc}", exc)

    async def _sample_nvml(self) -> None:
        from .nvml import sample

        while True:
            try:
                self.nvml = await asyncio.to_thread(sample, self.settings.nvml_library)
            except Exception as exc:  # the sampler is informational
                log.debug("NVML sample failed: %s", exc)
                # no readings, but each GPU keeps its index: the metrics' ``gpu`` label (DCGM's)
                # must not flip to "" (a new series) for a second when one sample fails
                self.nvml = {uuid: {"index": r["index"]} for uuid, r in self.nvml.items()}
            await asyncio.sleep(1.0)

    # -- requests -----------------------------------------------------------------------------

    async def handle(self, client: Client, message: dict[str, Any]) -> dict[str, Any] | None:
        op = message.get("op")
        if op == "want" or op == "done":
            try:
                self._lease_event(client, op, message)
            except (TypeError, ValueError) as exc:  # e.g. a lease that is not a number
                return wire.refusal(wire.E_BAD_REQUEST, f"{op}: {exc}")
            return None
        if op == "hello":
            return await self._hello(client, message)
        if op == "status":
            return self.status(message.get("allocation"), viewer=client.peer)
        if op == "refresh":
            await self.refresh()
            return {"ok": True}
        if op == "pids":
            return await self._pids(client, message)
        if op in ("release", "resize", "reserve", "gpus"):  # a kernel's own share (box 9)
            from . import kernel_ops

            if op == "gpus":
                return self._name_only_own(await kernel_ops.gpus(self), client.peer)
            from .intents import write_in_turn  # one writer, users' writes in a fair order

            return await write_in_turn(
                self, client, lambda: getattr(kernel_ops, op)(self, client, message)
            )
        if op in ("ledger.cas", "ledger.release", "ledger.update"):  # writes: in a fair order
            from . import intents

            return await intents.serve(self, client, message)
        if op == "ledger.reserve" or (isinstance(op, str) and op.startswith("ledger.queue")):
            from . import queue_ops  # a start that does not fit may wait (DESIGN box 13)

            return await queue_ops.serve(self, client, message)
        if isinstance(op, str) and op.startswith("ledger."):  # the agent owns the ledger
            from . import ledger_ops

            return await ledger_ops.handle(self, client, message)
        if op == "ping":
            from .ledger_ops import access_of

            return {
                "ok": True,
                "v": wire.VERSION,
                "v_min": wire.OLDEST_VERSION,
                "epoch": self.epoch,
                "pid": os.getpid(),
                "system": access_of(self).system,
            }
        return wire.refusal(wire.E_BAD_REQUEST, f"unknown op {op!r}")

    def _lease_event(self, client: Client, op: str, message: dict[str, Any]) -> None:
        uuid = message.get("gpu")
        for gpu, tenant in client.tenants:
            if gpu.uuid == uuid and gpu.tenants.get(tenant.allocation) is tenant:
                lease = int(message.get("lease", 0))
                try:
                    if op == "want":
                        gpu.want(tenant)
                    else:
                        gpu.done(tenant, lease)
                except Exception as exc:  # a bug one GPU's board hit: the others go on
                    self.gpu_log.failed(f"GPU {gpu.uuid}: {type(exc).__name__}: {exc}", exc)

    async def _hello(self, client: Client, message: dict[str, Any]) -> dict[str, Any]:
        version, refused = wire.negotiate(message)  # a range of versions: upgrades (wire.py)
        if refused is not None:
            self.refused_peer_log.failed(f"pid {client.pid}: {refused['message']}")
            return refused
        if client.allocation is not None:
            return wire.refusal(wire.E_BAD_REQUEST, "hello was already sent")
        allocation, refusal = await self.peer_allocation(
            client, str(message.get("allocation") or "")
        )
        if refusal is not None:
            return refusal
        assert allocation is not None
        wanted = [str(g) for g in message.get("gpus") or allocation.gpus]
        unplaced = [
            uuid
            for uuid in allocation.gpus
            if uuid in wanted
            and ((gpu := self.gpus.get(uuid)) is None or allocation.id not in gpu.tenants)
        ]
        if unplaced:  # no slot on that GPU's lease board (its shares are at their most)
            return wire.refusal(
                wire.E_NOT_PERMITTED,
                f"allocation {allocation.id} has no lease slot on GPU {unplaced[0]} "
                f"(a GPU holds at most {wire.SLOTS} shares)",
            )
        gpus: list[dict[str, Any]] = []
        fds: list[int] = []
        for uuid in allocation.gpus:
            if uuid not in wanted:
                continue
            gpu = self.gpus[uuid]
            tenant = gpu.tenants[allocation.id]
            tenant.connections += 1
            client.tenants.append((gpu, tenant))
            gpus.append(
                {  # indexes into the descriptors sent with this reply
                    "uuid": uuid,
                    "board": len(fds),
                    "policy": len(fds) + 1,
                    "account": len(fds) + 2,
                    "slot": tenant.slot,
                    "generation": int(gpu.shm.policy[tenant.slot].generation),
                }
            )
            fds.extend(gpu.shm.fds(tenant.slot))
        client.allocation = allocation.id
        client.send_fds = fds  # with the reply line, in one sendmsg (``shm.send_line``)
        return {
            "ok": True,
            "v": version,  # the version spoken on this connection
            "epoch": self.epoch,
            "quantum_ns": self.settings.quantum_ns,
            "window_ns": self.settings.window_ns,
            "gpus": gpus,
        }

    async def _pids(self, client: Client, message: dict[str, Any]) -> dict[str, Any]:
        """``pids``: the pids, as this agent sees them (``SO_PEERCRED``; the host's on a node
        whose agent runs with hostPID), of the processes connected for the caller's own
        allocation - for the interposer's NVML process lists inside a kernel pod, whose /proc
        cannot see the host pids the driver reports. Peer-checked like ``hello``; a connection
        that said ``hello`` asks for its own allocation only."""
        allocation_id = message.get("allocation")
        if not isinstance(allocation_id, str) or not allocation_id:
            return wire.refusal(
                wire.E_BAD_REQUEST,
                f"pids: allocation must be an allocation id (a string); got {allocation_id!r:.80}",
            )
        if client.allocation is not None and client.allocation != allocation_id:
            self.refused += 1
            return wire.refusal(
                wire.E_NOT_PERMITTED,
                "pids: this connection belongs to another allocation; ask for your own",
            )
        if client.allocation is None:
            _, refused = await self.peer_allocation(client, allocation_id)
            if refused is not None:
                return refused
        pids = sorted({c.pid for c in self.clients if c.allocation == allocation_id})
        # and the caller's own pid as the agent sees it: a caller whose getpid() differs runs in
        # a pid namespace of its own (a pod), where only this list tells its processes apart
        return {"ok": True, "pids": pids, "pid": client.pid}

    async def peer_allocation(
        self, client: Client, allocation_id: str
    ) -> tuple[Allocation | None, dict[str, Any] | None]:
        """``allocation_id``'s allocation if the peer may act on it, else a refusal (counted and
        logged). Before refusing it re-reads the ledger once (it may have changed since the last
        read), and keeps re-reading for a kernel pod whose UID the server has not recorded yet
        (it does so right after creating the pod) up to ``POD_RECORD_WAIT_NS``."""
        allocation = self.allocations.get(allocation_id)
        refusal = self._check_peer(client, allocation)
        deadline = monotonic_ns() + POD_RECORD_WAIT_NS
        looks = 0
        while refusal is not None and (
            looks == 0 or (_pod_pending(allocation) and monotonic_ns() < deadline)
        ):
            if looks:
                await asyncio.sleep(0.2)
            looks += 1
            await self.refresh()
            allocation = self.allocations.get(allocation_id)
            refusal = self._check_peer(client, allocation)
        if (
            refusal is None
            and allocation is not None
            and allocation.pid_start is None
            and not allocation.extra.get("k8s_pod")
        ):  # passed on its PID and owner alone: bind the record to that process now
            refusal = await self._stamp_start(allocation)
            if refusal is None:
                allocation = self.allocations.get(allocation_id)
                refusal = self._check_peer(client, allocation)
                if refusal is None and allocation is not None and allocation.pid_start is None:
                    refusal = wire.refusal(
                        wire.E_NOT_PERMITTED,
                        f"allocation {allocation_id}: the start time of its process could not "
                        "be recorded; try again",
                    )
        if refusal is not None:
            self.refused += 1
            self.refused_peer_log.failed(
                f"pid {client.pid} for {allocation_id!r}: {refusal['message']}"
            )
        return allocation, refusal

    def _check_peer(self, client: Client, allocation: Allocation | None) -> dict[str, Any] | None:
        """None when ``client`` may act as ``allocation``'s process (``hello``, ``pids``, a
        kernel's own ``release``/``resize``/``reserve``), else a refusal that says why.

        The agent identifies every process itself; nothing a caller or a record says about a
        PID is taken on its word (a PID is reused once its process exits, and the system
        agent, root, hands the share's lease memory to whoever passes):

        - the caller is the process that connected: uid and PID from ``SO_PEERCRED``, its start
          time read when the connection was accepted (:class:`.admission.Peer` ``start``). The
          process on that PID now must have that start time and run as that uid; a connection
          handed on to another process once its own exited (its PID then reused) is refused;
        - the record's process (``pid``) is alive and started at ``pid_start``, and the caller
          is that process or one of its descendants (checked by start time, not PID);
        - where the record names its owner's uid (``extra["uid"]``, stamped by the system
          agent), the caller runs as that uid, unless it is an admin;
        - a record without ``pid_start`` (made before the agent stamped start times, or by an
          admin) names its process by PID alone, which may since be another user's: it is
          trusted only while the process on that PID runs as the share's owner (its
          ``extra["uid"]``, else the uid of its ``user``; a record with neither is refused),
          and the first hello that passes makes the agent stamp that process's start time in
          the record (:meth:`_stamp_start`), so from then on the record names that process
          only and reconciliation may signal it (``reconcile.signal_identified``).

        A kernel pod's share is checked by the pod the caller runs in instead
        (:func:`_check_pod_peer`), once the caller is identified."""
        if allocation is None:
            return wire.refusal(
                wire.E_UNKNOWN_ALLOCATION,
                "no GPU share with that id on this node (released or never made)",
            )
        refusal = _connector_refusal(client)
        if refusal is not None:
            return refusal
        if allocation.extra.get("k8s_pod"):
            return _check_pod_peer(client, allocation)
        if allocation.pid is None:
            return wire.refusal(
                wire.E_NOT_PERMITTED, f"allocation {allocation.id} has no process yet"
            )
        holder = identify(allocation.pid)
        if holder is None or (
            allocation.pid_start is not None
            and abs(holder[0] - allocation.pid_start) > PID_START_TOLERANCE
        ):
            return wire.refusal(
                wire.E_NOT_PERMITTED, f"allocation {allocation.id}: its process is gone"
            )
        owner = _owner_uid(allocation)
        if allocation.pid_start is None and (owner is None or owner not in holder[2]):
            whose = "its owner's" if owner is None else f"uid {owner}'s (its owner)"
            return wire.refusal(
                wire.E_NOT_PERMITTED,
                f"allocation {allocation.id} names its process {allocation.pid} by PID alone "
                f"(no pid_start) and that process is not {whose}: the agent cannot tell it "
                "from a later process on that PID; start the kernel again (its start time is "
                "recorded), or an admin records its pid_start",
            )
        admin = client.peer is not None and client.peer.admin
        if owner is not None and client.uid != owner and not admin:
            return wire.refusal(
                wire.E_NOT_PERMITTED,
                f"process {client.pid} runs as uid {client.uid}; allocation {allocation.id} "
                f"is uid {owner}'s",
            )
        if client.pid != allocation.pid:
            started = lineage(client.pid).get(allocation.pid)
            if started is None or abs(started - holder[0]) > PID_START_TOLERANCE:
                return wire.refusal(
                    wire.E_NOT_PERMITTED,
                    f"process {client.pid} is not allocation {allocation.id}'s process "
                    f"({allocation.pid}) or one of its children",
                )
        return None

    async def _stamp_start(self, allocation: Allocation) -> dict[str, Any] | None:
        """Record the start time of ``allocation``'s process, which :meth:`_check_peer` just
        let through on its PID and owner alone; None when done, else a refusal. The process is
        identified again here (alive, its owner's), and the record is changed only if it still
        names that PID without a start time."""
        from ..errors import GpushareError
        from .intents import write

        holder = identify(allocation.pid or 0)
        owner = _owner_uid(allocation)
        if holder is None or owner is None or owner not in holder[2]:
            return wire.refusal(
                wire.E_NOT_PERMITTED, f"allocation {allocation.id}: its process is gone"
            )

        def stamped(current: Allocation, _others: list[Allocation]) -> Allocation:
            if current.pid != allocation.pid or current.pid_start is not None:
                raise _Changed
            return replace(current, pid_start=holder[0])

        async def job() -> dict[str, Any]:
            try:
                await self.ledger.update(allocation.id, stamped)
            except _Changed:
                pass  # changed meanwhile: checked again as it is now
            except GpushareError as exc:  # gone, busy or unavailable
                return wire.refusal(
                    wire.E_NOT_PERMITTED,
                    f"allocation {allocation.id}: the start time of its process {allocation.pid} "
                    f"could not be recorded ({exc}); try again",
                )
            return {"ok": True}

        done = await write(self, None, job)
        if not done.get("ok"):
            return done
        log.info(
            "allocation %s: recorded the start time of its process %d (its owner's, uid %d)",
            allocation.id,
            allocation.pid,
            owner,
        )
        await self.refresh()
        return None

    def _accepted(self, conn: socket.socket) -> None:
        """A new connection: admitted (its own ``_Protocol``) or refused and closed at once."""
        self.accepted += 1
        try:
            peer = read_peer(conn, self.admins)
        except OSError as exc:  # gone already
            log.debug("no peer credentials: %s", exc)
            conn.close()
            return
        why = self.admission.admit(peer, lambda: self.holds_share(peer))
        if why is not None:
            self.refused_log.failed(f"pid {peer.pid} ({peer.counted_as}): {why}")
            with contextlib.suppress(OSError):
                conn.send(wire.encode(wire.refusal(wire.E_NOT_PERMITTED, why)))
            conn.close()
            return
        protocol = _Protocol(self, peer)
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(lambda: protocol, conn))
        task.add_done_callback(lambda t: self._connect_failed(t, protocol, conn))

    def _connect_failed(
        self, task: asyncio.Task[Any], protocol: _Protocol, conn: socket.socket
    ) -> None:
        if task.cancelled() or task.exception() is not None:
            log.debug(
                "could not serve pid %d: %r",
                protocol.peer.pid,
                None if task.cancelled() else task.exception(),
            )
            if protocol.client is None:  # else its connection_lost counts it out
                self.admission.left(protocol.peer)
            conn.close()

    def _tell_revoked(self, gpu: GpuLoop, tenant: Tenant) -> None:
        """Wake the agents of the processes whose lease on ``gpu`` was revoked (wire.py,
        ``revoked``). A client with replies unread gets nothing more (bounded memory per client:
        its agent sees the revocation at its next look)."""
        line = json.dumps({"op": "revoked", "gpu": gpu.uuid}).encode() + b"\n"
        for client in self.clients:
            if any(t is tenant for _, t in client.tenants):
                transport = client.transport
                if not transport.is_closing() and transport.get_write_buffer_size() == 0:
                    transport.write(line)

    def disconnected(self, client: Client) -> None:
        self.clients.discard(client)
        for gpu, tenant in client.tenants:
            tenant.connections = max(0, tenant.connections - 1)
            if gpu.tenants.get(tenant.allocation) is tenant:
                gpu.disconnected(tenant)
        client.tenants.clear()

    # -- status -------------------------------------------------------------------------------

    def status(
        self, allocation_id: str | None = None, viewer: Peer | None = None
    ) -> dict[str, Any]:
        """What the agent enforces. A ``viewer`` (a connected client) sees only its own shares
        (:meth:`caller_shares`) unless it is an admin; the GPU entries show every GPU's totals
        but name only the viewer's shares. No ``viewer``: the agent itself (metrics, the usage
        publisher) sees everything."""
        if allocation_id is not None and not isinstance(allocation_id, str):
            return wire.refusal(wire.E_BAD_REQUEST, "allocation: an allocation id (a string)")
        now = monotonic_ns()
        mine = self.caller_shares(viewer) if viewer is not None else None
        viewer_admin = viewer is not None and bool(viewer.admin)
        allocations = []
        for allocation in self.allocations.values():
            if allocation_id is not None and allocation.id != allocation_id:
                continue
            if mine is not None and not mine(allocation):
                continue
            per_gpu = [
                gpu.tenant_status(gpu.tenants[allocation.id], now)
                for uuid in allocation.gpus
                if (gpu := self.gpus.get(uuid)) is not None and allocation.id in gpu.tenants
            ]
            for entry in per_gpu:
                entry.update(self._driver_counts(allocation.id, entry["gpu"]))
            allocations.append(
                {
                    "id": allocation.id,
                    "kernel_id": allocation.kernel_id,
                    "owner": allocation.owner,
                    "user": allocation.user,
                    # a kernel pod's record: its pod (metrics join on pod and namespace)
                    "pod": allocation.extra.get("k8s_pod"),
                    "namespace": allocation.extra.get("k8s_namespace"),
                    "pid": allocation.pid,
                    "request": allocation.request,
                    "limit": allocation.limit,
                    "memory_cap": allocation.memory,
                    "achieved_share": round(sum(g["achieved_share"] for g in per_gpu), 4),
                    "memory_used": sum(g["memory_used"] for g in per_gpu),
                    "lease_waits": sum(g["lease_waits"] for g in per_gpu),
                    "lease_wait_seconds": sum(g["lease_wait_seconds"] for g in per_gpu),
                    "connected": sum(g["processes"] for g in per_gpu) > 0,
                    "idle_s": min((g["idle_s"] for g in per_gpu), default=None),
                    "last_launch_ago_s": min(
                        (
                            g["last_launch_ago_s"]
                            for g in per_gpu
                            if g["last_launch_ago_s"] is not None
                        ),
                        default=None,
                    ),
                    "reclaim_warning": allocation.extra.get("reclaim_warning"),
                    # what the driver check did to it (its processes stopped or paused, why)
                    "driver_check": self.driver_check.report(allocation.id)
                    if self.driver_check is not None
                    else None,
                    "gpus": per_gpu,
                }
            )
        if allocation_id is not None and not allocations:
            refusal = wire.refusal(wire.E_UNKNOWN_ALLOCATION, f"no allocation {allocation_id!r}")
            gone = self.released.get(allocation_id)
            if allocation_id in self.reclaimed and (  # released by idle reclaim after a warning
                mine is None or (gone is not None and mine(gone))
            ):
                refusal["reclaimed"] = self.reclaimed[allocation_id]
            return refusal
        shown = {a["id"] for a in allocations} if mine is not None else None
        gpus = []
        for gpu in self.gpus.values():
            entry = gpu.status(now)
            entry["nvml"] = self.nvml.get(gpu.uuid)
            tenants = list(gpu.tenants.values())
            entry["shares"] = len(tenants)
            entry["reserved_request"] = round(sum(t.request for t in tenants), 4)
            entry["free_request"] = round(max(0.0, 1.0 - entry["reserved_request"]), 4)
            entry["reserved_memory"] = sum(t.memory for t in tenants)
            if shown is not None:  # others' shares are counted above, not named
                entry["allocations"] = [a for a in entry["allocations"] if a in shown]
                if entry["holder"] not in shown:
                    entry["holder"] = None
            gpus.append(entry)
        return {
            "ok": True,
            "daemon": {
                "pid": os.getpid(),
                "node": self.settings.node,
                "epoch": self.epoch,
                "wire_version": wire.VERSION,
                "wire_oldest_version": wire.OLDEST_VERSION,
                "uptime_s": round((now - self.started_ns) / 1e9, 3),
                "clients": len(self.clients),
                "refused": self.refused,
                "unreadable_rows": list(self.unreadable) if mine is None or viewer_admin else [],
                "unshared_kills": self.driver_check.unshared_kills if self.driver_check else 0,
                "metrics_port": self.metrics_port,
                "quantum_ms": self.settings.quantum_ns / 1e6,
                "window_ms": self.settings.window_ns / 1e6,
            },
            "allocations": allocations,
            "gpus": gpus,
        }

    def _driver_counts(self, allocation: str, gpu: str) -> dict[str, int]:
        if self.driver_check is None:
            return {"memory_kills": 0, "compute_fences": 0}
        return self.driver_check.counts(allocation, gpu)

    def _name_only_own(self, reply: dict[str, Any], viewer: Peer | None) -> dict[str, Any]:
        """A ``gpus`` reply as ``viewer`` may see it: every GPU's free capacity and number of
        ``shares``, but only the viewer's own allocation ids."""
        own: set[str] | None = None  # None: all (an admin, the agent itself)
        if viewer is not None and not viewer.admin:
            mine = self.caller_shares(viewer)
            own = {a.id for a in self.allocations.values() if mine(a)}
        for row in reply.get("gpus") or []:
            row["shares"] = len(row.get("allocations") or [])
            if own is not None:
                row["allocations"] = [i for i in row.get("allocations") or [] if i in own]
        return reply

    def caller_shares(self, peer: Peer) -> Callable[[Allocation], bool]:
        """Which allocations are ``peer``'s (what ``status`` shows it): all for an admin; else
        a kernel pod's record to a process in that pod, and a local record to its uid
        (``extra["uid"]``, or its ``user`` where the record has no uid) or to its process and
        that process's descendants (the peer check of ``hello``: a record with its process's
        start time, and a caller identified as the process that connected)."""
        if peer.admin:
            return lambda allocation: True
        name = user_name(peer.uid)
        ancestors: dict[int, float] | None = None  # read when a record needs it

        def mine(allocation: Allocation) -> bool:
            if allocation.extra.get("k8s_pod"):
                return peer.pod is not None and peer.pod == allocation.extra.get("k8s_pod_uid")
            if peer.pod is not None:
                return False
            uid = allocation.extra.get("uid")
            if uid is not None:
                if uid == peer.uid:
                    return True
            elif name is not None and allocation.user == name:
                return True
            if allocation.pid is None or allocation.pid_start is None:
                return False  # a PID alone may since name anybody's process
            nonlocal ancestors
            if ancestors is None:
                ancestors = _identified_lineage(peer)
            started = ancestors.get(allocation.pid)
            return (
                started is not None and abs(started - allocation.pid_start) <= PID_START_TOLERANCE
            )

        return mine

    def holds_share(self, peer: Peer) -> bool:
        """Whether ``peer`` holds a share on this node (may use the descriptor reserve)."""
        mine = self.caller_shares(peer)
        return any(mine(a) for a in self.allocations.values())


class _Changed(Exception):
    """A record changed between a check and the write that relied on it."""


def _connector_refusal(client: Client) -> dict[str, Any] | None:
    """None when the process on ``client``'s PID is still the one that connected (the start
    time read at accept, and the uid of ``SO_PEERCRED`` as its real or effective uid)."""
    peer = client.peer
    found = identify(client.pid)
    if (
        peer is None
        or peer.start is None
        or found is None
        or abs(found[0] - peer.start) > PID_START_TOLERANCE
        or client.uid not in found[2]
    ):
        return wire.refusal(
            wire.E_NOT_PERMITTED,
            f"the process that opened this connection (pid {client.pid}) is gone; a process "
            "says hello on a connection of its own",
        )
    return None


def _owner_uid(allocation: Allocation) -> int | None:
    """The uid of ``allocation``'s owner: its ``extra["uid"]``, else its ``user``'s, else None."""
    uid = allocation.extra.get("uid")
    if isinstance(uid, int) and not isinstance(uid, bool):
        return uid
    if allocation.user:
        try:
            return pwd.getpwnam(allocation.user).pw_uid
        except (KeyError, ValueError):
            return None
    return None


def _identified_lineage(peer: Peer) -> dict[int, float]:
    """The peer's process and its ancestors with their start times, if the process on the
    peer's PID is still the one that connected (:func:`_connector_refusal`); else empty."""
    found = lineage(peer.pid)
    start = found.get(peer.pid)
    if peer.start is None or start is None or abs(start - peer.start) > PID_START_TOLERANCE:
        return {}
    return found


#: how deeply a request may nest arrays and objects (a ledger record is 4 levels deep): deeper
#: lines are refused before they are decoded (the decoder recurses once per level)
MAX_DEPTH = 32
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def too_deep(line: bytes) -> bool:
    """Whether ``line`` nests arrays and objects deeper than :data:`MAX_DEPTH` (or its
    brackets do not pair up). Cheap: a line with at most that many brackets is never scanned;
    otherwise its strings are cut out and the innermost pairs removed ``MAX_DEPTH`` times over,
    each pass in C."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return False
    brackets = _STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not brackets or not removed:
            break
    return bool(brackets)


def _has_nvml() -> bool:
    """Whether the driver's NVML library (``libnvidia-ml.so.1``) loads here."""
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _pod_pending(allocation: Allocation | None) -> bool:
    return (
        allocation is not None
        and bool(allocation.extra.get("k8s_pod"))
        and not (allocation.extra.get("k8s_pod_uid"))
    )


def _check_pod_peer(client: Client, allocation: Allocation) -> dict[str, Any] | None:
    """A kernel pod's allocation: the peer must run in that pod (its cgroups name the pod UID
    the server recorded when it created the pod)."""
    pod = f"{allocation.extra.get('k8s_namespace', '')}/{allocation.extra['k8s_pod']}"
    expected = allocation.extra.get("k8s_pod_uid")
    if not expected:
        return wire.refusal(
            wire.E_NOT_PERMITTED, f"allocation {allocation.id}: pod {pod} is not recorded yet"
        )
    found = pod_uid_of(client.pid)
    if found == expected:
        return None
    where = f"pod UID {found}" if found else "no pod"
    return wire.refusal(
        wire.E_NOT_PERMITTED,
        f"process {client.pid} runs in {where}, not in allocation {allocation.id}'s pod {pod} "
        f"(UID {expected})",
    )


class _Protocol(asyncio.Protocol):
    """Line framing for one connection; requests are handled in order, in bounded memory.

    The connection was admitted already (``Daemon._accepted``: :class:`.admission.Admission` on
    the peer's identity from :func:`.admission.read_peer`; a refused one is closed at once with
    one refusal line). At most ``MAX_QUEUED`` requests (``MAX_QUEUED_BYTES``) wait to be handled
    and at most ``WRITE_HIGH_WATER`` bytes of replies wait for the client to read them: past
    either, the agent stops reading the connection (``pause_reading``) until they drain, so a
    client that writes and never reads holds a bounded buffer, not the agent's memory. A partial
    line is at most ``wire.MAX_LINE`` bytes; ``MAX_BAD_IN_A_ROW`` unreadable or refused requests in
    a row close the connection; one that holds no share is closed after ``idle_timeout_s`` without
    a request.
    """

    def __init__(self, daemon: Daemon, peer: Peer) -> None:
        self.daemon = daemon
        self.peer = peer
        self.buffer = bytearray()
        self.client: Client | None = None
        #: (request, or None with a ready reply; the reply; the request's size in bytes)
        self.queue: deque[tuple[dict[str, Any] | None, dict[str, Any] | None, int]] = deque()
        self.queued_bytes = 0
        self.worker: asyncio.Task[None] | None = None
        self.paused: set[str] = set()  # why reading is paused: "queue", "write"
        self.writable = asyncio.Event()
        self.writable.set()
        self.bad_in_a_row = 0
        self.last_request = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None

    # -- the connection's life -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        peer = self.peer
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.client = Client(transport, peer.pid, peer.uid, peer=peer)
        self.daemon.clients.add(self.client)
        self.last_request = asyncio.get_running_loop().time()
        self._arm_idle_timer(self.daemon.settings.idle_timeout_s)

    def _arm_idle_timer(self, delay: float) -> None:
        if self.daemon.settings.idle_timeout_s > 0:
            self.idle_timer = asyncio.get_running_loop().call_later(delay, self._idle_check)

    def _idle_check(self) -> None:
        self.idle_timer = None
        client = self.client
        if client is None or client.transport.is_closing() or client.allocation is not None:
            return  # a connection holding a share is never timed out
        timeout = self.daemon.settings.idle_timeout_s
        idle = asyncio.get_running_loop().time() - self.last_request
        if idle < timeout:
            self._arm_idle_timer(timeout - idle)
            return
        log.debug("closing the connection of pid %d: no request for %.0f s", client.pid, idle)
        client.transport.abort()

    # -- reading -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.client is None or self.client.transport.is_closing():
            return
        self.buffer += data
        self._fill()

    def _fill(self) -> None:
        """Moves complete lines from the buffer into the queue while it has room; pauses or
        resumes reading accordingly."""
        assert self.client is not None
        transport = self.client.transport
        while self._has_room() and (end := self.buffer.find(b"\n")) >= 0:
            line = bytes(self.buffer[:end])
            del self.buffer[: end + 1]
            if line.strip():
                self.last_request = asyncio.get_running_loop().time()
                self._dispatch(line)
                if transport.is_closing():
                    return
        if len(self.buffer) > wire.MAX_LINE and b"\n" not in self.buffer:
            log.debug(
                "closing the connection of pid %d: a line over %d bytes",
                self.client.pid,
                wire.MAX_LINE,
            )
            transport.abort()
            return
        if self._has_room():
            self._resume("queue")
        else:
            self._pause("queue")

    def _has_room(self) -> bool:
        return len(self.queue) < MAX_QUEUED and self.queued_bytes < MAX_QUEUED_BYTES

    def _pause(self, why: str) -> None:
        assert self.client is not None
        if not self.paused and not self.client.transport.is_closing():
            self.client.transport.pause_reading()
        self.paused.add(why)

    def _resume(self, why: str) -> None:
        assert self.client is not None
        if why not in self.paused:
            return
        self.paused.discard(why)
        if not self.paused and not self.client.transport.is_closing():
            self.client.transport.resume_reading()

    def _dispatch(self, line: bytes) -> None:
        assert self.client is not None
        if too_deep(line):
            self._enqueue(
                None,
                wire.refusal(
                    wire.E_BAD_REQUEST,
                    f"a message nested deeper than {MAX_DEPTH} levels of arrays and objects",
                ),
                len(line),
            )
            return
        try:
            message: dict[str, Any] | None = wire.decode(line)
        except (ValueError, RecursionError):
            message = None
        if message is None or not isinstance(message.get("op"), str):
            self._enqueue(
                None, wire.refusal(wire.E_BAD_REQUEST, "not a JSON object with an op"), len(line)
            )
            return
        if message["op"] in ("want", "done") and not self.queue and self.worker is None:
            # the hot messages: handled inline, no task switch (lease handoff latency)
            try:
                self.daemon._lease_event(self.client, message["op"], message)
            except (TypeError, ValueError) as exc:
                self._enqueue(
                    None, wire.refusal(wire.E_BAD_REQUEST, f"{message['op']}: {exc}"), len(line)
                )
            return
        self._enqueue(message, None, len(line))

    def _enqueue(
        self, message: dict[str, Any] | None, reply: dict[str, Any] | None, size: int
    ) -> None:
        self.queue.append((message, reply, size))
        self.queued_bytes += size
        if self.worker is None:
            self.worker = asyncio.get_running_loop().create_task(self._work())

    # -- answering ---------------------------------------------------------------------------

    async def _work(self) -> None:
        assert self.client is not None
        transport = self.client.transport
        handled = 0
        try:
            while self.queue and not transport.is_closing():
                if not self.writable.is_set():  # the client reads its replies first
                    await self.writable.wait()
                    continue
                message, reply, size = self.queue.popleft()
                self.queued_bytes -= size
                if message is not None:
                    try:
                        reply = await self.daemon.handle(self.client, message)
                    except Exception as exc:
                        self.daemon.request_log.failed(f"{message.get('op')!r}: {exc!r}", exc)
                        reply = wire.refusal("internal", str(exc))
                if reply is not None and not transport.is_closing():
                    self.bad_in_a_row = self.bad_in_a_row + 1 if reply.get("ok") is False else 0
                    fds, self.client.send_fds = self.client.send_fds, []
                    send_line(transport, wire.encode(reply), fds)
                    if self.bad_in_a_row >= MAX_BAD_IN_A_ROW:
                        log.debug(
                            "closing the connection of pid %d: %d refused requests in a row",
                            self.client.pid,
                            self.bad_in_a_row,
                        )
                        transport.close()
                        return
                self._fill()
                handled += 1
                if handled % BATCH == 0:  # let other connections have their turn
                    await asyncio.sleep(0)
        finally:
            self.worker = None

    def pause_writing(self) -> None:
        self.writable.clear()
        self._pause("write")

    def resume_writing(self) -> None:
        self.writable.set()
        self._resume("write")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        self.writable.set()  # a waiting worker ends
        self.queue.clear()
        self.buffer.clear()
        if self.client is not None:
            self.daemon.admission.left(self.peer)
            self.daemon.disconnected(self.client)
