"""The Leases that stand for users' Jupyter servers, kept by the controller on their behalf.

A user's server holds no Kubernetes rights, so it cannot renew its own Lease (see
:mod:`jupyter_gpushare.k8s.anchor` for direct mode). Instead it calls
``PUT /api/servers/{server_id}`` every few seconds and the controller renews
``Lease gpushare-server-<id>`` for it. Kernel pods are owned by that Lease and their records
name it, so when a server dies and stops calling, the reconciler deletes the expired Lease, the
garbage collector removes the pods and their Secrets, and the records are released — the same
path as in direct mode. A Lease remembers its user (annotation); another user touching it gets
403, so nobody can keep someone else's server alive or hang kernels under it.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from typing import Any

from ..k8s import manifests
from ..k8s.client import ApiException, Kube
from .auth import HubUser
from .errors import bad_request, forbidden, unavailable

USER_ANNOTATION = f"{manifests.GROUP}/user"
SERVER_ID = re.compile(r"^[a-z0-9][-a-z0-9]{0,39}$")


def check_server_id(value: Any) -> str:
    if not isinstance(value, str) or not SERVER_ID.match(value):
        raise bad_request("server_id", value, "1-40 lowercase letters, digits and '-'")
    return value


class ServerLeases:
    def __init__(self, kube: Kube, namespace: str, duration: float, holder: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.duration = duration
        self.holder = holder
        # server id -> (monotonic time renewed, user, the Lease)
        self._known: dict[str, tuple[float, str, dict[str, Any]]] = {}

    async def touch(
        self, user: HubUser, server_id: str, force: bool = False, attempt: int = 0
    ) -> dict[str, Any]:
        """Create or renew the server's Lease (at most every duration/4 unless ``force``);
        returns an ownerReference to it. 403 when it belongs to another user."""
        check_server_id(server_id)
        if attempt > 5:
            raise unavailable(
                "lease_busy",
                f"the Lease of server {server_id!r} kept changing while it was renewed; try again",
            )
        known = self._known.get(server_id)
        now = time.monotonic()
        if known is not None and known[1] != user.name:
            raise forbidden(f"server {server_id!r} belongs to another user")
        if known is not None and not force and now - known[0] < self.duration / 4:
            return manifests.owner_reference(known[2])
        name = manifests.lease_name(server_id)
        lease = await self.kube.get_lease(self.namespace, name)
        stamp = datetime.now(timezone.utc)
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
                return await self.touch(user, server_id, force=True, attempt=attempt + 1)
        else:
            owner = (lease["metadata"].get("annotations") or {}).get(USER_ANNOTATION)
            if owner != user.name:
                raise forbidden(f"server {server_id!r} belongs to another user")
            lease["spec"] = {
                **(lease.get("spec") or {}),
                "holderIdentity": self.holder,
                "leaseDurationSeconds": max(1, round(self.duration)),
                "renewTime": manifests.micro_time(stamp),
            }
            try:
                lease = await self.kube.replace_lease(self.namespace, lease)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                return await self.touch(user, server_id, force=True, attempt=attempt + 1)
        lease = {**lease, "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
        self._known[server_id] = (now, user.name, lease)
        return manifests.owner_reference(lease)


__all__ = ["ServerLeases", "check_server_id"]
