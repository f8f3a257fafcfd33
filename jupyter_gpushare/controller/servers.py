"""The Leases that stand for users' Jupyter servers, kept by the controller on their behalf.

A user's server holds no Kubernetes rights, so it cannot renew its own Lease (see
:mod:`jupyter_gpushare.k8s.anchor` for direct mode). Instead it calls
``PUT /api/servers/{server_id}`` every few seconds and the controller renews
``Lease gpushare-server-<id>`` for it: with one merge PATCH, and only once the Lease is 0.6 of
its duration old (the heartbeats in between cost no API request). Kernel pods are owned by
that Lease and their records name it, so when a server dies and stops calling, the reconciler
deletes the expired Lease, the garbage collector removes the pods and their Secrets, and the
records are released — the same path as in direct mode. A Lease remembers its user
(annotation); another user touching it gets 403, so nobody can keep someone else's server
alive or hang kernels under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from datetime import datetime, timezone
from typing import Any

from ..k8s import manifests
from ..k8s.client import ApiException, Kube
from ..k8s.watch import Informer
from .auth import HubUser
from .errors import bad_request, forbidden, unavailable

USER_ANNOTATION = f"{manifests.GROUP}/user"
SERVER_ID = re.compile(r"^[a-z0-9][-a-z0-9]{0,39}$")


def check_server_id(value: Any) -> str:
    if not isinstance(value, str) or not SERVER_ID.match(value):
        raise bad_request("server_id", value, "1-40 lowercase letters, digits and '-'")
    return value


class ServerLeases:
    """The server Leases, known from one informer (label ``component=gpushare-server``), so a
    new leader knows every server's owner without reading; a heartbeat renews a Lease only
    once it is ``renew_fraction`` of its duration old, with one merge PATCH (no GET, no PUT).
    With the default 60 s that is one PATCH every 36-46 s (heartbeats every 10 s): at most 1.7
    API requests per idle server and minute, and a Lease still has 14 s to run when renewed."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        duration: float,
        holder: str,
        renew_fraction: float = 0.6,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.duration = duration
        self.holder = holder
        self.renew_after = duration * renew_fraction
        self.leases = Informer(
            kube, "leases", namespace, label_selector=f"{manifests.LABEL_COMPONENT}=gpushare-server"
        )

    async def start(self, timeout: float | None = None) -> None:
        await self.leases.start(timeout)

    async def stop(self) -> None:
        await self.leases.stop()

    async def touch(
        self, user: HubUser, server_id: str, force: bool = False, attempt: int = 0
    ) -> dict[str, Any]:
        """Create or renew the server's Lease (once it is ``renew_after`` seconds old, or at
        once with ``force``); returns an ownerReference to it. 403 when it belongs to another
        user."""
        check_server_id(server_id)
        if attempt > 5:
            raise unavailable(
                "lease_busy",
                f"the Lease of server {server_id!r} kept changing while it was renewed; try again",
            )
        name = manifests.lease_name(server_id)
        lease = self.leases.get(name)
        stamp = datetime.now(timezone.utc)
        if lease is not None:
            owner = (lease["metadata"].get("annotations") or {}).get(USER_ANNOTATION)
            if owner != user.name:
                raise forbidden(f"server {server_id!r} belongs to another user")
            spec = lease.get("spec") or {}
            renewed = manifests.parse_time(spec.get("renewTime"))
            if (
                not force
                and renewed is not None
                and spec.get("holderIdentity") == self.holder
                and (stamp - renewed).total_seconds() < self.renew_after
            ):
                return _reference(lease)
            try:
                lease = await self._renew(name, stamp)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                lease = None  # deleted meanwhile (expired): made again below
        if lease is None:
            body = manifests.server_lease(
                server_id, self.namespace, self.holder, self.duration, now=stamp
            )
            body["metadata"]["annotations"] = {USER_ANNOTATION: user.name}
            try:
                lease = await self.kube.create_lease(self.namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # made meanwhile: learn it from the watch, then check its owner
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await self.leases.wait_for(name, lambda o: o is not None, 2.0)
                if self.leases.get(name) is None:
                    found = await self.kube.get_lease(self.namespace, name)
                    if found is not None:
                        await self.leases.note(found)
                return await self.touch(user, server_id, force=force, attempt=attempt + 1)
        await self.leases.note(lease)
        return _reference(lease)

    async def _renew(self, name: str, stamp: datetime) -> dict[str, Any]:
        """One merge PATCH of the renewal fields."""
        patch = {
            "spec": {
                "holderIdentity": self.holder,
                "leaseDurationSeconds": max(1, round(self.duration)),
                "renewTime": manifests.micro_time(stamp),
            }
        }
        coordination: Any = self.kube.coordination
        return await self.kube._json(
            coordination.patch_namespaced_lease(
                name,
                self.namespace,
                patch,
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        )


def _reference(lease: dict[str, Any]) -> dict[str, Any]:
    return manifests.owner_reference(
        {**lease, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
    )


__all__ = ["ServerLeases", "check_server_id"]
