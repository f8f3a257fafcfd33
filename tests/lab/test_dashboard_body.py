"""The dashboard's body (``dashboard_handlers.dashboard``), pure: what a viewer sees of a ledger
many servers share, and the GPU history outliving a release (issue 24, item 3): a GPU that showed
its shares' use for the last minute keeps showing it after one share is released, to the viewers
who saw that share whole (and to no one else). The browser test is test_share_flow.py; the REST
answers of a real server are in test_dashboard_api.py."""

from __future__ import annotations

import json
from typing import Any

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.serverext.dashboard_handlers import HISTORY_S, UsageHistory, dashboard
from jupyter_gpushare.share import ShareSpec
from jupyter_gpushare.usage import UsageView

GPU = Gpu(node="n1", uuid="GPU-1", index=0, name="NVIDIA A100", type="A100", memory=80 << 30)


def share(aid: str, user: str, limit: float = 1.0, **extra: Any) -> Allocation:
    """A kernel's share of 0.25 (up to ``limit``) and 20 GiB of ``GPU``."""
    return Allocation(
        id=aid,
        node="n1",
        gpus=("GPU-1",),
        spec=ShareSpec.from_mapping({"gpu_request": 0.25, "gpu_limit": limit}),
        memory=20 << 30,
        kernel_id=f"k-{aid}",
        user=user,
        extra=extra,
    )


def test_release_keeps_the_gpus_history() -> None:
    mine, theirs = share("a-mine", "me"), share("a-theirs", "them")
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


def test_shared_ledger_hides_other_servers_even_from_an_admin_unless_configured() -> None:
    """The body (pure): on a ledger many servers share, another server's share is capacity only
    for everyone unless the admin may see other servers (``show_other_servers``); a share the
    node agent redacted is never anyone's own."""

    def on(aid: str, server: str, **extra: Any) -> Allocation:
        return share(aid, f"user-{aid}", 0.5, k8s_server=server, path=f"{aid}.ipynb", **extra)

    records = [
        on("a-mine", "me"),
        on("a-theirs", "them"),
        on("a-red", "me", redacted=True),
    ]
    usage = UsageView("kubernetes", {"a-theirs": {"achieved_share": 0.2, "memory_used": 1}})

    history = [
        (100.0, {"a-mine": 0.25, "a-theirs": 0.5}),
        (102.0, {"a-mine": 0.3, "a-theirs": 0.5}),
    ]

    def body(admin: bool, show_others: bool) -> dict[str, Any]:
        here = lambda a: a.extra.get("k8s_server") == "me"  # noqa: E731
        return dashboard(
            [GPU],
            records,
            usage,
            admin=admin,
            own=lambda a: here(a) and not a.extra.get("redacted"),
            visible=(lambda _a: True) if show_others else here,
            paths={},
            simulated=False,
            history=history,
        )

    def ids(b: dict[str, Any]) -> list[str | None]:
        return sorted(s.get("id") or "-" for s in b["gpus"][0]["shares"])

    assert ids(body(admin=False, show_others=True)) == ["-", "-", "a-mine"]
    assert ids(body(admin=True, show_others=False)) == ["-", "a-mine", "a-red"]
    assert ids(body(admin=True, show_others=True)) == ["a-mine", "a-red", "a-theirs"]
    hidden = json.dumps(body(admin=True, show_others=False))
    assert "user-a-theirs" not in hidden and "a-theirs.ipynb" not in hidden
    assert body(admin=False, show_others=False)["gpus"][0]["free_request"] == 0.25
    # history: a viewer sees the use over time of what it sees whole, summed per GPU
    user_view = body(admin=False, show_others=False)["history"]
    assert user_view["shares"] == {"a-mine": [[100.0, 0.25], [102.0, 0.3]]}
    assert user_view["gpus"]["GPU-1"] == [[100.0, 0.25], [102.0, 0.3]]
    admin_view = body(admin=True, show_others=True)["history"]
    assert admin_view["gpus"]["GPU-1"] == [[100.0, 0.75], [102.0, 0.8]]
