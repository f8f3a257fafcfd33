"""The GPU dashboard, the picker's messages and start progress in a real JupyterLab, light and dark
themes, driven in headless Chromium (tests/lab/dashboard.mjs). One lab server for the module.

Per theme: a refused pick shows its explanation readably; a pick that fits starts with its
phases reported by the server; the Kernel menu and the notebook toolbar carry release, restart
with a new share and the dashboard; Enter on the status-bar item opens the dashboard, which shows
this kernel's share live (no notebook cell is added) and the GPU with both users' shares (the
server's Authorizer makes ada an admin: she sees another Unix user's ``gpushare run`` share
with its user and command; uma, a user, sees it as capacity only); the charts have axes, scale
and legends; its buttons are reachable with Tab; Escape in the picker leaves the notebook without
a kernel, quietly. Every text of the picker, the progress dialog, the status bar, the dashboard
and the notebook's GPU panel (ipywidgets, ``jupyter_gpushare.panel()``) has a WCAG AA contrast of
at least 4.5:1 on its background (computed in the page). Screenshots:
test-artifacts/lab/dashboard/<theme>-*.png.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labdriver import LabServer, driver_missing, run_driver
from support import ARTIFACTS
from test_dashboard_api import COMMAND, IDENTITIES, _record_other_users_share

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]

KERNEL = "gpushare-python"
AA = 4.5


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LabServer, dict[str, str]]]:
    """One JupyterLab for the module (1 A100 + 1 T4) and the other user's share on the A100."""
    import os
    import shutil
    import tempfile

    reason = driver_missing()
    if reason:
        if os.environ.get("CI", "").lower() == "true":  # never a silent pass in CI
            pytest.fail(f"the browser tests need Chromium under CI: {reason}")
        pytest.skip(reason)

    from support import isolated_env, stop_daemons, wait_for

    tmp = tmp_path_factory.mktemp("lab")
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    env = isolated_env(tmp, short)
    (tmp / "twoids.py").write_text(IDENTITIES)  # ada (admin) and uma (a user), by token
    env["PYTHONPATH"] = f"{tmp}:{env.get('PYTHONPATH', '')}"
    server = LabServer(
        env,
        "1xA100,1xT4",
        "--ServerApp.identity_provider_class=twoids.TwoTokens",
        "--ServerApp.authorizer_class=twoids.AdaIsAdmin",
    ).start(timeout=90)
    holder = subprocess.Popen(["sleep", "900"])
    try:
        wait_for(lambda: server.get("/gpushare/api/gpus").json()["gpus"] or None, timeout=60)
        _record_other_users_share(env, holder)
        yield server, env
    finally:
        holder.kill()
        holder.wait()
        server.stop()
        stop_daemons(env["GPUSHARE_SOCKET"])
        shutil.rmtree(short, ignore_errors=True)


def _low(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["ratio"] < AA]


#: the light theme as ada, whom the Authorizer makes an admin; the dark one as uma, a user
VIEWS = [("JupyterLab Light", "tok-ada"), ("JupyterLab Dark", "tok-uma")]


@pytest.mark.parametrize(("theme", "token"), VIEWS)
def test_dashboard_and_messages_in_theme(lab: Any, theme: str, token: str) -> None:
    server, _env = lab
    admin = token == "tok-ada"
    tag = "dark" if "Dark" in theme else "light"
    artifacts = ARTIFACTS / "lab" / "dashboard"
    artifacts.mkdir(parents=True, exist_ok=True)
    spec = server.get(f"/api/kernelspecs/{KERNEL}").json()
    seen = run_driver(
        "dashboard.mjs",
        server,
        artifacts,
        timeout=400,
        theme=theme,
        token=token,
        kernelLabel=spec["spec"]["display_name"],
        otherUser="gs-bob",
    )
    assert seen["bodyTheme"] == theme
    assert seen["launcherDashboard"] >= 1  # the launcher opens the dashboard too

    # the picker's refusal: readable in this theme (it was light text on light pink in dark)
    assert seen["refusal"].startswith("Request:")
    assert seen["pickerContrast"], "no text measured in the picker"
    assert not _low(seen["pickerContrast"]), _low(seen["pickerContrast"])
    if seen["progressShown"]:
        assert not _low(seen["progressContrast"]), _low(seen["progressContrast"])

    # the start's phases, as the server reported them, ended ready
    mine = [s for s in seen["starts"] if s["kernel_name"] == KERNEL]
    assert mine and mine[-1]["phase"] == "ready", seen["starts"]

    # status bar: percent of the GPU, live; readable
    assert "A100" in seen["status"] and "25–50 %" in seen["status"]
    assert "using" in seen["statusBusy"]
    assert not _low(seen["statusContrast"]), _low(seen["statusContrast"])

    # the Kernel menu and the notebook toolbar carry the GPU commands
    menu = " | ".join(seen["kernelMenu"])
    for label in (
        "Change the GPU Share (Live, or Restart the Kernel)",
        "Release GPU Share",
        "Open the GPU Dashboard",
    ):
        assert label in menu, menu
    assert set(seen["toolbar"]) >= {
        "jp-gpushare-toolbar-gpushare-dashboard",
        "jp-gpushare-toolbar-gpushare-restart",
        "jp-gpushare-toolbar-gpushare-release",
    }

    # the dashboard: this kernel's share live, without a notebook cell
    assert seen["cellsAfterDashboard"] == 2  # the GPU-work cell and the empty one after it
    kernel = seen["dashboardKernel"]
    assert "A100 #0" in kernel and "25–50 % of the GPU" in kernel
    assert "Using now" in kernel and "Memory" in kernel
    # the GPU: both users' shares; whose and what for the admin, capacity only for a user
    rows = seen["dashboardRows"]
    assert len(rows) >= 2, rows
    assert any("(you)" in r and ".ipynb" in r for r in rows), rows
    if admin:
        assert "every user" in seen["dashboardNote"]
        assert any("gs-bob" in r and " ".join(COMMAND) in r for r in rows), rows
    else:
        assert "your own shares" in seen["dashboardNote"]
        assert any("another user" in r and "(hidden)" in r and "25–50 %" in r for r in rows)
        assert "gs-bob" not in seen["dashboardText"] and "train.py" not in seen["dashboardText"]
    # plots with axes, scale and legends
    labels = seen["chartLabels"]
    for tick in ("0 %", "50 %", "100 %", "−2 min", "now"):
        assert tick in labels, labels
    legends = " ".join(seen["legends"])
    assert "used" in legends and "request" in legends and "limit" in legends
    assert "reserved" in legends
    assert seen["polylines"] >= 1
    assert not _low(seen["dashboardContrast"]), _low(seen["dashboardContrast"])
    assert len(seen["dashboardContrast"]) > 20  # the whole panel was measured
    # keyboard: Tab from the panel reaches its buttons
    assert "gpushare:release" in seen["tabReached"], seen["tabReached"]

    # the ipywidgets panel in the notebook: readable in this theme too
    assert seen["panelContrast"], seen.get("panelText")
    assert not _low(seen["panelContrast"]), _low(seen["panelContrast"])

    # Escape in the picker: quietly no kernel
    assert seen["dialogsAfterCancel"] == []
    assert seen["kernelsAfterCancel"] == 0
    assert "No Kernel" in seen["kernelNameAfterCancel"] or not seen["kernelNameAfterCancel"]

    for name in ("01-picker-refusal", "03-kernel-menu", "04-dashboard", "06-panel", "05-cancelled"):
        assert (artifacts / f"{tag}-{name}.png").stat().st_size > 10_000
