"""The whole local path in a real kernel: provisioner -> node daemon -> interposer -> simulator."""

from __future__ import annotations

import json

from support import CUDA_PROBE, wait_for

from jupyter_gpushare.daemon.client import DaemonClient


def test_kernel_memory_cap_is_enforced_by_the_interposer(jupyter_server):
    server = jupyter_server("1xA100")
    response = server.post(
        "/gpushare/api/kernels",
        {
            "name": "gpushare-python",
            "share": {"gpu_request": 0.25, "gpu_memory": "1GiB"},
        },
    )
    assert response.status_code == 201, response.text
    kernel, alloc = response.json(), response.json()["allocation"]
    client = server.client(kernel["id"])
    env = json.loads(
        client.execute(
            "import os, json; print(json.dumps({k: os.environ.get(k, '') for k in "
            "('LD_PRELOAD', 'LD_LIBRARY_PATH')}))"
        )
    )
    assert env["LD_PRELOAD"].endswith("libgpushare.so")
    seen = json.loads(client.execute(CUDA_PROBE))
    client.close()
    assert seen["total"] == 1 << 30  # cuMemGetInfo reports the cap, not the A100's 80 GiB
    assert seen["small"] == 0
    assert seen["big"] == 2  # CUDA_ERROR_OUT_OF_MEMORY: 256 MiB + 1 GiB is over the cap
    daemon = DaemonClient(server.env["GPUSHARE_SOCKET"])
    [mine] = wait_for(lambda: daemon.status(alloc["id"]).get("allocations"), timeout=10)
    assert mine["memory_cap"] == 1 << 30 and mine["request"] == 0.25
    assert mine["memory_used"] == 256 << 20  # the failed 1 GiB call left nothing behind
    assert mine["connected"] is True
