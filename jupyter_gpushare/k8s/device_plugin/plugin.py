"""The device plugin the node agent runs (``jupyter gpushare daemon --device-plugin``).

It speaks the kubelet's device plugin API so that the kube-scheduler counts shares and kernel pods
get their GPU, the interposer and a socket of their own through the kubelet, with no hostPath or
privilege: ``ListAndWatch`` advertises ``SHARE_UNITS_PER_GPU`` devices per GPU, ``Allocate``
hands a container its environment and mounts, and ``PreStartContainer`` checks, before the
container starts, that the pod holding the devices is the one ``Allocate`` served.

``Allocate`` names devices, not the pod, so the plugin infers the pod: the kernel pod of the
kernel namespace bound first among those waiting, served only if its allocation's record names it
(the labels and name a forger can copy decide nothing); the kubelet's PodResources then confirms
or refutes the guess before the container starts.

The lifecycle, the trust argument, the two orders a forgery can take, the ties between two pods
of one size (:mod:`jupyter_gpushare.k8s.admission` keeps them from happening) and what is left
are in the developer guide, ``docs/develop/device-plugin.md``; change it with this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ...daemon.lock import ensure_private_dir
from ...inventory import Gpu
from ...kernel_env import INTERPOSER, Simulated, share_environment
from ...ledger import Allocation
from .. import manifests
from . import api_pb2, api_pb2_grpc, podresources_pb2, podresources_pb2_grpc

log = logging.getLogger("gpushare.device_plugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
PLUGIN_SOCKET_NAME = "gpushare.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
ALLOCATION_ID = re.compile(r"^a-[0-9a-f]{16}$")
#: where the kernel container sees its own socket directory, the interposer and the simulator's
#: state file (the paths are the plugin's: the pod spec names none of them)
CONTAINER_SOCKET_DIR = "/run/gpushare"
CONTAINER_LIB_DIR = "/opt/gpushare/lib"
CONTAINER_SIM_STATE = "/run/gpushare-sim/sim.state"
SOCKET_NAME = "daemon.sock"
#: the host directory mounted at the agent's socket directory (the chart's
#: daemon.socketHostPath): ``Allocate``'s mounts name host paths, which the kubelet mounts as
#: they are, so the agent's own paths under that directory are translated (unset: the same path)
SOCKET_HOST_DIR_ENV = "GPUSHARE_SOCKET_HOST_DIR"


def _socket_host_dir() -> Path | None:
    value = os.environ.get(SOCKET_HOST_DIR_ENV, "")
    return Path(value) if value else None


@dataclass(frozen=True)
class PluginSettings:
    node: str
    namespace: str
    kubelet_socket: Path = KUBELET_SOCKET
    resource: str = manifests.SHARE_RESOURCE
    #: host directory of the per-pod socket directories (the agent's, 0755, root's)
    pod_socket_dir: Path = Path("/run/gpushare/pods")
    #: host directory holding libgpushare.so (and sim/), installed by the DaemonSet
    interposer_dir: Path = Path("/opt/gpushare/lib")
    #: GPUSHARE_SIM_DEVICES / GPUSHARE_SIM_STATE of the node when its GPUs are simulated
    simulated_devices: str = ""
    sim_state: str = ""
    health_interval: float = 10.0
    cleanup_interval: float = 5.0
    #: the host directory mounted at ``pod_socket_dir``'s parent (the agent's socket
    #: directory), when the two paths differ ($GPUSHARE_SOCKET_HOST_DIR)
    socket_host_dir: Path | None = field(default_factory=_socket_host_dir)

    def host_path(self, path: Path | str) -> str:
        """``path`` of the agent's container as the host (the kubelet) sees it: under the
        socket directory, the same file under ``socket_host_dir``; any other path as it is."""
        inside = Path(path)
        if self.socket_host_dir is None:
            return str(inside)
        try:
            relative = inside.relative_to(self.pod_socket_dir.parent)
        except ValueError:
            return str(inside)
        return str(self.socket_host_dir / relative)

    @property
    def plugin_socket(self) -> Path:
        return self.kubelet_socket.parent / PLUGIN_SOCKET_NAME

    @property
    def pod_resources_socket(self) -> Path:
        """The kubelet's PodResources socket: ``<root dir>/pod-resources/kubelet.sock`` beside
        its ``<root dir>/device-plugins/`` (the DaemonSet mounts that directory read-only)."""
        return self.kubelet_socket.parent.parent / "pod-resources" / "kubelet.sock"


@dataclass(frozen=True)
class Guess:
    """Which pod ``Allocate`` took a container's device IDs to be for (the API does not say):
    checked at ``PreStartContainer`` against the pod the kubelet says holds them."""

    allocation_id: str
    namespace: str
    name: str
    uid: str


# -- the pure decisions --------------------------------------------------------------------------


def devices(gpus: Sequence[Gpu]) -> list[tuple[str, str]]:
    """(device ID, health) of each share unit of ``gpus``: 100 per GPU."""
    return [
        (f"{g.uuid}/{n}", HEALTHY if g.healthy else UNHEALTHY)
        for g in sorted(gpus, key=lambda g: g.index)
        for n in range(manifests.SHARE_UNITS_PER_GPU)
    ]


def bound_at(pod: Mapping[str, Any]) -> str:
    """When ``pod`` was bound to its node (RFC 3339, comparable as text): the transition of its
    ``PodScheduled`` condition, which the API server stamps when the scheduler binds the pod
    (a pod's creator cannot write its status), or its creation for a pod created with its node
    already named (which the kubelet learns of as it is created)."""
    created = str((pod.get("metadata") or {}).get("creationTimestamp") or "")
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "True":
            return max(created, str(condition.get("lastTransitionTime") or ""))
    return created


def pending_pod(
    pods: Sequence[Mapping[str, Any]],
    node: str,
    resource: str,
    units: int,
    namespace: str | None = None,
    named: Callable[[Mapping[str, Any]], bool] | None = None,
) -> Mapping[str, Any] | None:
    """The kernel pod a container start of ``units`` is for: the first of
    :func:`pending_pods` (the kubelet admits pods in the order they are bound to it)."""
    found = pending_pods(pods, node, resource, units, namespace, named)
    return found[0] if found else None


def pending_pods(
    pods: Sequence[Mapping[str, Any]],
    node: str,
    resource: str,
    units: int,
    namespace: str | None = None,
    named: Callable[[Mapping[str, Any]], bool] | None = None,
    admitted: Collection[tuple[str, str]] | None = None,
) -> list[Mapping[str, Any]]:
    """Kernel pods that may be waiting for ``units``: in ``namespace`` (the kernel namespace,
    where only the controller may create pods), bound to ``node``, not yet admitted, not
    finished or being deleted, asking ``units``, with an allocation label; first bound first.
    Admitted: ``admitted`` when the kubelet said which pods ((namespace, name)) hold devices,
    else marked by ``Allocate``. Within one second of binding (timestamps have one-second
    resolution) the pods ``named`` says the ledger names as their allocation's pod (name,
    namespace and UID, which the API server assigns) come first, then by creation and UID:
    nothing a forger can pick (not the pod's name)."""
    candidates = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if namespace is not None and meta.get("namespace") != namespace:
            continue
        if (pod.get("spec") or {}).get("nodeName") != node or meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if admitted is None:
            if manifests.ALLOCATED_ANNOTATION in (meta.get("annotations") or {}):
                continue
        elif (meta.get("namespace"), meta.get("name")) in admitted:
            continue
        if not ALLOCATION_ID.match((meta.get("labels") or {}).get(manifests.LABEL_ALLOCATION, "")):
            continue
        if manifests.requested_units(pod, resource) != units:
            continue
        candidates.append(pod)
    candidates.sort(
        key=lambda p: (
            bound_at(p)[:19],  # to the second, whatever the precision a server writes
            named is None or not named(p),
            p["metadata"].get("creationTimestamp") or "",
            p["metadata"].get("uid", ""),
        )
    )
    return candidates


def device_holders(pod_resources: Sequence[Any], resource: str) -> dict[str, tuple[str, str]]:
    """(namespace, name) of the pod holding each device ID of ``resource``, from the kubelet's
    PodResources ``List`` (its ``pod_resources``): the pods the kubelet has admitted, with the
    device IDs its device manager recorded for their containers right after ``Allocate``."""
    held: dict[str, tuple[str, str]] = {}
    for pod in pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name == resource:
                    held.update(dict.fromkeys(devices.device_ids, (pod.namespace, pod.name)))
    return held


def allocation_is_the_pods(allocation: Allocation, pod: Mapping[str, Any]) -> bool:
    """Whether the ledger names ``pod`` as ``allocation``'s pod (the server records the pod's
    name and namespace before creating it, its UID after): a pod that copies another kernel's
    allocation label is not that kernel's pod, and gets nothing."""
    meta = pod.get("metadata") or {}
    extra = allocation.extra or {}
    if extra.get("k8s_pod") != meta.get("name"):
        return False
    if extra.get("k8s_namespace") not in (None, meta.get("namespace")):
        return False
    return extra.get("k8s_pod_uid") in (None, meta.get("uid"))


def container_response(
    allocation: Allocation, settings: PluginSettings, socket_dir: Path
) -> dict[str, Any]:
    """What the container of ``allocation``'s pod gets: env, mounts, CDI devices (as a dict of
    ``ContainerAllocateResponse`` fields)."""
    simulated = None
    if settings.simulated_devices:
        simulated = Simulated(
            settings.simulated_devices, CONTAINER_SIM_STATE, f"{CONTAINER_LIB_DIR}/sim"
        )
    envs = share_environment(  # the one builder (jupyter_gpushare.kernel_env)
        allocation_id=allocation.id,
        node=allocation.node,
        socket=f"{CONTAINER_SOCKET_DIR}/{SOCKET_NAME}",
        visible=("NVIDIA_VISIBLE_DEVICES", manifests.visible_devices(allocation.gpus)),
        interposer=f"{CONTAINER_LIB_DIR}/{INTERPOSER}",
        simulated=simulated,
    )
    mounts = [
        {
            "container_path": CONTAINER_LIB_DIR,
            "host_path": str(settings.interposer_dir),
            "read_only": True,
        },
        {
            "container_path": CONTAINER_SOCKET_DIR,
            "host_path": settings.host_path(socket_dir),
            "read_only": False,
        },
    ]
    cdi: list[str] = []
    if simulated is not None:
        if settings.sim_state:
            mounts.append(
                {
                    "container_path": CONTAINER_SIM_STATE,
                    "host_path": settings.host_path(settings.sim_state),
                    "read_only": False,
                }
            )
    else:  # real GPUs: the NVIDIA container toolkit's CDI names (GPU Operator >= v25.10)
        cdi = [f"nvidia.com/gpu={manifests.visible_devices([g])}" for g in allocation.gpus]
    return {"envs": envs, "mounts": mounts, "cdi_devices": cdi}


def preferred(
    available: Sequence[str], must: Sequence[str], size: int, gpus: Sequence[str]
) -> list[str]:
    """``size`` device IDs: those required, then units of ``gpus`` (the allocation's GPUs when
    the pod is known), then any."""
    chosen = list(must)[:size]
    for wanted in (lambda d: d.rsplit("/", 1)[0] in gpus, lambda d: True):
        for dev in available:
            if len(chosen) >= size:
                return chosen
            if dev not in chosen and wanted(dev):
                chosen.append(dev)
    return chosen


def fresh_directory(directory: Path) -> None:
    """``directory`` empty, 0755, the agent's own. A directory the agent made before is kept
    (only emptied): a running kernel pod has it bind-mounted by the kubelet, so a new directory
    at the same path (another inode) would never show the pod the socket made in it after an
    agent restart. Anything else there (another owner, a file or link) is removed first."""
    try:
        st = directory.lstat()
    except FileNotFoundError:
        directory.mkdir(mode=0o755)
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        directory.chmod(0o755)
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(directory, ignore_errors=True)
    else:
        directory.unlink(missing_ok=True)
    directory.mkdir(mode=0o755)


def kubelet_channel(path: Path) -> grpc.aio.Channel:
    """A channel to one of the kubelet's sockets, with a connection of its own: gRPC otherwise
    shares connections between channels to one target (its global subchannel pool), and a
    kubelet that restarted (a new socket at the same path) then fails the next call on the old
    connection ("Stream removed", broken pipe) instead of the call connecting afresh."""
    return grpc.aio.insecure_channel(
        f"unix://{path}", options=[("grpc.use_local_subchannel_pool", 1)]
    )


# -- the gRPC service ----------------------------------------------------------------------------


class AllocateError(Exception):
    """Allocate cannot serve this container: the kubelet fails the pod with this message."""


class PreStartRefused(Exception):
    """PreStartContainer refuses this container: the kubelet does not start it (the container
    waits in ``CreateContainerConfigError`` with this message, and is tried again)."""


class SharePlugin(api_pb2_grpc.DevicePluginServicer):
    """The device plugin of one node, inside the node agent (``daemon`` is its ``Daemon``)."""

    def __init__(self, daemon: Any, kube: Any, settings: PluginSettings) -> None:
        self.daemon = daemon
        self.kube = kube
        self.settings = settings
        self.gpus: list[Gpu] = []
        self.changed = asyncio.Event()
        self.listeners: dict[str, tuple[Any, str]] = {}  # allocation id -> (listener, pod uid)
        self.server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._lock = asyncio.Lock()
        self.registered = False
        #: whether the kubelet calls PreStartContainer (registered so when its PodResources
        #: socket is there to check containers against)
        self.pre_start = False
        #: device IDs -> the pod Allocate took them for, until PreStartContainer checks it
        self.guesses: dict[frozenset[str], Guess] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        # in the hostPath mode pods mount the agent's socket directory: refuse a prepared one
        ensure_private_dir(self.settings.pod_socket_dir, 0o755)
        self.gpus = await self._node_gpus()
        self._check_pod_resources()
        await self._serve_again()
        await self._serve()
        try:
            await self._register()
        except grpc.aio.AioRpcError as exc:  # no kubelet yet: _watch_kubelet tries again
            log.warning(
                "device plugin: registering with %s failed: %s",
                self.settings.kubelet_socket,
                exc.details(),
            )
        self._tasks = [
            asyncio.create_task(self._watch_health()),
            asyncio.create_task(self._watch_kubelet()),
            asyncio.create_task(self._cleanup()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.server is not None:
            await self.server.stop(0.5)
        for listener, _uid in self.listeners.values():
            listener.close()
        self.listeners.clear()

    async def _serve(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
        path = self.settings.plugin_socket
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{path}")
        await self.server.start()

    def _check_pod_resources(self) -> None:
        """PreStartContainer checks need the kubelet's PodResources socket: without it (an old
        DaemonSet that does not mount its directory) the plugin registers without them, and
        says so."""
        path = self.settings.pod_resources_socket
        self.pre_start = path.is_socket()
        if not self.pre_start:
            log.warning(
                "device plugin: no kubelet PodResources socket at %s: containers are not "
                "checked before they start (a pod bound in a kernel pod's second and admitted "
                "first is taken for it; mount %s read-only)",
                path,
                path.parent,
            )

    def _options(self) -> Any:
        return api_pb2.DevicePluginOptions(
            pre_start_required=self.pre_start, get_preferred_allocation_available=True
        )

    async def _register(self) -> None:
        async with kubelet_channel(self.settings.kubelet_socket) as ch:
            await api_pb2_grpc.RegistrationStub(ch).Register(
                api_pb2.RegisterRequest(
                    version=API_VERSION,
                    endpoint=PLUGIN_SOCKET_NAME,
                    resource_name=self.settings.resource,
                    options=self._options(),
                ),
                timeout=10,
            )
        self.registered = True
        log.info(
            "device plugin: registered %s with the kubelet (%d GPUs, %d units)",
            self.settings.resource,
            len(self.gpus),
            len(self.gpus) * manifests.SHARE_UNITS_PER_GPU,
        )

    async def _watch_kubelet(self) -> None:
        """A restarted kubelet removes the plugins' sockets: serve and register again. So too
        once its PodResources socket appears (a kubelet that made it after the plugin
        registered): the kubelet then calls PreStartContainer."""
        while True:
            await asyncio.sleep(2.0)
            if self.registered and self.settings.plugin_socket.exists():
                if self.pre_start or not self.settings.pod_resources_socket.is_socket():
                    continue
                log.info(
                    "device plugin: the kubelet's PodResources API is there; registering again"
                )
            else:
                log.info("device plugin: the kubelet restarted; registering again")
            self.registered = False
            try:
                self._check_pod_resources()
                await self._serve()
                await self._register()
            except Exception as exc:  # the kubelet is not back yet
                log.warning("device plugin: registering again failed: %s", exc)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            with contextlib.suppress(Exception):
                gpus = await self._node_gpus()
                if devices(gpus) != devices(self.gpus):
                    self.gpus = gpus
                    self.changed.set()

    async def _node_gpus(self) -> list[Gpu]:
        return [g for g in await self.daemon.ledger.gpus() if g.node == self.settings.node]

    # -- DevicePlugin ------------------------------------------------------------------------

    async def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self._options()

    async def ListAndWatch(self, request: Any, context: Any) -> Any:
        while True:
            self.changed.clear()
            yield api_pb2.ListAndWatchResponse(
                devices=[
                    api_pb2.Device(ID=dev, health=health) for dev, health in devices(self.gpus)
                ]
            )
            await self.changed.wait()

    async def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        replies = []
        for req in request.container_requests:
            gpus: Sequence[str] = ()
            with contextlib.suppress(Exception):
                waiting = await self._waiting(req.allocation_size)
                pod = waiting[0] if waiting else None
                if pod is not None:
                    found = await self._allocation(pod)
                    gpus = found.gpus if found is not None else ()
            replies.append(
                api_pb2.ContainerPreferredAllocationResponse(
                    deviceIDs=preferred(
                        list(req.available_deviceIDs),
                        list(req.must_include_deviceIDs),
                        req.allocation_size,
                        gpus,
                    )
                )
            )
        return api_pb2.PreferredAllocationResponse(container_responses=replies)

    async def PreStartContainer(self, request: Any, context: Any) -> Any:
        if self.pre_start:
            async with self._lock:  # guesses change under Allocate too
                try:
                    await self._pre_start(list(request.devices_ids))
                except PreStartRefused as exc:
                    log.warning("device plugin: PreStartContainer refused: %s", exc)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return api_pb2.PreStartContainerResponse()

    async def Allocate(self, request: Any, context: Any) -> Any:
        replies = []
        async with self._lock:  # one admission at a time: each finds and marks its own pod
            for req in request.container_requests:
                try:
                    replies.append(await self._allocate(list(req.devices_ids)))
                except AllocateError as exc:
                    log.warning("device plugin: Allocate refused: %s", exc)
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return api_pb2.AllocateResponse(container_responses=replies)

    async def _holders(self) -> dict[str, tuple[str, str]]:
        """The pod holding each of this resource's device IDs, as the kubelet says
        (PodResources ``List``)."""
        path = self.settings.pod_resources_socket
        async with kubelet_channel(path) as channel:
            reply = await podresources_pb2_grpc.PodResourcesListerStub(channel).List(
                podresources_pb2.ListPodResourcesRequest(), timeout=10
            )
        return device_holders(reply.pod_resources, self.settings.resource)

    async def _unmark(self, guess: Guess) -> None:
        """The pod ``guess`` named is waiting still: it is a candidate again."""
        with contextlib.suppress(Exception):  # gone meanwhile: nothing to undo
            await self.kube.core.patch_namespaced_pod(
                guess.name,
                guess.namespace,
                {"metadata": {"annotations": {manifests.ALLOCATED_ANNOTATION: None}}},
            )

    async def _drop_refuted(self, holders: Mapping[str, tuple[str, str]]) -> None:
        """Before an admission: guesses whose device IDs the kubelet gave another pod (or no
        pod any more) were wrong; the pod each named is waiting still, unless it holds devices
        of its own. (Only here: the kubelet admits one pod at a time and records its devices
        before the next ``Allocate``, while PreStartContainer runs beside an admission.)"""
        admitted = set(holders.values())
        for key, guess in list(self.guesses.items()):
            held = {holders.get(d) for d in key}
            if held == {(guess.namespace, guess.name)}:
                continue  # PreStartContainer confirms it
            del self.guesses[key]
            log.info(
                "device plugin: the devices Allocate took for pod %s are %s's",
                guess.name,
                ", ".join(sorted(f"{h[0]}/{h[1]}" for h in held if h)) or "no pod's",
            )
            if (guess.namespace, guess.name) not in admitted:
                await self._unmark(guess)

    async def _pre_start(self, ids: Sequence[str]) -> None:
        """The kubelet is starting the container holding ``ids``: it must be the pod
        ``Allocate`` took them for (whose allocation it was handed), and that pod must be its
        allocation's in the ledger."""
        resource, node = self.settings.resource, self.settings.node
        shown = f"{ids[0]} and {len(ids) - 1} more" if len(ids) > 1 else ", ".join(ids)
        try:
            holders = await self._holders()
        except grpc.aio.AioRpcError as exc:
            raise PreStartRefused(
                f"cannot ask the kubelet's PodResources API "
                f"({self.settings.pod_resources_socket}) which pod holds {resource} devices "
                f"{shown}: {exc.details()}; the container is not started until it answers"
            ) from None
        owners = {holders.get(d) for d in ids}
        if len(owners) != 1 or None in owners:
            raise PreStartRefused(
                f"the kubelet names no single pod holding {resource} devices {shown}: "
                "the container is not started"
            )
        [(namespace, name)] = owners  # type: ignore[misc]  # None excluded above
        guess = self.guesses.pop(frozenset(ids), None)
        pod = next(
            (
                p
                for p in await self._kernel_pods()
                if p["metadata"].get("namespace") == namespace and p["metadata"]["name"] == name
            ),
            None,
        )
        uid = pod["metadata"].get("uid") if pod is not None else None
        if guess is not None and (guess.namespace, guess.name, guess.uid) != (namespace, name, uid):
            if (guess.namespace, guess.name) not in set(holders.values()):
                await self._unmark(guess)  # the pod it named is waiting still
            raise PreStartRefused(
                f"pod {namespace}/{name} holds the {resource} devices that Allocate took for "
                f"pod {guess.namespace}/{guess.name} (allocation {guess.allocation_id} in "
                f"{node}'s ledger): it is not that pod, and its container is not started"
            )
        if guess is not None:
            return  # the pod Allocate took them for, its allocation's pod in the ledger
        # no guess: the agent restarted since Allocate, or the container starts again
        meta = (pod or {}).get("metadata") or {}
        marked = (meta.get("annotations") or {}).get(manifests.ALLOCATED_ANNOTATION) == node
        allocation = await self._allocation(pod) if pod is not None and marked else None
        if pod is None or allocation is None or not allocation_is_the_pods(allocation, pod):
            label = (meta.get("labels") or {}).get(manifests.LABEL_ALLOCATION, "")
            raise PreStartRefused(
                f"pod {namespace}/{name}: allocation {label or '(none)'} is not this pod's in "
                f"{node}'s ledger, or Allocate did not take its {resource} devices for it: "
                "its container is not started"
            )

    async def _waiting(
        self, units: int, admitted: Collection[tuple[str, str]] | None = None
    ) -> list[Mapping[str, Any]]:
        """The kernel pods that may be waiting for ``units``, in the order the kubelet admits
        them (:func:`pending_pods`), ties broken by what the ledger records; ``admitted``: the
        pods the kubelet says hold devices (else those marked are taken as admitted)."""
        pods = await self._kernel_pods()
        ids = {(p["metadata"].get("labels") or {}).get(manifests.LABEL_ALLOCATION) for p in pods}
        if any(i and i not in self.daemon.allocations for i in ids):
            await self.daemon.refresh()  # the controller recorded it just before the pod

        def named(pod: Mapping[str, Any]) -> bool:
            found = self.daemon.allocations.get(
                pod["metadata"]["labels"][manifests.LABEL_ALLOCATION]
            )
            return (
                found is not None
                and found.node == self.settings.node
                and allocation_is_the_pods(found, pod)
            )

        return pending_pods(
            pods,
            self.settings.node,
            self.settings.resource,
            units,
            self.settings.namespace,
            named,
            admitted,
        )

    async def _allocate(self, ids: Sequence[str]) -> Any:
        units = len(ids)
        # the kubelet records each admitted pod's devices before the next admission: a pod
        # holding none is waiting, whatever a (wrong, or lost) guess marked
        admitted: set[tuple[str, str]] | None = None
        if self.pre_start:
            try:
                holders = await self._holders()
            except grpc.aio.AioRpcError as exc:  # PreStartContainer refuses until it answers
                log.warning("device plugin: PodResources List failed: %s", exc.details())
            else:
                admitted = set(holders.values())
                await self._drop_refuted(holders)
        pods = await self._waiting(units, admitted)
        if not pods:
            raise AllocateError(
                f"no kernel pod on {self.settings.node} waits for {units} "
                f"units of {self.settings.resource}"
            )
        # the first bound is the one being admitted; if the ledger does not name it as its
        # allocation's pod (a copied label), its container gets nothing: never another's share
        pod = pods[0]
        meta = pod["metadata"]
        allocation = await self._allocation(pod)
        if allocation is None or not allocation_is_the_pods(allocation, pod):
            raise AllocateError(
                f"pod {meta['name']}: allocation "
                f"{meta['labels'][manifests.LABEL_ALLOCATION]} is not this "
                f"pod's in {self.settings.node}'s ledger"
            )
        await self.kube.core.patch_namespaced_pod(
            meta["name"],
            meta["namespace"],
            {"metadata": {"annotations": {manifests.ALLOCATED_ANNOTATION: self.settings.node}}},
        )
        socket_dir = self._listen(allocation.id, meta["uid"])
        if self.pre_start:
            self.guesses[frozenset(ids)] = Guess(
                allocation.id, meta["namespace"], meta["name"], meta["uid"]
            )
        reply = container_response(allocation, self.settings, socket_dir)
        log.info(
            "device plugin: Allocate takes %d devices for pod %s: allocation %s (%s)",
            units,
            meta["name"],
            allocation.id,
            ",".join(allocation.gpus),
        )
        return api_pb2.ContainerAllocateResponse(
            envs=reply["envs"],
            mounts=[api_pb2.Mount(**m) for m in reply["mounts"]],
            cdi_devices=[api_pb2.CDIDevice(name=n) for n in reply["cdi_devices"]],
        )

    async def _kernel_pods(self) -> list[dict[str, Any]]:
        listing = await self.kube.list_pods(
            self.settings.namespace,
            label_selector=f"{manifests.LABEL_COMPONENT}={manifests.KERNEL_COMPONENT}",
        )
        return [
            p
            for p in listing.get("items") or []
            if (p.get("spec") or {}).get("nodeName") == self.settings.node
        ]

    async def _allocation(self, pod: Mapping[str, Any]) -> Allocation | None:
        allocation_id = pod["metadata"]["labels"][manifests.LABEL_ALLOCATION]
        found = self.daemon.allocations.get(allocation_id)
        if found is None or not allocation_is_the_pods(found, pod):
            await self.daemon.refresh()  # the server recorded it just before creating the pod
            found = self.daemon.allocations.get(allocation_id)
        if found is None or found.node != self.settings.node:
            return None
        return found

    # -- per-pod sockets ---------------------------------------------------------------------

    def _listen(self, allocation_id: str, pod_uid: str) -> Path:
        """The pod's own directory with the agent's socket for it (made afresh)."""
        from ...daemon.admission import Listener
        from ...daemon.server import LISTEN_BACKLOG

        if not ALLOCATION_ID.match(allocation_id):
            raise AllocateError(f"allocation id {allocation_id!r} is not a gpushare id")
        directory = self.settings.pod_socket_dir / allocation_id
        old = self.listeners.pop(allocation_id, None)
        if old is not None:
            old[0].close()
        fresh_directory(directory)
        path = directory / SOCKET_NAME
        # 0666: callers are known by their credentials (and their pod)
        listener = Listener(str(path), LISTEN_BACKLOG, self.daemon._accepted)
        self.listeners[allocation_id] = (listener, pod_uid)
        return directory

    async def _serve_again(self, pods: list[dict[str, Any]] | None = None) -> None:
        """After an agent restart (and whenever one is missing): the running pods this node
        allocated for keep their sockets."""
        if pods is None:
            try:
                pods = await self._kernel_pods()
            except Exception as exc:
                log.warning("device plugin: cannot list kernel pods: %s", exc)
                return
        for pod in pods:
            meta = pod["metadata"]
            allocation_id = (meta.get("labels") or {}).get(manifests.LABEL_ALLOCATION, "")
            if (
                (meta.get("annotations") or {}).get(manifests.ALLOCATED_ANNOTATION)
                == self.settings.node
                and allocation_id not in self.listeners
                and not meta.get("deletionTimestamp")
                and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            ):
                with contextlib.suppress(AllocateError, OSError):
                    self._listen(allocation_id, meta["uid"])

    async def _cleanup(self) -> None:
        while True:
            await asyncio.sleep(self.settings.cleanup_interval)
            try:
                pods = await self._kernel_pods()
            except Exception as exc:
                log.debug("device plugin: cleanup skipped: %s", exc)
                continue
            await self._serve_again(pods)
            live = {
                p["metadata"]["uid"]
                for p in pods
                if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            }
            for allocation_id, (listener, uid) in list(self.listeners.items()):
                if uid not in live:
                    listener.close()
                    self.listeners.pop(allocation_id, None)
                    shutil.rmtree(self.settings.pod_socket_dir / allocation_id, ignore_errors=True)


async def start_plugin(daemon: Any, kube: Any, settings: PluginSettings) -> SharePlugin:
    plugin = SharePlugin(daemon, kube, settings)
    await plugin.start()
    return plugin


__all__ = [
    "Guess",
    "PluginSettings",
    "SharePlugin",
    "allocation_is_the_pods",
    "bound_at",
    "container_response",
    "device_holders",
    "devices",
    "pending_pod",
    "pending_pods",
    "preferred",
    "start_plugin",
]
