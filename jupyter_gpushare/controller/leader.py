"""Leader election on a ``coordination.k8s.io`` Lease: one active controller, standbys waiting.

The rules client-go's leader election uses, on plain Lease objects:

- a replica takes the Lease when it is missing, or when its holder has not renewed it for
  ``leaseDurationSeconds`` (the write carries the ``resourceVersion`` it read, so of two
  standbys racing for an expired Lease exactly one wins);
- the leader renews every ``renew_interval``; if it cannot renew for ``duration`` (API server
  unreachable, or someone else holds the Lease), it steps down at once (:attr:`on_lost`), before
  a standby can take over, so two replicas never act as leader together for longer than the
  clock skew between them;
- a standby keeps reading the Lease every ``retry_interval`` and reports the holder
  (:attr:`holder`) for its 503 answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from ..k8s import manifests
from ..k8s.client import ApiException, Kube

log = logging.getLogger("jupyter_gpushare.controller")

LEASE_API = "coordination.k8s.io/v1"


def lease_body(
    name: str,
    namespace: str,
    identity: str,
    duration: float,
    now: datetime,
    transitions: int,
    acquired: datetime | None = None,
    resource_version: str | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {manifests.LABEL_COMPONENT: "gpushare-controller"},
    }
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {
        "apiVersion": LEASE_API,
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": max(1, round(duration)),
            "acquireTime": manifests.micro_time(acquired or now),
            "renewTime": manifests.micro_time(now),
            "leaseTransitions": transitions,
        },
    }


class LeaderElection:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        duration: float = 15.0,
        renew_interval: float = 5.0,
        retry_interval: float = 2.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.duration = duration
        self.renew_interval = renew_interval
        self.retry_interval = retry_interval
        self.is_leader = False
        self.holder: str | None = None
        self.last_error: str | None = None
        self.on_started: Callable[[], Awaitable[None]] | None = None
        self.on_lost: Callable[[], Awaitable[None]] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="gpushare-leader-election")

    async def stop(self, release: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.is_leader:
            await self._step_down()
            if release:  # let a standby take over at once rather than after the duration
                with contextlib.suppress(ApiException, OSError):
                    lease = await self.kube.get_lease(self.namespace, self.name)
                    if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                        lease["spec"]["holderIdentity"] = ""
                        await self.kube.replace_lease(self.namespace, lease)

    async def _run(self) -> None:
        renewed = 0.0
        while True:
            try:
                held = await self._try_acquire_or_renew()
                self.last_error = None
                if held:
                    renewed = time.monotonic()
                    if not self.is_leader:
                        log.info("gpushare controller: %s is the leader", self.identity)
                        try:
                            if self.on_started is not None:
                                await self.on_started()
                        except Exception as exc:  # keep the Lease; try again next round
                            self.last_error = f"could not start serving: {exc}"
                            log.warning("gpushare controller: %s", self.last_error)
                            if self.on_lost is not None:
                                await self.on_lost()
                        else:
                            self.is_leader = True
                elif self.is_leader:
                    log.warning(
                        "gpushare controller: lease taken by %s; stepping down", self.holder
                    )
                    await self._step_down()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.last_error = str(exc) or type(exc).__name__
                log.warning("gpushare controller: leader election: %s", self.last_error)
                if self.is_leader and time.monotonic() - renewed > self.duration * 0.8:
                    log.warning("gpushare controller: could not renew the lease; stepping down")
                    await self._step_down()
            await asyncio.sleep(self.renew_interval if self.is_leader else self.retry_interval)

    async def _step_down(self) -> None:
        self.is_leader = False
        if self.on_lost is not None:
            await self.on_lost()

    async def _try_acquire_or_renew(self) -> bool:
        now = datetime.now(timezone.utc)
        lease = await self.kube.get_lease(self.namespace, self.name)
        if lease is None:
            try:
                await self.kube.create_lease(
                    self.namespace,
                    lease_body(self.name, self.namespace, self.identity, self.duration, now, 0),
                )
            except ApiException as exc:
                if exc.status == 409:
                    return False
                raise
            self.holder = self.identity
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        self.holder = holder or None
        mine = holder == self.identity
        if holder and not mine and not manifests.lease_expired(lease, now):
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        acquired = manifests.parse_time(spec.get("acquireTime")) if mine else None
        try:
            await self.kube.replace_lease(
                self.namespace,
                lease_body(
                    self.name,
                    self.namespace,
                    self.identity,
                    self.duration,
                    now,
                    transitions,
                    acquired,
                    resource_version=lease["metadata"]["resourceVersion"],
                ),
            )
        except ApiException as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise
        self.holder = self.identity
        return True


__all__ = ["LeaderElection", "lease_body"]
