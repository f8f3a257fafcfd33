"""A server stopped while a warm-pool kernel starts (issue 24, item 14).

jupyter_server's ``ServerApp._cleanup`` shuts the kernels down through ``cleanup_kernels``, which
skips ``shutdown_all`` for a kernel manager that is false; a ``MultiKernelManager`` is false
while it has no kernel (``__len__``), which is the case while the pool's first warm kernel still
starts. So the pool was never stopped: its task and the warm start outlived the server's loop
("Task was destroyed but it is pending", then the provisioner's cleanup "no running event
loop"), and the share stayed reserved. Here a real ServerApp with one pool of size 1 is cleaned
up the way jupyter_server's test fixtures do, while its warm kernel starts; the loop is then
closed. Nothing may be left: no pool task, no pending task, no warm kernel's share in the ledger.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, json, logging, sys

    from jupyter_server.serverapp import ServerApp

    destroyed = []

    class Catch(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "destroyed but it is pending" in text or "no running event loop" in text:
                destroyed.append(text[:300])

    for name in ("asyncio", "ServerApp", "jupyter_gpushare"):
        logging.getLogger(name).addHandler(Catch())

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = ServerApp(
        port=0,
        open_browser=False,
        allow_root=True,
        root_dir=sys.argv[1],
        kernel_manager_class="jupyter_gpushare.pools.PoolKernelManager",
        jpserver_extensions={"jupyter_gpushare": True},
    )
    app.log.addHandler(Catch())
    app.config.GpuShare.simulate = "1xA100"
    app.config.GpuShare.pools = [
        {"name": "warm", "kernelspec": "gpushare-python", "share": {}, "size": 1}
    ]

    async def main():
        app.initialize(argv=[], new_httpserver=False)
        km = app.kernel_manager
        pools = km.pools
        for _ in range(600):  # the pool's first warm start under way (no kernel yet)
            if any(p.starting for p in pools.pools.values()):
                break
            await asyncio.sleep(0.05)
        starting = sum(p.starting for p in pools.pools.values())
        kernels_then = len(km)
        await app._cleanup()  # as jupyter_server's jp_server_cleanup does
        ledger = await app.web_app.settings["gpushare"].ledger()
        left = [a.to_json() for a in await ledger.list()]
        return {
            "starting_at_cleanup": starting,
            "kernels_at_cleanup": kernels_then,
            "pool_task_left": pools._task is not None,
            "pending_tasks": sorted(
                repr(t.get_coro())[:120]
                for t in asyncio.all_tasks()
                if t is not asyncio.current_task()
            ),
            "allocations_left": left,
        }

    result = loop.run_until_complete(main())
    loop.close()
    gc.collect()
    result["destroyed"] = destroyed
    print(json.dumps(result))
    """
)


def test_stopping_the_server_while_a_warm_kernel_starts_leaves_nothing(
    gpushare_env: dict[str, str], tmp_path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=gpushare_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["starting_at_cleanup"] == 1, result  # the case: a warm start under way
    assert result["kernels_at_cleanup"] == 0, result
    assert result["pool_task_left"] is False, result
    assert not [t for t in result["pending_tasks"] if "jupyter_gpushare" in t or "Pool" in t], (
        result
    )
    assert result["allocations_left"] == [], result  # the warm start's share was released
    assert result["destroyed"] == [], result
    assert "no running event loop" not in proc.stderr, proc.stderr[-4000:]
