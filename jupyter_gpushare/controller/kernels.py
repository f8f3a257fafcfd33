"""What the active controller does for users: place shares, run kernel pods, resize, release.

:class:`KernelService` is the only holder of the cluster rights (DEVELOPING.md, box 12). It takes
an already-authenticated :class:`~.auth.HubUser` on every call and authorizes by the record: a
user sees and changes only allocations whose ``user`` is their Hub name; Hub admins all.

- placement and records: :func:`~jupyter_gpushare.placement.allocate` on the
  :class:`~jupyter_gpushare.k8s.ledger.WatchedLedger`: the GpuLedgers and Nodes are informer
  caches, placement runs on the indexed ``Placer`` the watch keeps current, and each record is
  a CAS on its GpuLedger's ``resourceVersion``; within the user's bound (:mod:`.bounds`,
  recorded on the allocation). Every read (allocations, GPUs, kernel status) is answered from
  the caches: REST polling costs the API server nothing;
- kernel pods: :mod:`jupyter_gpushare.k8s.manifests` builds the Secret and the Pod (the only
  place they are built), labelled with the caller's owner label; :mod:`.network` keeps the
  NetworkPolicy that lets only that user's server in (ensured before the pod exists); one
  :class:`~jupyter_gpushare.k8s.watch.PodWatcher` follows every
  kernel pod of the namespace;
- idempotent for retries and failover: a second reserve with the same ``kernel_id`` returns the
  share already placed for it; a launch is named by the caller's ``launch_id``, and a retry of
  the same launch finds its pod instead of making a second one. So a client that lost its
  answer (controller killed mid-start) retries against the new leader and never holds two
  shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..bound import check_within, narrowed, record, recorded, tightest
from ..inventory import Gpu, TypeAliases, check_spec, simulator_device_list
from ..k8s import manifests
from ..k8s.admission import ADMISSION_WAIT_S, AdmissionGate
from ..k8s.client import ApiException, Kube
from ..k8s.ledger import WatchedLedger
from ..k8s.watch import PodWatcher
from ..ledger import Allocation, AllocationNotFound
from ..placement import Policy, allocate
from ..progress import pod_phase
from ..resize import parse_change, resize
from ..share import ShareSpec
from ..usage import UsageSource
from .auth import HubUser
from .bounds import Bounds, Quotas
from .errors import ControllerError, bad_request, forbidden, not_found
from .network import KernelNetwork
from .servers import ServerLeases, check_server_id

log = logging.getLogger("jupyter_gpushare.controller")

KERNEL_ID = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_]{0,63}$")
LAUNCH_ID = re.compile(r"^[a-z0-9]{4,32}$")
PORT_KEYS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
#: environment the controller never takes from a user's server: it sets these itself
RESERVED_ENV = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "PATH",
    "KUBECONFIG",
)


def check_kernel_id(value: Any) -> str:
    if not isinstance(value, str) or not KERNEL_ID.match(value):
        raise bad_request("kernel_id", value, "1-64 letters, digits, '-' and '_'")
    return value


def check_command(value: Any) -> list[str]:
    if (
        not isinstance(value, list)
        or not value
        or len(value) > 256
        or not all(isinstance(a, str) and len(a) <= 4096 for a in value)
    ):
        raise bad_request("command", value, "a non-empty list of at most 256 strings")
    return list(value)


def check_env(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > 256
        or not all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(v) <= 65536
            and re.match(r"^[A-Za-z_][A-Za-z0-9_.-]{0,255}$", k)
            for k, v in value.items()
        )
    ):
        raise bad_request("env", value, "an object of at most 256 NAME: string pairs")
    return {
        k: v for k, v in value.items() if k not in RESERVED_ENV and not k.startswith("GPUSHARE_")
    }


def check_connection(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request("connection", value, "an object with the kernel's ports and key")
    out: dict[str, Any] = {}
    for key in PORT_KEYS:
        port = value.get(key)
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise bad_request(f"connection.{key}", port, "a port number 1-65535")
        out[key] = port
    for key, default in (
        ("key", None),
        ("signature_scheme", "hmac-sha256"),
        ("transport", "tcp"),
        ("kernel_name", ""),
    ):
        text = value.get(key, default)
        if not isinstance(text, str) or len(text) > 1024:
            raise bad_request(f"connection.{key}", text, "a string")
        out[key] = text
    if out["transport"] != "tcp":
        raise bad_request("connection.transport", out["transport"], "'tcp'")
    out["ip"] = "0.0.0.0"
    return out


class KernelService:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        aliases: TypeAliases,
        policy: Policy,
        bounds: Bounds,
        servers: ServerLeases,
        pod_settings: manifests.PodSettings,
        usage: UsageSource,
        start_timeout: float = 300.0,
        admission_wait: float = ADMISSION_WAIT_S,
        quotas: Quotas | None = None,
        network: KernelNetwork | None = None,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.aliases = aliases
        self.policy = policy
        self.bounds = bounds
        self.servers = servers
        self.pod_settings = pod_settings
        self.usage = usage
        self.start_timeout = start_timeout
        self.ledger = WatchedLedger(kube, namespace, aliases)
        self.watcher = PodWatcher(
            kube, namespace, f"{manifests.LABEL_COMPONENT}={manifests.KERNEL_COMPONENT}"
        )
        #: one kernel pod per node and size waits for the kubelet's admission at a time
        self.admission = AdmissionGate(self.watcher, pod_settings.share_resource, admission_wait)
        self.quotas = quotas or Quotas({}, {}, None)
        #: the per-user NetworkPolicies (None: the controller keeps none)
        self.network = network
        # one placement or resize per user at a time, so a quota check and its write are one
        # step (only the leader writes; a process lock is enough)
        self._user_locks: dict[str, asyncio.Lock] = {}

    async def start(self, timeout: float) -> None:
        """List and watch: Nodes, GpuLedgers, kernel pods, server Leases (one watch each)."""
        try:
            await self.ledger.start(timeout)
            await self.watcher.start(timeout)
            await self.servers.start(timeout)
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await self.servers.stop()
        await self.watcher.stop()
        await self.ledger.stop()

    # -- reads -----------------------------------------------------------------------------------

    async def gpus(self) -> list[Gpu]:
        return await self.ledger.gpus()

    async def allocations(self, user: HubUser) -> list[Allocation]:
        return [a for a in await self.ledger.list() if user.admin or a.user == user.name]

    async def allocation(self, user: HubUser, allocation_id: str) -> Allocation:
        try:
            found = await self.ledger.get(allocation_id)
        except AllocationNotFound:
            raise not_found("allocation", allocation_id) from None
        if not user.admin and found.user != user.name:
            raise forbidden(f"allocation {allocation_id!r} belongs to another user")
        return found

    def kernel_status(self, allocation: Allocation) -> dict[str, Any]:
        """The pod of an allocation as the watch sees it (for the server's ``poll``)."""
        name = allocation.extra.get("k8s_pod")
        pod = self.watcher.get(name) if name else None
        status: dict[str, Any] = {"allocation": allocation.id, "pod": name, "exists": bool(pod)}
        if pod is not None:
            status.update(
                phase=(pod.get("status") or {}).get("phase"),
                exit_code=manifests.pod_exit_code(pod),
                failure=manifests.pod_failure(pod),
                deleting=bool(pod["metadata"].get("deletionTimestamp")),
                ip=(pod.get("status") or {}).get("podIP"),
            )
            seen = pod_phase(pod)  # the start's phase in the cluster's words, for the server's UI
            if seen is not None:
                status.update(start_phase=seen[0], start_message=seen[1])
        elif name:
            status.update(exit_code=-9, failure=f"pod {name} was deleted")
        return status

    # -- placing ---------------------------------------------------------------------------------

    async def reserve(self, user: HubUser, body: Mapping[str, Any]) -> Allocation:
        kernel_id = check_kernel_id(body.get("kernel_id"))
        server_id = check_server_id(body.get("server_id"))
        share = body.get("share")
        if not isinstance(share, Mapping):
            raise bad_request("share", share, "an object with gpu_request, gpu_limit, ...")
        owner = body.get("owner", "kernel")
        if owner not in ("kernel", "pool"):
            raise bad_request("owner", owner, "'kernel' or 'pool'")
        spec = ShareSpec.from_mapping({k: v for k, v in share.items() if v is not None})
        bound = self.bounds.of(user)
        spec = narrowed(spec, bound)  # refused by name when over the user's bound
        gpus = await self.gpus()
        spec = check_spec(spec, gpus, self.aliases)
        async with self._user_lock(user):
            held = [a for a in await self.ledger.list() if a.user == user.name]
            existing = [a for a in held if a.kernel_id == kernel_id]
            if existing:  # a retry (or a restart) of the same kernel: one share per kernel
                return existing[0]
            self._check_quota(user, held, spec.gpu_request * spec.gpu_count)
            await self.servers.touch(user, server_id)  # its Lease exists before the record
            allocation = await allocate(
                self.ledger,
                spec,
                gpus,
                self.policy,
                place_fn=self.ledger.indexed(self.policy),
                owner=owner,
                kernel_id=kernel_id,
                backend="kubernetes",
                user=user.name,
                extra=record({"k8s_server": server_id, "k8s_namespace": self.namespace}, bound),
            )
        log.info(
            "gpushare controller: %s holds %s on %s %s (kernel %s)",
            user.name,
            spec.describe(),
            allocation.node,
            ",".join(allocation.gpus),
            kernel_id,
        )
        return allocation

    async def resize(
        self, user: HubUser, allocation_id: str, change: Mapping[str, Any]
    ) -> Allocation:
        before = await self.allocation(user, allocation_id)
        spec = parse_change(before.spec, change)
        own_bound = None if (user.admin and before.user != user.name) else self.bounds.of(user)
        check_within(
            spec, spec.gpu_memory or before.memory, tightest([recorded(before.extra), own_bound])
        )
        owner = HubUser(before.user) if before.user != user.name else user
        async with self._user_lock(owner):
            others = [
                a for a in await self.ledger.list() if a.user == before.user and a.id != before.id
            ]
            if before.user == user.name:  # an admin changing someone's share is not held
                self._check_quota(user, others, spec.gpu_request * len(before.gpus))
            _before, after = await resize(
                self.ledger, allocation_id, change, self.usage, actor=user.name, logger=log
            )
        return after

    def _user_lock(self, user: HubUser) -> asyncio.Lock:
        return self._user_locks.setdefault(user.name, asyncio.Lock())

    def _check_quota(self, user: HubUser, held: Sequence[Allocation], more: float) -> None:
        quota = self.quotas.of(user)
        if quota is None:
            return
        used = sum(a.request * len(a.gpus) for a in held)
        if used + more > quota + 1e-9:
            raise ControllerError(
                409,
                "over_quota",
                f"{user.name}'s shares may request at most {quota:g} GPU in all; they hold "
                f"{used:g} now, so {more:g} more does not fit (release or shrink a share)",
                field="gpu_request",
                value=more,
                quota=quota,
                held=round(used, 4),
            )

    async def release(self, user: HubUser, allocation_id: str) -> Allocation:
        found = await self.allocation(user, allocation_id)
        pod = found.extra.get("k8s_pod")
        if pod:
            await self._remove_pod(str(pod), grace=1)
        released = await self.ledger.release(allocation_id)
        if released is None:
            raise not_found("allocation", allocation_id)
        log.info(
            "gpushare controller: released %s of %s (by %s)", allocation_id, found.user, user.name
        )
        return released

    # -- kernel pods -----------------------------------------------------------------------------

    async def launch(self, user: HubUser, body: Mapping[str, Any]) -> dict[str, Any]:
        """Start the kernel pod of an allocation (placing it first when ``share`` is given) and
        wait for it to run; returns the connection info with the pod's IP."""
        launch_id = body.get("launch_id")  # everything is checked before anything is placed
        if not isinstance(launch_id, str) or not LAUNCH_ID.match(launch_id):
            raise bad_request(
                "launch_id",
                launch_id,
                "4-32 lowercase letters and digits, new "
                "for each launch and the same for its retries",
            )
        command = check_command(body.get("command"))
        env = check_env(body.get("env"))
        connection = check_connection(body.get("connection"))
        placed_here = "allocation_id" not in body
        if not placed_here:
            allocation_id = body["allocation_id"]
            if not isinstance(allocation_id, str):
                raise bad_request("allocation_id", allocation_id, "a string")
            if "share" in body:
                raise bad_request("share", body["share"], "either share or allocation_id")
            allocation = await self.allocation(user, allocation_id)
        else:
            allocation = await self.reserve(user, body)
        kernel_id = allocation.kernel_id or check_kernel_id(body.get("kernel_id"))
        server_id = check_server_id(allocation.extra.get("k8s_server") or body.get("server_id"))
        name = f"gpushare-kernel-{kernel_id[:8].lower()}-{launch_id[:10]}"
        owner = await self.servers.touch(user, server_id)

        def with_pod(current: Allocation, _others: list[Allocation]) -> Allocation:
            extra = {
                **current.extra,
                "k8s_namespace": self.namespace,
                "k8s_pod": name,
                "k8s_server": server_id,
            }
            if current.extra.get("k8s_pod") != name:
                extra.pop("k8s_pod_uid", None)  # a restart's new pod gets its own
            return replace(current, extra=extra, state="reserved")

        allocation = await self.ledger.update(allocation.id, with_pod)
        node_gpus = [g for g in await self.gpus() if g.node == allocation.node]
        request = manifests.KernelPodRequest(
            name=name,
            namespace=self.namespace,
            kernel_id=kernel_id,
            allocation_id=allocation.id,
            node=allocation.node,
            gpus=allocation.gpus,
            command=command,
            env=env,
            server_id=server_id,
            owner=owner,
            simulated_devices=simulator_device_list(node_gpus)
            if node_gpus and all(g.simulated for g in node_gpus)
            else "",
            gpu_request=allocation.request,
            gpu_memory=allocation.memory,
            user_label=manifests.owner_label(user.name),  # the caller's server connects to it
        )
        try:
            if self.network is not None:  # before the pod: never a kernel its user can't reach
                await self.network.ensure(request.user_label)
            try:
                await self.kube.create_secret(
                    self.namespace,
                    manifests.connection_secret(name, self.namespace, connection, owner, kernel_id),
                )
            except ApiException as exc:
                if exc.status != 409:  # 409: this launch's retry; the Secret is already there
                    raise
            manifest = manifests.kernel_pod(request, self.pod_settings)
            async with self.admission.turn(manifest):
                try:
                    pod = await self.kube.create_pod(self.namespace, manifest)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    pod = await self._existing_pod(name, allocation.id)
                await self.watcher.note(pod)
            uid = pod["metadata"]["uid"]

            def with_uid(current: Allocation, _others: list[Allocation]) -> Allocation:
                return replace(current, extra={**current.extra, "k8s_pod_uid": uid})

            allocation = await self.ledger.update(allocation.id, with_uid)
            await self.kube.set_secret_owners(
                self.namespace,
                name,
                [manifests.owner_reference({**pod, "apiVersion": "v1", "kind": "Pod"})],
            )
            pod = await self._wait_running(name)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._remove_pod(name, grace=1)
                if placed_here:  # a start that placed its share gives it back when it fails
                    await self.ledger.release(allocation.id)
            raise

        def active(current: Allocation, _others: list[Allocation]) -> Allocation:
            return replace(current, state="active")

        allocation = await self.ledger.update(allocation.id, active)
        log.info(
            "gpushare controller: kernel %s of %s runs in pod %s on %s",
            kernel_id,
            user.name,
            name,
            allocation.node,
        )
        info = {k: v for k, v in connection.items()}
        info["ip"] = pod["status"]["podIP"]
        return {"allocation": allocation.to_json(), "pod": name, "connection": info}

    async def _existing_pod(self, name: str, allocation_id: str) -> dict[str, Any]:
        pod = await self.kube.get_pod(self.namespace, name)
        labels = (pod or {}).get("metadata", {}).get("labels") or {}
        if pod is None or labels.get(manifests.LABEL_ALLOCATION) != allocation_id:
            raise ControllerError(
                409, "launch_conflict", f"pod {name} exists and is not this launch's"
            )
        return pod

    async def _wait_running(self, name: str) -> dict[str, Any]:
        def settled(pod: dict[str, Any] | None) -> bool:
            return pod is None or manifests.pod_running(pod) or bool(manifests.pod_failure(pod))

        try:
            pod = await self.watcher.wait_for(name, settled, self.start_timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise ControllerError(
                503,
                "kernel_pod_failed",
                f"kernel pod {name} did not start within {self.start_timeout:g} s",
            ) from None
        if pod is None:
            raise ControllerError(
                503, "kernel_pod_failed", f"kernel pod {name} was deleted while starting"
            )
        failure = manifests.pod_failure(pod)
        if failure:
            raise ControllerError(503, "kernel_pod_failed", failure)
        return pod

    async def stop_kernel(self, user: HubUser, allocation_id: str, grace: int) -> dict[str, Any]:
        """Delete the allocation's pod and Secret; the share stays (a restart reuses it). A
        share released from inside its kernel (the node agent's Release: the record goes, the
        pod and its Python state live on) leaves the user's pod, found by its labels."""
        try:
            allocation = await self.allocation(user, allocation_id)
        except ControllerError as exc:
            if exc.status != 404:
                raise
            pod = self.released_pod(user, allocation_id)
            if pod is None:
                raise
            await self._remove_pod(pod["metadata"]["name"], grace)
            return self.released_status(allocation_id, pod)
        name = allocation.extra.get("k8s_pod")
        if name:
            await self._remove_pod(str(name), grace)
        return self.kernel_status(allocation)

    def released_pod(self, user: HubUser, allocation_id: str) -> dict[str, Any] | None:
        """The kernel pod of ``user``'s allocation ``allocation_id`` whose record is gone (its
        share released from inside the kernel), from the watch: labelled with that allocation
        and, unless ``user`` is a Hub admin, with the user's owner label."""
        owner = manifests.owner_label(user.name)
        for pod in self.watcher.values():
            labels = pod["metadata"].get("labels") or {}
            if labels.get(manifests.LABEL_ALLOCATION) != allocation_id:
                continue
            if user.admin or labels.get(manifests.LABEL_OWNER) == owner:
                return pod
        return None

    def released_status(self, allocation_id: str, pod: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`kernel_status` of a pod whose share was released: it runs on, unshared."""
        return {
            "allocation": allocation_id,
            "pod": pod["metadata"]["name"],
            "exists": True,
            "released": True,
            "phase": (pod.get("status") or {}).get("phase"),
            "exit_code": manifests.pod_exit_code(pod),
            "failure": manifests.pod_failure(pod),
            "deleting": bool(pod["metadata"].get("deletionTimestamp")),
            "ip": (pod.get("status") or {}).get("podIP"),
        }

    async def _remove_pod(self, name: str, grace: int) -> None:
        with contextlib.suppress(ApiException):
            await self.kube.delete_pod(self.namespace, name, grace)
        try:
            await self.watcher.wait_for(name, lambda p: p is None, grace + 15.0)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("gpushare controller: pod %s did not confirm termination; forcing", name)
            with contextlib.suppress(ApiException):
                await self.kube.delete_pod(self.namespace, name, 0)
        with contextlib.suppress(ApiException):
            await self.kube.delete_secret(self.namespace, name)


def gpus_json(gpus: Sequence[Gpu]) -> list[dict[str, Any]]:
    return [g.to_json() for g in gpus]


__all__ = ["KernelService", "check_command", "check_connection", "check_env", "gpus_json"]
