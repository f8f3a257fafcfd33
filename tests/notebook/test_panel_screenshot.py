"""The panel rendered in a real JupyterLab in headless Chromium, in the light and the dark theme,
kept as screenshots for people to look at: test-artifacts/notebook/panel-<theme>.png (the panel)
and lab-<theme>.png (the page); every text in the panel has a contrast of at least 4.5:1 (WCAG
AA) against what is behind it, computed in the page from getComputedStyle.

Locally the test skips with the reason when Chromium, Node or playwright-core are missing; under
CI (``CI=true``) it fails instead, so a missing browser is never a silent pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nbkit import allocations_of, daemon_allocation
from support import REPO, wait_for

from jupyter_gpushare.share import format_bytes

sys.path.insert(0, str(REPO / "tests" / "lab"))
from labdriver import LabServer, chromium_path, driver_missing  # tests/lab (read-only)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
ARTIFACTS = REPO / "test-artifacts" / "notebook"

#: GPU work in a background thread of the kernel, so that the panel has something to show.
WORK = """
import ctypes, threading
cu = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p
cu.cuLaunchKernel.argtypes = [P] + [ctypes.c_uint] * 7 + [P, P, P]
dev, ctx, mod, fn, ptr = ctypes.c_int(), P(), P(), P(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(6 << 30)) == 0
assert cu.cuModuleLoadData(ctypes.byref(mod), b"any module") == 0
assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"busy_us") == 0
us = ctypes.c_uint64(3000)
params = (P * 1)(ctypes.cast(ctypes.byref(us), P))
def spin():
    cu.cuCtxSetCurrent(ctx)
    while True:
        cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        cu.cuCtxSynchronize()
threading.Thread(target=spin, daemon=True).start()
"""

NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": "import jupyter_gpushare\njupyter_gpushare.panel()",
        }
    ],
    "metadata": {
        "kernelspec": {"name": "gpushare-python", "display_name": "gpushare", "language": "python"}
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}


@pytest.fixture
def lab(gpushare_env):
    reason = driver_missing()
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the panel screenshot needs a browser under CI: {reason}")
        pytest.skip(reason)
    server = LabServer(gpushare_env, "1xA100").start(timeout=90)
    yield server
    server.stop()


def test_panel_screenshot_in_jupyterlab(lab):
    assert lab.request(
        "PUT", "/api/contents/panel.ipynb", json={"type": "notebook", "content": NOTEBOOK}
    ).status_code in (200, 201)
    session = lab.post(
        "/api/sessions",
        {
            "path": "panel.ipynb",
            "name": "panel.ipynb",
            "type": "notebook",
            "kernel": {"name": "gpushare-python"},
        },
    )
    assert session.status_code == 201, session.text
    kernel_id = session.json()["kernel"]["id"]
    [alloc] = wait_for(lambda: [a for a in allocations_of(lab, kernel_id) if a["pid"]], 30)
    client = lab.client(kernel_id)
    client.execute(WORK)
    client.close()

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    truth = daemon_allocation(lab, alloc["id"])
    for theme in ("JupyterLab Light", "JupyterLab Dark"):
        tag = "dark" if "Dark" in theme else "light"
        (ARTIFACTS / f"zz-failure-{tag}.png").unlink(missing_ok=True)  # only this run's
        env = dict(
            os.environ,
            LAB_URL=lab.url,
            LAB_TOKEN=lab.token,
            ARTIFACTS=str(ARTIFACTS),
            CHROMIUM=chromium_path() or "",
            PLAYWRIGHT_FROM=str(REPO / "tests" / "lab" / "package.json"),
            THEME=theme,
        )
        proc = subprocess.run(
            ["node", str(HERE / "panel_shot.mjs")],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        log = proc.stdout + "\n--- stderr ---\n" + proc.stderr
        (ARTIFACTS / f"panel_shot-{tag}.log").write_text(log)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{lab.log()}"
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        assert seen["theme"] == theme

        shown = seen["fields"]
        assert shown["state"] == "active" and shown["simulated"] == "simulated GPU"
        assert shown["gpu_uuid"] == alloc["gpus"][0]
        assert (shown["request"], shown["limit"]) == ("25 %", "50 %")
        assert shown["memory_cap"] == format_bytes(truth["memory_cap"])
        assert shown["memory_used"] == "6GiB"
        assert shown["achieved_share"] not in ("0 %", "–")  # the busy thread shows
        assert seen["svg"] == 2 and seen["release"] == 1
        # readable in this theme: every text, the plot's axis labels and legend included
        texts = {c["text"] for c in seen["contrast"]}
        assert {"100 %", "now", "request", "limit", "request / limit"} <= texts, texts
        low = [c for c in seen["contrast"] if c["ratio"] < 4.5]
        assert not low, (theme, low)
        for name in (f"panel-{tag}.png", f"lab-{tag}.png"):
            assert (ARTIFACTS / name).stat().st_size > 5000
