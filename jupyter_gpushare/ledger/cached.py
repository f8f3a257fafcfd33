"""The SQLite ledger as its only writer keeps it: the system agent's (issue 12).

In system mode the node agent is the only process that opens the SQLite ledger, so it keeps the
last snapshot and the inventory in memory: every caller's ``ledger.snapshot`` and the agent's
own follower are answered without a SQLite transaction, and a compare-and-swap against the
snapshot it handed out writes only the rows that changed (the base class rewrites every row of
the node: with 64 live shares that is 64 JSON encodings per change), on one connection kept open
(opening one costs ~0.7 ms of CPU, the write itself ~0.02 ms). The version check is still
the file's, in the same ``BEGIN IMMEDIATE`` transaction: if anything else ever wrote the file, a
stale snapshot only makes a caller's CAS lose and retry (nothing is overwritten), and the cache is
read again after ``ttl`` seconds at the latest.

Durability: one ``BEGIN IMMEDIATE`` transaction per change, in WAL mode with
``synchronous=NORMAL``, through statements ``sqlite3`` prepares once and keeps in the
connection's statement cache. A commit then appends to the WAL without an ``fsync`` (the WAL
is synced at checkpoints). That is durable enough here because the agent is the ledger's only
writer and the ledger holds only what the running kernels hold: WAL keeps the file consistent
through any crash (a commit is all or nothing), an agent crash loses nothing (the WAL is in
the page cache), and a power loss can lose at most the last changes before it, whose kernels
died with the machine anyway (reconciliation releases what a lost release left behind, and a
lost placement belongs to a kernel that never outlived the outage). ``synchronous=FULL``
would add an ``fsync`` to every placement and release: milliseconds on many disks, for no
state that outlives the processes it describes.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..inventory import Gpu
from . import Allocation, Snapshot
from .sqlite import SQLiteLedger, _unavailable, is_unreadable


class CachedSQLiteLedger(SQLiteLedger):
    def __init__(self, path: str | Path, ttl: float = 5.0) -> None:
        super().__init__(path)
        self.ttl = ttl
        self._snap: Snapshot | None = None
        self._snap_at = 0.0
        self._gpus: list[Gpu] | None = None
        self._writes = 0  # a read that started before a write does not fill the cache
        self._db: sqlite3.Connection | None = None  # the writer's connection (any one thread)
        self._db_lock = threading.Lock()

    async def snapshot(self) -> Snapshot:
        if self._snap is not None and time.monotonic() - self._snap_at < self.ttl:
            return self._snap
        writes = self._writes
        snap = await super().snapshot()
        if writes == self._writes:
            self._snap, self._snap_at = snap, time.monotonic()
        return snap

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        base = self._snap
        if base is None or base.versions.get(node, 0) != expected_version:
            self._writes += 1
            self._snap = None
            swapped = await super().compare_and_swap(node, expected_version, allocations)
            self._writes += 1
            self._snap = None
            return swapped
        old = {a.id: a for a in base.on_node(node)}
        # a row that cannot be read stays as it is in the file (and in the cached view) until
        # it is replaced by a readable record of its id: never deleted or written from here
        held = [a for a in old.values() if is_unreadable(a)]
        allocations = [a for a in allocations if not is_unreadable(a)]
        new_ids = {a.id for a in allocations}
        upserts = [a for a in allocations if old.get(a.id) is not a and old.get(a.id) != a]
        gone = [i for i in old if i not in new_ids and not is_unreadable(old[i])]
        gone += [a.id for a in upserts]
        self._writes += 1
        swapped = await asyncio.to_thread(
            self._write_changes_sync, node, expected_version, gone, upserts
        )
        self._writes += 1
        if swapped and self._snap is base:
            kept = tuple(a for a in base.allocations if a.node != node)
            still = tuple(a for a in held if a.id not in new_ids)
            self._snap = Snapshot(
                allocations=kept + still + tuple(allocations),
                versions={**base.versions, node: expected_version + 1},
            )
        else:
            self._snap = None
        return swapped

    @_unavailable
    def _write_changes_sync(
        self, node: str, expected_version: int, gone: Sequence[str], upserts: Sequence[Allocation]
    ) -> bool:
        with self._db_lock:
            if self._db is None:
                self._connect().close()  # the file, its schema and WAL mode, as the base makes
                db = sqlite3.connect(
                    self.path, timeout=30, isolation_level=None, check_same_thread=False
                )  # used under _db_lock only
                db.execute("PRAGMA busy_timeout=30000")
                db.execute("PRAGMA synchronous=NORMAL")
                self._db = db
            try:
                return self._write_changes(self._db, node, expected_version, gone, upserts)
            except sqlite3.Error:
                self._db.close()  # opened afresh next time (the file may have been replaced)
                self._db = None
                raise

    def _write_changes(
        self,
        db: sqlite3.Connection,
        node: str,
        expected_version: int,
        gone: Sequence[str],
        upserts: Sequence[Allocation],
    ) -> bool:
        with self._transaction(db, "IMMEDIATE"):
            row = db.execute("SELECT version FROM nodes WHERE node=?", (node,)).fetchone()
            if (row[0] if row else 0) != expected_version:
                return False
            db.executemany(
                "DELETE FROM allocations WHERE node=? AND id=?", [(node, i) for i in gone]
            )
            db.executemany(
                "INSERT INTO allocations (id, node, body) VALUES (?, ?, ?)",
                [(a.id, node, json.dumps(a.to_json())) for a in upserts],
            )
            db.execute(
                "INSERT INTO nodes (node, version) VALUES (?, ?) "
                "ON CONFLICT(node) DO UPDATE SET version=excluded.version",
                (node, expected_version + 1),
            )
            return True

    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        self._gpus = None
        await super().put_gpus(node, gpus)
        self._gpus = None

    async def gpus(self) -> list[Gpu]:
        if self._gpus is None:
            self._gpus = await super().gpus()
        return list(self._gpus)

    async def close(self) -> None:
        with self._db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None
        await super().close()
