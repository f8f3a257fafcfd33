"""The system agent's ledger path kept short (issue 12, performance) without giving up a promise.

:class:`AgentLedger` keeps one connection to the agent and starts a change from the ledger its
last compare-and-swap reply carried; the agent splices cached encoded records into its replies.
Each shortcut is checked here against what it could break: a kept connection is never used by
another identity (a forked child that became another user) or after the agent was replaced; a
change started from a stale view still never overwrites anyone, and a "not found" or "nothing
fits" is only answered from a fresh view; what a user sees of others stays redacted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace

import pytest
from test_system_agent import ALICE, BOB, Agent, agent_dir, as_user, result_of, unix_user

from jupyter_gpushare.daemon import wire
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.placement import PlacementRefused, allocate
from jupyter_gpushare.share import ShareSpec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)")


@pytest.fixture
def system_agent() -> Iterator[Agent]:
    found = Agent(agent_dir())
    yield found
    found.stop()
    shutil.rmtree(found.dir, ignore_errors=True)


def test_encoded_values_are_spliced_into_one_json_line() -> None:
    line = wire.encode({"ok": True, "a": wire.Encoded([b'{"x":1}', b"2"]), "v": {"n": 1}})
    assert wire.decode(line) == {"ok": True, "v": {"n": 1}, "a": [{"x": 1}, 2]}
    assert wire.decode(wire.encode({"a": wire.Encoded([])})) == {"a": []}
    assert line.endswith(b"\n") and line.count(b"\n") == 1


def _kept_fd(ledger: AgentLedger) -> int:
    conn = ledger._kept
    assert conn is not None, "no kept connection"
    return conn.sock.fileno()


async def _view_matches_the_agents(ledger: AgentLedger) -> None:
    """The view ``ledger`` built from its last swap's reply is what a snapshot shows."""
    assert ledger._last is not None
    built = ledger._last[0]
    fresh = await ledger.snapshot()
    assert sorted(built.allocations, key=lambda a: a.id) == sorted(
        fresh.allocations, key=lambda a: a.id
    )
    assert dict(built.versions) == dict(fresh.versions)


def test_a_kept_connection_serves_many_changes_and_survives_an_agent_restart(
    system_agent: Agent,
) -> None:
    async def go() -> None:
        ledger = AgentLedger(system_agent.socket)
        gpus = await ledger.gpus()
        spec = ShareSpec(0.1, 0.1)
        made = await allocate(ledger, spec, gpus, None, owner="run", server_pid=os.getpid())
        kept = _kept_fd(ledger)
        for _ in range(5):  # one connection for all of them
            extra = await allocate(ledger, spec, gpus, None, owner="run", server_pid=os.getpid())
            assert await ledger.release(extra.id) == extra
            assert _kept_fd(ledger) == kept
        await _view_matches_the_agents(ledger)
        # the agent is replaced (a rollout): the next call finds the kept connection closed
        system_agent.stop()
        system_agent.__init__(system_agent.dir)  # a new agent on the same socket and ledger
        assert (await ledger.get(made.id)).id == made.id
        assert await ledger.release(made.id) is not None
        assert (await ledger.snapshot()).find(made.id) is None

    asyncio.run(go())


def test_a_stale_view_never_overwrites_and_never_answers_not_found(system_agent: Agent) -> None:
    async def go() -> None:
        mine, other = AgentLedger(system_agent.socket), AgentLedger(system_agent.socket)
        gpus = await mine.gpus()

        async def place(ledger: AgentLedger, request: float) -> Allocation:
            spec = ShareSpec(request, request)
            return await allocate(ledger, spec, gpus, None, owner="run", server_pid=os.getpid())

        first = await place(mine, 0.3)
        second = await place(other, 0.3)  # behind ``mine``'s back: its view is stale now
        assert mine._last is not None and mine._last[0].find(second.id) is None
        # a release of what ``mine`` has not seen is found (re-read), not answered "gone"
        assert await mine.release(second.id) == second
        third = await place(other, 0.3)
        # an update of what ``mine`` has not seen is found too, and applied
        changed = await mine.update(third.id, lambda a, _others: replace(a, state="active"))
        assert changed.state == "active"
        fourth = await place(other, 0.4)  # the GPU is full now: 0.3 + 0.3 + 0.4
        # from its stale view 0.1 still fits; the compare-and-swap refuses that view, and the
        # refusal comes from a fresh one
        with pytest.raises(PlacementRefused):
            await place(mine, 0.1)
        snap = await other.snapshot()
        assert {a.id for a in snap.allocations} == {first.id, third.id, fourth.id}
        assert snap.find(third.id).state == "active"  # type: ignore[union-attr]
        assert sum(a.request for a in snap.allocations) <= 1.0 + 1e-9

    asyncio.run(go())


def test_a_forked_child_that_became_another_user_never_uses_the_parents_connection(
    system_agent: Agent,
) -> None:
    alice, bob = unix_user(ALICE), unix_user(BOB)

    async def parent_side() -> AgentLedger:
        ledger = AgentLedger(system_agent.socket)
        gpus = await ledger.gpus()
        await allocate(ledger, ShareSpec(0.2, 0.2), gpus, None, owner="run", server_pid=os.getpid())
        return ledger

    root_ledger = asyncio.run(parent_side())  # root holds a kept connection (an admin's)
    assert root_ledger._kept is not None

    async def child_side(ledger: AgentLedger) -> tuple[str, list[str]]:
        gpus = await ledger.gpus()
        made = await allocate(
            ledger, ShareSpec(0.1, 0.1), gpus, None, owner="kernel", server_pid=os.getpid()
        )
        await _view_matches_the_agents(ledger)  # others' records redacted in both
        snap = await ledger.snapshot()
        return made.user, [a.owner for a in snap.allocations if a.id != made.id]

    for user in (alice, bob):  # the same ledger object, inherited through fork, then setuid
        outcome = result_of(as_user(user, child_side, root_ledger))
        assert outcome[0] == "ok", outcome
        made_by, others = outcome[1]
        assert made_by == user.pw_name  # the agent saw the child's uid, not root's
        assert "run" not in others and set(others) <= {"other"}  # root's share: redacted
