"""The system agent's SQLite ledger kept in memory (ledger/cached.py): what it writes is what
the plain SQLite ledger reads, and a write from elsewhere is never overwritten."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger.cached import CachedSQLiteLedger
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import allocate
from jupyter_gpushare.share import ShareSpec

NODE = "n1"


def by_id(snap):  # type: ignore[no-untyped-def]
    return {a.id: a for a in snap.allocations}, dict(snap.versions)


def test_cached_writes_match_the_file_and_lose_to_an_outside_writer(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    cached, plain = CachedSQLiteLedger(path, ttl=60), SQLiteLedger(path)

    async def scenario() -> None:
        gpus = simulated_gpus("2xA100", NODE)
        await cached.put_gpus(NODE, gpus)
        made = [await allocate(cached, ShareSpec(0.25, 0.25), gpus, None) for _ in range(3)]
        assert by_id(await cached.snapshot()) == by_id(await plain.snapshot())
        # a change of one record rewrites that row only, and the file says so
        grown = await cached.update(
            made[0].id, lambda a, _o: replace(a, spec=replace(a.spec, gpu_limit=0.5))
        )
        assert (await plain.get(made[0].id)).limit == 0.5 == grown.limit
        await cached.release(made[1].id)
        assert by_id(await cached.snapshot()) == by_id(await plain.snapshot())
        assert len((await plain.snapshot()).allocations) == 2
        # someone else writes the file: the cached snapshot is stale, its CAS loses
        stale = await cached.snapshot()
        await plain.release(made[2].id)
        assert not await cached.compare_and_swap(
            NODE, stale.versions[NODE], list(stale.on_node(NODE))
        )
        assert by_id(await cached.snapshot()) == by_id(await plain.snapshot())
        assert [a.id for a in (await plain.snapshot()).allocations] == [made[0].id]
        # and the base-class loops work through it as before
        again = await allocate(cached, ShareSpec(0.5, 0.5), gpus, None)
        assert by_id(await cached.snapshot()) == by_id(await plain.snapshot())
        assert again.id in by_id(await plain.snapshot())[0]

    asyncio.run(scenario())
