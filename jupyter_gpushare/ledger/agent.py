"""The ledger as served by a system node agent (a shared machine, issue 12).

On a machine with a system agent (``jupyter gpushare daemon --system``) nobody but the agent opens
the SQLite ledger; every user's server, ``jupyter gpushare run``, provisioner and kernel uses
:class:`AgentLedger`, which implements the four :class:`~jupyter_gpushare.ledger.Ledger`
primitives as requests on the agent's unix socket (``ledger.snapshot``, ``ledger.cas``,
``ledger.put_gpus``, ``ledger.gpus``; see :mod:`jupyter_gpushare.daemon.ledger_ops`). Placement,
release, resize and reconciliation are the base class's read-modify-CAS loops, unchanged: the
agent authorizes each compare-and-swap by the caller's uid (peer credentials), so a user can
only add, change and remove their own allocations, and sees everyone else's only as capacity.

Each call opens its own connection with asyncio (no blocking call on the event loop; safe to use
from any event loop and after ``fork``). A refusal is raised as :class:`AgentRefused` (or
:class:`~jupyter_gpushare.share.ShareError` when the agent names a share field); an agent that
does not answer as :class:`~jupyter_gpushare.ledger.LedgerUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..inventory import Gpu
from ..share import ShareError, ShareSpec
from . import Allocation, Ledger, LedgerUnavailable, Placer, Snapshot

#: seconds one request may take (connect, send, read the reply)
TIMEOUT_S = 30.0
#: the longest reply line read (a snapshot of many allocations)
MAX_REPLY = 64 * 2**20


class AgentRefused(RuntimeError):
    """The agent refused a request (another user's share, a bound, over capacity)."""

    def __init__(self, error: str, message: str, reply: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error = error
        self.reply = reply or {}

    @property
    def status(self) -> int:
        return 403 if self.error == "not_permitted" else 409

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, "message": str(self)}


class AgentLedger(Ledger):
    """The ledger of the agent on ``socket_path``. ``bound`` is this process's per-user bound
    (JupyterHub's ``GPUSHARE_MAX_SHARE``); the agent records it (or a smaller one of its own) on
    every allocation this ledger creates and checks every later change against it."""

    def __init__(self, socket_path: str | Path, bound: ShareSpec | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.bound = bound
        self._recorded: dict[str, Allocation] = {}
        #: records as the agent showed them (other users' redacted); one sent back unchanged
        #: goes as ``{"id", "keep": true}``, which keeps a compare-and-swap small
        self._seen: dict[str, Allocation] = {}

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
        reader, writer = await asyncio.open_unix_connection(str(self.socket_path), limit=MAX_REPLY)
        try:
            writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            await writer.drain()
            line = await reader.readuntil(b"\n")
        finally:
            writer.close()
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError("the agent's reply is not a JSON object")
        return reply

    async def allocate(
        self, spec: ShareSpec, inventory: Sequence[Gpu], place: Placer, **fields: Any
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
        reply = await self.request({"op": "ledger.snapshot"})
        snap = Snapshot(
            allocations=tuple(Allocation.from_json(a) for a in reply.get("allocations", [])),
            versions={str(k): int(v) for k, v in (reply.get("versions") or {}).items()},
        )
        for a in snap.allocations:  # sent back unchanged, a record goes by its id alone
            self._seen[a.id] = a
        while len(self._seen) > 4096:
            self._seen.pop(next(iter(self._seen)))
        return snap

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        from ..bound import to_json

        reply = await self.request(
            {
                "op": "ledger.cas",
                "node": node,
                "version": expected_version,
                "allocations": [
                    {"id": a.id, "keep": True} if self._seen.get(a.id) == a else a.to_json()
                    for a in allocations
                ],
                "bound": to_json(self.bound) if self.bound is not None else None,
            }
        )
        for data in reply.get("added") or []:  # the agent's stamped copies of new records
            added = Allocation.from_json(data)
            self._recorded[added.id] = added
        while len(self._recorded) > 256:  # only allocate() collects them
            self._recorded.pop(next(iter(self._recorded)))
        return bool(reply.get("swapped"))

    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        await self.request(
            {"op": "ledger.put_gpus", "node": node, "gpus": [g.to_json() for g in gpus]}
        )

    async def gpus(self) -> list[Gpu]:
        reply = await self.request({"op": "ledger.gpus"})
        return [Gpu.from_json(g) for g in reply.get("gpus", [])]
