"""The server's kernel manager with warm pools: ``ServerApp.kernel_manager_class =
jupyter_gpushare.pools.PoolKernelManager`` in the server's config (``jupyter gpushare lab``
passes it; jupyter_server reads only ``jpserver_extensions`` from the ``.d`` snippet a package
ships, so the package cannot set it for a plain ``jupyter lab``).

``start_kernel(kernel_name=…, path=…, env=…, gpushare_share=…)`` resolves the share the way the
provisioner will (server default < kernelspec config < the user's choice); when a pool's
kernelspec and resolved share are equal to it, a ready warm kernel is bound to the session and
its id returned at once. Otherwise — no pool matches, the pool is empty, its kernels died, the
binding failed, or the caller asked for a specific kernel id — it is the normal start.

A start that may wait in the queue (``gpushare_wait``, or the provisioner's ``queue_wait``) and
does not fit now first has warm kernels give their shares back (:func:`.manager.warm_to_give_back`),
and no pool refills while it waits.

Unclaimed warm kernels are left out of ``GET /api/kernels`` (they belong to nobody yet) and are
never culled by the idle culler; they are in ``list_kernel_ids`` (so reconciliation keeps their
shares) and are shut down with the server.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, cast

from jupyter_client.kernelspec import NoSuchKernel
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from jupyter_server.utils import ensure_async

from ..config import GpuShare
from ..provisioner import GpushareProvisioner
from ..share import SHARE_FIELDS, ShareError, ShareSpec
from .config import PoolConfigError, PoolProfile, parse_pools
from .manager import Pool, PoolManager, warm_to_give_back

PROVISIONER = "gpushare-provisioner"


class PoolKernelManager(AsyncMappingKernelManager):
    """jupyter_server's kernel manager, plus gpushare's warm kernel pools."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gpushare = GpuShare.of(self)  # the server's; bad pools refused right here
        self._managers_starting: dict[str, Any] = {}
        pools = [self._pool(p) for p in parse_pools(self.gpushare.pools)]
        self.pools = PoolManager(self, pools)
        for pool in pools:
            self.log.info(
                "gpushare: pool %s: %d warm %s kernel(s) holding %s (%s)",
                pool.profile.name,
                pool.profile.target(),
                pool.profile.kernelspec,
                pool.spec.describe(),
                pool.backend,
            )

    def __bool__(self) -> bool:
        """Always true. ``MultiKernelManager`` is false while it holds no kernel (``__len__``),
        and jupyter_server's ``cleanup_kernels`` skips ``shutdown_all`` for a false kernel
        manager: a server stopped while its pool's first warm kernel starts (no kernel yet)
        never stopped the pool, whose start then outlived the server's event loop ("Task was
        destroyed but it is pending", "no running event loop" in the provisioner's cleanup)
        and left its share reserved (tests/test_pool_server_stop.py)."""
        return True

    # -- share resolution (the provisioner's rule, without a provisioner) ------------------------

    def resolve(
        self, kernel_name: str, user_share: dict[str, Any] | None
    ) -> tuple[ShareSpec, str] | None:
        """``(spec, backend)`` a start of ``kernel_name`` with ``user_share`` will hold, or None
        for a kernelspec that is not a gpushare one. Raises ShareError / NoSuchKernel."""
        if self.kernel_spec_manager is None:
            raise NoSuchKernel(kernel_name)
        kernelspec = self.kernel_spec_manager.get_kernel_spec(kernel_name)
        provisioner = (kernelspec.metadata or {}).get("kernel_provisioner") or {}
        if provisioner.get("provisioner_name") != PROVISIONER:
            return None
        config = provisioner.get("config") or {}
        given = {k: v for k, v in config.items() if k in SHARE_FIELDS and v is not None}
        spec = ShareSpec.from_mapping(given, defaults=self.gpushare.default_spec())
        if user_share:
            spec = ShareSpec.from_mapping(user_share, defaults=spec)
        return spec, config.get("backend") or self.gpushare.backend

    def _pool(self, profile: PoolProfile) -> Pool:
        where = f"pool {profile.name!r}"
        try:
            resolved = self.resolve(profile.kernelspec, dict(profile.share))
        except NoSuchKernel:
            raise PoolConfigError(
                f"{where}: no kernelspec named {profile.kernelspec!r} (see "
                "`jupyter kernelspec list`)"
            ) from None
        except ShareError as exc:
            raise PoolConfigError(
                f"{where}.share.{exc.field}: {exc.value!r} is not allowed "
                f"with kernelspec {profile.kernelspec!r} (allowed: "
                f"{exc.allowed})"
            ) from None
        if resolved is None:
            raise PoolConfigError(
                f"{where}: kernelspec {profile.kernelspec!r} does not use the "
                f"{PROVISIONER}; pool kernels must hold a GPU share"
            )
        spec, backend = resolved
        if profile.backend is not None and profile.backend != backend:
            raise PoolConfigError(
                f"{where}.backend: {profile.backend!r}, but kernelspec "
                f"{profile.kernelspec!r} starts kernels on {backend!r}"
            )
        return Pool(profile=profile, spec=spec, backend=backend)

    # -- starting ------------------------------------------------------------------------------

    async def start_kernel(  # type: ignore[override]
        self, *, kernel_id: str | None = None, path: str | None = None, **kwargs: Any
    ) -> str:
        if kernel_id is None and self.pools.pools:
            claimed = await self._claim(path, kwargs)
            if claimed is not None:
                return claimed
        if not self.pools.pools or self._wait_of(kwargs) <= 0:
            return await self._start(kernel_id, path, kwargs)
        # a start that may wait in the queue: warm kernels give their shares back first, and
        # no pool refills while it waits (DESIGN box 13: before a user waits)
        async with self.pools.refills_held():
            await self._make_room(kwargs)
            return await self._start(kernel_id, path, kwargs)

    async def _start(self, kernel_id: str | None, path: str | None, kwargs: dict[str, Any]) -> str:
        try:
            return await super().start_kernel(kernel_id=kernel_id, path=cast(Any, path), **kwargs)
        except BaseException:
            self.forget_failed_starts()
            raise

    def _wait_of(self, kwargs: dict[str, Any]) -> float:
        """Seconds this start may wait in the queue: its own (``gpushare_wait``, from ``"wait"``
        of POST /gpushare/api/kernels), else the provisioner's configured ``queue_wait``."""
        wait = kwargs.get("gpushare_wait")
        if wait is None:
            wait = self.config.get("GpushareProvisioner", {}).get("queue_wait", 0.0)
        try:
            return float(wait)
        except (TypeError, ValueError):
            return 0.0

    async def _make_room(self, kwargs: dict[str, Any]) -> None:
        """Give back the warm kernels whose shares let this start fit now (none if it fits)."""
        try:
            resolved = self.resolve(
                kwargs.get("kernel_name") or self.default_kernel_name,
                kwargs.get("gpushare_share"),
            )
            if resolved is None:
                return
            spec, backend_name = resolved
            backend = self.gpushare.get_backend(backend_name)
            gpus, _ = await backend.inventory()
            held = await (await backend.ledger()).list()
            shares = warm_to_give_back(
                gpus, held, spec, self.gpushare.policy(), self.pools.unclaimed()
            )
            if shares:
                await self.pools.give_back({str(a.kernel_id) for a in shares})
        except Exception:  # the start goes on as without pools (it waits, or is refused)
            self.log.exception("gpushare: giving warm kernels back for a waiting start failed")

    def forget_failed_starts(self) -> None:
        """Drop the starts that failed from jupyter_client's pending kernels.

        ``MultiKernelManager`` keeps a failed start's task in ``_pending_kernels`` (without
        pending kernels the kernel never joins ``_kernels``); ``shutdown_all`` then shuts that id
        down, jupyter_server answers 404 "Kernel does not exist", and the server cannot stop
        (SIGTERM/Ctrl-C hang). A refused share (409 no fit) is an everyday failed start here.
        A done start task whose kernel is not in the map is such a leftover: nothing is pending.
        """
        for kernel_id, task in list(self._pending_kernels.items()):
            if kernel_id not in self and task.done():
                self._pending_kernels.pop(kernel_id, None)

    async def _claim(self, path: str | None, kwargs: dict[str, Any]) -> str | None:
        kernel_name = kwargs.get("kernel_name") or self.default_kernel_name
        try:
            resolved = self.resolve(kernel_name, kwargs.get("gpushare_share"))
        except (NoSuchKernel, ShareError, ValueError):
            return None  # the normal start reports it, as it would without pools
        if resolved is None:
            return None
        pools = self.pools.matching(kernel_name, *resolved)
        if not pools:
            return None
        env = dict(kwargs.get("env") or {})
        cwd = self.cwd_for_path(path, env=env) if path is not None else self.root_dir
        try:
            return await self.pools.claim(pools, cwd, env, env.get("JPY_SESSION_NAME"))
        except Exception:  # never an error the user would not see without pools
            self.log.exception("gpushare: claiming a warm kernel failed; starting one")
            return None

    async def start_warm_kernel(self, profile: PoolProfile, kernel_id: str) -> str:
        """Start one warm kernel for ``profile`` (the share owned by the pool).

        Cancelled (the server stops while it starts), it leaves nothing behind: the kernel
        process, if it was launched, is killed, its share released, its connection file and
        zmq sockets closed, and nothing is left pending in jupyter_client's map."""
        try:
            await super().start_kernel(
                kernel_id=kernel_id,
                path=cast(Any, ""),
                kernel_name=profile.kernelspec,
                env=dict(os.environ),
                gpushare_share=dict(profile.share),
                gpushare_owner="pool",
                gpushare_pool=profile.name,
            )
            # with use_pending_kernels the start returns before the kernel runs (no ports yet)
            ready = self.get_kernel(kernel_id).ready
            if not isinstance(ready, asyncio.Future):
                ready = asyncio.wrap_future(ready)
            await asyncio.shield(ready)  # a cancel must not cancel jupyter_client's future
            return kernel_id
        except asyncio.CancelledError:
            await asyncio.shield(self._abandon_start(kernel_id))
            raise
        finally:
            self._managers_starting.pop(kernel_id, None)

    def pre_start_kernel(self, kernel_name: str | None, kwargs: Any) -> tuple[Any, str, str]:
        km, kernel_name, kernel_id = super().pre_start_kernel(kernel_name, kwargs)
        if kwargs.get("gpushare_owner") == "pool":
            self._managers_starting[kernel_id] = km  # reachable if its start is cancelled
        return km, kernel_name, kernel_id

    async def _abandon_start(self, kernel_id: str) -> None:
        km = self._managers_starting.pop(kernel_id, None)
        try:
            if kernel_id in self:  # it started: an ordinary shutdown
                await ensure_async(self.shutdown_kernel(kernel_id, now=True))
            elif km is not None:
                if km.has_kernel:
                    await ensure_async(km.shutdown_kernel(now=True))  # kill, then clean up
                else:
                    await ensure_async(km.cleanup_resources())  # sockets, files, the share
                provisioner = getattr(km, "provisioner", None)
                if isinstance(provisioner, GpushareProvisioner):
                    await provisioner.abandon("its pool start was cancelled")
        except Exception:
            self.log.exception("gpushare: cleaning up the cancelled start of %s", kernel_id)
        finally:
            self.forget_failed_starts()

    def mark_claimed(self, kernel_id: str) -> None:
        kernel = self.get_kernel(kernel_id)
        kernel.last_activity = utcnow()  # type: ignore[attr-defined]
        self._kernel_connections.setdefault(kernel_id, 0)

    # -- what pool kernels are spared ------------------------------------------------------------

    def list_kernels(self) -> list[dict[str, Any]]:
        hidden = self.pools.unclaimed()
        return [k for k in super().list_kernels() if k["id"] not in hidden]

    async def cull_kernel_if_idle(self, kernel_id: str) -> None:
        if kernel_id in self.pools.unclaimed():
            return  # a warm kernel is idle by design
        await super().cull_kernel_if_idle(kernel_id)

    async def shutdown_all(self, now: bool = False) -> None:  # type: ignore[override]
        await self.pools.stop()  # no refill while the server shuts down
        self.forget_failed_starts()
        await ensure_async(super().shutdown_all(now=now))
