"""The agent owns the ledger: one user's ledger traffic cannot make another's start fail
(issue 23, item 6).

Two real Unix users against one ``jupyter gpushare daemon --system`` (see
``tests/test_system_agent.py`` for how). bob floods the agent with compare-and-swaps on four
connections (no-op swaps on two, real changes of his own record on the other two); meanwhile
alice starts shares and resizes them the way her Jupyter server does (``placement.allocate`` and
``ledger.update`` through :class:`~jupyter_gpushare.ledger.agent.AgentLedger`). Every one of her
requests must succeed, each within a bound that holds on a loaded 2-core machine.

Before the agent took intents (reserve, release, update of one record) and served writers in a
fair order, alice's starts answered ``busy: could not record the allocation after 200 tries``.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import time
from typing import Any

import pytest
from test_system_agent import NODE, Agent, agent, as_user, result_of, unix_user  # noqa: F401

from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.placement import allocate
from jupyter_gpushare.resize import resized
from jupyter_gpushare.share import ShareSpec

ALICE, BOB = "gsalice", "gsbob"
#: how long one of alice's requests may take while bob floods (a loaded 2-core machine; the
#: issue saw ~4 s per failed start and 4.3 s per 503 PATCH)
BOUND_S = 2.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)")


def _line(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the agent closed the connection")
        data += chunk
    reply = json.loads(data)
    assert isinstance(reply, dict)
    return reply


def flood(path: str, node: str, seconds: float, real: bool, counter: Any) -> int:
    """One of bob's connections: compare-and-swap as fast as the agent answers. ``real``: each
    swap changes bob's own record (a field of its ``extra``); else a swap that changes nothing."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    snap = _line(sock, {"op": "ledger.snapshot"})
    version = int(snap["versions"].get(node, 0))
    records = snap["allocations"]
    mine = next(a for a in records if not a["extra"].get("redacted"))
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sent += 1
        allocations: list[dict[str, Any]] = [
            {"id": a["id"], "keep": True} for a in records if a["id"] != mine["id"]
        ]
        if real:
            mine = {**mine, "extra": {**mine["extra"], "flood": sent}}
            allocations.append(mine)
        else:
            allocations.append({"id": mine["id"], "keep": True})
        reply = _line(
            sock,
            {
                "op": "ledger.cas",
                "node": node,
                "version": version,
                "allocations": allocations,
                "snapshot": True,
            },
        )
        if reply.get("ok") is False:
            if reply.get("error") == "busy":  # the agent's own bound on this user: keep going
                continue
            raise AssertionError(f"bob's swap refused: {reply}")
        if "versions" in reply:  # lost: the ledger as it is now
            version = int(reply["versions"].get(node, 0))
            records = reply["allocations"]
            mine = next(a for a in records if a["id"] == mine["id"])
        elif isinstance(reply.get("version"), int):
            version = reply["version"]
    with counter.get_lock():
        counter.value += sent
    return sent


async def bob_floods(path: str, node: str, seconds: float, counter: Any) -> int:
    ledger = AgentLedger(path)
    inventory = await ledger.gpus()
    await allocate(
        ledger, ShareSpec(0.05, 0.05), inventory, None, owner="run", server_pid=os.getpid()
    )
    loop = asyncio.get_running_loop()
    sent = await asyncio.gather(
        *(
            loop.run_in_executor(None, flood, path, node, seconds, i % 2 == 1, counter)
            for i in range(4)
        )
    )
    return sum(sent)


async def alice_starts(path: str, starts: int, resizes: int) -> dict[str, Any]:
    """Starts and resizes as alice's server makes them; each one's time, or its failure."""
    ledger = AgentLedger(path)
    inventory = await ledger.gpus()
    times: list[float] = []
    failures: list[str] = []
    made = []
    for _ in range(starts):
        began = time.monotonic()
        try:
            made.append(
                await allocate(
                    ledger,
                    ShareSpec(0.1, 0.1),
                    inventory,
                    None,
                    owner="kernel",
                    server_pid=os.getpid(),
                )
            )
        except Exception as exc:
            failures.append(f"start: {type(exc).__name__}: {exc}")
        times.append(time.monotonic() - began)
    for i in range(resizes):
        if not made:
            break
        target = made[i % len(made)]
        change = {"gpu_request": 0.05 if i % 2 == 0 else 0.1, "gpu_limit": 0.1}
        began = time.monotonic()
        try:
            await ledger.update(
                target.id, lambda cur, others, c=change: resized(cur, others, inventory, c, None)
            )
        except Exception as exc:
            failures.append(f"resize: {type(exc).__name__}: {exc}")
        times.append(time.monotonic() - began)
    for a in made:
        await ledger.release(a.id)
    return {"times": times, "failures": failures}


def test_one_users_ledger_flood_does_not_fail_anothers_starts(agent) -> None:  # noqa: F811
    alice, bob = unix_user(ALICE), unix_user(BOB)
    found: Agent = agent(simulate="2xA100")
    path = str(found.socket)
    counter = multiprocessing.get_context("fork").Value("i", 0)
    flooding = as_user(bob, bob_floods, path, NODE, 8.0, counter)
    time.sleep(1.5)  # bob's share placed, his four connections swapping
    outcome = result_of(as_user(alice, alice_starts, path, 6, 20), 60)
    flooded = result_of(flooding, 60)
    assert flooded[0] == "ok", flooded
    assert outcome[0] == "ok", outcome
    result = outcome[1]
    assert result["failures"] == [], result["failures"]
    assert len(result["times"]) == 26
    slowest = max(result["times"])
    assert slowest < BOUND_S, f"alice's slowest request took {slowest:.2f} s: {result['times']}"
    assert flooded[1] > 200, f"bob sent only {flooded[1]} swaps"


def test_the_writer_serves_uids_in_turn_bounds_each_and_refuses_a_flood() -> None:
    """FairWriter alone: bob's 20 waiting writes do not go ahead of alice's one (she is served
    within one of his turns); a uid over its rate waits its turn, the agent's own first; past
    ``waiting`` queued writes a uid is refused (Busy), others are not."""
    from jupyter_gpushare.daemon.intents import Busy, FairWriter

    async def go() -> None:
        writer = FairWriter(rate=1000.0, burst=1000.0, waiting=25)
        done: list[str] = []

        def job(name: str) -> Any:
            async def run() -> str:
                done.append(name)
                await asyncio.sleep(0)
                return name

            return run

        bobs = [asyncio.ensure_future(writer.run(1002, job(f"bob{i}"))) for i in range(20)]
        await asyncio.sleep(0)
        alices = asyncio.ensure_future(writer.run(1001, job("alice")))
        own = asyncio.ensure_future(writer.run(None, job("agent")))
        await asyncio.gather(*bobs, alices, own)
        # before alice: the write running when she asked, and at most one turn of bob's
        assert sum(1 for d in done[: done.index("alice")] if d.startswith("bob")) <= 2, done
        assert done.index("agent") <= 1, done  # the agent's own go first
        # the bound on waiting writes: bob's 26th is refused, alice's first is not
        writer2 = FairWriter(rate=1000.0, burst=1000.0, waiting=25)
        gate = asyncio.Event()

        async def blocked() -> str:
            await gate.wait()
            return "x"

        held = [asyncio.ensure_future(writer2.run(1002, blocked)) for _ in range(40)]
        await asyncio.sleep(0.01)
        refused = [f for f in held if f.done() and isinstance(f.exception(), Busy)]
        assert 40 - 25 - 2 <= len(refused) <= 40 - 25, len(refused)
        alice_turn = asyncio.ensure_future(writer2.run(1001, job("alice2")))
        await asyncio.sleep(0.01)
        assert not alice_turn.done()  # waiting for her turn, not refused
        gate.set()
        await asyncio.wait_for(
            asyncio.gather(*(f for f in held if f not in refused), alice_turn), 10
        )
        # the rate: 20 writes of one uid at 100/s with a burst of 5 take >= 0.1 s
        slow = FairWriter(rate=100.0, burst=5.0)
        began = time.monotonic()
        await asyncio.gather(*(slow.run(1003, job(f"c{i}")) for i in range(20)))
        assert time.monotonic() - began >= 0.1
        # admins (bounded=False) are not held to it
        began = time.monotonic()
        await asyncio.gather(*(slow.run(0, job(f"r{i}"), bounded=False) for i in range(20)))
        assert time.monotonic() - began < 0.1

    asyncio.run(go())
