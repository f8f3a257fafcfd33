"""AgentLedger sends a record it proposes unchanged as ``{"id", "keep": true}`` (a small
compare-and-swap), decided from the ledger view it keeps for the next change (``_last``), with
no second record of what it saw: what the agent last showed for that node goes by its id, a new
or changed record, another node's, or any record once the view is forgotten goes in full."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.share import ShareSpec


def _allocation(i: int, node: str = "n1") -> Allocation:
    return Allocation(
        id=f"a-{i:016x}",
        node=node,
        gpus=(f"GPU-{node}-0",),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5),
        memory=1 << 30,
    )


def test_unchanged_records_go_by_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ledger = AgentLedger(tmp_path / "agent.sock")
    sent: list[dict[str, Any]] = []

    async def request(message: dict[str, Any]) -> dict[str, Any]:
        sent.append(message)
        return {"ok": True, "swapped": True, "version": message["version"] + 1}

    ledger.request = request  # type: ignore[method-assign]
    shown = [_allocation(1), _allocation(2), _allocation(3, node="n2")]
    snap = ledger._remember(
        {"allocations": [a.to_json() for a in shown], "versions": {"n1": 4, "n2": 9}}
    )
    one, two, elsewhere = snap.allocations
    changed = replace(two, memory=2 << 30)
    new = _allocation(4)
    assert asyncio.run(ledger.compare_and_swap("n1", 4, [one, changed, new]))
    proposed = sent[-1]["allocations"]
    assert proposed[0] == {"id": one.id, "keep": True}
    assert proposed[1] == changed.to_json() and proposed[2] == new.to_json()
    # the view after the swap holds what was proposed: all three go by id next time
    assert asyncio.run(ledger.compare_and_swap("n1", 5, [one, changed, new]))
    assert sent[-1]["allocations"] == [{"id": a.id, "keep": True} for a in (one, changed, new)]
    # another node's record is not kept for this node; a forgotten view keeps nothing
    asyncio.run(ledger.compare_and_swap("n1", 6, [elsewhere]))
    assert sent[-1]["allocations"] == [elsewhere.to_json()]
    ledger.forget_snapshot()
    asyncio.run(ledger.compare_and_swap("n1", 7, [one]))
    assert sent[-1]["allocations"] == [one.to_json()]
