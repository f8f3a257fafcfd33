"""Idle-GPU reclaim: the policy (pure) and warn-then-release in a real server on the simulator."""

from __future__ import annotations

import json
from pathlib import Path

from support import add_kernelspec, wait_for
from test_resize import BUSY

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.reclaim import RELEASE, WARN, WITHDRAW, ReclaimPolicy, decide
from jupyter_gpushare.share import ShareSpec


def _allocation(owner="kernel", user="ada", warning=None):
    [gpu] = simulated_gpus("1xA100", node="n")
    spec = ShareSpec(gpu_request=0.25, gpu_limit=0.5, gpu_memory=2**30, gpu_type="A100")
    extra = {"reclaim_warning": warning} if warning else {}
    return Allocation(
        id=Allocation.new_id(),
        node="n",
        gpus=(gpu.uuid,),
        spec=spec,
        memory=2**30,
        owner=owner,
        user=user,
        extra=extra,
    )


def test_policy():
    policy = ReclaimPolicy(
        idle_after=60,
        grace=30,
        exempt_users=frozenset({"root"}),
        exempt_profiles=frozenset({"training"}),
    )
    fresh = _allocation()
    assert decide(fresh, 10, policy, set(), now=1000) is None
    assert decide(fresh, 61, policy, set(), now=1000) == WARN
    assert decide(fresh, None, policy, set(), now=1000) is None  # the daemon does not know it
    warned = _allocation(warning={"warned_at": 1000, "release_at": 1030})
    assert decide(warned, 70, policy, set(), now=1010) is None  # in its grace period
    assert decide(warned, 90, policy, set(), now=1030) == RELEASE
    assert decide(warned, 0.5, policy, set(), now=1030) == WITHDRAW  # GPU work again
    assert decide(_allocation(user="root"), 1e6, policy, set(), now=0) is None
    assert decide(fresh, 1e6, policy, {"gpushare-python", "training"}, now=0) is None
    assert decide(_allocation(owner="pool"), 1e6, policy, set(), now=0) is None
    assert decide(_allocation(owner="run"), 1e6, policy, set(), now=0) is None
    off = ReclaimPolicy(idle_after=0, grace=30)
    assert decide(fresh, 1e6, off, set(), now=0) is None
    assert decide(warned, 1e6, off, set(), now=2000) == WITHDRAW


def test_idle_kernel_is_warned_then_released_busy_kernel_keeps_its_share(
    jupyter_server, gpushare_env
):
    config = Path(gpushare_env["JUPYTER_CONFIG_DIR"])
    config.mkdir(parents=True, exist_ok=True)
    (config / "jupyter_server_config.json").write_text(
        json.dumps(
            {
                "GpuShare": {
                    "reclaim_idle_after": 4,
                    "reclaim_grace": 6,
                    "reclaim_interval": 0.5,
                    "reclaim_exempt_profiles": ["gpushare-exempt"],
                }
            }
        )
    )
    add_kernelspec(gpushare_env, "gpushare-exempt", {"gpu_request": 0.25, "gpu_limit": 0.5})
    server = jupyter_server("1xA100")
    daemon = DaemonClient(server.env["GPUSHARE_SOCKET"])
    wait_for(daemon.alive, timeout=30)
    busy = server.start_kernel("gpushare-python")
    busy_client = server.client(busy["id"])
    busy_client.execute(BUSY)  # busy from (nearly) its first second
    idle = server.start_kernel("gpushare-python")
    exempt = server.start_kernel("gpushare-exempt")
    ids = {a["kernel_id"]: a["id"] for a in server.allocations()}
    idle_client = server.client(idle["id"])

    def warned():
        return {a["kernel_id"] for a in server.get("/gpushare/api/reclaim").json()["warned"]}

    assert wait_for(warned, timeout=30) == {idle["id"]}
    [mine] = daemon.status(ids[idle["id"]])["allocations"]
    assert "has not used its GPU share" in mine["reclaim_warning"]["message"]
    assert mine["idle_s"] >= 4
    out = idle_client.execute("print('cell ran')")  # the next cell shows the warning
    assert "has not used its GPU share" in out and "cell ran" in out
    assert "has not used" not in idle_client.execute("1 + 1")  # once per warning
    shown = idle_client.execute(  # and the panel shows it
        "from jupyter_gpushare.notebook.panel import GpuPanel\n"
        "p = GpuPanel(); p.refresh(); print(p.message.value); p.close()"
    )
    assert 'data-field="reclaim_warning"' in shown and "has not used its GPU share" in shown

    gone = wait_for(
        lambda: ids[idle["id"]] not in {a["id"] for a in server.allocations()}, timeout=30
    )
    assert gone
    told = daemon.status(ids[idle["id"]])  # what a kernel that ran no cell meanwhile reads
    assert told["error"] == "unknown_allocation" and "message" in told["reclaimed"]
    out = idle_client.execute("print('still here')")  # the kernel lives on
    assert "still here" in out and "released by idle-GPU reclaim" in out
    # as after the panel's Release: a new share can be reserved for the kernel's restart
    reserved = idle_client.execute(
        "from jupyter_gpushare.notebook import actions; "
        "print(actions.request(gpu_request=0.25)['allocation']['id'])"
    ).strip()
    assert reserved in {a["id"] for a in server.allocations()}
    holders = {a["kernel_id"] for a in server.allocations()}
    assert busy["id"] in holders and exempt["id"] in holders  # busy and exempt keep theirs
    assert not warned() & {busy["id"], exempt["id"]}
    [kept] = daemon.status(ids[busy["id"]])["allocations"]
    assert kept["achieved_share"] > 0.3 and kept["idle_s"] < 1
    busy_client.execute("stop.set(); spinner.join()")
    busy_client.close()
    idle_client.close()
    log = server.log_path.read_text()
    assert "idle GPU share" in log and "reclaimed idle GPU share" in log  # logged for admins
