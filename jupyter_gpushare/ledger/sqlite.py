"""SQLite ledger: the local backend's allocation store.

Three tables: ``nodes`` (one version counter per node), ``allocations`` (one JSON row each) and
``gpus`` (the inventory each node published). A compare-and-swap is one ``BEGIN IMMEDIATE``
transaction that checks the node's version, rewrites its rows and bumps the version, so it is
atomic across threads and processes and survives a crash of any of them (WAL journal).

Calls run in a worker thread (``asyncio.to_thread``), never on the event loop; each call opens its
own connection, so the ledger is safe to share between threads and to fork. Creating the object
touches nothing; the file and its schema are made on first use. The node agent, which follows
the file for its whole life, holds one more connection open, unused
(:meth:`SQLiteLedger.hold_open`): SQLite checkpoints the WAL into the database, with an
``fsync`` of each, whenever the file's last connection closes, which made every call of every
other process cost ~4 ms of waiting on the disk (a kernel's placement and its record are on the
kernel start's path, issue 12). Checkpoints then happen as commits grow the log (SQLite's
``wal_autocheckpoint``) and when the agent exits. Other processes do not hold the file (a
remount read-only or an unmount stays possible while no agent runs).

Durability: WAL with ``synchronous=NORMAL``: a commit is atomic and survives a crash of any
process; a power loss can lose the last commits before it, which describe processes that the
power loss ended too (reconciliation releases what a lost release left).

Failures: any SQLite error (a full disk, ``SQLITE_FULL``; a read-only file or directory; a file
that is not a database) is raised as :class:`~jupyter_gpushare.ledger.LedgerUnavailable` with
SQLite's reason and code, after the transaction is rolled back (or found already rolled back:
SQLite rolls back by itself on ``SQLITE_FULL``), so a failed write leaves the rows before it;
the failure is logged once a minute at most, one line, no traceback. A
row that cannot be read (not JSON, missing fields, an impossible share) is skipped by readers with
one warning per row, and kept as it is by writers, never silently dropped.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import ParamSpec, TypeVar

from ..inventory import Gpu
from ..share import ShareSpec
from . import Allocation, Ledger, LedgerUnavailable, Snapshot

log = logging.getLogger("jupyter_gpushare.ledger")

P = ParamSpec("P")
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (node TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS allocations (
    id TEXT PRIMARY KEY, node TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS allocations_node ON allocations (node);
CREATE TABLE IF NOT EXISTS gpus (
    uuid TEXT PRIMARY KEY, node TEXT NOT NULL, body TEXT NOT NULL);
"""


def _unavailable(method: Callable[P, T]) -> Callable[P, T]:
    """SQLite's errors leave a primitive as :class:`LedgerUnavailable` with the reason."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(*args, **kwargs)
        except (sqlite3.Error, OSError) as exc:  # OSError: the directory cannot be made
            ledger = args[0]
            assert isinstance(ledger, SQLiteLedger)
            reason = (
                _reason(exc, ledger.path)
                if isinstance(exc, sqlite3.Error)
                else exc.strerror or str(exc)
            )
            _log_unavailable(str(ledger.path), reason)
            raise LedgerUnavailable(str(ledger.path), reason) from None

    return wrapper


#: how often one failure of the ledger is logged (each caller still gets the error at once)
LOG_EVERY_S = 60.0
_logged: dict[tuple[str, str], tuple[float, int]] = {}
_logged_lock = threading.Lock()


def _log_unavailable(path: str, reason: str) -> None:
    """One warning line per failure and minute, however many calls meet it (a daemon or a
    status bar polls every few hundred ms)."""
    now = time.monotonic()
    with _logged_lock:
        last, suppressed = _logged.get((path, reason), (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            _logged[(path, reason)] = (last, suppressed + 1)
            return
        _logged[(path, reason)] = (now, 0)
    more = f" ({suppressed} more time(s) in the last minute)" if suppressed else ""
    log.warning("gpushare: the ledger %s is unavailable: %s%s", path, reason, more)


def _reason(exc: sqlite3.Error, path: Path) -> str:
    """SQLite's words and code, and what they mean here: a full file system (SQLite says
    SQLITE_FULL, or an I/O error when the WAL index could not grow), a read-only one or file."""
    name = getattr(exc, "sqlite_errorname", None) or ""
    reason = f"{exc} ({name})" if name else str(exc)
    try:
        if name == "SQLITE_FULL" or name.startswith("SQLITE_IOERR"):
            if os.statvfs(path.parent).f_bavail == 0:
                reason += f"; no space left on the file system of {path.parent}"
        elif name.startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY")):
            if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
                reason += f"; {path.parent} is on a read-only file system"
            elif path.exists() and not os.access(path, os.W_OK):
                reason += "; the file is read-only for this user"
            elif not os.access(path.parent, os.W_OK):
                reason += f"; its directory {path.parent} is not writable for this user"
    except OSError:
        pass
    return reason


#: SQLITE_BUSY's primary code (extended codes keep it in the low byte)
_SQLITE_BUSY = 5


def _initialize(db: sqlite3.Connection, patience: float = 30.0) -> None:
    """WAL mode and the schema, on a file other processes may be opening at the same moment.
    Switching the journal mode takes an exclusive lock and SQLite answers SQLITE_BUSY at once
    (no busy handler) while another connection holds the file: retry that for a while. A file
    already in WAL mode (the mode is stored in the file) is not switched again."""
    deadline = time.monotonic() + patience
    while True:
        try:
            (mode,) = db.execute("PRAGMA journal_mode").fetchone()
            if str(mode).lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)
            return
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", 0) or 0
            if code & 0xFF != _SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.005, 0.05))


#: (pid, file) -> a connection held open and never used (``hold_open``); a forked child
#: keeps its parent's entry, never closing it (closing a descriptor of the file would drop the
#: child's own POSIX locks on it) and opens its own
_HELD: dict[tuple[int, str], sqlite3.Connection] = {}
_HELD_LOCK = threading.Lock()


def _hold_open(path: Path) -> None:
    """Keep one connection to ``path`` open for the rest of this process (best effort)."""
    key = (os.getpid(), str(path))
    if key in _HELD:
        return
    with _HELD_LOCK:
        if key in _HELD:
            return
        try:
            db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        except sqlite3.Error:
            return
        try:
            db.execute("SELECT 1 FROM nodes LIMIT 1").fetchall()  # opens the file and its WAL
        except sqlite3.Error:
            db.close()
            return
        _HELD[key] = db


#: ``Allocation.backend`` (and ``owner``, ``state``) of a ledger row that cannot be read
UNREADABLE = "unreadable"
#: what reading a row's body as an allocation raises when it cannot be read
BAD_ROW = (ValueError, KeyError, TypeError, AttributeError, RecursionError)


def is_unreadable(allocation: Allocation) -> bool:
    return allocation.backend == UNREADABLE


def unreadable_row(
    row_id: str, node: str, body: str, inventory: Sequence[Gpu], exc: Exception
) -> Allocation:
    """A row that cannot be read, as a record that keeps what it may hold reserved: the whole
    of the GPUs it names (those of its node that its body still lists), else of every GPU of
    its node. Never released by reconciliation (not a ``local`` record), never written back;
    an admin repairs or deletes the row (``jupyter gpushare status`` and the agent's log name
    it). A skipped row would free its share for others: the GPU booked twice once repaired."""
    on_node = {g.uuid: g for g in inventory if g.node == node}
    try:
        named = json.loads(body).get("gpus")
        listed = tuple(dict.fromkeys(u for u in named if isinstance(u, str) and u in on_node))
    except (ValueError, TypeError, AttributeError, RecursionError):
        listed = ()
    gpus = listed or tuple(on_node)
    memory = max((on_node[u].memory for u in gpus), default=0)
    return Allocation(
        id=row_id,
        node=node,
        gpus=gpus,
        spec=ShareSpec(1.0, 1.0, gpu_memory=memory, gpu_count=max(1, len(gpus))),
        memory=memory,
        owner=UNREADABLE,
        backend=UNREADABLE,
        state=UNREADABLE,
        created=0.0,
        extra={UNREADABLE: f"{type(exc).__name__}: {exc}"[:300]},
    )


class SQLiteLedger(Ledger):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._ready = False
        self._warned: set[str] = set()  # unreadable rows already named in the log
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        if not self._ready:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA synchronous=NORMAL")
            if not self._ready:
                with self._init_lock:  # threads of this process: one initializes
                    if not self._ready:
                        _initialize(db)
                        self._ready = True
        except BaseException:
            db.close()
            raise
        return db

    def hold_open(self) -> None:
        """Keep a connection to the file open, unused, for the rest of this process (blocking;
        the node agent calls it once at start: see the module's doc). Raises SQLite's error
        when the file cannot be opened."""
        self._connect().close()
        _hold_open(self.path)

    @contextmanager
    def _transaction(self, db: sqlite3.Connection, kind: str = "") -> Iterator[None]:
        """``BEGIN [kind]`` … ``COMMIT``; on any error a rollback that cannot hide the error
        (SQLite may have rolled back already, e.g. on SQLITE_FULL)."""
        db.execute(f"BEGIN {kind}".strip())
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the first error is the one to report; closing discards the rest
            raise

    def _warn_once(self, key: str, what: str, exc: Exception, held: str = "skipping") -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(
            "gpushare: the ledger %s: %s %s that cannot be read (%s: %s); it is "
            "kept in the file as it is",
            self.path,
            held,
            what,
            type(exc).__name__,
            exc,
        )

    @staticmethod
    def _readable(body: str) -> bool:
        try:
            Allocation.from_json(json.loads(body))
        except BAD_ROW:
            return False
        return True

    def _held(
        self, row_id: str, node: str, body: str, inventory: Callable[[], Sequence[Gpu]]
    ) -> Allocation:
        """The record of row ``row_id``; an unreadable one as :func:`unreadable_row` (counted as
        taking its GPUs, named once in the log) until an admin repairs or deletes it."""
        try:
            return Allocation.from_json(json.loads(body))
        except BAD_ROW as exc:
            held = unreadable_row(row_id, node, body, inventory(), exc)
            self._warn_once(
                f"allocation:{row_id}",
                f"allocation row {row_id!r} on node {node!r}",
                exc,
                f"counting GPU(s) {', '.join(held.gpus) or '(none known)'} as taken by",
            )
            return held

    # -- synchronous primitives (also used directly by the CLI and tests) --------------------

    @_unavailable
    def snapshot_sync(self) -> Snapshot:
        with closing(self._connect()) as db:
            with self._transaction(db):
                versions = dict(db.execute("SELECT node, version FROM nodes").fetchall())
                rows = db.execute(
                    "SELECT id, node, body FROM allocations ORDER BY rowid"
                ).fetchall()
        known: list[list[Gpu]] = []  # read once, only when a row cannot be read

        def inventory() -> list[Gpu]:
            if not known:
                known.append(self.gpus_sync())
            return known[0]

        return Snapshot(
            allocations=tuple(self._held(i, node, body, inventory) for i, node, body in rows),
            versions=versions,
        )

    @_unavailable
    def compare_and_swap_sync(
        self, node: str, expected_version: int, allocations: Sequence[Allocation]
    ) -> bool:
        with closing(self._connect()) as db, self._transaction(db, "IMMEDIATE"):
            row = db.execute("SELECT version FROM nodes WHERE node=?", (node,)).fetchone()
            if (row[0] if row else 0) != expected_version:
                return False
            rows = db.execute("SELECT id, body FROM allocations WHERE node=?", (node,))
            allocations = [a for a in allocations if not is_unreadable(a)]  # never written
            new = {a.id for a in allocations}
            unreadable = [  # kept as they are, unless replaced by a readable record
                row_id
                for row_id, body in rows.fetchall()
                if row_id not in new and not self._readable(body)
            ]
            db.execute(
                "DELETE FROM allocations WHERE node=? AND id NOT IN "
                f"({','.join('?' * len(unreadable))})",
                (node, *unreadable),
            )
            db.executemany(
                "INSERT INTO allocations (id, node, body) VALUES (?, ?, ?)",
                [(a.id, node, json.dumps(a.to_json())) for a in allocations],
            )
            db.execute(
                "INSERT INTO nodes (node, version) VALUES (?, ?) "
                "ON CONFLICT(node) DO UPDATE SET version=excluded.version",
                (node, expected_version + 1),
            )
            return True

    @_unavailable
    def put_gpus_sync(self, node: str, gpus: Sequence[Gpu]) -> None:
        with closing(self._connect()) as db, self._transaction(db, "IMMEDIATE"):
            db.execute("DELETE FROM gpus WHERE node=?", (node,))
            db.executemany(
                "INSERT OR REPLACE INTO gpus (uuid, node, body) VALUES (?, ?, ?)",
                [(g.uuid, node, json.dumps(g.to_json())) for g in gpus],
            )

    @_unavailable
    def gpus_sync(self) -> list[Gpu]:
        with closing(self._connect()) as db:
            rows = db.execute("SELECT uuid, body FROM gpus ORDER BY node, rowid").fetchall()
        gpus = []
        for uuid, body in rows:
            try:
                gpus.append(Gpu.from_json(json.loads(body)))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                self._warn_once(f"gpu:{uuid}", f"GPU row {uuid!r}", exc)
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
