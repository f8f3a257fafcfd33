"""Helpers for the notebook-side tests: CUDA through the simulator from inside a kernel, iopub
collection for widget comm messages, the daemon's view of an allocation."""

from __future__ import annotations

import json
import re
import time
from typing import Any

from jupyter_gpushare.daemon.client import DaemonClient

#: Allocates 256 MiB in the primary context (as the CUDA runtime, PyTorch and CuPy do).
ALLOCATE = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
print("alloc", cu.cuMemAlloc_v2(ctypes.byref(ptr), 256 << 20))
"""

MIB = 1 << 20
CUDA_ERROR_NOT_PERMITTED = 800


def daemon(server: Any) -> DaemonClient:
    return DaemonClient(server.env["GPUSHARE_SOCKET"])


def daemon_allocation(server: Any, allocation_id: str) -> dict[str, Any] | None:
    reply = daemon(server).status(allocation_id)
    return reply["allocations"][0] if reply.get("ok") else None


def gpu_memory_used(server: Any, uuid: str) -> int | None:
    """What the simulator's NVML reports in use on the GPU (sampled by the daemon each second)."""
    for gpu in daemon(server).status().get("gpus", []):
        if gpu["uuid"] == uuid and gpu.get("nvml"):
            return int(gpu["nvml"]["memory_used"])
    return None


def allocations_of(server: Any, kernel_id: str) -> list[dict[str, Any]]:
    return [a for a in server.allocations() if a["kernel_id"] == kernel_id]


def start_kernel(server: Any, share: dict[str, Any] | None = None) -> tuple[dict, dict]:
    """A gpushare kernel holding ``share``; returns (kernel model, allocation)."""
    body: dict[str, Any] = {"name": "gpushare-python"}
    if share:
        body["share"] = share
    response = server.post("/gpushare/api/kernels", body)
    assert response.status_code == 201, response.text
    kernel = response.json()
    [allocation] = allocations_of(server, kernel["id"])
    return kernel, allocation


def run_collecting(kc: Any, code: str, timeout: float = 60) -> tuple[dict, list[dict]]:
    """Execute ``code``; every iopub message (any parent) until this request goes idle, each
    tagged ``during`` (between this request's busy and idle) and ``t`` (receipt time)."""
    msg_id = kc.execute(code)
    seen: list[dict[str, Any]] = []
    busy = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except Exception:  # queue.Empty
            continue
        mine = msg["parent_header"].get("msg_id") == msg_id
        if mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "busy":
            busy = True
        msg["during"] = busy
        msg["t"] = time.monotonic()
        seen.append(msg)
        if mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            reply = kc.get_shell_msg(timeout=timeout)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = kc.get_shell_msg(timeout=timeout)
            return reply, seen
    raise AssertionError(f"no idle within {timeout}s for {code!r}")


def widget_updates(messages: list[dict], comm_ids: set[str]) -> list[dict[str, Any]]:
    """The state updates (``comm_msg`` with method ``update``) sent for those widgets."""
    return [
        m["content"]["data"]["state"]
        for m in messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] in comm_ids
        and m["content"]["data"].get("method") == "update"
    ]


def fields(html: str) -> dict[str, str]:
    """``data-field`` cells of the panel's HTML."""
    return {k: v for k, v in re.findall(r'data-field="([a-z_]+)">([^<]*)<', html)}


def click(kc: Any, comm_id: str) -> None:
    """What the browser sends when a Button is clicked."""
    msg = kc.session.msg(
        "comm_msg",
        {
            "comm_id": comm_id,
            "data": {"method": "custom", "content": {"event": "click"}},
        },
    )
    kc.shell_channel.send(msg)


def json_line(text: str) -> Any:
    return json.loads(text.strip().splitlines()[-1])
