"""SQLite ledger: the local backend's allocation store.

Three tables: ``nodes`` (one version counter per node), ``allocations`` (one JSON row each) and
``gpus`` (the inventory each node published). A compare-and-swap is one ``BEGIN IMMEDIATE``
transaction that checks the node's version, rewrites its rows and bumps the version, so it is
atomic across threads and processes and survives a crash of any of them (WAL journal).

Calls run in a worker thread (``asyncio.to_thread``), never on the event loop; each call opens its
own connection, so the ledger is safe to share between threads and to fork.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path

from ..inventory import Gpu
from . import Allocation, Ledger, Snapshot

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (node TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS allocations (
    id TEXT PRIMARY KEY, node TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS allocations_node ON allocations (node);
CREATE TABLE IF NOT EXISTS gpus (
    uuid TEXT PRIMARY KEY, node TEXT NOT NULL, body TEXT NOT NULL);
"""


class SQLiteLedger(Ledger):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with closing(self._connect()) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.execute("PRAGMA busy_timeout=30000")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    # -- synchronous primitives (also used directly by the CLI and tests) --------------------

    def snapshot_sync(self) -> Snapshot:
        with closing(self._connect()) as db:
            db.execute("BEGIN")
            versions = dict(db.execute("SELECT node, version FROM nodes").fetchall())
            rows = db.execute("SELECT body FROM allocations ORDER BY rowid").fetchall()
            db.execute("COMMIT")
        return Snapshot(
            allocations=tuple(Allocation.from_json(json.loads(body)) for (body,) in rows),
            versions=versions,
        )

    def compare_and_swap_sync(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT version FROM nodes WHERE node=?", (node,)).fetchone()
                if (row[0] if row else 0) != expected_version:
                    db.execute("ROLLBACK")
                    return False
                db.execute("DELETE FROM allocations WHERE node=?", (node,))
                db.executemany(
                    "INSERT INTO allocations (id, node, body) VALUES (?, ?, ?)",
                    [(a.id, node, json.dumps(a.to_json())) for a in allocations],
                )
                db.execute(
                    "INSERT INTO nodes (node, version) VALUES (?, ?) "
                    "ON CONFLICT(node) DO UPDATE SET version=excluded.version",
                    (node, expected_version + 1),
                )
                db.execute("COMMIT")
                return True
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def put_gpus_sync(self, node: str, gpus: Sequence[Gpu]) -> None:
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM gpus WHERE node=?", (node,))
            db.executemany(
                "INSERT OR REPLACE INTO gpus (uuid, node, body) VALUES (?, ?, ?)",
                [(g.uuid, node, json.dumps(g.to_json())) for g in gpus],
            )
            db.execute("COMMIT")

    def gpus_sync(self) -> list[Gpu]:
        with closing(self._connect()) as db:
            rows = db.execute("SELECT body FROM gpus ORDER BY node, rowid").fetchall()
        gpus = [Gpu.from_json(json.loads(body)) for (body,) in rows]
        return sorted(gpus, key=lambda g: (g.node, g.index))

    # -- the async interface ----------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        return await asyncio.to_thread(self.snapshot_sync)

    async def compare_and_swap(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        return await asyncio.to_thread(
            self.compare_and_swap_sync, node, expected_version, list(allocations)
        )

    async def put_gpus(self, node: str, gpus: Sequence[Gpu]) -> None:
        await asyncio.to_thread(self.put_gpus_sync, node, list(gpus))

    async def gpus(self) -> list[Gpu]:
        return await asyncio.to_thread(self.gpus_sync)
