"""Warm-pool kernels are given back before a user waits (issue 27, DESIGN box 13).

A start that may wait in the queue and does not fit now first has ready warm kernels of another
shape shut down, as many as let it fit (``pools.manager.warm_to_give_back``, pure; checked on
plain data first), and no pool refills while it waits. Then in a real jupyter_server with the
PoolKernelManager on one simulated A100.
"""

from __future__ import annotations

from typing import Any

from support import wait_for
from test_pools import MANAGER, pool_view, ready_ids, write_config

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import Policy
from jupyter_gpushare.pools.manager import warm_to_give_back
from jupyter_gpushare.share import ShareSpec

GiB = 1 << 30
A100 = [Gpu("n1", f"GPU-{i}", i, "NVIDIA A100", "A100", 80 * GiB) for i in range(2)]


def share(name: str, gpu: int, request: float, owner: str = "kernel") -> Allocation:
    return Allocation(
        id=f"a-{name}",
        node="n1",
        gpus=(f"GPU-{gpu}",),
        spec=ShareSpec(gpu_request=request, gpu_limit=request, gpu_type="A100"),
        memory=int(request * 80 * GiB),
        owner=owner,
        kernel_id=name,
    )


def test_the_fewest_warm_shares_that_make_room_largest_first() -> None:
    held = [
        share("user1", 0, 0.5),
        share("warm-small", 0, 0.25, "pool"),
        share("warm-big", 0, 0.25, "pool"),
        share("user2", 1, 0.75),
        share("warm-other", 1, 0.25, "pool"),
    ]
    warm = {"warm-small", "warm-big", "warm-other"}
    half = ShareSpec(gpu_request=0.5, gpu_limit=0.5, gpu_type="A100")
    # 0.5 fits on GPU 0 once both of its warm shares go; GPU 1's cannot make room for it
    given = warm_to_give_back(A100, held, half, Policy(), warm)
    assert sorted(a.kernel_id for a in given) == ["warm-big", "warm-small"]
    # 0.25 fits once one warm share goes: one, not three
    quarter = ShareSpec(gpu_request=0.25, gpu_limit=0.25, gpu_type="A100")
    assert len(warm_to_give_back(A100, held, quarter, Policy(), warm)) == 1
    # it fits now: nothing given back
    assert warm_to_give_back(A100, held[:1], half, Policy(), warm) == []
    # claimed kernels (not in `warm`) are users' now: never given back
    assert warm_to_give_back(A100, held, half, Policy(), set()) == []
    # even all warm shares leave no room for a whole GPU: all of them go (it waits for less)
    whole = ShareSpec(gpu_request=1.0, gpu_limit=1.0, gpu_type="A100")
    assert len(warm_to_give_back(A100, held, whole, Policy(), warm)) == 3
    # of a type it cannot use: none
    t4 = ShareSpec(gpu_request=1.0, gpu_limit=1.0, gpu_type="T4")
    assert warm_to_give_back(A100, held, t4, Policy(), warm) == []


def test_a_start_that_would_wait_gets_the_warm_kernels_share(
    jupyter_server: Any, gpushare_env: dict[str, str]
) -> None:
    half = {"gpu_request": 0.5, "gpu_limit": 0.5}
    write_config(
        gpushare_env,
        {
            "pools": [{"name": "half", "kernelspec": "gpushare-python", "share": half, "size": 1}],
            "reclaim_idle_after": 0,
        },
    )
    server = jupyter_server("1xA100", MANAGER)
    [warm] = ready_ids(server, 1)

    def start(request: float, limit: float, **more: Any) -> Any:
        body = {"name": "gpushare-python", "share": {"gpu_request": request, "gpu_limit": limit}}
        return server.request("POST", "/gpushare/api/kernels", json={**body, **more})

    assert start(0.25, 0.25).status_code == 201  # another shape: a cold start, 0.25 left
    # 0.5 (limit 1, not the pool's shape) without a wait: refused, the warm kernel kept
    refused = start(0.5, 1.0)
    assert refused.status_code == 409 and refused.json()["error"] == "no_fit", refused.text
    assert pool_view(server)["ready"] == 1
    # the same start asking to wait: the warm kernel gives its share back, the start fits
    waited = start(0.5, 1.0, wait=30)
    assert waited.status_code == 201, waited.text
    assert waited.json()["allocation"]["gpu_request"] == 0.5
    view = pool_view(server)
    assert view["given_back"] == 1 and view["ready"] == 0, view
    assert warm not in {a["kernel_id"] for a in server.allocations()}
    # after the start the pool refills again where there is room: here none (0.75 + 0.5 > 1)
    wait_for(lambda: pool_view(server)["refill_errors"], 30)
    assert pool_view(server)["ready"] == 0
