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
from ..share import ShareError, ShareSpec
from . import Allocation, Ledger, LedgerUnavailable, PlaceFunction, Snapshot

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


class _Connection:
    """One unix socket to the agent, used by one request at a time (see the module's doc)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.owner = (os.getpid(), os.getuid(), os.geteuid())
        self.last_used = 0.0

    @classmethod
    async def open(cls, path: str) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, path)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

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
        super().__init__(message, code=error, status=403 if error == "not_permitted" else 409)
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
        uid and user name, the bound that applies)."""
        import os
        import pwd

        uid = os.getuid()
        try:
            fields["user"] = pwd.getpwuid(uid).pw_name
        except KeyError:
            fields["user"] = str(uid)
        fields["extra"] = {**dict(fields.get("extra") or {}), "uid": uid}
        made = await super().allocate(spec, inventory, place, **fields)
        return self._recorded.pop(made.id, made)  # as stamped by the agent (its bound)

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
