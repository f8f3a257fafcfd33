"""Kernel pools: config validation (pure) and warm hand-over in a real jupyter_server."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import JupyterServer, wait_for

from jupyter_gpushare.pools.binding import bind_code, session_changes
from jupyter_gpushare.pools.config import PoolConfigError, parse_pools

MANAGER = "--ServerApp.kernel_manager_class=jupyter_gpushare.pools.PoolKernelManager"
SMALL = {"gpu_request": 0.25, "gpu_limit": 0.5}


def write_config(env: dict[str, str], gpushare: dict[str, Any]) -> None:
    path = Path(env["JUPYTER_CONFIG_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    (path / "jupyter_server_config.json").write_text(json.dumps({"GpuShare": gpushare}))


# -- config ----------------------------------------------------------------------------------


def test_schedule_picks_the_window_size():
    [pool] = parse_pools(
        [
            {
                "name": "small",
                "kernelspec": "gpushare-python",
                "share": SMALL,
                "size": 1,
                "schedule": [
                    {"days": "mon-fri", "hours": "08:00-18:00", "size": 4},
                    {"days": "sat", "hours": "22:00-02:00", "size": 2},
                ],
            }
        ]
    )
    monday = dt.datetime(2026, 11, 16)
    assert pool.target(monday.replace(hour=9)) == 4
    assert pool.target(monday.replace(hour=18)) == 1  # the end is exclusive
    assert pool.target(monday + dt.timedelta(days=5, hours=23)) == 2  # Saturday night
    assert pool.target(monday + dt.timedelta(days=6, hours=1)) == 2  # ... past midnight
    assert pool.target(monday + dt.timedelta(days=6, hours=3)) == 1


@pytest.mark.parametrize(
    ("pools", "words"),
    [
        (
            [{"name": "a", "kernelspec": "k", "share": {"gpu_request": 2}}],
            ["pool 'a'", "share.gpu_request", "2"],
        ),
        ([{"name": "a", "kernelspec": "k", "size": -1}], ["pool 'a'", "size", "0 to 64"]),
        ([{"name": "a", "kernelspec": "k", "sise": 2}], ["unknown key 'sise'"]),
        ([{"name": "a", "kernelspec": "k"}, {"name": "a", "kernelspec": "k"}], ["named 'a'"]),
        (
            [{"name": "a", "kernelspec": "k", "schedule": [{"days": "mo-fr", "size": 1}]}],
            ["schedule[0].days", "mon-fri"],
        ),
        (
            [{"name": "a", "kernelspec": "k", "schedule": [{"hours": "8-18", "size": 1}]}],
            ["schedule[0].hours", "HH:MM-HH:MM"],
        ),
        ([{"name": "a", "kernelspec": "k", "backend": "slurm"}], ["backend", "'local'"]),
    ],
)
def test_bad_pool_config_is_refused_by_name(pools, words):
    with pytest.raises(PoolConfigError) as refused:
        parse_pools(pools)
    for word in words:
        assert word in str(refused.value)


@pytest.mark.parametrize(
    ("pool", "words"),
    [
        (
            {
                "name": "big",
                "kernelspec": "gpushare-python",
                "share": {"gpu_request": 3},
                "size": 1,
            },
            ["Bad config", "pool 'big'", "gpu_request"],
        ),
        (
            {"name": "nospec", "kernelspec": "no-such-spec", "size": 1},
            ["Bad config", "pool 'nospec'", "no kernelspec named 'no-such-spec'"],
        ),
        (
            {"name": "cpu", "kernelspec": "python3", "size": 1},
            ["Bad config", "pool 'cpu'", "does not use the gpushare-provisioner"],
        ),
    ],
)
def test_bad_pool_config_stops_the_server(gpushare_env, pool, words):
    write_config(gpushare_env, {"pools": [pool]})
    server = JupyterServer(gpushare_env, "1xA100", MANAGER)
    with pytest.raises(RuntimeError, match="exited") as failed:
        server.start(timeout=60)
    for word in words:
        assert word in str(failed.value)
    assert server.proc is not None and server.proc.returncode != 0


def test_binding_changes_only_the_session_and_never_the_share():
    launch = {"HOME": "/h", "CUDA_VISIBLE_DEVICES": "GPU-1", "GPUSHARE_ALLOCATION_ID": "a-1"}
    session = {
        "HOME": "/h",
        "JPY_SESSION_NAME": "/w/nb.ipynb",
        "CUDA_VISIBLE_DEVICES": "",
        "GPUSHARE_ALLOCATION_ID": "a-2",
        "LD_PRELOAD": "",
        "EXTRA": "1",
    }
    assert session_changes(launch, session) == {"JPY_SESSION_NAME": "/w/nb.ipynb", "EXTRA": "1"}
    code = bind_code("/w", {"A": "b'c"}, "/w/nb.ipynb")
    namespace: dict[str, Any] = {"get_ipython": lambda: type("S", (), {"user_ns": namespace})()}
    here = os.getcwd()
    try:
        exec(compile(code, "bind", "exec"), namespace)  # our own generated code
        assert os.environ["A"] == "b'c" and namespace["__session__"] == "/w/nb.ipynb"
    finally:
        os.environ.pop("A", None)
        os.chdir(here)


# -- warm hand-over --------------------------------------------------------------------------


def pool_view(server: JupyterServer) -> dict[str, Any]:
    response = server.get("/gpushare/api/pools")
    assert response.status_code == 200, response.text
    [pool] = response.json()["pools"]
    return pool


def ready_ids(server: JupyterServer, count: int) -> list[str]:
    pool = wait_for(lambda: (p := pool_view(server))["ready"] == count and p, timeout=90)
    return [k["kernel_id"] for k in pool["kernels"]]


def test_pool_serves_two_warm_then_cold_and_refills(jupyter_server, gpushare_env):
    write_config(
        gpushare_env,
        {
            "pools": [
                {"name": "small", "kernelspec": "gpushare-python", "share": SMALL, "size": 2},
            ],
            "reclaim_idle_after": 0,
        },
    )
    server = jupyter_server("2xA100", MANAGER)
    warm = ready_ids(server, 2)
    by_id = {a["kernel_id"]: a for a in server.allocations()}
    assert {by_id[k]["owner"] for k in warm} == {"pool"}  # counted against capacity, as pool
    listed = {k["id"] for k in server.get("/api/kernels").json()}
    assert not listed & set(warm)  # unclaimed warm kernels belong to nobody yet
    status = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "status"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.stdout.count("warm pool kernel") == 2, status.stdout + status.stderr

    # 1: a notebook session in a sub-directory gets a warm kernel, bound to the session
    (server.root / "work").mkdir()
    session = server.post(
        "/api/sessions",
        {
            "path": "work/analysis.ipynb",
            "type": "notebook",
            "name": "analysis.ipynb",
            "kernel": {"name": "gpushare-python"},
        },
    )
    assert session.status_code == 201, session.text
    first = session.json()["kernel"]["id"]
    assert first in warm
    # 2: a plain kernel start with the same kernelspec and share is served warm too
    second = server.start_kernel("gpushare-python")["id"]
    assert second in warm and second != first
    # 3: the pool is empty (a refill takes seconds): a normal (cold) start, no error
    third = server.start_kernel("gpushare-python")["id"]
    assert third not in warm

    client = server.client(first)
    seen = json.loads(
        client.execute(
            "import os, json; print(json.dumps([os.getcwd(), os.environ.get('JPY_SESSION_NAME'), "
            "__session__, os.environ['GPUSHARE_ALLOCATION_ID']]))"
        )
    )
    client.close()
    assert seen[0] == str(server.root / "work")
    assert seen[1] == seen[2] == str(server.root / "work" / "analysis.ipynb")
    assert seen[3] == by_id[first]["id"]  # the share it held warm is its share now

    owners = {a["kernel_id"]: a["owner"] for a in server.allocations()}
    assert owners[first] == owners[second] == owners[third] == "kernel"
    # the session's notebook is recorded on the claimed share (jupyter gpushare status)
    extras = {a["kernel_id"]: a["extra"] for a in server.allocations()}
    assert extras[first]["notebook"] == str(server.root / "work" / "analysis.ipynb")
    assert "notebook" not in extras[second]  # a plain kernel start: no notebook
    refilled = ready_ids(server, 2)  # the pool refills in the background
    assert not set(refilled) & {first, second, third}
    view = pool_view(server)
    assert view["claimed"] == 2 and view["started"] == 4 and view["refill_errors"] == []
    listed = {k["id"] for k in server.get("/api/kernels").json()}
    assert {first, second, third} <= listed and not listed & set(refilled)
    assert "handed out warm" in server.log_path.read_text()

    # a restart of the handed-out kernel is the user's kernel restarting: same place, same share
    restarted = server.post(f"/api/kernels/{first}/restart")
    assert restarted.status_code == 200, restarted.text
    client = server.client(first)
    again = json.loads(
        client.execute(
            "import os, json; print(json.dumps([os.getcwd(), os.environ.get('JPY_SESSION_NAME'), "
            "os.environ['GPUSHARE_ALLOCATION_ID']]))"
        )
    )
    client.close()
    assert again == seen[:2] + seen[3:]
    [mine] = [a for a in server.allocations() if a["kernel_id"] == first]
    assert mine["owner"] == "kernel" and mine["extra"]["claimed_from_pool"] == "small"


def test_pool_refill_errors_are_shown_and_starts_fall_back(jupyter_server, gpushare_env):
    # 3 warm kernels of 0.5 cannot fit on one GPU: the third is a refill error, not a crash
    write_config(
        gpushare_env,
        {
            "pools": [
                {
                    "name": "half",
                    "kernelspec": "gpushare-python",
                    "share": {"gpu_request": 0.5, "gpu_limit": 1.0},
                    "size": 3,
                },
            ]
        },
    )
    server = jupyter_server("1xA100", MANAGER)
    view = wait_for(lambda: (p := pool_view(server))["refill_errors"] and p, timeout=90)
    assert view["ready"] == 2
    assert "no" in view["refill_errors"][0]["message"]  # the placement refusal, in user words
    # a share the pool does not hold is started normally (and refused normally: GPU is full)
    refused = server.post(
        "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
    )
    assert refused.status_code == 409, refused.text
    # a matching start is served warm even though the GPU is full
    served = server.post(
        "/gpushare/api/kernels",
        {"name": "gpushare-python", "share": {"gpu_request": 0.5, "gpu_limit": 1.0}},
    )
    assert served.status_code == 201, served.text
    assert served.json()["id"] in [k["kernel_id"] for k in view["kernels"]]


def test_the_idle_culler_spares_warm_kernels(jupyter_server, gpushare_env):
    write_config(
        gpushare_env,
        {
            "pools": [
                {"name": "small", "kernelspec": "gpushare-python", "share": SMALL, "size": 1},
            ]
        },
    )
    server = jupyter_server(
        "1xA100",
        MANAGER,
        "--MappingKernelManager.cull_idle_timeout=2",
        "--MappingKernelManager.cull_interval=1",
    )
    [warm] = ready_ids(server, 1)
    claimed = server.start_kernel("gpushare-python")["id"]
    assert claimed == warm
    [refilled] = ready_ids(server, 1)
    # the claimed kernel is an ordinary kernel now: idle, unconnected, it is culled
    wait_for(
        lambda: claimed not in {k["id"] for k in server.get("/api/kernels").json()}, timeout=30
    )
    time.sleep(3)  # well past the idle timeout for the warm one as well
    assert [k["kernel_id"] for k in pool_view(server)["kernels"]] == [refilled]
    assert refilled in {a["kernel_id"] for a in server.allocations()}
    assert "Culling" in server.log_path.read_text()


async def test_the_schedule_grows_and_shrinks_the_pool(gpushare_env, tmp_path, monkeypatch):
    """In-process: jupyter_server's kernel manager with a pool whose schedule is read from a
    clock the test sets (real kernels, real ledger)."""
    from jupyter_client.kernelspec import KernelSpecManager

    from jupyter_gpushare.config import GpuShare
    from jupyter_gpushare.pools.kernel_manager import PoolKernelManager

    for key, value in gpushare_env.items():
        monkeypatch.setenv(key, value)
    GpuShare.clear_instance()
    settings = GpuShare.instance(
        simulate="1xA100",
        enforce=False,
        pools=[
            {
                "name": "sched",
                "kernelspec": "gpushare-python",
                "share": SMALL,
                "size": 1,
                "schedule": [{"days": "mon-fri", "hours": "09:00-17:00", "size": 2}],
            }
        ],
    )
    km = PoolKernelManager(root_dir=str(tmp_path), kernel_spec_manager=KernelSpecManager())
    now = [dt.datetime(2026, 11, 16, 10, 0)]  # a Monday morning: 2
    km.pools.clock = lambda: now[0]

    async def settled(count: int) -> list[str]:
        for _ in range(600):
            [pool] = km.pools.model()
            held = [a for a in await settings.local_ledger().list() if a.owner == "pool"]
            if pool["ready"] == count and pool["starting"] == 0 and len(held) == count:
                assert pool["target"] == count
                return [k["kernel_id"] for k in pool["kernels"]]
            await asyncio.sleep(0.1)
        raise AssertionError(f"the pool did not settle at {count}: {km.pools.model()}")

    km.pools.start()
    try:
        morning = await settled(2)
        now[0] = dt.datetime(2026, 11, 16, 20, 0)  # evening: 1
        km.pools.wake()
        evening = await settled(1)
        assert set(evening) < set(morning)  # one stopped (and its share released), one kept
        for _ in range(300):  # its process is shut down after its share is released
            if len(km.list_kernel_ids()) == 1:
                break
            await asyncio.sleep(0.1)
        assert km.list_kernel_ids() == evening
    finally:
        try:
            await km.shutdown_all(now=True)
        finally:  # the next test in this process must not find these settings
            GpuShare.clear_instance()
