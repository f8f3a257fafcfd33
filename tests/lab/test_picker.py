"""The GPU share picker in a real JupyterLab, driven in headless Chromium (tests/lab/picker.mjs).

Simulated GPUs: one A100 and one T4. The browser picks 0.25 of an A100 with limit 0.5 for a new
notebook; the kernel must hold exactly that allocation (checked over REST and inside the
kernel). The palette restarts it with a new share (0.5-1) and opens the GPU dashboard (no
notebook cell is added). Then a pick
above its limit is refused by the picker, a pick that does not fit is refused by the server
with its explanation (shown in the dialog), a pick that fits starts, and the palette command
releases that kernel's share; cancelling the picker leaves a notebook without a kernel quietly
(no error dialog, no kernel chooser). Screenshots: test-artifacts/lab/<test>/.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from labdriver import run_driver

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]

KERNEL = "gpushare-python"
OTHER_KERNEL = "gpushare-python-half"
TOO_BIG = 0.9  # the A100 has 0.5 free once the first kernel holds 0.5


def _kernel_of(server: Any, notebook: str, sessions: list[dict[str, Any]] | None = None) -> str:
    if sessions is None:
        sessions = server.get("/api/sessions").json()
    ids = [s["kernel"]["id"] for s in sessions if s["path"] == notebook]
    assert len(ids) == 1, sessions
    return ids[0]


def test_pick_share_in_lab(lab_server: Any, artifacts: Path) -> None:
    server = lab_server("1xA100,1xT4")
    spec = server.get(f"/api/kernelspecs/{KERNEL}").json()
    assert spec["spec"]["metadata"]["kernel_provisioner"]["provisioner_name"] == (
        "gpushare-provisioner"
    )
    gpus = {g["type"]: g for g in server.get("/gpushare/api/gpus").json()["gpus"]}

    other = server.get(f"/api/kernelspecs/{OTHER_KERNEL}").json()
    seen = run_driver(
        "picker.mjs",
        server,
        artifacts,
        kernelLabel=spec["spec"]["display_name"],
        tooBig=TOO_BIG,
        otherKernelLabel=other["spec"]["display_name"],
    )

    # 1. the first notebook's kernel holds exactly the pick
    # (GET /api/sessions and /gpushare/api/allocations, read by the driver at that moment)
    kernel1 = _kernel_of(server, "Untitled.ipynb", seen["afterPick"]["sessions"])
    allocations = {a["kernel_id"]: a for a in seen["afterPick"]["allocations"]}
    assert len(allocations) == 1
    mine = allocations[kernel1]
    assert mine["gpu_request"] == 0.25
    assert mine["gpu_limit"] == 0.5
    assert mine["gpu_type"] == "A100"
    assert mine["gpus"] == [gpus["A100"]["uuid"]]
    assert mine["gpu_memory"] == gpus["A100"]["memory"] // 4  # default: request × GPU memory
    assert seen["cell1"].strip("'\" \n") == f"{mine['id']} {gpus['A100']['uuid']}"
    assert "A100" in seen["status1"] and "25–50 %" in seen["status1"]
    achieved = float(re.search(r"using (\d+) %", seen["statusBusy"]).group(1))
    assert achieved > 0  # live achieved share of the busy kernel, from the node daemon
    assert any(row.startswith("A100") for row in seen["pickerTypes"])
    assert any(row.startswith("T4") for row in seen["pickerTypes"])

    # 1b. "Restart kernel with a new GPU share": a new kernel holds the new share, the old
    # kernel and its share are gone; 1c. the dashboard shows its share, no cell was added
    restarted = _kernel_of(server, "Untitled.ipynb")
    assert restarted != kernel1
    assert server.get(f"/api/kernels/{kernel1}").status_code == 404
    now = {a["kernel_id"]: a for a in server.allocations()}
    assert kernel1 not in now
    assert (now[restarted]["gpu_request"], now[restarted]["gpu_limit"]) == (0.5, 1.0)
    assert seen["cellRestarted"].strip("'\" \n") == now[restarted]["id"]
    assert "50–100 %" in seen["statusRestarted"]
    assert seen["dashboardAllocation"] == now[restarted]["id"]
    assert "50–100 % of the GPU" in seen["dashboardKernel"]
    assert seen["cellsAdded"] == 0
    kernel1 = restarted

    # 2. refusals carry the explanation: the picker's own check, then the server's
    assert seen["clientRefusal"].startswith("Request:"), seen["clientRefusal"]
    assert "at most the limit (50 %)" in seen["clientRefusal"]
    # the dialog shows what the server answered to the picker's POST (seen on the wire)
    assert seen["serverAnswer"]["status"] == 409
    refusal = seen["serverAnswer"]["body"]
    assert refusal["error"] == "no_fit"
    # the picker says it once, in percent (not the server's fractions again)
    assert f"No A100 has {round(TOO_BIG * 100)} % free" in seen["serverRefusal"]
    assert seen["problemBoxes"] == 0
    # at that moment only the restarted first kernel held a share (as after the release below)
    a100_free = 1 - sum(
        a["gpu_request"] for a in seen["afterRelease"] if gpus["A100"]["uuid"] in a["gpus"]
    )
    assert f"{a100_free:g} on A100" in refusal["suggestions"]  # (its "Use" button was clicked)
    assert seen["afterUse"] == {"request": f"{a100_free:g}", "type": "A100"}

    # 3. the second kernel started with the corrected pick, then released its share by command
    kernel2 = _kernel_of(server, "Untitled1.ipynb", seen["afterReleaseSessions"])
    assert kernel2 != kernel1
    assert "50–75 %" in seen["status2"]
    assert "released" in seen["status3"]
    assert [a["kernel_id"] for a in seen["afterRelease"]] == [kernel1]
    # the kernel kept running without its share (its session still had it after the release)
    state = {
        s["kernel"]["id"]: s["kernel"]["execution_state"] for s in seen["afterReleaseSessions"]
    }
    assert state[kernel2] != "dead"

    # 5. Escape in the picker of a Change Kernel kept the running kernel, quietly
    assert seen["changeCancelled"]["dialogs"] == []
    assert seen["changeCancelled"]["kept"] is True
    # then Change Kernel to another gpushare kernelspec went through the picker: T4, 0.25-0.5
    changed = _kernel_of(server, "Untitled1.ipynb")
    assert changed != kernel2
    assert server.get(f"/api/kernels/{kernel2}").status_code == 404  # replaced
    assert server.get(f"/api/kernels/{changed}").json()["name"] == OTHER_KERNEL
    final = {a["kernel_id"]: a for a in server.allocations()}
    assert (
        final[changed]["gpu_type"],
        final[changed]["gpu_request"],
        final[changed]["gpu_limit"],
    ) == ("T4", 0.25, 0.5)
    assert final[changed]["gpus"] == [gpus["T4"]["uuid"]]
    assert "T4" in seen["status5"]
    own = other["spec"]["metadata"]["kernel_provisioner"]["config"]  # the picker starts from it
    assert seen["changeInitial"] == {
        "request": f"{own['gpu_request']:g}",
        "limit": f"{own['gpu_limit']:g}",
    }

    # 4. cancel: no kernel, and nothing pops up about it
    assert seen["dialogsAfterCancel"] == []
    assert len(server.get("/api/kernels").json()) == 2  # the two notebooks' kernels only

    for name in ("02-picker", "03-kernel-running", "05-refused-by-server", "07-released"):
        assert (artifacts / f"{name}.png").stat().st_size > 10_000
