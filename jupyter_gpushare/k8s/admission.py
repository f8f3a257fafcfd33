"""One kernel pod per node and share size waits for the kubelet's admission at a time.

Why: the device-plugin API's ``Allocate`` names device IDs, never the pod they are for, so the
node's plugin infers the pod (:mod:`jupyter_gpushare.k8s.device_plugin.plugin`): the waiting
kernel pod of that size on its node that was bound first. Two such pods waiting at once and
bound in the same second (the API's timestamps have one-second resolution) are a tie the kubelet
may break the other way; the plugin then hands one pod the other's allocation, and
``PreStartContainer`` refuses its container (``CreateContainerConfigError``): the kernel's start
fails. Six kernels of one size started 0.1 s apart on one node did that in a CI run.

So the tie is never made: whoever creates kernel pods (the controller; a Jupyter server in
direct mode) creates the pod of a node and size only while no other pod of that node and size
waits for admission. The plugin's waiting pod is then the only one, and its guess is the
kubelet's pod. HAMi serializes the same step with a lock per node held from binding until
``Allocate``; here the lock is the creator's own, and what it waits for is read from the
creator's informer of kernel pods, so a controller that took over the leadership also waits for
the pods its predecessor created.

Waiting for admission (:func:`awaiting_admission`): a pod that asks the share resource, for the
node (bound to it, or required by its affinity), not being deleted, not failed or finished, not
running, and not yet marked ``gpushare.jupyter.org/device-allocated`` by the node's plugin
(which ``Allocate`` does before it answers). A start waits at most ``timeout`` seconds for the
pods ahead of it (a kubelet that admits nothing, a node that went away): then its pod is created
anyway, and the wait is logged with the pods' names.

Cost: starts of one size on one node are admitted one after another; each waits for the
admissions ahead of it (binding by the scheduler, then the kubelet's admission). Six starts of
one size on one node of the test cluster (real API server and scheduler, the kubelet double)
took 0.5-1.0 s with the gate and 0.8 s without it, when none failed. Pods of other sizes or
other nodes never wait for each other.

Two gates, one contract (``turn(manifest)``, held while the pod is created):

- :class:`AdmissionGate` (the controller, the only creator of kernel pods in controller mode):
  a lock per node and size in the process, and the pods ahead read from its informer of all
  kernel pods;
- :class:`LeaseGate` (direct mode, the chart's default: every user's server creates its own
  kernel pods and sees only those): a ``coordination.k8s.io`` Lease per node and size,
  ``gpushare-admit-<units>-<hash of the node>``, created by the server whose pod is next and
  deleted (by UID, so never another's) once that pod is admitted. Another server's start waits
  while the Lease exists; a Lease whose holder died is owned by that server's anchor Lease (the
  garbage collector removes it with the server) and is taken over once it expired
  (``admission_wait`` seconds). Servers' clocks only matter for that takeover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from . import manifests
from .client import ApiException, Kube
from .watch import PodWatcher

log = logging.getLogger(__name__)

#: seconds a start waits for the admissions of the pods ahead of it before it goes anyway
ADMISSION_WAIT_S = 30.0
#: an admission Lease lasts the wait plus this (the create, clock steps between servers)
LEASE_MARGIN_S = 10.0


def pod_node(pod: Mapping[str, Any]) -> str | None:
    """The node ``pod`` is for: the one it is bound to, else the one its required node affinity
    names alone (kernel pods name their node by ``metadata.name``)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms") or []
    names = {
        str(value)
        for term in required
        for field in term.get("matchFields") or []
        if field.get("key") == "metadata.name" and field.get("operator") == "In"
        for value in field.get("values") or []
    }
    return names.pop() if len(names) == 1 else None


def awaiting_admission(pod: Mapping[str, Any] | None) -> bool:
    """Whether ``pod`` may still be admitted by its node's kubelet (and its ``Allocate`` be
    called): it exists, is not being deleted, has not failed, finished or started running, and
    the node's plugin has not marked it allocated."""
    if pod is None:
        return False
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    if manifests.ALLOCATED_ANNOTATION in (meta.get("annotations") or {}):
        return False
    return not (manifests.pod_running(pod) or manifests.pod_failure(pod))


class AdmissionGate:
    """Creates of kernel pods, one (node, size) at a time up to the kubelet's admission."""

    def __init__(self, pods: PodWatcher, resource: str, timeout: float = ADMISSION_WAIT_S) -> None:
        self.pods = pods
        self.resource = resource
        self.timeout = timeout
        #: (node, units) -> its turn and how many starts hold or wait for it
        self._turns: dict[tuple[str, int], tuple[asyncio.Lock, int]] = {}
        #: starts that went ahead after waiting ``timeout`` (for logs and tests)
        self.timeouts = 0

    @contextlib.asynccontextmanager
    async def turn(self, pod: Mapping[str, Any]) -> AsyncIterator[None]:
        """Hold the turn of ``pod`` (the manifest about to be created) while the body creates
        it and records it in the informer (``PodWatcher.note``): the next start of its node
        and size then sees it and waits for its admission. Pods that ask no share resource
        (without the device plugin) or name no single node pass at once."""
        units = manifests.requested_units(pod, self.resource)
        node = pod_node(pod)
        if units <= 0 or node is None:
            yield
            return
        key = (node, units)
        turn, users = self._turns.get(key) or (asyncio.Lock(), 0)
        self._turns[key] = (turn, users + 1)
        try:
            async with turn:
                await self._after_those_ahead(node, units, str(pod["metadata"]["name"]))
                yield
        finally:  # the last user of a turn removes it (a released lock reads unlocked before
            turn, users = self._turns[key]  # its next waiter runs: that is not the last user)
            if users == 1:
                del self._turns[key]
            else:
                self._turns[key] = (turn, users - 1)

    def ahead(self, node: str, units: int, name: str) -> list[str]:
        """The pods of ``node`` and ``units`` other than ``name`` that wait for admission."""
        return sorted(
            str(p["metadata"]["name"])
            for p in self.pods.values()
            if p["metadata"].get("name") != name
            and not self.pods.deleted(str(p["metadata"].get("name")))
            and pod_node(p) == node
            and manifests.requested_units(p, self.resource) == units
            and awaiting_admission(p)
        )

    async def _after_those_ahead(self, node: str, units: int, name: str) -> None:
        ahead = self.ahead(node, units, name)
        if not ahead:
            return
        started = time.monotonic()

        def admitted() -> bool:  # only those: no one else creates this (node, size) meanwhile
            return not any(awaiting_admission(self.pods.get_live(p)) for p in ahead)

        try:
            await self.pods.wait_until(admitted, self.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.timeouts += 1
            log.warning(
                "gpushare: kernel pod %s waited %.0f s for the admission of %s on %s (%d units); "
                "creating it anyway",
                name,
                time.monotonic() - started,
                ", ".join(p for p in ahead if awaiting_admission(self.pods.get_live(p))),
                node,
                units,
            )


class LeaseGate:
    """Creates of kernel pods across servers (direct mode): the server whose pod of a node and
    size is next holds that node and size's Lease from before the create until the kubelet has
    admitted the pod (read from its own informer), or ``timeout`` seconds."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        pods: PodWatcher,
        resource: str,
        holder: str,
        owner: Callable[[], Awaitable[Mapping[str, Any] | None]],
        timeout: float = ADMISSION_WAIT_S,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.pods = pods
        self.resource = resource
        self.holder = holder
        self.owner = owner
        self.timeout = timeout
        #: starts that went ahead without the Lease, or before their pod was admitted
        self.timeouts = 0

    @contextlib.asynccontextmanager
    async def turn(self, pod: Mapping[str, Any]) -> AsyncIterator[None]:
        """Hold the Lease of ``pod``'s node and size while the body creates it (and records it
        in the informer), and after, until the kubelet has admitted it."""
        units = manifests.requested_units(pod, self.resource)
        node = pod_node(pod)
        if units <= 0 or node is None:
            yield
            return
        name = str(pod["metadata"]["name"])
        deadline = time.monotonic() + self.timeout
        held = await self._acquire(node, units, name, deadline)
        try:
            yield
            await self._admitted(name, node, units)
        finally:
            if held is not None:
                with contextlib.suppress(ApiException, OSError):
                    await self.kube.delete_lease(
                        self.namespace, held["metadata"]["name"], held["metadata"]["uid"]
                    )

    async def _acquire(
        self, node: str, units: int, name: str, deadline: float
    ) -> dict[str, Any] | None:
        """Create the Lease (or take over an expired one); None after waiting ``timeout``."""
        delay = 0.05
        owner = await self.owner()
        while True:
            now = datetime.now(timezone.utc)
            # held for the create and then at most ``timeout`` for the admission: a Lease
            # expires only past that (with a margin for the create and clock steps)
            duration = self.timeout + LEASE_MARGIN_S
            body = manifests.admission_lease(
                node, units, self.namespace, self.holder, duration, owner, now
            )
            try:
                return await self.kube.create_lease(self.namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
            held = await self.kube.get_lease(self.namespace, body["metadata"]["name"])
            if held is not None and manifests.lease_expired(held, now):
                body["metadata"]["resourceVersion"] = held["metadata"]["resourceVersion"]
                with contextlib.suppress(ApiException):  # 409: another server took it first
                    taken = await self.kube.replace_lease(self.namespace, body)
                    log.warning(
                        "gpushare: took over the expired admission Lease of %s on %s (%d units)",
                        (held.get("spec") or {}).get("holderIdentity"),
                        node,
                        units,
                    )
                    return taken
            if time.monotonic() >= deadline:
                self.timeouts += 1
                log.warning(
                    "gpushare: kernel pod %s waited %.0f s for %s's admission Lease on %s "
                    "(%d units); creating it anyway",
                    name,
                    self.timeout,
                    ((held or {}).get("spec") or {}).get("holderIdentity", "another server"),
                    node,
                    units,
                )
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.4)

    async def _admitted(self, name: str, node: str, units: int) -> None:
        try:
            await self.pods.wait_for(name, lambda p: not awaiting_admission(p), self.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.timeouts += 1
            log.warning(
                "gpushare: kernel pod %s was not admitted on %s (%d units) within %.0f s; "
                "letting the next start of that size go",
                name,
                node,
                units,
                self.timeout,
            )


__all__ = [
    "ADMISSION_WAIT_S",
    "AdmissionGate",
    "LeaseGate",
    "awaiting_admission",
    "pod_node",
]
