"""The ``kubernetes`` backend: each gpushare kernel is a pod on the node and GPU placement chose.

Launch, step by step (every call async, status followed by the server's shared pod watch):

1. ``pre_launch``: the server picks the kernel's ports and key (the connection info); the kernel
   command points at the connection file where the Secret is mounted; the allocation record gets
   the pod's name and the server's Lease (for reconciliation).
2. ``launch_kernel``: a Secret with the connection file (owned by the server Lease until the pod
   exists, then by the pod), then the Pod (owned by the server Lease; required node affinity to
   the allocation's node, so the scheduler checks CPU/memory/taints; ``NVIDIA_VISIBLE_DEVICES``
   = the GPU's UUID; daemon socket and interposer mounted from the host and preloaded). It waits
   for the pod to run and returns the connection info with the pod's IP. The cluster's refusals
   (Unschedulable with the scheduler's message, image pull errors, a container that ended) end
   the wait at once, with those words.
3. While it runs, ``poll`` reads the watched pod: an evicted, OOM-killed, failed or deleted pod
   is a dead kernel, and jupyter_client's restarter starts a new pod with the same share.
4. ``cleanup`` deletes the pod and its Secret; the provisioner releases the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from jupyter_client.connect import KernelConnectionInfo

from ..backends.base import KernelBackend
from ..inventory import Gpu, simulator_device_list
from ..ledger import Allocation, Ledger
from ..progress import pod_phase
from ..progress import report as report_phase
from . import manifests
from .admission import LeaseGate
from .anchor import ServerAnchor
from .client import ApiException, ClusterError, Kube, connect
from .config import KubernetesBackendConfig
from .ledger import KubernetesLedger
from .watch import PodWatcher


class KernelPodFailed(ClusterError):
    """The kernel pod could not run; the message is the cluster's reason."""

    reason_code = "kernel_pod_failed"


@dataclass
class KubeContext:
    """What all kernels of one server share (per event loop): client, ledger, watch, Lease."""

    config: KubernetesBackendConfig
    kube: Kube
    ledger: KubernetesLedger
    watcher: PodWatcher
    anchor: ServerAnchor
    #: one pod per node and size waits for admission at a time (across servers: a Lease)
    admission: LeaseGate

    async def close(self, delete_lease: bool = False) -> None:
        await self.watcher.stop()
        await self.anchor.close(delete=delete_lease)
        await self.kube.close()


_contexts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, KubeContext] = (
    weakref.WeakKeyDictionary()
)
_context_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


async def kube_context(config: KubernetesBackendConfig, aliases: Any) -> KubeContext:
    """This loop's shared cluster context (direct mode; the controller's client is
    :mod:`jupyter_gpushare.controller.client`): one client, ledger, pod watch and Lease."""
    loop = asyncio.get_running_loop()
    lock = _context_locks.setdefault(loop, asyncio.Lock())
    async with lock:
        ctx = _contexts.get(loop)
        if ctx is None:
            kube = await connect(config.kubeconfig, config.context)
            ns = config.namespace
            watcher = PodWatcher(kube, ns, f"{manifests.LABEL_SERVER}={config.server_id}")
            anchor = ServerAnchor(
                kube,
                ns,
                config.server_id,
                config.lease_duration,
                config.lease_renew_interval,
                config.owner_pod,
            )
            ctx = KubeContext(
                config=config,
                kube=kube,
                ledger=KubernetesLedger(kube, ns, aliases, inventory_ttl=config.inventory_ttl),
                watcher=watcher,
                anchor=anchor,
                admission=LeaseGate(
                    kube,
                    ns,
                    watcher,
                    config.share_resource,
                    config.server_id,
                    anchor.owner_reference,
                    config.admission_wait,
                ),
            )
            try:
                await ctx.watcher.start(config.connect_timeout)
            except BaseException:
                await kube.close()  # the next use tries again
                raise
            _contexts[loop] = ctx
        return ctx


async def close_context(delete_lease: bool = True) -> None:
    """Stop this loop's shared watch and Lease renewal (server shutdown)."""
    ctx = _contexts.pop(asyncio.get_running_loop(), None)
    if ctx is not None:
        await ctx.close(delete_lease)


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


PORT_NAMES = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


class KubernetesKernelBackend(KernelBackend):
    name = "kubernetes"

    def __init__(self, provisioner: Any) -> None:
        super().__init__(provisioner)
        self.config = KubernetesBackendConfig.instance(config=provisioner.config)
        self.pod_name: str | None = None
        self.namespace = self.config.namespace
        self.allocation: Allocation | None = None
        self.failure: str | None = None
        self._connection: dict[str, Any] | None = None
        self._ctx: KubeContext | None = None
        self._launched = False
        self._deleting = False

    async def context(self) -> KubeContext:
        if self._ctx is None:
            self._ctx = await kube_context(self.config, self.provisioner.settings.aliases())
        return self._ctx

    # -- the share's world ---------------------------------------------------------------------

    async def ledger(self) -> Ledger:
        return (await self.context()).ledger

    async def inventory(self) -> Sequence[Gpu]:
        return await (await self.context()).ledger.gpus()

    # -- launch --------------------------------------------------------------------------------

    async def pre_launch(self, allocation: Allocation, **kwargs: Any) -> dict[str, Any]:
        ctx = await self.context()
        km = self.provisioner.parent
        if km is None:  # jupyter_client always sets it; a provisioner made by hand has none
            raise RuntimeError("the gpushare provisioner has no kernel manager (parent)")
        kernel_id = str(self.provisioner.kernel_id)
        self.pod_name = f"gpushare-kernel-{kernel_id[:8]}-{uuid.uuid4().hex[:5]}"
        self.failure = None
        self._launched = False
        self._deleting = False
        self._connection = self._connection_info(km)
        settings = self.provisioner.settings
        given = list(kwargs.pop("extra_arguments", []))
        extra = given + [a for a in settings.extra_kernel_args if a not in given]
        kwargs["cmd"] = self._pod_command(km.format_kernel_cmd(extra_arguments=extra), km)
        self.allocation = await ctx.ledger.update(allocation.id, self._record_pod)
        return kwargs

    def _record_pod(self, current: Allocation, _others: list[Allocation]) -> Allocation:
        extra = {
            **current.extra,
            "k8s_namespace": self.namespace,
            "k8s_pod": self.pod_name,
            "k8s_server": self.config.server_id,
        }
        extra.pop("k8s_pod_uid", None)  # a restart's new pod gets its own
        return replace(current, extra=extra)

    async def _record_pod_uid(self, ctx: KubeContext, pod: dict[str, Any]) -> None:
        """The node daemon lets only processes of this pod (by cgroup) use the share."""
        uid = pod["metadata"]["uid"]
        assert self.allocation is not None

        def with_uid(current: Allocation, _others: list[Allocation]) -> Allocation:
            return replace(current, extra={**current.extra, "k8s_pod_uid": uid})

        self.allocation = await ctx.ledger.update(self.allocation.id, with_uid)

    def _connection_info(self, km: Any) -> dict[str, Any]:
        """Ports (chosen here, by the server) and key; the kernel binds all interfaces of its
        pod. Kept across restarts of the same kernel."""
        if self._connection is not None:
            return self._connection
        ports = dict(zip(PORT_NAMES, _free_ports(len(PORT_NAMES)), strict=True))
        key = km.session.key
        return {
            **ports,
            "ip": "0.0.0.0",
            "transport": "tcp",
            "signature_scheme": km.session.signature_scheme,
            "key": key.decode() if isinstance(key, bytes) else str(key),
            "kernel_name": km.kernel_name or "",
        }

    def _pod_command(self, cmd: list[str], km: Any) -> list[str]:
        """The kernel command with the server's paths replaced by the pod's: the connection
        file by the Secret's mount, the server's Python by the image's."""
        local_file = os.path.realpath(km.connection_file) if km.connection_file else None
        target = manifests.PodSettings.from_config(self.config).connection_file
        out = []
        for arg in cmd:
            if local_file and local_file in arg:
                arg = arg.replace(local_file, target)
            out.append(arg)
        if out and out[0] == sys.executable:
            out[0] = self.config.python
        return out

    def _forwarded_env(self, given: dict[str, str] | None) -> dict[str, str]:
        """Only what jupyter_client and the kernelspec add (JPY_SESSION_NAME, spec env …); the
        server's own environment (tokens, paths) stays out of the pod."""
        env = {
            k: v
            for k, v in (given or {}).items()
            if os.environ.get(k) != v and not k.startswith("GPUSHARE_")
        }
        spec_env = getattr(self.provisioner.kernel_spec, "env", None) or {}
        env.update({k: str(v) for k, v in spec_env.items()})
        for key in ("LD_PRELOAD", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "PATH"):
            env.pop(key, None)
        return env

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        ctx = await self.context()
        assert self.allocation is not None and self.pod_name and self._connection
        owner = await ctx.anchor.owner_reference()
        ns = self.namespace
        inventory = await self.inventory()
        node_gpus = [g for g in inventory if g.node == self.allocation.node]
        request = manifests.KernelPodRequest(
            name=self.pod_name,
            namespace=ns,
            kernel_id=str(self.provisioner.kernel_id),
            allocation_id=self.allocation.id,
            node=self.allocation.node,
            gpus=self.allocation.gpus,
            command=cmd,
            env=self._forwarded_env(kwargs.get("env")),
            server_id=self.config.server_id,
            owner=owner,
            simulated_devices=simulator_device_list(node_gpus)
            if node_gpus and all(g.simulated for g in node_gpus)
            else "",
            gpu_request=self.allocation.request,
            gpu_memory=self.allocation.memory,
        )
        settings = manifests.PodSettings.from_config(self.config)
        await ctx.kube.create_secret(
            ns,
            manifests.connection_secret(
                self.pod_name, ns, self._connection, owner, request.kernel_id
            ),
        )
        manifest = manifests.kernel_pod(request, settings)
        try:
            async with ctx.admission.turn(manifest):
                pod = await ctx.kube.create_pod(ns, manifest)
                await ctx.watcher.note(pod)
            await self._record_pod_uid(ctx, pod)
            await ctx.kube.set_secret_owners(
                ns,
                self.pod_name,
                [manifests.owner_reference({**pod, "apiVersion": "v1", "kind": "Pod"})],
            )
            self._launched = True
            pod = await self._wait_running(ctx)
        except BaseException:
            await self._remove(ctx, grace=1)
            self._launched = False
            raise
        info = dict(self._connection)
        info["ip"] = pod["status"]["podIP"]
        info["key"] = str(info["key"]).encode()
        self.log.info(
            "gpushare: kernel %s runs in pod %s/%s on %s (%s)",
            self.provisioner.kernel_id,
            ns,
            self.pod_name,
            self.allocation.node,
            ",".join(self.allocation.gpus),
        )
        return info  # type: ignore[return-value]

    async def _wait_running(self, ctx: KubeContext) -> dict[str, Any]:
        assert self.pod_name
        name = self.pod_name

        def settled(pod: dict[str, Any] | None) -> bool:
            seen = pod_phase(pod)  # each change of the pod: the start's phase, for the UI
            if seen is not None:
                report_phase(self.provisioner.settings, self.provisioner.kernel_id, *seen)
            return pod is None or manifests.pod_running(pod) or bool(manifests.pod_failure(pod))

        try:
            pod = await ctx.watcher.wait_for(name, settled, self.config.start_timeout)
        except (asyncio.TimeoutError, TimeoutError):
            pod = ctx.watcher.get(name) or {}
            phase = (pod.get("status") or {}).get("phase", "unknown")
            raise KernelPodFailed(
                f"kernel pod {name} did not start within {self.config.start_timeout:g} s "
                f"(phase {phase})"
            ) from None
        if pod is None:
            raise KernelPodFailed(f"kernel pod {name} was deleted while starting")
        failure = manifests.pod_failure(pod)
        if failure:
            self.failure = failure
            self.log.error(
                "gpushare: kernel %s could not start: %s", self.provisioner.kernel_id, failure
            )
            raise KernelPodFailed(failure)
        return pod

    # -- the running kernel ----------------------------------------------------------------------

    def process_identity(self) -> tuple[int | None, float | None]:
        return None, None  # the process lives in a pod on another node

    @property
    def has_process(self) -> bool:
        return self._launched

    def _pod(self) -> dict[str, Any] | None:
        if self._ctx is None or self.pod_name is None:
            return None
        return self._ctx.watcher.get(self.pod_name)

    async def poll(self) -> int | None:
        """None while the kernel's pod runs; its exit status once the pod ended, was deleted or
        is being deleted (the process is on its way out; a restart waits for it to be gone)."""
        if not self._launched:
            return None
        pod = self._pod()
        code = manifests.pod_exit_code(pod)
        deleting = pod is not None and bool(pod["metadata"].get("deletionTimestamp"))
        if code is None and deleting:
            code = -9
        if code is not None and self.failure is None and not self._deleting:
            failure = manifests.pod_failure(pod) if pod is not None else None
            if pod is None or deleting:
                failure = f"pod {self.pod_name} was deleted" + (f" ({failure})" if failure else "")
            self.failure = failure or f"pod {self.pod_name} ended (exit code {code})"
            self.log.warning(
                "gpushare: kernel %s ended: %s", self.provisioner.kernel_id, self.failure
            )
        return code

    async def wait(self) -> int | None:
        if not self._launched or self._ctx is None or self.pod_name is None:
            return None
        await self._ctx.watcher.wait_for(
            self.pod_name, lambda p: manifests.pod_exit_code(p) is not None, None
        )
        return await self.poll()

    async def send_signal(self, signum: int) -> None:
        if signum == 0:
            return
        if signum == signal.SIGINT:
            self._interrupt()
        elif signum in (signal.SIGTERM, signal.SIGKILL):
            await self._delete_pod(0 if signum == signal.SIGKILL else None)
        else:
            self.log.warning("gpushare: signal %s cannot be sent to a kernel pod", signum)

    def _interrupt(self) -> None:
        """Interrupt by message: there is no process to signal from the server."""
        km = self.provisioner.parent
        if km is None or getattr(km, "_control_socket", None) is None:
            return
        msg = km.session.msg("interrupt_request", content={})
        km.session.send(km._control_socket, msg)

    async def kill(self, restart: bool = False) -> None:
        await self._delete_pod(grace=1)

    async def terminate(self, restart: bool = False) -> None:
        await self._delete_pod(grace=None)

    async def _delete_pod(self, grace: int | None) -> None:
        self._deleting = True
        if self._ctx is not None and self.pod_name is not None:
            await self._ctx.kube.delete_pod(self.namespace, self.pod_name, grace)

    async def cleanup(self, restart: bool = False) -> None:
        if self._ctx is not None and self.pod_name is not None:
            await self._remove(self._ctx, grace=1)
        self._launched = False
        self._deleting = False
        if not restart:
            self._connection = None

    async def _remove(self, ctx: KubeContext, grace: int) -> None:
        """Delete the pod and its Secret (the garbage collector would too; this is at once).

        A graceful delete (``grace`` >= 1) lets the kubelet confirm that the kernel process
        ended before the pod object goes, so a restart never races its predecessor for the
        ports; a node that does not answer gets a forced delete after a bound."""
        name = self.pod_name
        assert name is not None
        with contextlib.suppress(ApiException):
            await ctx.kube.delete_pod(self.namespace, name, grace)
        try:
            await ctx.watcher.wait_for(name, lambda p: p is None, grace + 15.0)
        except (asyncio.TimeoutError, TimeoutError):
            self.log.warning("gpushare: pod %s did not confirm termination; forcing", name)
            with contextlib.suppress(ApiException):
                await ctx.kube.delete_pod(self.namespace, name, 0)
        with contextlib.suppress(ApiException):
            await ctx.kube.delete_secret(self.namespace, name)
        ctx.watcher.forget(name)

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return max(recommended, float(self.config.termination_grace))

    async def get_provisioner_info(self) -> dict[str, Any]:
        return {
            "k8s_namespace": self.namespace,
            "k8s_pod": self.pod_name,
            "k8s_server": self.config.server_id,
        }

    async def load_provisioner_info(self, info: dict[str, Any]) -> None:
        self.namespace = info.get("k8s_namespace", self.namespace)
        self.pod_name = info.get("k8s_pod")
        self._launched = self.pod_name is not None
