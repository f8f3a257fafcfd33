"""The ledger as served by a system node agent (a shared machine, issue 12).

On a machine with a system agent (``jupyter gpushare daemon --system``) nobody but the agent opens
the SQLite ledger; every user's server, ``jupyter gpushare run``, provisioner and kernel uses
:class:`AgentLedger`, which implements the four :class:`~jupyter_gpushare.ledger.Ledger`
primitives as requests on the agent's unix socket (``ledger.snapshot``, ``ledger.cas``,
``ledger.put_gpus``, ``ledger.gpus``; see :mod:`jupyter_gpushare.daemon.ledger_ops`). Placement,
release, resize and reconciliation are the base class's read-modify-CAS loops, unchanged: the
agent authorizes each compare-and-swap by the caller's uid (peer credentials), so a user can
only add, change and remove their own allocations, and sees everyone else's only as capacity.

Requests go over one connection kept open between calls (:class:`_Connection`: a non-blocking
socket driven by whichever event loop makes the call, so no blocking call on the event loop; safe
to use from any event loop and after ``fork``): the agent reads a connection's peer credentials
once, so a kept connection saves the connect, the agent's accept and its identity read on every
request after the first (issue 12's placement + record budget). A call made while the kept
connection is busy (another task, another thread) opens its own. The kept connection is used
again only by the process, uid and euid that opened it (a forked child or a process that changed
its uid opens its own, so it never acts with another identity's credentials), only within
:data:`KEEP_S` of its last use (well inside the agent's idle timeout) and only after a
zero-cost check that the agent has not closed it (a restarted agent: the next call connects
afresh). A read-only request that finds a kept connection dead is sent again once on a new one;
a ``ledger.cas`` is never sent twice. A refusal is raised as :class:`AgentRefused` (or
:class:`~jupyter_gpushare.share.ShareError` when the agent names a share field); an agent that
does not answer as :class:`~jupyter_gpushare.ledger.LedgerUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import GpushareError
from ..inventory import Gpu
from ..placement.policy import Policy
from ..placement.state import PlacementRefused
from ..share import ShareError, ShareSpec
from . import (
    Allocation,
    AllocationNotFound,
    Ledger,
    LedgerConflict,
    LedgerUnavailable,
    PlaceFunction,
    Snapshot,
)

#: seconds one request may take (connect, send, read the reply)
TIMEOUT_S = 30.0
#: the longest reply line read (a snapshot of many allocations)
MAX_REPLY = 64 * 2**20
#: a kept connection idle longer than this is closed, not used again (the agent closes
#: connections that hold no share after its ``--idle-timeout``, 60 s by default)
KEEP_S = 5.0
#: requests that change nothing: sent again once when a kept connection turned out dead
IDEMPOTENT = frozenset({"ledger.snapshot", "ledger.gpus", "ledger.put_gpus"})
#: records parsed from snapshots, kept to skip parsing a record the agent shows unchanged
PARSED_MAX = 4096
#: how long the ledger as the last compare-and-swap reply showed it may start the next
#: read-modify-CAS loop (``Ledger.snapshot_to_change``) instead of a ``ledger.snapshot``
LAST_SEEN_S = 10.0
#: the record fields a ``ledger.reserve`` sends (the agent stamps user, uid and bound itself)
RESERVE_FIELDS = (
    "id",
    "owner",
    "kernel_id",
    "backend",
    "state",
    "pid",
    "pid_start",
    "server_pid",
    "extra",
)
#: the longest single ``ledger.queue.wait`` (a progress report at least this often)
QUEUE_POLL_S = 10.0


#: how long a caller waits for the machine's system agent when nothing listens on its socket
#: (stopped, or restarting: systemd starts it again within seconds)
SYSTEM_WAIT_S = 10.0


class AgentNotRunning(ConnectionError):
    """Nothing listens on the agent's socket (for the system agent: after waiting for it)."""

    def __init__(self, path: str, exc: OSError) -> None:
        from .. import paths

        if path == str(paths.SYSTEM_SOCKET):
            text = (
                f"the system GPU agent is not running (nothing answers on {path} after "
                f"{SYSTEM_WAIT_S:g} s); ask your admin to start it (systemctl start "
                "jupyter-gpushare-agent). GPU shares are booked only by it on this machine"
            )
        else:
            text = f"no gpushare agent answers on {path} ({exc.strerror or exc})"
        super().__init__(exc.errno, text)

    def __str__(self) -> str:
        return str(self.strerror)


class _Connection:
    """One unix socket to the agent, used by one request at a time (see the module's doc)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.owner = (os.getpid(), os.getuid(), os.geteuid())
        self.last_used = 0.0

    @classmethod
    async def open(cls, path: str) -> _Connection:
        """A connection to the agent on ``path``. The machine's system agent stopped or
        restarting (nothing listens there) is waited for up to :data:`SYSTEM_WAIT_S`, then
        :class:`AgentNotRunning` says so (never a private ledger instead: ``paths.find_agent``)."""
        from .. import paths

        deadline = time.monotonic() + (SYSTEM_WAIT_S if path == str(paths.SYSTEM_SOCKET) else 0)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await asyncio.get_running_loop().sock_connect(sock, path)
                return cls(sock)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise AgentNotRunning(path, exc) from None
            except BaseException:
                sock.close()
                raise
            await asyncio.sleep(0.25)

    def reusable(self, now: float) -> bool:
        """Whether this kept connection may serve another request now: same process and
        identity, used recently, and nothing (an EOF from a stopped agent, a stray byte)
        waiting on it."""
        if self.owner != (os.getpid(), os.getuid(), os.geteuid()):
            return False
        if now - self.last_used > KEEP_S:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # open, nothing pending
        except OSError:
            return False
        return False  # EOF or unexpected bytes

    async def request(self, line: bytes) -> bytes:
        """Send one request line, read its one reply line."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, line)
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await loop.sock_recv(self.sock, 256 * 1024)
            if not chunk:
                raise asyncio.IncompleteReadError(b"".join(chunks), None)
            chunks.append(chunk)
            size += len(chunk)
            if chunk.endswith(b"\n"):
                break
            if b"\n" in chunk:  # a reply is one line; more means a confused connection
                raise ValueError("the agent sent more than one reply line")
            if size > MAX_REPLY:
                raise asyncio.LimitOverrunError("the agent's reply is too long", size)
        reply = b"".join(chunks)
        if reply.count(b"\n") != 1:
            raise ValueError("the agent sent more than one reply line")
        return reply

    def close(self) -> None:
        self.sock.close()  # in a forked child: its own copy (the parent's stays open)


class AgentRefused(GpushareError, RuntimeError):
    """The agent refused a request (another user's share, a bound, over capacity)."""

    def __init__(self, error: str, message: str, reply: dict[str, Any] | None = None) -> None:
        super().__init__(
            message,
            code=error,
            status=403 if error == "not_permitted" else 404 if error == "unknown_entry" else 409,
        )
        self.error = error
        self.reply = reply or {}


class AgentLedger(Ledger):
    """The ledger of the agent on ``socket_path``. ``bound`` is this process's per-user bound
    (JupyterHub's ``GPUSHARE_MAX_SHARE``); the agent records it (or a smaller one of its own) on
    every allocation this ledger creates and checks every later change against it."""

    def __init__(self, socket_path: str | Path, bound: ShareSpec | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.bound = bound
        #: the kept connection while no request uses it (taken out while one does)
        self._kept: _Connection | None = None
        self._kept_lock = threading.Lock()
        #: id -> (the record's JSON as last received, the Allocation parsed from it)
        self._parsed: dict[str, tuple[dict[str, Any], Allocation]] = {}
        #: the ledger as last seen (a snapshot, or a compare-and-swap's reply): when, by which pid
        self._last: tuple[Snapshot, float, int] | None = None
        self._recorded: dict[str, Allocation] = {}
        #: False once the agent answered that it takes no intents (an older agent)
        self._intents = True

    @property
    def path(self) -> Path:  # where it lives, for messages (``SQLiteLedger.path``'s role)
        return self.socket_path

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = await asyncio.wait_for(self._request(message), TIMEOUT_S)
        except (
            OSError,
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ) as exc:
            reason = str(exc) or type(exc).__name__
            raise LedgerUnavailable(f"served by the agent on {self.socket_path}", reason) from None
        if not reply.get("ok"):
            if reply.get("error") == "ledger_unavailable":  # the agent's file, in its words
                raise LedgerUnavailable(
                    str(reply.get("ledger", self.socket_path)),
                    str(reply.get("reason", reply.get("message", ""))),
                )
            if reply.get("error") == PlacementRefused.code:
                raise PlacementRefused(
                    str(reply.get("message", "nothing fits")), reply.get("suggestions") or ()
                )
            if reply.get("field"):
                raise ShareError(
                    str(reply["field"]),
                    reply.get("value"),
                    str(reply.get("allowed", reply.get("message", ""))),
                )
            raise AgentRefused(
                str(reply.get("error", "refused")),
                str(reply.get("message", "the gpushare agent refused")),
                reply,
            )
        return reply

    async def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._kept_lock:
            conn, self._kept = self._kept, None
        if conn is not None and not conn.reusable(time.monotonic()):
            conn.close()
            conn = None
        kept = conn is not None
        if conn is None:
            conn = await _Connection.open(str(self.socket_path))
        try:
            try:
                raw = await conn.request(line)
            except (OSError, asyncio.IncompleteReadError):
                if not kept or message.get("op") not in IDEMPOTENT:
                    raise
                conn.close()  # the kept connection died under us: once more, afresh
                conn = await _Connection.open(str(self.socket_path))
                raw = await conn.request(line)
        except BaseException:
            conn.close()
            raise
        conn.last_used = time.monotonic()
        with self._kept_lock:
            if self._kept is None:
                conn, self._kept = None, conn
        if conn is not None:
            conn.close()
        reply = json.loads(raw)
        if not isinstance(reply, dict):
            raise ValueError("the agent's reply is not a JSON object")
        return reply

    async def allocate(
        self, spec: ShareSpec, inventory: Sequence[Gpu], place: PlaceFunction, **fields: Any
    ) -> Allocation:
        """As :meth:`Ledger.allocate`; returns the allocation as the agent recorded it (owner
        uid and user name, the bound that applies). With a ``place`` that names its policy
        (``placement.bind``) the agent places and records it in one intent
        (``ledger.reserve``), so other users' writes cannot make it lose."""
        policy = getattr(place, "policy", None)
        if isinstance(policy, Policy):
            reply = await self._intent(self._reserve_message(spec, policy, fields, queue=False))
            if reply is not None:
                made = Allocation.from_json(reply["allocation"])
                self._took(reply, made)
                return made
        import pwd

        uid = os.getuid()
        try:
            fields["user"] = pwd.getpwuid(uid).pw_name
        except KeyError:
            fields["user"] = str(uid)
        fields["extra"] = {**dict(fields.get("extra") or {}), "uid": uid}
        made = await super().allocate(spec, inventory, place, **fields)
        return self._recorded.pop(made.id, made)  # as stamped by the agent (its bound)

    # -- intents (issue 23 item 6; the agent applies them in a fair order) -------------------

    def _reserve_message(
        self, spec: ShareSpec, policy: Policy | None, fields: dict[str, Any], queue: bool
    ) -> dict[str, Any]:
        from ..bound import to_json

        sent = {k: v for k, v in fields.items() if k in RESERVE_FIELDS and v is not None}
        unknown = sorted(set(fields) - set(RESERVE_FIELDS) - {"user"})
        if unknown:
            raise TypeError(f"allocate() got fields the agent does not take: {unknown}")
        if "extra" in sent:
            sent["extra"] = dict(sent["extra"])
        return {
            "op": "ledger.reserve",
            "share": {k: v for k, v in spec.to_json().items() if v is not None},
            "policy": policy.to_json() if policy is not None else None,
            "fields": sent,
            "bound": to_json(self.bound) if self.bound is not None else None,
            "queue": queue,
            "view": self._needs_view(),
        }

    def _needs_view(self) -> bool:
        """Whether this process keeps no recent view of the ledger (an intent's reply then
        carries one, for the next change to start from)."""
        last = self._last
        return last is None or last[2] != os.getpid() or time.monotonic() - last[1] >= LAST_SEEN_S

    async def _intent(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The agent's reply to an intent; None from an agent that takes none (then the
        caller's read-modify-CAS loop does the same)."""
        if not self._intents:
            return None
        try:
            return await self.request(message)
        except AgentRefused as exc:
            if exc.error == "bad_request" and "unknown op" in str(exc):
                self._intents = False
                return None
            raise

    def _took(
        self, reply: dict[str, Any], made: Allocation | None, gone: Allocation | None = None
    ) -> None:
        """An intent took effect (``made`` is the record now, ``gone`` the one removed): the
        view the next change starts from gets that one record, when it showed the node at the
        version just before (else it is dropped: the next change reads afresh)."""
        if "versions" in reply:  # the ledger as it is (asked for with "view": true)
            self._remember(reply)
            return
        record = made or gone
        version = reply.get("version")
        last = self._last
        if (
            record is None
            or not isinstance(version, int)
            or last is None
            or last[2] != os.getpid()
            or last[0].versions.get(record.node, 0) != version - 1
        ):
            self.forget_snapshot()
            return
        kept = tuple(a for a in last[0].allocations if a.id != record.id)
        self._keep_view(
            Snapshot(
                allocations=kept + ((made,) if made is not None else ()),
                versions={**last[0].versions, record.node: version},
            )
        )

    async def release(
        self, allocation_id: str, if_unchanged: Allocation | None = None
    ) -> Allocation | None:
        reply = await self._intent(
            {
                "op": "ledger.release",
                "id": allocation_id,
                "if_unchanged": if_unchanged.to_json() if if_unchanged is not None else None,
                "view": self._needs_view(),
            }
        )
        if reply is None:
            return await super().release(allocation_id, if_unchanged)
        released = reply.get("released")
        gone = Allocation.from_json(released) if isinstance(released, dict) else None
        if gone is not None:
            self._took(reply, None, gone)
        return gone

    async def update(
        self,
        allocation_id: str,
        change: Any,
    ) -> Allocation:
        """As :meth:`Ledger.update`, as an intent on the one record: it loses only when that
        record changed meanwhile (then ``change`` runs again on the agent's current view)."""
        if not self._intents:
            return await super().update(allocation_id, change)
        for _attempt in range(self.max_attempts):
            snap, maybe_stale = await self.snapshot_to_change()
            found = snap.find(allocation_id)
            others = []
            if found is not None:
                others = [a for a in snap.on_node(found.node) if a.id != allocation_id]
            try:
                if found is None:
                    raise AllocationNotFound(allocation_id)
                changed = change(found, others)
            except Exception:
                if not maybe_stale:
                    raise
                self.forget_snapshot()
                continue
            reply = await self._intent(
                {
                    "op": "ledger.update",
                    "id": allocation_id,
                    "version": snap.versions.get(found.node, 0),
                    "before": found.to_json(),
                    "after": changed.to_json(),
                    "view": self._needs_view(),
                }
            )
            if reply is None:
                return await super().update(allocation_id, change)
            if reply.get("applied"):
                changed = Allocation.from_json(reply["allocation"])
                self._took(reply, changed)
                return changed
            if "versions" in reply:
                self._remember(reply)  # the ledger as it is: the next try decides on it
            else:
                self.forget_snapshot()
        raise LedgerConflict(f"could not update {allocation_id} after {self.max_attempts} tries")

    async def reserve_waiting(
        self,
        spec: ShareSpec,
        policy: Policy | None,
        timeout: float | None,
        progress: Any = None,
        **fields: Any,
    ) -> Allocation:
        """Place ``spec`` now, or wait in the agent's queue (DESIGN box 13) up to ``timeout``
        seconds (None: for as long as it takes) and return the share it started. ``progress``
        is called with each view of the waiting entry (``position``, ``eta``, ``message``).
        Raises ``PlacementRefused`` when the wait ends without a start (the queue's reason
        and the last position in the message), and the agent's refusal (``never_fits``,
        ``queue_full``, a bound) at once. A cancelled wait (Ctrl-C, a stopped start) cancels
        the entry; a share started in that moment is released."""
        message = self._reserve_message(spec, policy, fields, queue=True)
        reply = await self.request(message)
        if reply.get("allocation"):
            made = Allocation.from_json(reply["allocation"])
            self._took(reply, made)
            return made
        entry = reply["entry"]
        refused = str(reply.get("refusal") or "nothing fits now")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if progress is not None:
                    progress(entry)
                if entry["state"] == "started":
                    self.forget_snapshot()
                    return Allocation.from_json(entry["allocation"])
                if entry["state"] != "waiting":
                    raise PlacementRefused(f"{refused}; the queued start was {entry['message']}")
                left = QUEUE_POLL_S if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                waited = await self.request(
                    {
                        "op": "ledger.queue.wait",
                        "entry": entry["id"],
                        "timeout": min(left, QUEUE_POLL_S),
                    }
                )
                entry = waited["entry"]
        except BaseException:
            ended = await asyncio.shield(self._cancel_entry(entry["id"]))
            if ended is not None and ended.get("state") == "started":  # nobody waits for it
                await asyncio.shield(self.release(str(ended["allocation"]["id"])))
            raise
        last = await self._cancel_entry(entry["id"])
        if last is not None and last.get("state") == "started":
            self.forget_snapshot()
            return Allocation.from_json(last["allocation"])
        raise PlacementRefused(
            f"{refused}; waited {timeout:g} s in the queue: {entry.get('message')}"
        )

    async def _cancel_entry(self, entry_id: str) -> dict[str, Any] | None:
        """Cancel a waiting entry; a share started meanwhile is released (its start was not
        waited for). The entry as it ended."""
        try:
            reply = await self.request({"op": "ledger.queue.cancel", "entry": entry_id})
        except (GpushareError, OSError):
            return None
        entry = reply.get("entry")
        return entry if isinstance(entry, dict) else None

    async def queue(self) -> list[dict[str, Any]]:
        """The agent's waiting starts in order (others' as capacity only, unless an admin)."""
        return list((await self.request({"op": "ledger.queue"})).get("entries") or [])

    # -- the four primitives -----------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        return self._remember(await self.request({"op": "ledger.snapshot"}))

    def _remember(self, reply: dict[str, Any]) -> Snapshot:
        """The snapshot in ``reply`` (a ``ledger.snapshot`` reply, or a ``ledger.cas`` reply
        that lost its swap and carries the ledger as it is), kept for the next change."""
        snap = Snapshot(
            allocations=tuple(self._parse(a) for a in reply.get("allocations", [])),
            versions={str(k): int(v) for k, v in (reply.get("versions") or {}).items()},
        )
        self._keep_view(snap)
        return snap

    def _keep_view(self, snap: Snapshot) -> None:
        self._last = (snap, time.monotonic(), os.getpid())

    async def snapshot_to_change(self) -> tuple[Snapshot, bool]:
        """The ledger as this process last saw it, if within :data:`LAST_SEEN_S` (a change then
        costs one request, its compare-and-swap), else a fresh snapshot."""
        last = self._last
        if last is not None and last[2] == os.getpid():
            if time.monotonic() - last[1] < LAST_SEEN_S:
                return last[0], True
        return await self.snapshot(), False

    def forget_snapshot(self) -> None:
        self._last = None

    def _parse(self, data: dict[str, Any]) -> Allocation:
        """``data`` as an Allocation; the one parsed before when the agent sent the same JSON
        (a snapshot repeats most records unchanged)."""
        key = data.get("id")
        if isinstance(key, str):
            hit = self._parsed.get(key)
            if hit is not None and hit[0] == data:
                return hit[1]
        parsed = Allocation.from_json(data)
        if isinstance(key, str):
            if len(self._parsed) >= PARSED_MAX:
                self._parsed.clear()
            self._parsed[key] = (data, parsed)
        return parsed

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        from ..bound import to_json

        # A record sent back as the agent last showed it (other users' redacted) goes by its id
        # alone, ``{"id", "keep": true}``, which keeps a compare-and-swap small; the agent reads
        # it as its stored record, which is that one while the node is at ``expected_version``.
        last = self._last
        seen = {a.id: a for a in last[0].allocations if a.node == node} if last else {}
        reply = await self.request(
            {
                "op": "ledger.cas",
                "node": node,
                "version": expected_version,
                "allocations": [
                    {"id": a.id, "keep": True} if _same(seen.get(a.id), a) else a.to_json()
                    for a in allocations
                ],
                "bound": to_json(self.bound) if self.bound is not None else None,
                "snapshot": True,  # what the node holds afterwards, for the next change
            }
        )
        added: dict[str, Allocation] = {}
        for data in reply.get("added") or []:  # the agent's stamped copies of new records
            made = Allocation.from_json(data)
            self._recorded[made.id] = added[made.id] = made
        while len(self._recorded) > 256:  # only allocate() collects them
            self._recorded.pop(next(iter(self._recorded)))
        swapped = bool(reply.get("swapped"))
        last, version = self._last, reply.get("version")
        if "versions" in reply:  # lost: the ledger as it is now
            self._remember(reply)
        elif swapped and isinstance(version, int) and last is not None and last[2] == os.getpid():
            # took effect: the node holds what was proposed (new records as stamped) at
            # ``version``; other nodes as last seen (a stale view only costs a lost swap)
            mine = tuple(added.get(a.id, a) for a in allocations)
            self._keep_view(
                Snapshot(
                    allocations=tuple(a for a in last[0].allocations if a.node != node) + mine,
                    versions={**last[0].versions, node: version},
                )
            )
        else:  # an agent that does not send it
            self._last = None
        return swapped

    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        await self.request(
            {"op": "ledger.put_gpus", "node": node, "gpus": [g.to_json() for g in gpus]}
        )

    async def gpus(self) -> list[Gpu]:
        reply = await self.request({"op": "ledger.gpus"})
        return [Gpu.from_json(g) for g in reply.get("gpus", [])]


def _same(seen: Allocation | None, a: Allocation) -> bool:
    return seen is a or seen == a
