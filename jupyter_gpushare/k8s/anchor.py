"""The Jupyter server's liveness anchor in the cluster: a ``Lease`` it renews while it runs.

Every kernel pod of the server is owned by this Lease (and each kernel's Secret by its pod), so
when the Lease goes, the garbage collector removes the server's pods and Secrets. It goes when:

- the server pod is deleted (the Lease is owned by it, when the server runs in a pod);
- the server stops renewing it (killed, hung, partitioned): the reconciler
  (:mod:`.reconcile`, run by the node daemon) deletes Leases expired for longer than their
  duration, and releases the ledger records of their kernels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from datetime import datetime, timezone
from typing import Any

from . import manifests
from .client import ApiException, Kube

log = logging.getLogger(__name__)


class ServerAnchor:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        server_id: str,
        duration: float,
        interval: float,
        owner_pod: str = "",
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.server_id = server_id
        self.duration = duration
        self.interval = interval
        self.owner_pod = owner_pod
        self.holder = f"{socket.gethostname()}/{os.getpid()}"
        self._lease: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return manifests.lease_name(self.server_id)

    async def owner_reference(self) -> dict[str, Any]:
        """An ownerReference to the live Lease (created on first use)."""
        async with self._lock:
            if self._lease is None:
                self._lease = await self._create()
            if self._task is None:
                self._task = asyncio.create_task(self._renew_forever(), name="gpushare-lease")
            return manifests.owner_reference(self._lease)

    async def _create(self) -> dict[str, Any]:
        existing = await self.kube.get_lease(self.namespace, self.name)
        if existing is not None:
            return await self._renew(existing)
        owner = None
        if self.owner_pod:
            pod = await self.kube.get_pod(self.namespace, self.owner_pod)
            if pod is not None:
                owner = manifests.owner_reference({**pod, "apiVersion": "v1", "kind": "Pod"})
        body = manifests.server_lease(
            self.server_id, self.namespace, self.holder, self.duration, owner
        )
        lease = await self.kube.create_lease(self.namespace, body)
        log.info("gpushare: server lease %s/%s created", self.namespace, self.name)
        return {**lease, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}

    async def _renew(self, lease: dict[str, Any]) -> dict[str, Any]:
        lease = {**lease, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
        lease["spec"] = {
            **(lease.get("spec") or {}),
            "holderIdentity": self.holder,
            "leaseDurationSeconds": max(1, round(self.duration)),
            "renewTime": manifests.micro_time(datetime.now(timezone.utc)),
        }
        renewed = await self.kube.replace_lease(self.namespace, lease)
        return {**renewed, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                async with self._lock:
                    current = await self.kube.get_lease(self.namespace, self.name)
                    if current is None:
                        # Reclaimed (we were unreachable for longer than the duration): its pods
                        # are being garbage-collected; new kernels get a new Lease.
                        log.warning("gpushare: server lease %s was reclaimed", self.name)
                        self._lease = await self._create()
                    else:
                        self._lease = await self._renew(current)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep renewing through API hiccups
                log.warning("gpushare: renewing lease %s failed: %s", self.name, exc)

    async def close(self, delete: bool = False) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if delete and self._lease is not None:
            with contextlib.suppress(ApiException):
                await self.kube.delete_lease(self.namespace, self.name)
            self._lease = None
