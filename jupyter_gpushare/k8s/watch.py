"""Following kernel pods: one watch per Jupyter server, shared by all its kernels.

:class:`PodWatcher` lists the server's kernel pods (label ``gpushare.jupyter.org/server``), then
watches from that ``resourceVersion`` and keeps the latest object of each pod. Kernels ask it
(:meth:`PodWatcher.get`, :meth:`PodWatcher.wait_for`) instead of polling the API server, so a
scheduler refusal, an image pull error, an eviction or a deletion reaches the kernel's waiter as
soon as the API server publishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from .client import ApiException, ClusterError, Kube

log = logging.getLogger(__name__)

Pod = dict[str, Any]


class ClusterUnavailable(ClusterError):
    """The API server cannot be reached (REST and kernel starts answer 503 with the reason)."""

    reason_code = "cluster_unavailable"


class PodWatcher:
    def __init__(self, kube: Kube, namespace: str, label_selector: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.label_selector = label_selector
        self._pods: dict[str, Pod] = {}
        self._deleted: set[str] = set()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self.last_error: str | None = None

    async def start(self, timeout: float | None = None) -> None:
        """Start following; returns once the first listing is in. After ``timeout`` seconds
        without one, stops and raises :class:`ClusterUnavailable` with the last error."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="gpushare-pod-watch")
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            await self.stop()
            raise ClusterUnavailable(
                f"the Kubernetes API server did not answer within {timeout:g} s "
                f"({self.last_error or 'no reply'})"
            ) from None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    # -- queries -------------------------------------------------------------------------------

    def get(self, name: str) -> Pod | None:
        """The latest object of pod ``name``; None when it is gone (or never seen)."""
        return self._pods.get(name)

    def deleted(self, name: str) -> bool:
        return name in self._deleted

    async def note(self, pod: Pod) -> None:
        """Record an object we got from a write (create), so waiters need not wait for the
        watch to echo it."""
        await self._update(pod, deleted=False)

    def forget(self, name: str) -> None:
        self._pods.pop(name, None)
        self._deleted.discard(name)

    async def wait_for(
        self, name: str, done: Callable[[Pod | None], bool], timeout: float | None
    ) -> Pod | None:
        """Wait until ``done(pod)`` (pod None once deleted); returns the pod. Raises
        :class:`TimeoutError` after ``timeout`` seconds."""

        async def waiting() -> Pod | None:
            async with self._changed:
                while True:
                    pod = None if name in self._deleted else self._pods.get(name)
                    if done(pod):
                        return pod
                    await self._changed.wait()

        return await asyncio.wait_for(waiting(), timeout)

    # -- the watch loop ------------------------------------------------------------------------

    async def _update(self, pod: Pod, deleted: bool) -> None:
        name = pod["metadata"]["name"]
        known = self._pods.get(name)
        if not deleted and known is not None and _rv(known) > _rv(pod):
            return  # an older echo
        async with self._changed:
            if deleted:
                self._pods.pop(name, None)
                self._deleted.add(name)
            elif name not in self._deleted:  # names are unique per launch: never reused
                self._pods[name] = pod
            self._changed.notify_all()

    async def _relist(self) -> str:
        listing = await self.kube.list_pods(self.namespace, self.label_selector)
        seen = {p["metadata"]["name"]: p for p in listing.get("items") or []}
        listed_at = _rv(listing)
        async with self._changed:
            for name in list(self._pods):
                # Gone, unless we learnt of it after this listing was taken (a pod just created).
                if name not in seen and _rv(self._pods[name]) <= listed_at:
                    self._pods.pop(name)
                    self._deleted.add(name)
            for name, pod in seen.items():
                if name not in self._deleted:
                    self._pods[name] = pod
            self._changed.notify_all()
        return str(listing["metadata"]["resourceVersion"])

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                version = await self._relist()
                self._synced.set()
                async for event in self.kube.watch(
                    "pods", self.namespace, version, label_selector=self.label_selector
                ):
                    kind = event["type"]
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        await self._update(event["object"], deleted=kind == "DELETED")
                delay = 0.2
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status != 410:
                    self.last_error = f"{exc.status} {exc.reason}"
                    log.warning("gpushare: pod watch failed (%s); retrying", exc.status)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            except Exception as exc:
                self.last_error = str(exc) or type(exc).__name__
                log.warning("gpushare: pod watch interrupted (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


def _rv(obj: Pod) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except (TypeError, ValueError):
        return 0
