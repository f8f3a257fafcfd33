"""The warm-pool manager: keeps each profile's warm kernels started, hands them out, refills.

Warm kernels are ordinary gpushare kernels of the server's kernel manager (so jupyter_server
tracks, restarts and shuts them down like any other), started with the allocation owner
``pool``: their shares count against capacity honestly and show as pool kernels in the ledger,
``jupyter gpushare status`` and ``GET /gpushare/api/pools``. A claim binds a ready warm kernel to
the user's session (working directory and environment, see :mod:`.binding`), flips the owner to
``kernel`` with a compare-and-swap on the ledger, and wakes the refill loop.

Nothing here raises to the user: a pool that is empty, whose kernels died or whose binding failed
makes :meth:`PoolManager.claim` answer None, and the caller starts a kernel the normal way.

Warm kernels are given back before a user waits (DESIGN box 13): a start that asks to wait in
the queue and does not fit now first shuts down the ready warm kernels whose shares make room
for it (:func:`warm_to_give_back`, pure; :meth:`PoolManager.give_back`), and no pool refills
while such a start waits (:meth:`PoolManager.refills_held`): the capacity goes to the user.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jupyter_server.utils import ensure_async

from ..ledger import Allocation
from ..placement import Placement, PlacementRefused, Policy, place
from ..provisioner import GpushareProvisioner
from ..share import ShareError, ShareSpec
from .binding import bind_session
from .config import PoolProfile

if TYPE_CHECKING:
    from .kernel_manager import PoolKernelManager

#: Refill retries after a failed warm start wait 2, 4, 8 … seconds, at most this long.
MAX_BACKOFF_S = 60.0
#: Seconds between a hand-over and the start of its replacement.
REFILL_DELAY_S = 0.5
#: Refill errors kept per pool for the REST view.
KEPT_ERRORS = 10


@dataclass
class WarmKernel:
    kernel_id: str
    pool: str
    started: float
    ready_at: float | None = None
    client: Any = None  # an AsyncKernelClient kept connected until the claim


@dataclass
class Pool:
    """One profile's state."""

    profile: PoolProfile
    spec: ShareSpec  # the profile's share resolved against its kernelspec and the default
    backend: str
    ready: list[WarmKernel] = field(default_factory=list)
    starting: int = 0
    claimed: int = 0
    started: int = 0
    failures: int = 0  # consecutive failed warm starts (reset by a success)
    given_back: int = 0  # warm kernels shut down to make room for a start that would wait
    retry_at: float = 0.0
    errors: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEPT_ERRORS))

    def error(self, message: str) -> None:
        self.errors.append({"time": time.time(), "message": message})

    def to_json(self, now: float, when: _dt.datetime) -> dict[str, Any]:
        return {
            **self.profile.to_json(),
            "resolved_share": self.spec.to_json(),
            "backend": self.backend,
            "target": self.profile.target(when),
            "ready": len(self.ready),
            "starting": self.starting,
            "claimed": self.claimed,
            "started": self.started,
            "given_back": self.given_back,
            "kernels": [{"kernel_id": w.kernel_id, "ready_since": w.ready_at} for w in self.ready],
            "refill_errors": list(self.errors),
            "retry_in_s": round(max(0.0, self.retry_at - now), 1) if self.failures else None,
        }


class PoolManager:
    """All pools of one server. ``start()`` on the server's event loop; ``stop()`` before the
    kernels are shut down."""

    def __init__(self, km: PoolKernelManager, pools: list[Pool], interval: float = 1.0) -> None:
        #: local wall time, for the pools' schedules (replaceable, e.g. in tests)
        self.clock: Callable[[], _dt.datetime] = _dt.datetime.now
        self.km = km
        self.log = km.log
        self.pools = {p.profile.name: p for p in pools}
        self.interval = interval
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # claims and trims do not interleave on one pool
        self._starting_ids: set[str] = set()
        self._held = 0  # starts of users waiting for room: no refill takes it meanwhile

    # -- which kernels are warm ------------------------------------------------------------------

    def unclaimed(self) -> set[str]:
        """Kernel ids started for a pool and not handed out yet (ready or finishing start)."""
        ids = {w.kernel_id for p in self.pools.values() for w in p.ready}
        return ids | self._starting_ids

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self.pools and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for pool in self.pools.values():
            for warm in pool.ready:
                _close_client(warm)

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # a wake() from here on means: go round again at once
            for pool in self.pools.values():
                try:
                    await self._tend(pool)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # one pool's trouble must not stop the others
                    self.log.exception("gpushare: pool %s", pool.profile.name)
                    pool.error(f"pool manager: {exc}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)

    async def _tend(self, pool: Pool) -> None:
        await self._drop_dead(pool)
        target = pool.profile.target(self.clock())
        if len(pool.ready) > target:
            await self._trim(pool, target)
        elif (
            len(pool.ready) + pool.starting < target
            and time.monotonic() >= pool.retry_at
            and not self._held
        ):
            await self._start_one(pool)
            if len(pool.ready) < target:
                self.wake()  # more to start: go round again at once

    async def _drop_dead(self, pool: Pool) -> None:
        for warm in list(pool.ready):
            kernel = self.km.get_kernel(warm.kernel_id) if warm.kernel_id in self.km else None
            if kernel is not None and await ensure_async(kernel.is_alive()):
                continue
            if warm not in pool.ready:  # claimed meanwhile: the claim checks it again
                continue
            pool.ready.remove(warm)
            _close_client(warm)
            pool.error(f"warm kernel {warm.kernel_id} died before it was claimed")
            self.log.warning(
                "gpushare: pool %s: warm kernel %s died", pool.profile.name, warm.kernel_id
            )
            if warm.kernel_id in self.km:
                await self._shutdown(warm.kernel_id)

    async def _trim(self, pool: Pool, target: int) -> None:
        async with self._lock:
            extra = pool.ready[target:]
            del pool.ready[target:]
        for warm in extra:
            _close_client(warm)
            self.log.info(
                "gpushare: pool %s: shrinking to %d, stopping %s",
                pool.profile.name,
                target,
                warm.kernel_id,
            )
            await self._shutdown(warm.kernel_id)

    async def _start_one(self, pool: Pool) -> None:
        pool.starting += 1
        began = time.monotonic()
        kernel_id = str(uuid.uuid4())
        self._starting_ids.add(kernel_id)  # hidden from the kernel list from the first moment
        client = None
        try:
            await self.km.start_warm_kernel(pool.profile, kernel_id)  # cleans up if cancelled
            client = self.km.get_kernel(kernel_id).client()
            client.start_channels(hb=False)
            await ensure_async(client.wait_for_ready(timeout=60))  # an AsyncKernelClient
        except asyncio.CancelledError:  # stop(): the server shuts down (it stops the kernel)
            if client is not None:
                with contextlib.suppress(Exception):
                    client.stop_channels()
            raise
        except Exception as exc:
            pool.failures += 1
            delay = min(MAX_BACKOFF_S, 2.0**pool.failures)
            pool.retry_at = time.monotonic() + delay
            message = getattr(exc, "log_message", None) or str(exc) or type(exc).__name__
            pool.error(message)
            self.log.warning(
                "gpushare: pool %s could not start a warm kernel (retry in %.0f s): %s",
                pool.profile.name,
                delay,
                message,
            )
            if kernel_id in self.km:
                await self._shutdown(kernel_id)
            return
        finally:
            pool.starting -= 1
            self._starting_ids.discard(kernel_id)
        pool.failures = 0
        pool.started += 1
        pool.ready.append(WarmKernel(kernel_id, pool.profile.name, began, time.time(), client))
        self.log.info(
            "gpushare: pool %s: warm kernel %s ready in %.2f s (%d/%d)",
            pool.profile.name,
            kernel_id,
            time.monotonic() - began,
            len(pool.ready),
            pool.profile.target(self.clock()),
        )

    async def _shutdown(self, kernel_id: str) -> None:
        with contextlib.suppress(Exception):
            await ensure_async(self.km.shutdown_kernel(kernel_id, now=True))

    # -- giving warm kernels back to a user who would wait -----------------------------------

    @contextlib.asynccontextmanager
    async def refills_held(self) -> AsyncIterator[None]:
        """While a user's start waits for room: no pool refills (a refill would take back the
        room the warm kernels gave, or what a release frees for the user)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            self.wake()

    async def give_back(self, kernel_ids: set[str]) -> list[str]:
        """Shut down the ready warm kernels among ``kernel_ids`` (their shares are released
        with them); the ids given back."""
        async with self._lock:
            taken = [w for p in self.pools.values() for w in p.ready if w.kernel_id in kernel_ids]
            for pool in self.pools.values():
                pool.ready = [w for w in pool.ready if w.kernel_id not in kernel_ids]
                pool.given_back += sum(1 for w in taken if w.pool == pool.profile.name)
        for warm in taken:
            _close_client(warm)
            self.log.info(
                "gpushare: pool %s: giving warm kernel %s back for a start that would wait",
                warm.pool,
                warm.kernel_id,
            )
            await self._shutdown(warm.kernel_id)
        return [w.kernel_id for w in taken]

    # -- hand-over -------------------------------------------------------------------------------

    def matching(self, kernel_name: str, spec: ShareSpec, backend: str) -> list[Pool]:
        return [
            p
            for p in self.pools.values()
            if p.profile.kernelspec == kernel_name and p.spec == spec and p.backend == backend
        ]

    async def claim(
        self, pools: list[Pool], cwd: str, env: Mapping[str, str], session_name: str | None
    ) -> str | None:
        """A ready warm kernel of one of ``pools`` bound to the session, or None."""
        for pool in pools:
            while True:
                async with self._lock:
                    if not pool.ready:
                        break
                    warm = pool.ready.pop(0)
                try:
                    await self._hand_over(warm, cwd, env, session_name)
                except Exception as exc:
                    pool.error(f"claim of {warm.kernel_id} failed: {exc}")
                    self.log.warning(
                        "gpushare: pool %s: warm kernel %s could not be handed "
                        "over (%s); trying another",
                        pool.profile.name,
                        warm.kernel_id,
                        exc,
                    )
                    await self._shutdown(warm.kernel_id)
                    self.wake()
                    continue
                finally:
                    _close_client(warm)
                pool.claimed += 1
                # refill in the background, a moment later: starting a kernel blocks this event
                # loop for a few ms and loads the CPU, which the user's first reply should not see
                asyncio.get_running_loop().call_later(REFILL_DELAY_S, self.wake)
                self.log.info(
                    "gpushare: pool %s: kernel %s handed out warm (cwd %s)",
                    pool.profile.name,
                    warm.kernel_id,
                    cwd,
                )
                return warm.kernel_id
        return None

    async def _hand_over(
        self, warm: WarmKernel, cwd: str, env: Mapping[str, str], session_name: str | None
    ) -> None:
        km = self.km.get_kernel(warm.kernel_id)
        provisioner = km.provisioner
        if not isinstance(provisioner, GpushareProvisioner) or provisioner.allocation is None:
            raise RuntimeError("the warm kernel holds no GPU share")
        if not await ensure_async(km.is_alive()):
            raise RuntimeError("the warm kernel is not running")
        # binding and the owner flip at once (a failed binding shuts the kernel down, which
        # releases its share, so no flip needs undoing)
        applied, _allocation = await asyncio.gather(
            bind_session(warm.client, km, cwd, env, session_name),
            provisioner.claim_from_pool(warm.pool, session_name),
        )
        provisioner.bind_cwd(cwd)  # paths resolve in the session's directory (resolvePath)
        # a restart of this kernel must look like the user's own start
        launch = getattr(km, "_launch_args", None)
        if isinstance(launch, dict):
            launch.pop("gpushare_owner", None)
            launch.pop("gpushare_pool", None)
            launch["cwd"] = cwd
            if isinstance(launch.get("env"), dict):
                launch["env"].update(applied)
        self.km.mark_claimed(warm.kernel_id)
        # jupyter_server's activity watch reads the binding's busy/idle on a stream of its own:
        # hand the kernel over once it says idle there too, as a fresh kernel would
        for _ in range(100):
            if getattr(km, "execution_state", "idle") != "busy":
                break
            await asyncio.sleep(0.01)

    def model(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [p.to_json(now, self.clock()) for p in self.pools.values()]


def _close_client(warm: WarmKernel) -> None:
    if warm.client is not None:
        with contextlib.suppress(Exception):
            warm.client.stop_channels()
        warm.client = None


def warm_to_give_back(
    gpus: Sequence[Any],
    allocations: Sequence[Allocation],
    spec: ShareSpec,
    policy: Policy,
    warm: set[str],
) -> list[Allocation]:
    """The shares of ready warm kernels (kernel ids in ``warm``) to give back before a start of
    ``spec`` waits. Pure. None when it fits now. Else the fewest that make it fit: those of one
    GPU, largest first, on the GPU that needs the fewest (then those of all GPUs, for a start of
    several); where even all of them do not, every one on a GPU of a type the start may use (it
    then waits for less, and a release that frees the rest starts it)."""
    try:
        if _fits(gpus, allocations, spec, policy):
            return []
    except ShareError:  # it can never be placed here: the provisioner refuses it with why
        return []
    shares = sorted(
        (a for a in allocations if a.owner == "pool" and a.kernel_id in warm),
        key=lambda a: (-a.request, a.id),
    )
    by_gpu: dict[str, list[Allocation]] = {}
    for share in shares:
        for gpu in share.gpus:
            by_gpu.setdefault(gpu, []).append(share)
    best: list[Allocation] | None = None
    for group in [*by_gpu.values(), shares]:
        given: list[Allocation] = []
        for share in group:
            if best is not None and len(given) + 1 >= len(best):
                break  # no fewer than the best found
            given.append(share)
            if _fits(gpus, [a for a in allocations if a not in given], spec, policy):
                best = given
                break
    if best is not None:
        return best
    kind = (spec.gpu_type or "").lower()
    usable = {g.uuid for g in gpus if kind in ("", "any") or g.type.lower() == kind}
    return [a for a in shares if set(a.gpus) & usable]


def _fits(
    gpus: Sequence[Any], allocations: Sequence[Allocation], spec: ShareSpec, policy: Policy
) -> Placement | None:
    try:
        return place(gpus, allocations, spec, policy)
    except PlacementRefused:
        return None
