"""A ledger that cannot be written or read: a full disk, a read-only file system, a corrupt file,
a bad row. Each is a clear ``LedgerUnavailable`` (503 ``ledger_unavailable`` over REST, one line
from the CLI) with SQLite's reason, and nothing already recorded is lost.

The full disk and the read-only file system are real: a small tmpfs (root, as in CI), filled up
or remounted read-only. ``PRAGMA max_page_count`` gives the same SQLITE_FULL without root.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger import LedgerUnavailable
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import place
from jupyter_gpushare.share import ShareSpec

GPUS = simulated_gpus("2xA100", node="n1")
BLOB = {"blob": "x" * 400_000}  # a record bigger than the space left


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "1m") -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of ``directory``; returns the filler to delete."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True)


async def seed(ledger: SQLiteLedger) -> list[str]:
    await ledger.put_gpus("n1", GPUS)
    return [
        (await ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run")).id for _ in range(3)
    ]


async def ids(ledger: SQLiteLedger) -> list[str]:
    return [a.id for a in await ledger.list()]


def test_full_disk_is_reported_and_loses_nothing(tmp_path: Path) -> None:
    async def go(fs: Path) -> None:
        ledger = SQLiteLedger(fs / "ledger.sqlite")
        before = await seed(ledger)
        filler = fill(fs)
        with pytest.raises(LedgerUnavailable) as err:
            await ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run", extra=BLOB)
        # SQLITE_FULL, or an I/O error when the WAL index cannot grow: either way it says so
        assert "SQLITE_" in err.value.reason, err.value.reason
        assert f"no space left on the file system of {fs}" in err.value.reason
        assert "cannot rollback" not in str(err.value)
        assert str(err.value).startswith(f"the ledger {fs / 'ledger.sqlite'} is unavailable: ")
        try:  # readers may need room too (the WAL index grows): the same clear error, or rows
            assert await ids(ledger) == before
        except LedgerUnavailable as exc:
            assert "no space left" in exc.reason
        filler.unlink()
        assert await ids(ledger) == before  # the failed write left the rows before it
        await ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run", extra=BLOB)
        assert len(await ids(ledger)) == 4

    with tmpfs(tmp_path / "fs") as fs:
        asyncio.run(go(fs))


class CappedLedger(SQLiteLedger):
    """A ledger whose file may not grow past ``cap`` pages (SQLITE_FULL without a full disk)."""

    cap: int | None = None

    def _connect(self) -> sqlite3.Connection:
        db = super()._connect()
        if self.cap is not None:
            db.execute(f"PRAGMA max_page_count={self.cap}")
        return db


def test_sqlite_full_is_not_hidden_behind_a_failed_rollback(tmp_path: Path) -> None:
    async def go() -> None:
        ledger = CappedLedger(tmp_path / "ledger.sqlite")
        before = await seed(ledger)
        with sqlite3.connect(ledger.path) as db:
            ledger.cap = db.execute("PRAGMA page_count").fetchone()[0]
        with pytest.raises(LedgerUnavailable) as err:
            await ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run", extra=BLOB)
        assert "SQLITE_FULL" in err.value.reason, err.value.reason
        assert await ids(ledger) == before
        with pytest.raises(LedgerUnavailable, match="SQLITE_FULL"):
            await ledger.put_gpus("n2", simulated_gpus("64xA100", node="n2"))
        assert len(await ledger.gpus()) == 2

    asyncio.run(go())


def test_read_only_ledger_is_reported_and_loses_nothing(tmp_path: Path) -> None:
    async def go(fs: Path) -> None:
        ledger = SQLiteLedger(fs / "ledger.sqlite")
        before = await seed(ledger)
        remount(fs, "ro")
        with pytest.raises(LedgerUnavailable) as err:
            await ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run")
        assert f"{fs} is on a read-only file system" in err.value.reason, err.value.reason
        with pytest.raises(LedgerUnavailable, match="read-only file system"):
            await SQLiteLedger(fs / "ledger.sqlite").snapshot()
        remount(fs, "rw")
        assert await ids(ledger) == before

    with tmpfs(tmp_path / "fs") as fs:
        asyncio.run(go(fs))


def test_corrupt_file_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    path.write_bytes(b"this is not a SQLite database\n" * 100)
    ledger = SQLiteLedger(path)  # touches nothing yet
    for call in (ledger.snapshot, ledger.gpus):
        with pytest.raises(LedgerUnavailable) as err:
            asyncio.run(call())
        assert "file is not a database" in err.value.reason
        assert "SQLITE_NOTADB" in err.value.reason
    with pytest.raises(LedgerUnavailable, match="SQLITE_NOTADB"):
        asyncio.run(ledger.allocate(ShareSpec(), GPUS, place))
    assert path.read_bytes().startswith(b"this is not")  # nothing was written over it


def test_a_bad_row_keeps_its_gpus_taken_with_one_warning_and_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A row that cannot be read is never skipped (its share would be booked again, the GPU
    over-allocated once the row is repaired): it holds the GPUs its body still names, else all
    of its node's, until an admin repairs or deletes it; it is never written over."""
    from jupyter_gpushare.placement import PlacementRefused

    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    good = asyncio.run(seed(ledger))
    bad_share = asyncio.run(ledger.get(good[0])).to_json() | {
        "id": "a-bad-share",
        "gpu_request": 0.9,
    }
    with sqlite3.connect(ledger.path) as db:
        db.execute("INSERT INTO allocations VALUES ('a-not-json', 'n1', '{oops')")
        db.execute(
            "INSERT INTO allocations VALUES (?, 'n1', ?)", ("a-bad-share", json.dumps(bad_share))
        )
        db.execute("INSERT INTO gpus VALUES ('GPU-bad', 'n1', '[]')")
    with caplog.at_level(logging.WARNING, logger="jupyter_gpushare.ledger"):
        for _ in range(3):
            assert asyncio.run(ids(ledger)) == [*good, "a-not-json", "a-bad-share"]
            assert len(asyncio.run(ledger.gpus())) == 2
        held = {a.id: a for a in asyncio.run(ledger.list())}
        assert held["a-not-json"].gpus == tuple(g.uuid for g in GPUS)  # no GPU named: all
        assert held["a-bad-share"].gpus == tuple(bad_share["gpus"])  # the GPU it names
        assert held["a-not-json"].state == "unreadable" and held["a-not-json"].request == 1.0
        with pytest.raises(PlacementRefused):
            asyncio.run(ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run"))
        asyncio.run(ledger.release(good[0]))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings  # one per bad row, however often it is read
    assert any("'a-not-json'" in w and "as taken by" in w for w in warnings)
    assert any("'a-bad-share'" in w and "gpu_request" in w for w in warnings)
    assert any("'GPU-bad'" in w for w in warnings)
    assert sorted(asyncio.run(ids(ledger))) == sorted([*good[1:], "a-not-json", "a-bad-share"])
    with sqlite3.connect(ledger.path) as db:  # the writes kept the rows nobody could read
        kept = dict(db.execute("SELECT id, body FROM allocations").fetchall())
        assert kept["a-not-json"] == "{oops"
        db.execute("DELETE FROM allocations WHERE id='a-not-json'")  # an admin resolves it
    new = asyncio.run(ledger.allocate(ShareSpec(0.25, 0.5), GPUS, place, owner="run"))
    assert new.gpus != tuple(bad_share["gpus"])  # not on the GPU the bad share still holds


# -- as a user meets it: REST and the CLI ----------------------------------------------------


def corrupt(path: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.write_bytes(b"garbage " * 512)


def check_503(response: Any, words: str) -> None:
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error"] == "ledger_unavailable" and words in body["reason"], body
    assert body["message"].startswith("the ledger ") and "Traceback" not in response.text


def test_rest_answers_503_with_the_reason(
    jupyter_server: Any, gpushare_env: dict[str, str], tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "fs", "4m") as fs:
        ledger = fs / "ledger.sqlite"
        gpushare_env["GPUSHARE_LEDGER"] = str(ledger)
        server = jupyter_server("1xA100", "--GpuShare.enforce=False")
        started = server.post(
            "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
        )
        assert started.status_code == 201, started.text
        [held] = server.allocations()

        filler = fill(fs)  # full: a write that needs room fails, and says why
        patched = server.request(
            "PATCH", f"/gpushare/api/allocations/{held['id']}", json={"gpu_request": 0.3}
        )
        check_503(patched, "no space left on the file system")
        filler.unlink()
        assert server.allocations()[0]["gpu_request"] == 0.25

        remount(fs, "ro")
        for path in ("/gpushare/api/allocations", "/gpushare/api/gpus"):
            check_503(server.get(path), f"{fs} is on a read-only file system")
        check_503(server.delete(f"/gpushare/api/allocations/{held['id']}"), "read-only")
        remount(fs, "rw")
        assert [a["id"] for a in server.allocations()] == [held["id"]]

        corrupt(ledger)
        for path in (
            "/gpushare/api/allocations",
            "/gpushare/api/gpus",
            f"/gpushare/api/allocations/{held['id']}",
        ):
            check_503(server.get(path), "file is not a database")
        kernels_before = server.get("/api/kernels").json()
        refused = server.post(
            "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
        )
        check_503(refused, "file is not a database")
        assert server.get("/api/kernels").json() == kernels_before  # no kernel left behind
        server.stop()
        log = server.log_path.read_text(errors="replace")
        assert "Uncaught exception" not in log and "Traceback" not in log, log[-3000:]
        assert log.count("is unavailable: file is not a database") == 1  # once a minute


def test_cli_says_one_line(gpushare_env: dict[str, str], tmp_path: Path) -> None:
    ledger = tmp_path / "bad.sqlite"
    corrupt(ledger)
    env = {**gpushare_env, "GPUSHARE_LEDGER": str(ledger), "GPUSHARE_SIMULATE": "1xA100"}
    for args in (["status"], ["run", "--gpu-request", "0.25", "--", "true"]):
        result = subprocess.run(
            [sys.executable, "-m", "jupyter_gpushare", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 5, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert lines[-1] == (
            f"gpushare: the ledger {ledger} is unavailable: file is not a database (SQLITE_NOTADB)"
        ), result.stderr
        assert "Traceback" not in result.stderr


def test_a_failing_ledger_is_logged_once_a_minute_not_per_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ledger.sqlite"
    corrupt(path)
    ledger = SQLiteLedger(path)
    with caplog.at_level(logging.WARNING, logger="jupyter_gpushare.ledger"):
        for _ in range(20):  # a daemon or a status bar polling
            with pytest.raises(LedgerUnavailable):
                asyncio.run(ledger.snapshot())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"gpushare: the ledger {path} is unavailable: file is not a database (SQLITE_NOTADB)"
    ], lines
    assert all(r.exc_info is None for r in caplog.records)  # no traceback
