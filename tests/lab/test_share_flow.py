"""What a new user meets in JupyterLab (issue 24, items 1-8, 11, 13), in headless Chromium.

One JupyterLab on one simulated A100; tests/lab/share_flow.mjs drives it once, in order (the
steps are listed there), and each test below checks one item on what the driver saw. Screenshots
(kept for the docs): test-artifacts/lab/share_flow/ -- 02-picker, 05-picker-live-checks,
01-change-share-dialog, 01b-change-share-restart-only, 04-picker-does-not-fit,
04b-picker-after-use, 08-dashboard-side-and-panel, 08-dashboard-main-area,
07-release-disabled-after-release, 03-dashboard-history-after-release,
06-refused-calls-explained, 13-picker-cancelled.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labdriver import LabServer, driver_missing, run_driver
from support import ARTIFACTS, isolated_env, stop_daemons

from jupyter_gpushare.statusview import what_runs

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

KERNEL = "gpushare-python"
NOTEBOOK_A = "gpuwork_loop_benchmark_run.ipynb"
SHOTS = (
    "02-picker",
    "05-picker-live-checks",
    "01-change-share-dialog",
    "01b-change-share-restart-only",
    "04-picker-does-not-fit",
    "04b-picker-after-use",
    "08-dashboard-side-and-panel",
    "08-dashboard-main-area",
    "07-release-disabled-after-release",
    "03-dashboard-history-after-release",
    "06-refused-calls-explained",
    "13-picker-cancelled",
)


@pytest.fixture(scope="module")
def flow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The driver's run (once for the module): what it saw, the server, and `status --json` of
    the end state."""
    reason = driver_missing()
    if reason:
        pytest.skip(reason)
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    env = isolated_env(tmp_path_factory.mktemp("flow"), short)
    server = LabServer(env, "1xA100").start(timeout=90)
    artifacts = ARTIFACTS / "lab" / "share_flow"
    shutil.rmtree(artifacts, ignore_errors=True)
    try:
        spec = server.get(f"/api/kernelspecs/{KERNEL}").json()
        try:
            seen = run_driver(
                "share_flow.mjs",
                server,
                artifacts,
                timeout=420,
                kernelName=KERNEL,
                kernelLabel=spec["spec"]["display_name"],
            )
        except AssertionError as exc:  # each test reports the step it needs
            log = (artifacts / "share_flow.mjs.log").read_text()
            seen = json.loads(log.split("\n--- stderr ---")[0].strip().splitlines()[-1])
            seen["driver_error"] = str(exc)[:2000]
        status = subprocess.run(
            [sys.executable, "-m", "jupyter_gpushare", "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        yield {"seen": seen, "status": status, "server": server, "artifacts": artifacts}
    finally:
        server.stop()
        stop_daemons(env["GPUSHARE_SOCKET"])
        shutil.rmtree(short, ignore_errors=True)


def _seen(flow: dict[str, Any], *keys: str) -> dict[str, Any]:
    seen = flow["seen"]
    missing = [k for k in keys if seen.get(k) is None]
    assert not missing, f"the driver did not see {missing}: {seen.get('stepErrors') or seen}"
    return seen


def test_1_change_share_says_a_restart_loses_state_and_changes_live_where_it_fits(flow):
    seen = _seen(flow, "changeDialog", "kernelAfterLive", "restartOnly")
    dialog = seen["changeDialog"]
    assert "its variables, imports and running work" in dialog["text"] and "lost" in dialog["text"]
    assert dialog["buttons"] == ["Cancel", "Change live (no restart)", "Restart with new share"]
    assert NOTEBOOK_A in dialog["title"]
    assert "Fits on this kernel’s A100" in dialog["text"]  # not what a restart would need
    # the live change: same kernel, its variables kept, the new share in force
    assert seen["kernelAfterLive"] == seen["kernelA"]
    assert "42" in seen["markerAfterLive"]
    assert "75–100 %" in seen["statusLive"]
    # where it does not fit on the kernel's GPU, only the restart is offered, and why
    only = seen["restartOnly"]
    assert only["liveDisabled"] is True and only["restartButton"] == 1
    assert "Only a restart" in only["note"] and "200GiB" in only["note"]


def test_2_a_picker_started_kernel_records_its_notebook(flow):
    seen = _seen(flow, "allocationA")
    a = seen["allocationA"]
    assert a["extra"]["notebook"].endswith(NOTEBOOK_A), a  # `status` shows it
    assert what_runs(a).endswith(NOTEBOOK_A)
    # `jupyter gpushare status` now: the second notebook's kernel (started from the launcher)
    status = flow["status"]
    assert status.returncode == 0, status.stderr
    shown = [what_runs(x) for x in json.loads(status.stdout)["allocations"]]
    assert shown and all(s.endswith(".ipynb") for s in shown), shown
    assert not any(s.startswith("kernel ") for s in shown), shown


def test_3_release_keeps_the_gpus_history(flow):
    seen = _seen(flow, "historyAfterRelease")
    [points] = seen["historyAfterRelease"]
    # A ran GPU work at its 75-100 % for half a minute before its release
    assert max(v for _t, v in points) > 0.3, points


def test_4_picker_says_before_start_that_a_share_does_not_fit(flow):
    seen = _seen(flow, "fitB", "useButton", "afterUse", "statusB")
    fit = seen["fitB"]
    assert "No A100 has 50 % free" in fit and "the most free is 25 %" in fit, fit
    assert not re.search(r"\b0\.\d", fit), fit  # percent, as the table above
    assert seen["pickerTextB"].count("most free is") == 1, seen["pickerTextB"]
    use = seen["useButton"]
    assert use["tag"] == "BUTTON" and use["cursor"] == "pointer", use
    assert use["border"] != "0px" and use["borderStyle"] != "none", use  # looks like a button
    assert use["text"] == "Use 25–50 % of A100", use
    # request and limit together; the summary, the button and the kernel's status say the same
    assert (seen["afterUse"]["request"], seen["afterUse"]["limit"]) == ("0.25", "0.5")
    assert "25–50 %" in seen["afterUse"]["summary"]
    assert seen["afterUse"]["fit"].startswith("Fits")
    assert "25–50 %" in seen["statusB"]


def test_5_fields_are_checked_as_typed_in_their_words_without_moving(flow):
    seen = _seen(flow, "requestError", "memoryError", "pickerBoxes")
    assert seen["requestError"].startswith("Request:"), seen["requestError"]
    assert "0.333" in seen["requestError"] and "33.3 %" in seen["requestError"]
    assert "gpu_request" not in seen["requestError"]
    assert seen["memoryError"].startswith("Memory:") and "lots" in seen["memoryError"]
    assert "10GiB" in seen["memoryError"]
    first, *rest = seen["pickerBoxes"]
    assert all(box == first for box in rest), seen["pickerBoxes"]  # the dialog did not move


def test_6_refused_calls_explain_themselves_in_each_cell(flow):
    seen = _seen(flow, "refused1", "refused2")
    for output in (seen["refused1"], seen["refused2"]):
        assert "800" in output, output
        assert "gpushare:" in output and "was released" in output, output


def test_7_release_is_disabled_once_released(flow):
    seen = _seen(flow, "statusReleased", "releasePaletteClass")
    assert seen["releaseToolbarDisabled"] is True
    assert "lm-mod-disabled" in seen["releasePaletteClass"]


def test_8_dashboard_side_and_main_area_one_legend_style(flow):
    seen = _seen(flow, "legend", "sideLayout", "mainDashboard")
    legend = seen["legend"]
    for what in ("request", "limit"):
        assert legend["dashboard"][what] == legend["panel"][what], legend
        assert legend["dashboard"][f"{what}Legend"] == legend["panel"][f"{what}Legend"], legend
    side = seen["sideLayout"]
    assert all(h["lines"] <= 2 for h in side["headers"]), side["headers"]
    names = [n for n in side["names"] if n["title"].endswith(NOTEBOOK_A)]
    assert names and all(n["lines"] == 1 for n in names), side["names"]
    assert side["reservedDrawnOverUse"] is True  # reserved 100 %: drawn over the use at 100 %
    main = seen["mainDashboard"]
    assert main["inMain"] and main["wide"] and main["width"] > 720, main


def test_11_the_picker_states_and_applies_the_default_limit_rule(flow):
    seen = _seen(flow, "summaryDefaultLimit")
    assert "30–50 %" in seen["summaryDefaultLimit"], seen["summaryDefaultLimit"]
    assert "0.5 or the request" in seen["limitPlaceholder"]


def test_13_cancel_in_the_picker_logs_no_error(flow):
    seen = _seen(flow, "cancelErrors")
    assert seen["cancelErrors"] == [], seen["cancelErrors"]
    assert seen["dialogsAfterCancel"] == []


def test_screenshots_are_kept(flow):
    missing = [n for n in SHOTS if not (flow["artifacts"] / f"{n}.png").is_file()]
    assert not missing, (missing, flow["seen"].get("failed"))
