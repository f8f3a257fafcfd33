"""Reconciliation on Kubernetes: records of kernels that are gone are reclaimed.

Run by the node daemon's DaemonSet (``python -m jupyter_gpushare.k8s.reconcile --node
$NODE_NAME``; without ``--node``, for every node). Each pass:

1. deletes server Leases that expired more than a grace period ago (a Jupyter server that was
   killed): the garbage collector then removes their kernel pods, and the pods' Secrets;
2. releases, by compare-and-swap, each ``kubernetes`` record whose holder is gone
   (:func:`stale_reason`): its server's Lease is gone or expired, or its pod has been missing
   for longer than the grace period (pod deleted and nobody restarted it).

Passes run every ``--interval`` seconds and at once when a kernel pod is deleted (watch).

In the controller a pass reads nothing from the API server: it is given the controller's caches
(``ledger`` a :class:`~.ledger.WatchedLedger`, ``pods`` the cluster's kernel-pod informer,
``leases`` the server-Lease informer) and only writes (a release, a Lease deletion).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ..inventory import TypeAliases
from ..ledger import Allocation
from . import manifests
from .client import ApiException, Kube, connect
from .ledger import KubernetesLedger
from .watch import Informer

log = logging.getLogger(__name__)


def stale_reason(
    allocation: Allocation,
    leases: Mapping[str, Mapping[str, Any]],
    pods: Mapping[str, Mapping[str, Any]],
    now: datetime,
    missing_since: float | None,
    grace: float,
    clock: float,
) -> str | None:
    """Why a ``kubernetes`` record is stale, or None. ``leases`` by server id, ``pods`` by name
    (the kernel pods that exist); ``missing_since`` the monotonic time its pod was first seen
    missing (None if present); ``clock`` the monotonic time now."""
    if allocation.backend != "kubernetes":
        return None
    extra = allocation.extra
    server = extra.get("k8s_server")
    if not server:
        age = now.timestamp() - allocation.created
        return f"no server recorded after {age:.0f} s" if age > max(grace, 60.0) else None
    lease = leases.get(server)
    if lease is None:
        # The records and the Leases come through separate watches: a record placed a moment
        # ago by a server that has just started can arrive before that server's Lease does.
        age = now.timestamp() - allocation.created
        return f"its Jupyter server ({server}) is gone" if age > grace else None
    if manifests.lease_expired(lease, now, grace):
        return f"its Jupyter server ({server}) stopped renewing its lease"
    pod = extra.get("k8s_pod")
    if pod and pod not in pods and missing_since is not None and clock - missing_since > grace:
        return f"its pod {pod} is gone"
    return None


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        node: str | None = None,
        grace: float = 10.0,
        aliases: TypeAliases | None = None,
        ledger: KubernetesLedger | None = None,
        pods: Informer | None = None,
        leases: Informer | None = None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.node = node
        self.grace = grace
        self.ledger = ledger if ledger is not None else KubernetesLedger(kube, namespace, aliases)
        self.pods = pods
        self.leases = leases
        self._missing: dict[tuple[str, str], float] = {}

    async def run_once(self) -> list[Allocation]:
        """One pass; returns the records released."""
        now = datetime.now(timezone.utc)
        leases = await self._leases(now)
        if self.pods is not None:
            pods = {p["metadata"]["name"]: p for p in self.pods.values()}
        else:
            listing = await self.kube.list_pods(
                self.namespace, f"{manifests.LABEL_COMPONENT}={manifests.KERNEL_COMPONENT}"
            )
            pods = {p["metadata"]["name"]: p for p in listing.get("items") or []}
        clock = time.monotonic()
        released = []
        for allocation in await self.ledger.list(self.node):
            pod = allocation.extra.get("k8s_pod")
            key = (allocation.id, str(pod))
            if pod and pod not in pods:
                self._missing.setdefault(key, clock)
            else:
                self._missing.pop(key, None)
            reason = stale_reason(
                allocation, leases, pods, now, self._missing.get(key), self.grace, clock
            )
            if reason is None:
                continue
            if await self.ledger.release(allocation.id, if_unchanged=allocation) is not None:
                log.info("gpushare: released %s on %s: %s", allocation.id, allocation.node, reason)
                released.append(allocation)
            self._missing.pop(key, None)
        return released

    async def _leases(self, now: datetime) -> dict[str, dict[str, Any]]:
        """Live server Leases by server id; deletes the long-expired ones (their pods and
        Secrets then go with the garbage collector)."""
        live = {}
        if self.leases is not None:
            found = list(self.leases.values())
        else:
            found = await self.kube.list_leases(
                self.namespace, f"{manifests.LABEL_COMPONENT}=gpushare-server"
            )
        for lease in found:
            server = (lease["metadata"].get("labels") or {}).get(manifests.LABEL_SERVER, "")
            if manifests.lease_expired(lease, now, self.grace):
                with contextlib.suppress(ApiException):
                    if await self.kube.delete_lease(self.namespace, lease["metadata"]["name"]):
                        log.info(
                            "gpushare: deleted expired server lease %s", lease["metadata"]["name"]
                        )
                continue
            live[server] = lease
        return live

    async def run_forever(self, interval: float = 5.0) -> None:
        wake = asyncio.Event()
        watcher = asyncio.create_task(self._watch_deletions(wake))
        try:
            while True:
                try:
                    await self.run_once()
                except ApiException as exc:
                    log.warning("gpushare: reconciliation failed: %s", exc)
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(wake.wait(), interval)
                wake.clear()
        finally:
            watcher.cancel()

    async def _watch_deletions(self, wake: asyncio.Event) -> None:
        if self.pods is not None:  # the controller's informer: no watch of our own

            def deleted(kind: str, _obj: Any, _before: Any) -> None:
                if kind == "DELETED":
                    asyncio.get_running_loop().call_later(self.grace + 0.5, wake.set)

            self.pods.subscribe(deleted)
            try:
                await asyncio.Event().wait()  # until cancelled
            finally:
                self.pods.unsubscribe(deleted)
        selector = f"{manifests.LABEL_COMPONENT}={manifests.KERNEL_COMPONENT}"
        while True:
            try:
                listing = await self.kube.list_pods(self.namespace, selector)
                async for event in self.kube.watch(
                    "pods",
                    self.namespace,
                    listing["metadata"]["resourceVersion"],
                    label_selector=selector,
                ):
                    if event["type"] == "DELETED":
                        # Re-check after the grace period (a restart may re-point the record).
                        asyncio.get_running_loop().call_later(self.grace + 0.5, wake.set)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("gpushare: reconciler watch restarts: %s", exc)
                await asyncio.sleep(1.0)


async def _main(args: argparse.Namespace) -> None:
    kube = await connect(args.kubeconfig)
    try:
        reconciler = Reconciler(kube, args.namespace, args.node or None, args.grace)
        await reconciler.run_forever(args.interval)
    finally:
        await kube.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", default="gpushare")
    parser.add_argument("--node", default="", help="only this node's records (DaemonSet)")
    parser.add_argument("--kubeconfig", default="", help="default: in-cluster or $KUBECONFIG")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds a lease may be overdue or a pod missing before reclaiming",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
