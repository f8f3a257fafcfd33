"""The dashboard's GPU history outlives a release (issue 24, item 3), pure: a GPU that showed its
shares' use for the last minute keeps showing it after one share is released, to the viewers who
saw that share whole (and to no one else). The browser test is test_share_flow.py."""

from __future__ import annotations

from typing import Any

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.serverext.dashboard_handlers import HISTORY_S, UsageHistory, dashboard
from jupyter_gpushare.share import ShareSpec
from jupyter_gpushare.usage import UsageView

GPU = Gpu(node="n1", uuid="GPU-1", index=0, name="NVIDIA A100", type="A100", memory=80 << 30)


def _share(aid: str, user: str) -> Allocation:
    return Allocation(
        id=aid,
        node="n1",
        gpus=("GPU-1",),
        spec=ShareSpec.from_mapping({"gpu_request": 0.25, "gpu_limit": 1.0}),
        memory=20 << 30,
        kernel_id=f"k-{aid}",
        user=user,
    )


def test_release_keeps_the_gpus_history() -> None:
    mine, theirs = _share("a-mine", "me"), _share("a-theirs", "them")
    history = UsageHistory()
    for t in range(100, 160, 2):  # a minute at 100 %: both busy
        busy = {"a-mine": {"achieved_share": 0.6}, "a-theirs": {"achieved_share": 0.4}}
        view = UsageView("daemon", busy, nodes=frozenset({"n1"}))
        history.add(view, [mine, theirs], now=float(t))
    # a-mine released: gone from the ledger and from the daemon's usage
    history.add(
        UsageView("daemon", {"a-theirs": {"achieved_share": 0.0}}, nodes=frozenset({"n1"})),
        [theirs],
        now=160.0,
    )

    def gpu_history(admin: bool, own: Any) -> list[list[float]]:
        body = dashboard(
            [GPU],
            [theirs],
            UsageView("daemon", {}, nodes=frozenset({"n1"})),
            admin=admin,
            own=own,
            paths={},
            simulated=True,
            history=list(history.samples),
            past=history.records,
            now=160.0,
        )
        return body["history"]["gpus"]["GPU-1"]

    owner = gpu_history(admin=False, own=lambda a: a.user == "me")
    assert max(v for _t, v in owner) == 0.6  # before: [] (the released share's past was gone)
    admin = gpu_history(admin=True, own=lambda a: a.user == "me")
    assert max(v for _t, v in admin) == 1.0  # both shares, at 100 % for the minute
    other = gpu_history(admin=False, own=lambda a: a.user == "them")
    assert max(v for _t, v in other) == 0.4  # never another user's released share

    # bounded: once out of the window, a released share's record goes too
    history.add(
        UsageView("daemon", {}, nodes=frozenset({"n1"})), [theirs], now=160.0 + HISTORY_S + 1
    )
    assert "a-mine" not in history.records
