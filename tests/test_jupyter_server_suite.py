"""jupyter_server's own kernel and session tests pass with gpushare (issue 13).

Their ``tests/services/kernels`` and ``tests/services/sessions`` (from the sdist of the installed
jupyter_server, extracted by ``.ci/setup.d/jupyter_server_tests.sh``) run three ways, unedited,
with our pytest plugin ``tests/jupyter_server_compat/gpushare_plugin.py``: ``plain``, ``gpushare``
(PoolKernelManager, the extension on, every test kernel a gpushare kernel on simulated GPUs) and
``pool`` (the same plus a warm pool). A gpushare way may fail only where plain jupyter_server
fails on this machine too; and no task of ours may outlive its server ("Task was destroyed but
it is pending").

The two gpushare ways run side by side, each in ``SHARDS`` pytest processes that share its tests
out between them (the suite mostly waits on kernels), on a representative part of the two
folders by default (``SUBSET``: why, below; ``GPUSHARE_JSTESTS_FULL=1`` runs them whole). A
test that fails in a gpushare way is run again, without the others, in that way and plain (side
by side), before it counts: the suite has timing-sensitive tests that fail now and then on a
loaded machine with plain jupyter_server too. Timings go to
``test-artifacts/jupyter_server_suite.json``.

``plain`` runs only for those tests, not the whole part beside the two gpushare ways (it did
until session 5): it exercises no code of ours, and its whole run served only as the reference
for which failures count, which the run again decides by itself (a test that fails in plain too
is not counted, as before). It was the third of three processes on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jupyter_server
import pytest
from support import ARTIFACTS, REPO

CACHE = Path(os.environ.get("GPUSHARE_JSTESTS_DIR", "/var/cache/gpushare-jstests"))
SUITE = CACHE / f"jupyter_server-{jupyter_server.__version__}"
PLUGIN_DIR = REPO / "tests" / "jupyter_server_compat"
#: The representative part run by default (GPUSHARE_JSTESTS_FULL=1: both folders whole). It has
#: every test of theirs that drives the kernel manager and the provisioner: REST start, list,
#: restart, interrupt, shutdown, pending kernels, a kernel id given by the client, restart
#: errors, transport encryption, config, events, and sessions over all their kernel managers.
#: Left out, to keep the three ways under ~4 min together on a 2-core machine (the whole
#: folders take ~5.5 min side by side): test_cull.py (~60 s a way of idle timeouts; warm kernels
#: and the culler: tests/test_pools.py), test_execution_state.py (websocket execution-state
#: polling) and test_connection.py (websocket internals; fails with plain jupyter_server 2.21.1
#: and this tornado).
SUBSET = [
    "tests/services/kernels/test_api.py",
    "tests/services/kernels/test_config.py",
    "tests/services/kernels/test_events.py",
    "tests/services/kernels/test_restart_error.py",
    "tests/services/kernels/test_transport_encryption.py",
    "tests/services/sessions",
]
FULL = ["tests/services/kernels", "tests/services/sessions"]
PATHS = FULL if os.environ.get("GPUSHARE_JSTESTS_FULL") == "1" else SUBSET
MODES = ("plain", "gpushare", "pool")
#: the ways the whole part runs in; ``plain`` is the reference for the tests that fail in them
GPUSHARE_MODES = MODES[1:]
RUN_TIMEOUT_S = 840
#: pytest processes per gpushare way; the tests are dealt out round-robin (one process per way
#: waited mostly on kernel starts, and sessions/test_api.py alone took ~90 s of it)
SHARDS = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S * 2 + 60)]


def _suite() -> Path:
    if (SUITE / ".complete").exists():
        return SUITE
    reason = (
        f"jupyter_server {jupyter_server.__version__}'s tests are not in {SUITE}: run "
        ".ci/setup.d/jupyter_server_tests.sh (its JUPYTER_SERVER_VERSION must be the "
        "installed jupyter_server's)"
    )
    if os.environ.get("CI", "").lower() == "true":  # never a silent pass in CI
        pytest.fail(reason)
    pytest.skip(reason)


def _env(mode: str, report: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GPUSHARE_JSTESTS_MODE=mode,
        PYTHONPATH=os.pathsep.join([str(PLUGIN_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONDONTWRITEBYTECODE="1",  # the extracted suite is shared and read-only
    )
    for key in (
        "GPUSHARE_SIMULATE",
        "GPUSHARE_LEDGER",
        "GPUSHARE_SOCKET",
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_DATA_DIR",
        "JUPYTER_RUNTIME_DIR",
        "PYTEST_ADDOPTS",
    ):
        env.pop(key, None)
    if report is not None:
        env["GPUSHARE_JSTESTS_REPORT"] = str(report)
    return env


#: no:cacheprovider, no:benchmark: nothing written into the shared extracted suite
PYTEST = ["-m", "pytest", "-p", "gpushare_plugin", "-p", "no:cacheprovider", "-p", "no:benchmark"]


def _start(mode: str, suite: Path, report: Path, args: list[str]) -> subprocess.Popen[bytes]:
    log = open(report.with_suffix(".log"), "wb")
    return subprocess.Popen(
        [sys.executable, *PYTEST, "-q", "--color=no", *args],
        cwd=suite,
        env=_env(mode, report),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _collect(suite: Path, paths: list[str]) -> list[str]:
    """The node ids of ``paths``, in pytest's order."""
    done = subprocess.run(
        [sys.executable, *PYTEST, "--collect-only", "-q", "--color=no", *paths],
        cwd=suite,
        env=_env("plain", None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    nodeids = [line for line in done.stdout.splitlines() if "::" in line]
    assert done.returncode == 0 and nodeids, done.stdout[-4000:] + done.stderr[-4000:]
    return nodeids


def _merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One way's report from its shards' reports."""
    merged: dict[str, Any] = {"failed": [], "passed": 0, "destroyed_pending": []}
    merged.update(seconds_by_file={}, warm_claims=0, cold_starts_with_pools=0, seconds=0.0)
    for report in reports:
        merged["failed"] += report["failed"]
        merged["destroyed_pending"] += report["destroyed_pending"]
        for key in ("passed", "warm_claims", "cold_starts_with_pools"):
            merged[key] += report.get(key, 0)
        for path, seconds in report["seconds_by_file"].items():
            merged["seconds_by_file"][path] = merged["seconds_by_file"].get(path, 0) + seconds
        merged["seconds"] = max(merged["seconds"], report["seconds"])
    return merged


def _run_all(
    runs: dict[str, tuple[str, list[str]]], suite: Path, out: Path
) -> dict[str, dict[str, Any]]:
    """Run ``{label: (mode, pytest args)}`` side by side; each label's report (plus
    ``seconds``)."""
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    seconds = {}
    try:
        for label, (mode, args) in runs.items():
            procs[label] = _start(mode, suite, out / f"{label}.json", args)
        for label, proc in procs.items():
            try:
                proc.wait(max(1.0, RUN_TIMEOUT_S - (time.monotonic() - began)))
            except subprocess.TimeoutExpired:
                log = (out / f"{label}.log").read_text(errors="replace")[-4000:]
                pytest.fail(f"jupyter_server's tests ({label}) took over {RUN_TIMEOUT_S} s:\n{log}")
            seconds[label] = round(time.monotonic() - began, 1)
    finally:
        for proc in procs.values():  # never left running behind a failure or a timeout
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for label, proc in procs.items():
        report = out / f"{label}.json"
        if not report.exists():
            log = (out / f"{label}.log").read_text(errors="replace")[-4000:]
            pytest.fail(
                f"jupyter_server's tests ({label}) wrote no report (rc {proc.returncode}):\n{log}"
            )
        results[label] = json.loads(report.read_text())
        results[label]["seconds"] = seconds[label]
    return results


def _ours(messages: list[str]) -> list[str]:
    return [m for m in messages if "jupyter_gpushare" in m or "gpushare:" in m]


def test_jupyter_servers_own_kernel_and_session_tests_pass_with_gpushare(tmp_path):
    suite = _suite()
    nodeids = _collect(suite, PATHS)
    shards = _run_all(
        {
            f"{mode}-{i}": (mode, nodeids[i::SHARDS])
            for mode in GPUSHARE_MODES
            for i in range(SHARDS)
        },
        suite,
        tmp_path,
    )
    first = {
        mode: _merge([shards[f"{mode}-{i}"] for i in range(SHARDS)]) for mode in GPUSHARE_MODES
    }
    for mode in GPUSHARE_MODES:
        assert first[mode]["passed"] > 100, first[mode]  # the suite really ran
    timings = {mode: first[mode]["seconds"] for mode in GPUSHARE_MODES}

    # failing with gpushare: again, without the other tests, in that way and plain (flaky on a
    # loaded box? failing with plain jupyter_server too?), the ways and plain side by side
    failed = {mode: sorted(first[mode]["failed"]) for mode in GPUSHARE_MODES}
    confirmed: dict[str, list[str]] = {}
    plain: set[str] = set()
    failing = sorted({nodeid for nodeids in failed.values() for nodeid in nodeids})
    if failing:
        again = _run_all(
            {
                **{mode: (mode, nodeids) for mode, nodeids in failed.items() if nodeids},
                "plain": ("plain", failing),
            },
            suite,
            tmp_path / "again",
        )
        plain = set(again["plain"]["failed"])
        confirmed = {
            mode: sorted(set(again[mode]["failed"]) - plain) for mode in failed if failed[mode]
        }

    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "jupyter_server_suite.json").write_text(
        json.dumps(
            {
                "jupyter_server": jupyter_server.__version__,
                "paths": PATHS,
                "seconds_side_by_side": timings,
                "seconds_by_file": {m: first[m]["seconds_by_file"] for m in GPUSHARE_MODES},
                "passed": {m: first[m]["passed"] for m in GPUSHARE_MODES},
                "warm_claims": first["pool"]["warm_claims"],
                "cold_starts_with_pools": first["pool"]["cold_starts_with_pools"],
                "failed_first_run": failed,
                "failed_with_plain_too": sorted(plain),
                "confirmed": confirmed,
                "destroyed_pending": {m: first[m]["destroyed_pending"] for m in GPUSHARE_MODES},
            },
            indent=1,
        )
    )
    print(
        f"jupyter_server {jupyter_server.__version__} tests, side by side: {timings} s; "
        f"passed {[first[m]['passed'] for m in GPUSHARE_MODES]}; failed first {failed}, with "
        f"plain too {sorted(plain)}; pool: "
        f"{first['pool']['warm_claims']} warm claims, {first['pool']['cold_starts_with_pools']}"
        " cold"
    )
    assert not any(confirmed.values()), (
        f"jupyter_server's own tests fail with gpushare but not without: {confirmed} (logs: "
        f"{tmp_path})"
    )
    for mode in GPUSHARE_MODES:
        # a server stopped while its pool's first warm kernel started left PoolManager._run
        # pending (jupyter_server skipped shutdown_all for a kernel manager with no kernel);
        # PoolKernelManager is always true now (tests/test_pool_server_stop.py)
        ours = _ours(first[mode]["destroyed_pending"])
        assert ours == [], first[mode]["destroyed_pending"]
    assert first["pool"]["warm_claims"] > 10, first["pool"]  # the pool really served kernels
