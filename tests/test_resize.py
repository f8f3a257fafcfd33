"""Live resize of a running kernel's share over REST, measured in enforcement on the simulator."""

from __future__ import annotations

import json
import time

import pytest
from support import BUSY, wait_for

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import PlacementRefused
from jupyter_gpushare.resize import BelowUse, resized
from jupyter_gpushare.share import ShareError, ShareSpec

GiB = 2**30
MiB = 2**20


MEM = """
import json
free, total, ptr = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_uint64()
cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
print(json.dumps({"total": total.value}))
"""


# -- the rule (pure) --------------------------------------------------------------------------


def _allocation(gpu, request, limit, memory, aid=None):
    spec = ShareSpec(gpu_request=request, gpu_limit=limit, gpu_memory=memory, gpu_type="A100")
    return Allocation(
        id=aid or Allocation.new_id(), node=gpu.node, gpus=(gpu.uuid,), spec=spec, memory=memory
    )


def test_resize_rules_on_the_current_gpu():
    [gpu] = simulated_gpus("1xA100", node="n")
    mine = _allocation(gpu, 0.25, 0.5, 10 * GiB)
    other = _allocation(gpu, 0.5, 1.0, 40 * GiB)
    up = resized(mine, [other], [gpu], {"gpu_request": 0.5, "gpu_limit": 1.0}, None)
    assert (up.request, up.limit, up.memory, up.id) == (0.5, 1.0, 10 * GiB, mine.id)
    with pytest.raises(PlacementRefused):  # 0.5 + 0.75 > 1 on this GPU
        resized(mine, [other], [gpu], {"gpu_request": 0.75, "gpu_limit": 1.0}, None)
    with pytest.raises(ShareError, match="gpu_type"):
        resized(mine, [other], [gpu], {"gpu_type": "T4"}, None)
    with pytest.raises(BelowUse) as below:
        resized(mine, [], [gpu], {"gpu_memory": "1GiB"}, 3 * GiB)
    assert below.value.to_json()["memory_used"] == 3 * GiB
    assert "1GiB" in str(below.value) and "3GiB" in str(below.value)


# -- end to end --------------------------------------------------------------------------------


def _rate_series(daemon, aid, seconds):
    """(t, device_seconds) samples every 50 ms."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        [mine] = daemon.status(aid)["allocations"]
        out.append((time.monotonic(), mine["gpus"][0]["device_seconds"]))
        time.sleep(0.05)
    return out


def _settle_time(series, start, target, tol, span=0.5):
    """First time after ``start`` from which the device-time rate over ``span`` seconds is
    within ``tol`` of ``target``."""
    for i, (t0, d0) in enumerate(series):
        if t0 < start:
            continue
        later = [(t, d) for t, d in series[i:] if t - t0 >= span]
        if not later:
            break
        t1, d1 = later[0]
        if abs((d1 - d0) / (t1 - t0) - target) <= tol:
            return t0 - start
    return None


def _patch(server, aid, body):
    return server.request("PATCH", f"/gpushare/api/allocations/{aid}", json=body)


def test_resize_takes_effect_within_one_window(jupyter_server):
    server = jupyter_server("1xA100")
    daemon = DaemonClient(server.env["GPUSHARE_SOCKET"])
    wait_for(daemon.alive, timeout=30)
    kernel = server.post(
        "/gpushare/api/kernels",
        {
            "name": "gpushare-python",
            "share": {"gpu_request": 0.25, "gpu_limit": 0.5, "gpu_memory": "4GiB"},
        },
    ).json()
    aid = kernel["allocation"]["id"]
    window_s = daemon.status()["daemon"]["window_ms"] / 1e3
    client = server.client(kernel["id"])
    client.execute(BUSY)
    wait_for(lambda: daemon.status(aid)["allocations"][0]["achieved_share"] > 0.4, timeout=20)

    settle = {}
    for name, body, target in (
        ("down", {"gpu_limit": 0.25}, 0.25),
        ("up", {"gpu_request": 0.5, "gpu_limit": 1.0}, 1.0),
    ):
        time.sleep(window_s)  # a full window at the old share
        began = time.monotonic()
        response = _patch(server, aid, body)
        assert response.status_code == 200, response.text
        series = _rate_series(daemon, aid, window_s + 1.5)
        settle[name] = _settle_time(series, began, target, tol=0.08)
        assert settle[name] is not None, (name, series)
        assert settle[name] <= window_s, (name, settle[name])
        [mine] = daemon.status(aid)["allocations"]
        assert (mine["request"], mine["limit"]) == (response.json()["gpu_request"], target)
        assert abs(mine["achieved_share"] - target) <= 0.08, mine  # the window average too
    print(f"resize settled within {settle} s (window {window_s} s)")

    # the memory cap changes live in the interposer, and is never set below what is in use
    assert json.loads(client.execute(MEM))["total"] == 4 * GiB
    client.execute(
        f"mem = ctypes.c_uint64(); assert cu.cuMemAlloc_v2(ctypes.byref(mem), {512 * MiB}) == 0"
    )
    below = _patch(server, aid, {"gpu_memory": "256MiB"})
    assert below.status_code == 409, below.text
    assert below.json()["error"] == "below_use"
    assert below.json()["memory_used"] == 512 * MiB and "512MiB" in below.json()["message"]
    assert _patch(server, aid, {"gpu_memory": "1GiB"}).status_code == 200
    wait_for(lambda: json.loads(client.execute(MEM))["total"] == GiB, timeout=5)
    client.execute("stop.set(); spinner.join()")
    client.close()

    # placement rules on its current GPU: another kernel holds 0.25; 0.5 + 0.25 + 0.5 > 1
    other = server.post(
        "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
    ).json()
    assert other["allocation"]["gpus"] == kernel["allocation"]["gpus"]
    refused = _patch(server, aid, {"gpu_request": 0.8, "gpu_limit": 1.0})
    assert refused.status_code == 409 and refused.json()["error"] == "no_fit", refused.text
    bad = _patch(server, aid, {"gpu_count": 2})
    assert bad.status_code == 400 and bad.json()["field"] == "gpu_count"
    assert _patch(server, "a-0000000000000000", {"gpu_limit": 0.5}).status_code == 404
    assert "resized" in server.log_path.read_text()  # logged for admins
