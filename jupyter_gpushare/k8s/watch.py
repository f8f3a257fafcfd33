"""Informers: list once, then follow a kind of object through one watch, from a cache.

:class:`Informer` is client-go's informer reduced to what gpushare needs. It lists the objects once
(``resourceVersion`` of the listing), then watches from that version with
``allowWatchBookmarks``, keeping the latest object of each name in memory. Readers ask the cache
(:meth:`Informer.get`, :meth:`Informer.values`, :meth:`Informer.wait_for`) and never the API server.

- **Resume, don't re-list**: the last ``resourceVersion`` seen (an event's object, or a
  ``BOOKMARK``, which the API server sends so that a quiet watch still moves forward) is where the
  next watch starts when the stream ends (the server's ``timeoutSeconds``) or drops (connection
  reset, API server restart). Only ``410 Gone`` (the version was compacted away) re-lists, and a
  re-list turns objects missing from it into deletions.
- **Our own writes first**: :meth:`Informer.note` records the object a write returned (and
  :meth:`Informer.note_deleted` an object we deleted), so the writer's next read sees it without
  waiting for the watch to echo it; an event older than what is cached (by ``resourceVersion``)
  is dropped.
- **Counters** (``lists``, ``watches``, ``events``) say how often the API server was asked, for
  tests and ``benchmarks/k8s_scale.py``.

The watch itself is :meth:`jupyter_gpushare.k8s.client.Kube.watch`: the generated
``kubernetes_asyncio`` call (its auth, TLS and connection pool) with our own line reader, because
``kubernetes_asyncio.watch.Watch`` reads lines with aiohttp's 64 KiB line cap (a GpuLedger with
many allocations is larger) and retries a 410 with the same, expired version.

:class:`PodWatcher` is the informer of kernel pods: one per Jupyter server in direct mode (label
``gpushare.jupyter.org/server``), one for the whole cluster in the controller. Kernels wait on it
for their pod instead of polling, so a scheduler refusal, an image pull error, an eviction or a
deletion reaches the kernel's waiter as soon as the API server publishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from .client import ApiException, ClusterError, Kube

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Pod = Obj
#: called with ("ADDED" | "MODIFIED" | "DELETED", the object, the object cached before or None)
Listener = Callable[[str, Obj, Obj | None], None]

KINDS = ("pods", "gpuledgers", "nodes", "leases", "configmaps", "networkpolicies")


class ClusterUnavailable(ClusterError):
    """The API server cannot be reached (REST and kernel starts answer 503 with the reason)."""

    reason_code = "cluster_unavailable"


async def list_objects(
    kube: Kube, kind: str, namespace: str, label_selector: str = "", field_selector: str = ""
) -> Obj:
    """One LIST of ``kind`` as JSON (``items`` and the listing's ``metadata.resourceVersion``)."""
    params: dict[str, Any] = {"_preload_content": False}
    if label_selector:
        params["label_selector"] = label_selector
    if field_selector:
        params["field_selector"] = field_selector
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    func, args = kube.lister(kind, namespace)
    return await kube._json(func(*args, **params))


class Informer:
    """The objects of one kind (in one namespace, by selector), kept current by one watch."""

    def __init__(
        self,
        kube: Kube,
        kind: str,
        namespace: str = "",
        label_selector: str = "",
        field_selector: str = "",
        timeout_seconds: int = 240,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        self.kube = kube
        self.kind = kind
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.timeout_seconds = timeout_seconds
        self.resource_version = ""
        self.lists = 0
        self.watches = 0
        self.events = 0
        self.last_error: str | None = None
        self._items: dict[str, Obj] = {}
        self._listeners: list[Listener] = []
        self._changed = asyncio.Condition()
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._response: Any = None  # the open watch (tests drop it to check the resume)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, timeout: float | None = None) -> None:
        """Start following; returns once the first listing is in. After ``timeout`` seconds
        without one, stops and raises :class:`ClusterUnavailable` with the last error."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"gpushare-{self.kind}-informer")
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

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener`` on every change (in the event loop, synchronously: keep it short)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def drop_watch(self) -> None:
        """Close the open watch stream as a network failure would (for tests): the informer
        resumes from its last resourceVersion."""
        response = self._response
        if response is not None:
            response.close()

    # -- queries -------------------------------------------------------------------------------

    def get(self, name: str) -> Obj | None:
        """The latest object named ``name``; None when there is none."""
        return self._items.get(name)

    def values(self) -> Iterator[Obj]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return len(self._items)

    async def note(self, obj: Obj) -> None:
        """Record an object a write of ours returned, so readers need not wait for the echo."""
        self._apply("MODIFIED", obj)
        async with self._changed:
            self._changed.notify_all()

    async def note_deleted(self, obj: Obj) -> None:
        """Record that a write of ours deleted ``obj``, so readers stop seeing it without
        waiting for the watch's ``DELETED`` event."""
        self._apply("DELETED", obj)
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(
        self, name: str, done: Callable[[Obj | None], bool], timeout: float | None
    ) -> Obj | None:
        """Wait until ``done(object)`` (None while there is none); returns the object. Raises
        :class:`TimeoutError` after ``timeout`` seconds."""
        await self.wait_until(lambda: done(self._current(name)), timeout)
        return self._current(name)

    async def wait_until(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Wait until ``done()`` (asked again at each change of the cache). Raises
        :class:`TimeoutError` after ``timeout`` seconds."""

        async def waiting() -> None:
            async with self._changed:
                while not done():
                    await self._changed.wait()

        await asyncio.wait_for(waiting(), timeout)

    def _current(self, name: str) -> Obj | None:
        return self._items.get(name)

    # -- keeping the cache ---------------------------------------------------------------------

    def _apply(self, kind: str, obj: Obj) -> bool:
        """Apply one change to the cache; False when it is older than what is cached."""
        name = obj["metadata"]["name"]
        known = self._items.get(name)
        if known is not None and _rv(known) > _rv(obj):
            return False  # an older echo of something we already hold
        if kind == "DELETED":
            if known is None:
                return False
            del self._items[name]
        else:
            if known is not None and _rv(known) == _rv(obj) and known == obj:
                return False
            self._items[name] = obj
        self._notify(kind, obj, known)
        return True

    def _notify(self, kind: str, obj: Obj, before: Obj | None) -> None:
        for listener in self._listeners:
            try:
                listener(kind, obj, before)
            except Exception:  # a listener's bug must not stop the watch
                log.exception("gpushare: %s informer listener failed", self.kind)

    async def _relist(self) -> None:
        listing = await list_objects(
            self.kube, self.kind, self.namespace, self.label_selector, self.field_selector
        )
        self.lists += 1
        listed_at = _rv(listing)
        seen = {o["metadata"]["name"]: o for o in listing.get("items") or []}
        for name in list(self._items):
            # Gone, unless we learnt of it after this listing was taken (our own fresh write).
            if name not in seen and _rv(self._items[name]) <= listed_at:
                self._forget_listed(name)
        for obj in seen.values():
            self._apply("ADDED" if obj["metadata"]["name"] not in self._items else "MODIFIED", obj)
        self.resource_version = str(listing["metadata"]["resourceVersion"])
        async with self._changed:
            self._changed.notify_all()

    def _forget_listed(self, name: str) -> None:
        obj = self._items.pop(name)
        self._notify("DELETED", obj, obj)

    async def _watch(self) -> None:
        params: dict[str, Any] = {}
        if self.label_selector:
            params["label_selector"] = self.label_selector
        if self.field_selector:
            params["field_selector"] = self.field_selector
        self.watches += 1
        stream = self.kube.watch(
            self.kind,
            self.namespace,
            self.resource_version,
            timeout_seconds=self.timeout_seconds,
            on_response=self._opened,
            **params,
        )
        try:
            async for event in stream:
                kind = event["type"]
                obj = event.get("object") or {}
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self.events += 1
                    self._apply(kind, obj)
                    async with self._changed:
                        self._changed.notify_all()
                if version:  # bookmarks move the version forward too
                    self.resource_version = str(version)
        finally:
            self._response = None

    def _opened(self, response: Any) -> None:
        self._response = response

    async def _run(self) -> None:
        delay = 0.2
        relist = True
        while True:
            try:
                if relist:
                    await self._relist()
                    relist = False
                    self._synced.set()
                await self._watch()  # ended by the server's timeout: resume from our version
                delay = 0.2
                self.last_error = None
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    log.info("gpushare: %s watch expired (410 Gone); listing again", self.kind)
                    relist = True
                    continue
                self.last_error = f"{exc.status} {exc.reason}"
                log.warning("gpushare: %s watch failed (%s); retrying", self.kind, exc.status)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except Exception as exc:
                self.last_error = str(exc) or type(exc).__name__
                log.info("gpushare: %s watch interrupted (%s); resuming", self.kind, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)


class PodWatcher(Informer):
    """The informer of kernel pods (by label). A pod name is never reused (names are unique per
    launch), so a deleted name stays deleted: a late echo cannot bring it back."""

    def __init__(self, kube: Kube, namespace: str, label_selector: str) -> None:
        super().__init__(kube, "pods", namespace, label_selector)
        self._deleted: set[str] = set()

    def deleted(self, name: str) -> bool:
        return name in self._deleted

    def get_live(self, name: str) -> Obj | None:
        """The pod of that name unless it was deleted (``get`` still shows a deleted pod's last
        state)."""
        return self._current(name)

    def forget(self, name: str) -> None:
        self._items.pop(name, None)
        self._deleted.discard(name)

    def _current(self, name: str) -> Obj | None:
        return None if name in self._deleted else self._items.get(name)

    def _apply(self, kind: str, obj: Obj) -> bool:
        name = obj["metadata"]["name"]
        if name in self._deleted:
            return False
        if kind == "DELETED":
            self._deleted.add(name)
            if name not in self._items:
                self._items[name] = obj  # so that the deletion is announced
        return super()._apply(kind, obj)

    def _forget_listed(self, name: str) -> None:
        self._deleted.add(name)
        super()._forget_listed(name)


def _rv(obj: Obj) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion") or 0)
    except (TypeError, ValueError, KeyError):
        return 0


__all__ = ["ClusterUnavailable", "Informer", "PodWatcher", "list_objects"]
