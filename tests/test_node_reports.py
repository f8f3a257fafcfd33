"""The controller's view of the nodes' usage reports (``controller/usage.py``, ``NodeReports``):
every user's server polls ``GET /api/usage``; the view is built once per change, not per GET,
and still follows every new report and every report that turns stale."""

from __future__ import annotations

import asyncio
from typing import Any

from jupyter_gpushare.controller.usage import NodeReports, usage_json
from jupyter_gpushare.k8s.usage import CLOCK_SLACK, STALE_INTERVALS


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def report(node: str, at: float, *ids: str, interval: float = 2.0) -> dict[str, Any]:
    return {
        "node": node,
        "time": at,
        "interval_s": interval,
        "allocations": [{"id": i, "memory_used": 1 << 20, "achieved": 0.25} for i in ids],
    }


def test_a_hundred_gets_build_the_view_once_and_a_new_report_is_seen_next() -> None:
    async def main() -> None:
        clock = Clock(1000.0)
        reports = NodeReports(clock=clock)
        reports.put("n1", report("n1", 999.5, "a-1"))
        reports.put("n2", report("n2", 999.8, "a-2"))
        first = await reports.read()
        answers = [usage_json(await reports.read(), {"a-1"}) for _ in range(100)]
        assert reports.builds == 1
        assert all(a == answers[0] for a in answers)
        assert answers[0]["allocations"] == {
            "a-1": {
                "id": "a-1",
                "memory_used": 1 << 20,
                "achieved": 0.25,
                "node": "n1",
                "age_s": 0.5,
            }
        }
        # one new report: the next GET sees it (a new view), then it is cached again
        clock.now += 0.1
        reports.put("n1", report("n1", 1000.1, "a-1", "a-3"))
        after = await reports.read()
        assert after is not first and reports.builds == 2
        assert set(after.allocations) == {"a-1", "a-2", "a-3"}
        assert after.allocations["a-1"]["age_s"] == 0.0
        for _ in range(100):
            assert await reports.read(fresh=True) is after
        assert reports.builds == 2

    asyncio.run(main())


def test_a_node_that_stops_reporting_turns_stale_without_a_new_report() -> None:
    """The cached view is not kept past the moment a report turns stale, nor longer than
    ``max_age`` (the ages it shows stay about right)."""

    async def main() -> None:
        clock = Clock(1000.0)
        reports = NodeReports(clock=clock, max_age=1.0)
        reports.put("n1", report("n1", 1000.0, "a-1"))
        assert (await reports.read()).covers("n1")
        clock.now += 0.9
        assert (await reports.read()).get("a-1")["age_s"] == 0.0  # cached: within max_age
        clock.now += 0.2
        assert (await reports.read()).get("a-1")["age_s"] == 1.1  # rebuilt after max_age
        deadline = 1000.0 + STALE_INTERVALS * 2.0 + CLOCK_SLACK
        clock.now = deadline
        assert (await reports.read()).covers("n1")  # not stale yet at the deadline itself
        builds = reports.builds
        clock.now = deadline + 0.01  # past it, within max_age of the last build
        view = await reports.read()
        assert reports.builds == builds + 1
        assert not view.covers("n1") and view.get("a-1") is None and "n1" in view.stale
        assert "no current usage from node(s) n1" in (view.message or "")

    asyncio.run(main())


def test_with_no_report_the_fallback_is_read_every_time() -> None:
    class Fallback:
        reads = 0

        async def read(self, fresh: bool = False) -> Any:
            Fallback.reads += 1
            return "from the ConfigMaps"

        async def changed(self) -> None:
            pass

    async def main() -> None:
        reports = NodeReports(fallback=Fallback())
        for _ in range(3):
            assert await reports.read() == "from the ConfigMaps"
        assert Fallback.reads == 3 and reports.builds == 0
        reports.fallback = None
        assert "no node daemon has reported" in ((await reports.read()).message or "")

    asyncio.run(main())


def test_a_malformed_or_oversized_report_is_refused_naming_the_field() -> None:
    """A report comes from another pod (a node daemon, token checked first): each malformed part
    is a 400 that names its field, and a report cannot hold more than MAX_ALLOCATIONS entries
    (the request body is bounded by the HTTP server as well)."""
    import pytest

    from jupyter_gpushare.controller.errors import ControllerError
    from jupyter_gpushare.controller.usage import MAX_ALLOCATIONS, check_report
    from jupyter_gpushare.k8s.usage import FORMAT

    good = {"format": FORMAT, "node": "n1", "time": 1.0, "allocations": [{"id": "a-1"}]}
    assert check_report("n1", good) is good
    bad: list[tuple[Any, str]] = [
        (["not", "an", "object"], "body"),
        ({**good, "format": 99}, "format"),
        ({**good, "node": "n2"}, "node"),  # a report for another node than the path's
        ({**good, "time": "soon"}, "time"),
        ({**good, "allocations": [{"id": "a"}] * (MAX_ALLOCATIONS + 1)}, "allocations"),
        ({**good, "allocations": "a-1"}, "allocations"),
        ({**good, "allocations": [{"id": 7}]}, "allocations[].id"),
        ({**good, "allocations": [None]}, "allocations[].id"),
        ({**good, "gpus": {"GPU-1": {}}}, "gpus"),
    ]
    for document, field in bad:
        with pytest.raises(ControllerError) as refused:
            check_report("n1", document)
        assert refused.value.status == 400 and refused.value.to_json()["field"] == field, (
            field,
            refused.value.to_json(),
        )
        assert len(refused.value.message) < 300  # the value is shown shortened, not echoed whole


def test_the_view_is_what_view_of_makes_of_the_latest_reports() -> None:
    """Reports replaced node by node (allocations come and go, intervals differ, clocks run
    ahead or behind, nodes stop reporting): after every step the view built from the nodes'
    parts equals k8s/usage.view_of over the latest reports (ages, stale nodes, message), and a
    user's GET answers what filtering the whole view would."""
    import random

    from jupyter_gpushare.k8s.usage import NodeUsage, view_of

    async def main() -> None:
        rng = random.Random(7)
        clock = Clock(5000.0)
        reports = NodeReports(clock=clock)
        latest: dict[str, dict[str, Any]] = {}
        for step in range(300):
            clock.now += rng.choice((0.0, 0.05, 0.5, 3.0))
            node = f"n{rng.randrange(12)}"
            ids = [f"{node}-a{i}" for i in range(8) if rng.random() < 0.5]
            at = clock.now - rng.choice((0.0, 0.3, 1.0, 7.9, 9.0, 20.0, -3.0))
            latest[node] = report(node, at, *ids, interval=rng.choice((1.0, 2.0, 5.0)))
            reports.put(node, latest[node])
            if step % 3:
                continue
            view = await reports.read(fresh=True)
            want = view_of([NodeUsage(n, d, clock.now) for n, d in latest.items()])
            assert dict(view.allocations) == dict(want.allocations), step
            assert len(view.allocations) == len(want.allocations)
            assert (view.nodes, view.stale, view.message) == (want.nodes, want.stale, want.message)
            assert view.get("n99-a0") is None and view.get(f"{node}-a9") is None
            allowed = set(rng.sample(sorted(want.allocations) or ["x"], 1)) | {"n0-a1", "nope"}
            assert usage_json(view, allowed) == usage_json(want, allowed)
            assert usage_json(view, None) == usage_json(want, None)

    asyncio.run(main())


def test_reports_between_gets_are_coalesced_within_the_bound() -> None:
    """500 reports with a GET after each, all within ``coalesce`` seconds: one view. The next
    GET after the bound shows the newest report; ``fresh`` (a resize's check) shows it at
    once."""

    async def main() -> None:
        clock = Clock(1000.0)
        reports = NodeReports(clock=clock, coalesce=0.1)
        for n in range(100):
            reports.put(f"n{n}", report(f"n{n}", 1000.0, f"a-{n}"))
        first = await reports.read()
        assert reports.builds == 1 and len(first.allocations) == 100
        for i in range(500):
            clock.now = 1000.0 + i * 0.0001  # 500 reports in 50 ms
            reports.put(f"n{i % 100}", report(f"n{i % 100}", clock.now, f"a-{i % 100}", f"b-{i}"))
            assert await reports.read() is first
        assert reports.builds == 1 and first.get("b-499") is None
        assert (await reports.read(fresh=True)).get("b-499") is not None  # fresh: at once
        assert reports.builds == 2
        reports.put("n0", report("n0", clock.now, "c-1"))
        clock.now += 0.1  # the bound: the next GET builds again and has the newest report
        newest = await reports.read()
        assert reports.builds == 3 and newest.get("c-1") is not None
        assert newest.get("b-400") is None  # n0's earlier report was replaced

    asyncio.run(main())
