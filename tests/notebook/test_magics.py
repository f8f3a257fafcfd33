"""``%gpushare`` magics and the plain-Python actions in real kernels started through the
provisioner on simulated GPUs (node daemon, interposer and simulator all real)."""

from __future__ import annotations

import json

import pytest
from nbkit import (
    ALLOCATE,
    CUDA_ERROR_NOT_PERMITTED,
    MIB,
    allocations_of,
    daemon,
    daemon_allocation,
    gpu_memory_used,
    start_kernel,
)
from support import wait_for

USAGE = "%gpushare ACTION [options]"
GIB = 2**30


def test_status_gpus_and_live_request_and_refusals(jupyter_server):
    server = jupyter_server("1xA100")
    kernel, alloc = start_kernel(server)  # the kernelspec's 0.25-0.5
    other, other_alloc = start_kernel(server, {"gpu_request": 0.5, "gpu_limit": 0.5})
    client = server.client(kernel["id"])

    # loaded automatically (--ext=jupyter_gpushare), and status matches the daemon's status
    text = client.execute("%gpushare status")
    mine = daemon_allocation(server, alloc["id"])
    assert "active [simulated GPU]" in text and alloc["id"] in text
    assert alloc["gpus"][0] in text
    assert (
        f"request      {mine['request']:.0%}   limit {mine['limit']:.0%}".replace("%", " %") in text
    )
    assert "used of 20GiB" in text and "2 shares on it" in text and "share(s)" not in text
    plain = json.loads(
        client.execute(
            "import jupyter_gpushare, json; s = jupyter_gpushare.status(); "
            "print(json.dumps([s['state'], s['allocation']['memory_cap'], s['gpu']['uuid'], "
            "s['gpu']['kernels'], s['simulated']]))"
        )
    )
    assert plain == ["active", mine["memory_cap"], alloc["gpus"][0], 2, True]

    # gpus: the node's GPUs with their free capacity (0.25 free: 0.25 + 0.5 are held)
    text = client.execute("%gpushare gpus")
    assert alloc["gpus"][0] in text and " 25 % " in text and "(simulated)" in text

    # a live change that does not fit on this GPU is refused with the reason; nothing changes
    text = client.execute("%gpushare request --gpu-request 0.6 --gpu-limit 0.6")
    assert "%gpushare request:" in text and "0.6" in text and "free" in text, text
    assert allocations_of(server, kernel["id"])[0]["gpu_request"] == 0.25
    assert daemon_allocation(server, alloc["id"])["request"] == 0.25
    # one that fits takes effect in the ledger and the daemon at once
    text = client.execute("%gpushare request --gpu-request 0.5 --gpu-limit 1")
    assert "now holds 50–100 % of an A100" in text and "(changed live)" in text, text
    [now] = allocations_of(server, kernel["id"])
    assert (now["id"], now["gpu_request"], now["gpu_limit"]) == (alloc["id"], 0.5, 1.0)
    mine = daemon_allocation(server, alloc["id"])
    assert (mine["request"], mine["limit"]) == (0.5, 1.0)
    # a memory cap below what the kernel uses now is refused
    assert "alloc 0" in client.execute(ALLOCATE)
    text = client.execute("%gpushare request --gpu-memory 128MiB")
    assert "128MiB is below the 256MiB the kernel uses" in text, text
    assert allocations_of(server, kernel["id"])[0]["gpu_memory"] == now["gpu_memory"]

    # a kernel cannot release or resize another kernel's allocation (peer credentials)
    reply = json.loads(
        client.execute(
            "from jupyter_gpushare.daemon.client import DaemonClient; import os, json; "
            "d = DaemonClient(os.environ['GPUSHARE_SOCKET']); "
            f"print(json.dumps([d.release({other_alloc['id']!r}), "
            f"d.resize({other_alloc['id']!r}, {{'gpu_limit': 1}})]))"
        )
    )
    assert [r["error"] for r in reply] == ["not_permitted", "not_permitted"], reply
    assert f"is not allocation {other_alloc['id']}'s process" in reply[0]["message"]
    # ... nor can any other process (here: the test itself)
    assert daemon(server).release(other_alloc["id"])["error"] == "not_permitted"
    assert allocations_of(server, other["id"])[0]["id"] == other_alloc["id"]
    assert daemon_allocation(server, other_alloc["id"])["limit"] == 0.5
    client.close()


def test_request_changes_only_what_is_asked(jupyter_server):
    """The limit is never raised behind the user's back; an auto memory cap (request × GPU
    memory) follows the request; an explicit one stays."""
    server = jupyter_server("1xA100")  # 80GiB
    kernel, alloc = start_kernel(server)  # the kernelspec's 0.25–0.5, memory auto: 20GiB
    client = server.client(kernel["id"])

    def held() -> tuple[float, float, int]:
        [a] = allocations_of(server, kernel["id"])
        mine = daemon_allocation(server, alloc["id"])
        assert (mine["request"], mine["limit"], mine["memory_cap"]) == (
            a["gpu_request"],
            a["gpu_limit"],
            a["gpu_memory"],
        )  # the daemon enforces it
        return a["gpu_request"], a["gpu_limit"], a["gpu_memory"]

    assert held() == (0.25, 0.5, 20 * GIB)
    text = client.execute("%gpushare request --gpu-request 0.9")
    assert "--gpu-request 0.9 is above this kernel's limit 0.5" in text, text
    assert "(gpu_limit= in Python)" in text
    assert "--gpu-request 0.9 --gpu-limit 0.9" in text
    assert held() == (0.25, 0.5, 20 * GIB)
    text = client.execute("%gpushare request --gpu-request 0.4")
    assert "now holds 40–50 % of an A100" in text and "32GiB" in text, text
    assert held() == (0.4, 0.5, 32 * GIB)  # 0.4 × 80GiB: auto memory follows
    client.execute("%gpushare request --gpu-limit 1")
    assert held() == (0.4, 1.0, 32 * GIB)  # only the limit
    client.execute("%gpushare request --gpu-request 0.9 --gpu-limit 0.9")
    assert held() == (0.9, 0.9, int(80 * GIB * 0.9))
    client.execute("%gpushare request --gpu-memory 10GiB")
    assert held() == (0.9, 0.9, 10 * GIB)
    client.execute("%gpushare request --gpu-request 0.5")
    assert held() == (0.5, 0.9, 10 * GIB)  # an explicit cap stays
    refused = client.execute(
        "import jupyter_gpushare\n"
        "from jupyter_gpushare.notebook.actions import GpushareError\n"
        "try:\n    jupyter_gpushare.request(gpu_request=1.0)\n"
        "except GpushareError as e:\n    print(e.code, e)"
    )
    assert refused.startswith("invalid_share gpu_request 1 is above this kernel's limit 0.9")
    assert held() == (0.5, 0.9, 10 * GIB)
    client.close()


def test_bad_arguments_print_usage_and_change_nothing(jupyter_server):
    server = jupyter_server("1xA100")
    kernel, alloc = start_kernel(server)
    client = server.client(kernel["id"])
    # alone: the list of actions, no error and no "::" from IPython's usage formatting
    alone = client.execute("%gpushare")
    assert alone.startswith(USAGE) and "::" not in alone and "error" not in alone, alone
    for action in ("status", "gpus", "release", "request"):
        assert f"\n  {action} " in alone
    cases = {
        "bogus": "unknown action 'bogus'",
        "status --gpu-limit 0.5": "--gpu-* options go with 'request' only",
        "request --gpu-request 2": "--gpu-request 2 is not allowed",
        "request --gpu-request 0.9 --gpu-limit 0.5": "at most --gpu-limit (0.5)",
        "request --gpu-memory lots": "--gpu-memory lots is not allowed",
        "request --gpu-requets 0.3": "unrecognized arguments",
        "release now": "unrecognized arguments",
    }
    for line, error in cases.items():
        text = client.execute(f"%gpushare {line}")
        assert USAGE in text and error in text, (line, text)
        assert "::" not in text and "gpu_request=" not in text, (line, text)
    # nothing asked of the daemon changes anything: no change given, another type
    assert "Nothing to change" in client.execute("%gpushare request")
    assert "another GPU type needs a new share" in client.execute("%gpushare request --gpu-type T4")
    keys = ("id", "gpus", "gpu_request", "gpu_limit", "gpu_memory", "gpu_type")
    assert [{k: a[k] for k in keys} for a in server.allocations()] == [{k: alloc[k] for k in keys}]
    mine = daemon_allocation(server, alloc["id"])
    assert (mine["request"], mine["limit"], mine["memory_cap"]) == (0.25, 0.5, alloc["gpu_memory"])
    client.close()


def test_release_then_request_then_restart_uses_the_new_share(jupyter_server, gpushare_env):
    # as outside pytest: ipykernel forwards the process's own stderr (fd 2) to the notebook
    gpushare_env.pop("PYTEST_CURRENT_TEST", None)
    server = jupyter_server("1xA100")
    kernel, alloc = start_kernel(server)
    uuid = alloc["gpus"][0]
    client = server.client(kernel["id"])
    assert "alloc 0" in client.execute(ALLOCATE)
    wait_for(lambda: (gpu_memory_used(server, uuid) or 0) >= 256 * MIB, timeout=10)

    text = client.execute("%gpushare release")
    assert f"Released 25–50 % of an A100 ({alloc['id']}" in text
    assert "256MiB of GPU memory freed" in text and text.count("freed") == 1, text
    assert "Restart the kernel to get a new share" in text and "`" not in text
    # the ledger, the daemon and the simulator's memory all show it gone
    assert allocations_of(server, kernel["id"]) == []
    assert daemon_allocation(server, alloc["id"]) is None
    wait_for(lambda: gpu_memory_used(server, uuid) == 0, timeout=10)
    # the kernel lives on; CUDA refuses with the reason
    assert client.execute("print(1 + 1)").strip() == "2"
    codes = client.execute(
        "print(cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20), "
        "cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "
        "cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); import time; time.sleep(2)"
    )
    assert codes.split()[:3] == [str(CUDA_ERROR_NOT_PERMITTED)] * 3, codes
    assert "GPU share of this kernel was released" in codes  # the interposer's stderr line
    reason = client.execute(
        "s = ctypes.c_char_p(); cu.cuGetErrorString(800, ctypes.byref(s)); print(s.value.decode())"
    )
    assert "GPU share of this kernel was released" in reason and "Restart the kernel" in reason
    # a framework's error after the release gets the reason appended (post_run_cell)
    with pytest.raises(AssertionError) as failed:
        client.execute("raise RuntimeError('CUDA error: operation not permitted')")
    assert "gpushare: The GPU share of this kernel was released" in str(failed.value)
    text = client.execute("%gpushare status")
    assert "GPU share: released" in text and "cannot use a GPU again" in text
    assert "already released" in client.execute("%gpushare release")

    # a new share, reserved now, used by the restart
    text = client.execute("%gpushare request --gpu-request 0.5 --gpu-limit 0.5")
    assert "Reserved 50 % of an A100" in text and "restart the kernel" in text, text
    [reserved] = allocations_of(server, kernel["id"])
    assert (reserved["gpu_request"], reserved["gpu_limit"]) == (0.5, 0.5)
    assert "A new share is already reserved" in client.execute("%gpushare request")
    client.close()
    assert server.post(f"/api/kernels/{kernel['id']}/restart").status_code == 200
    [after] = wait_for(lambda: [a for a in allocations_of(server, kernel["id"]) if a["pid"]], 60)
    assert after["id"] == reserved["id"] and after["state"] == "active"
    client = server.client(kernel["id"])
    assert "alloc 0" in client.execute(ALLOCATE)  # a fresh process: the GPU works again
    text = client.execute("%gpushare status")
    assert f"active [simulated GPU]  {reserved['id']}" in text and "limit 50 %" in text
    client.close()
    server.delete(f"/api/kernels/{kernel['id']}")
    assert server.allocations() == []


def test_actions_without_a_share_or_daemon(monkeypatch, tmp_path):
    """Outside a gpushare kernel, and with a daemon that does not answer: clear states, clear
    errors, nothing raised by status()."""
    from jupyter_gpushare.notebook import actions

    for name in ("GPUSHARE_ALLOCATION_ID", "GPUSHARE_SOCKET", "GPUSHARE_SIMULATED"):
        monkeypatch.delenv(name, raising=False)
    assert actions.status()["state"] == "none"
    for call in (actions.release, actions.request, actions.gpus):
        try:
            call()
        except actions.NoShare as exc:
            assert "GPU share" in str(exc)
        else:
            raise AssertionError(f"{call.__name__} did not refuse")
    monkeypatch.setenv("GPUSHARE_ALLOCATION_ID", "a-0123456789abcdef")
    monkeypatch.setenv("GPUSHARE_SOCKET", str(tmp_path / "nobody.sock"))
    monkeypatch.delenv("GPUSHARE_LEDGER", raising=False)
    status = actions.status()  # no daemon, no interposer in this process: not enforced
    assert status["state"] == "unenforced" and "not enforced here" in status["message"]
    try:
        actions.release()
    except actions.DaemonUnreachable as exc:
        assert "daemon is unreachable" in str(exc) and "shut the kernel down" in str(exc)
    else:
        raise AssertionError("release did not refuse")
    try:
        actions.gpus()
    except actions.DaemonUnreachable as exc:
        assert "nobody.sock" in str(exc)
    else:
        raise AssertionError("gpus did not refuse")


def test_release_with_enforcement_off_goes_to_the_ledger(jupyter_server):
    server = jupyter_server("1xA100", "--GpuShare.enforce=False")
    kernel, alloc = start_kernel(server)
    client = server.client(kernel["id"])
    text = " ".join(client.execute("%gpushare status").split())  # lines wrap between words
    assert "GPU share: unenforced" in text and "not enforced here" in text, text
    text = client.execute("%gpushare release")
    assert f"Released 25–50 % of an A100 ({alloc['id']}" in text, text
    assert server.allocations() == []
    assert client.execute("print(1 + 1)").strip() == "2"
    client.close()


def test_release_from_outside_frees_the_kernels_memory(jupyter_server):
    """DELETE /gpushare/api/allocations/{id}: the interposer's agent notices on its own and frees
    the process's GPU memory; the kernel then reports the share as released."""
    server = jupyter_server("1xA100")
    kernel, alloc = start_kernel(server)
    uuid = alloc["gpus"][0]
    client = server.client(kernel["id"])
    assert "alloc 0" in client.execute(ALLOCATE)
    wait_for(lambda: (gpu_memory_used(server, uuid) or 0) >= 256 * MIB, timeout=10)
    assert server.delete(f"/gpushare/api/allocations/{alloc['id']}").status_code == 204
    wait_for(lambda: gpu_memory_used(server, uuid) == 0, timeout=10)  # nothing ran in the kernel
    text = client.execute("%gpushare status")
    assert "GPU share: released" in text and "released from outside" in text, text
    code = client.execute("print(cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20))")
    assert code.split()[0] == str(CUDA_ERROR_NOT_PERMITTED)
    # the refused call explains itself in the cell's output (issue 24, item 6)
    assert "gpushare: a GPU call was refused" in code and "was released" in code, code
    client.close()
