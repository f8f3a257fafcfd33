"""REST for pools and idle reclaim, and the server tasks behind them.

- ``GET /gpushare/api/pools`` → ``{"pools": [profile + resolved_share, target, ready, starting,
  claimed, started, kernels, refill_errors, retry_in_s]}`` (``enabled`` false, with a message,
  when the server's kernel manager has no pools).
- ``PATCH /gpushare/api/allocations/{id}`` (live resize) is :class:`~.handlers.AllocationHandler`'s.
- ``GET /gpushare/api/reclaim`` → the policy and the allocations warned now (their
  ``reclaim_warning`` is also in each allocation's ``extra``); on Kubernetes this server's
  kernels only.
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.utils import url_path_join
from tornado import web

from ..ledger import Allocation
from ..reclaim import IdleReclaimer, ReclaimPolicy
from .handlers import GpushareHandler


class PoolsHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        pools = getattr(self.kernel_manager, "pools", None)
        if pools is None:
            self.finish(
                json.dumps(
                    {
                        "enabled": False,
                        "pools": [],
                        "message": "kernel pools need ServerApp.kernel_manager_class = "
                        "jupyter_gpushare.pools.PoolKernelManager",
                    }
                )
            )
            return
        self.finish(json.dumps({"enabled": True, "pools": pools.model()}, default=str))


class ReclaimHandler(GpushareHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        s = self.gpushare
        backend = s.get_backend()
        warned = [
            a.to_json()
            for a in await (await backend.ledger()).list()
            if a.extra.get("reclaim_warning") and backend.may_touch(a.extra)
        ]
        self.finish(
            json.dumps(
                {
                    "enabled": s.reclaim_idle_after > 0,
                    "idle_after": s.reclaim_idle_after,
                    "grace": s.reclaim_grace,
                    "exempt_users": list(s.reclaim_exempt_users),
                    "exempt_profiles": list(s.reclaim_exempt_profiles),
                    "warned": warned,
                }
            )
        )


def admin_handlers(base_url: str) -> list[tuple[str, type]]:
    api = url_path_join(base_url, "gpushare", "api")
    return [
        (url_path_join(api, "pools"), PoolsHandler),
        (url_path_join(api, "reclaim"), ReclaimHandler),
    ]


def _profiles_of(kernel_manager: Any) -> Any:
    """An allocation's kernelspec name and pool name (for reclaim exemptions)."""

    def profiles(allocation: Allocation) -> set[str]:
        names = set()
        pool = allocation.extra.get("claimed_from_pool") or allocation.extra.get("pool")
        if pool:
            names.add(str(pool))
        kid = allocation.kernel_id
        if kid and kid in kernel_manager:
            names.add(kernel_manager.get_kernel(kid).kernel_name)
        return names

    return profiles


def start_admin_tasks(serverapp: Any, settings: Any) -> None:
    """Start the warm pools and the idle reclaimer (after the GPUs and the daemon are up)."""
    km = serverapp.kernel_manager
    pools = getattr(km, "pools", None)
    if pools is not None:
        pools.start()
    elif settings.pools:
        serverapp.log.error(
            "gpushare: %d pool(s) configured, but ServerApp.kernel_manager_class"
            " is %s; set it to jupyter_gpushare.pools.PoolKernelManager",
            len(settings.pools),
            type(km).__name__,
        )
    reclaimer = IdleReclaimer(settings, settings.ledger, _profiles_of(km), serverapp.log)
    serverapp.web_app.settings["gpushare_reclaimer"] = reclaimer
    reclaimer.start()
    policy = ReclaimPolicy.from_settings(settings)
    if policy.idle_after > 0:
        serverapp.log.info(
            "gpushare: idle reclaim: warn after %.0f s idle, release %.0f s later",
            policy.idle_after,
            policy.grace,
        )
