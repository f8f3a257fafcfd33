"""A test double of the kubelet (and of the NVIDIA container runtime) for fake GPU nodes.

NOT a product part. It lets the real control plane of ``cluster.py`` run gpushare kernel pods on
this machine:

- registers Nodes (``--node NAME=2xA100``) with CPU/memory capacity, Ready, no ``not-ready``
  taint; heartbeats keep them Ready;
- runs each pod bound to one of its nodes as a local process: the container's
  ``command``/``args`` (the image is ignored, except that an image containing
  ``does-not-exist`` reports ``ErrImagePull`` as a kubelet would), its ``env`` (``fieldRef``
  resolved), Secret volumes written to a directory, hostPaths mapped (the daemon socket
  directory per node, other existing host paths as they are), and mount paths replaced by
  those directories in argv and env. ``NVIDIA_VISIBLE_DEVICES`` becomes
  ``CUDA_VISIBLE_DEVICES`` (what the NVIDIA runtime's device isolation amounts to for the
  simulator);
- reports ``phase``, ``podIP`` (127.0.0.1) and container states (running, terminated with exit
  code) back through the API, and honours graceful deletion (SIGTERM, SIGKILL after the grace
  period, then the final delete);
- runs init containers in order, then all containers; restarts the containers of pods with
  ``restartPolicy: Always`` (the DaemonSet's node daemon) when they exit; expands ``$(VAR)``
  in command and args as the kubelet does;
- puts each container's processes into a cgroup named after the pod's UID, with the kubelet's
  cgroupfs layout (``kubepods/pod<uid>/<container>``, in the first writable hierarchy), so
  the node daemon identifies kernel pods as it does on a real node (``/proc/<pid>/cgroup``);
- gives pods of a service account the agent knows (``--service-account NS/NAME=KUBECONFIG``)
  that account's credentials as ``KUBECONFIG`` (what the projected token is on a real node);
  pods with ``automountServiceAccountToken: false`` (kernel pods) get none; a projected volume's
  ``serviceAccountToken`` (the DaemonSet's token for the controller) is minted with the
  TokenRequest API for its audience and lifetime, bound to the pod, as the kubelet does;
- labels its nodes ``gpushare.jupyter.org/simulate=<N>x<TYPE>`` as an admin labels demo
  nodes; the node daemon (the DaemonSet of ``deploy/daemonset.yaml``) then simulates those GPUs
  and publishes them on the Node;
- plays the kubelet's side of the device-plugin API (v1beta1) over real gRPC, as its device
  manager does: a ``Registration`` server on each node's
  ``/var/lib/kubelet/device-plugins/kubelet.sock``; on ``Register`` it connects back to the
  plugin, follows ``ListAndWatch`` and sets the Node's capacity/allocatable of the resource to
  its healthy devices; a container asking that resource gets free device IDs
  (``GetPreferredAllocation`` when the plugin offers it), ``Allocate`` is called and its reply
  applied when the container runs (envs under the spec's env, mounts as volumes, CDI devices
  and device specs recorded in ``devices.json`` of the pod); a failed ``Allocate`` fails the pod
  with ``UnexpectedAdmissionError`` as the kubelet does. Pods are admitted one at a time (the
  kubelet's ``HandlePodAdditions``), and a pod's device IDs are recorded before the next
  admission; a plugin registered with ``pre_start_required`` gets ``PreStartContainer`` with
  the container's device IDs each time the container is about to start, after admission; if it
  fails, the container is not started: it waits in ``CreateContainerConfigError`` with the
  plugin's message (the pod stays Pending) and is tried again a second later (the kubelet:
  at its pod worker's next sync);
- serves the kubelet's PodResources API (v1, ``List`` and ``Get``) on each node's
  ``/var/lib/kubelet/pod-resources/kubelet.sock``: each active pod of the node with its
  containers and the device IDs recorded for them;
- writes Secret volumes as the kubelet does (root-owned files, group ``fsGroup``, mode
  ``defaultMode`` plus group read with an fsGroup) and runs containers as their
  ``runAsUser``/``runAsGroup`` with ``fsGroup`` and ``supplementalGroups`` (setuid in the child;
  ``allowPrivilegeEscalation: false`` sets no_new_privs; ``runAsNonRoot`` with uid 0 is a
  ``CreateContainerConfigError``), HOME a private directory of that user;
- test hooks, as annotations on a pod: ``test.gpushare/evict: <message>`` evicts it the way the
  kubelet does under node pressure (phase Failed, reason Evicted); ``test.gpushare/oom: "1"``
  kills it as the OOM killer would (terminated, reason OOMKilled, exit code 137);
  ``test.gpushare/admit-after: <seconds>`` admits it that much later (a kubelet busy syncing
  other pods, or one that takes a batch of pods at once), so that other pods bound meanwhile
  are waiting too when its ``Allocate`` comes; ``test.gpushare/start-after: <seconds>`` starts
  its containers that much after admission (a sandbox to create, an image to pull), so that
  other pods are admitted before its ``PreStartContainer``.
"""

# A test double: its few small local file operations may block the agent's own loop.
# ruff: noqa: ASYNC230

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
from kubernetes_asyncio.client.exceptions import ApiException

from jupyter_gpushare.k8s.client import Kube, connect
from jupyter_gpushare.k8s.device_plugin import (
    api_pb2,
    api_pb2_grpc,
    podresources_pb2,
    podresources_pb2_grpc,
)

log = logging.getLogger("node-agent")
EVICT = "test.gpushare/evict"
OOM = "test.gpushare/oom"
ADMIT_AFTER = "test.gpushare/admit-after"
START_AFTER = "test.gpushare/start-after"
PER_NODE_HOST_PATHS = (
    "/run/gpushare",
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet/pod-resources",
    "/opt/gpushare/lib",
)
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
#: how long a container whose PreStartContainer failed waits before it is tried again
PRE_START_RETRY = 1.0


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


SIMULATE_LABEL = "gpushare.jupyter.org/simulate"
METRICS_PORT = re.compile(r"^--metrics-port=\d+$")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class Cgroups:
    """Per-container cgroups in the kubelet's cgroupfs layout, in the first hierarchy this
    machine lets us write (None: the pods' processes stay where they are, unidentifiable)."""

    CANDIDATES = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")

    def __init__(self) -> None:
        self.root: Path | None = None
        for candidate in self.CANDIDATES:
            base = Path(candidate) / "kubepods"
            try:
                base.mkdir(exist_ok=True)
                (base / "cgroup.procs").stat()
            except OSError:
                continue
            self.root = base
            break

    def path(self, uid: str, container: str) -> Path | None:
        """The container's cgroup (made now); the child joins it before it drops root."""
        if self.root is None:
            return None
        path = self.root / f"pod{uid}" / container
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove(self, uid: str) -> None:
        if self.root is None:
            return
        pod = self.root / f"pod{uid}"
        for path in sorted(pod.glob("*"), reverse=True):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            pod.rmdir()


class AdmissionError(Exception):
    """The device manager cannot admit a container (the kubelet's UnexpectedAdmissionError)."""


class PreStartError(Exception):
    """A device plugin's PreStartContainer failed: the container is not started."""


class _Registration(api_pb2_grpc.RegistrationServicer):
    def __init__(self, manager: DeviceManager) -> None:
        self.manager = manager

    async def Register(self, request: Any, context: Any) -> Any:
        if request.version != "v1beta1":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported API version {request.version!r}"
            )
        await self.manager.connect(request.resource_name, request.endpoint, request.options)
        return api_pb2.Empty()


class _PodResources(podresources_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources API (v1) of one node: its active pods, each container with
    the device IDs the device manager recorded for it."""

    def __init__(self, manager: DeviceManager) -> None:
        self.manager = manager

    def _pod(self, running: RunningPod) -> Any:
        allocated = self.manager.allocated.get(running.uid, {})
        return podresources_pb2.PodResources(
            name=running.name,
            namespace=running.pod["metadata"]["namespace"],
            containers=[
                podresources_pb2.ContainerResources(
                    name=c["name"],
                    devices=[
                        podresources_pb2.ContainerDevices(resource_name=r, device_ids=ids)
                        for r, ids in allocated.get(c["name"], {}).items()
                    ],
                )
                for c in running.pod["spec"]["containers"]
            ],
        )

    def _active(self) -> list[RunningPod]:
        return [
            r
            for r in self.manager.agent.pods.values()
            if r.pod["spec"].get("nodeName") == self.manager.node and not r.finished
        ]

    async def List(self, request: Any, context: Any) -> Any:
        return podresources_pb2.ListPodResourcesResponse(
            pod_resources=[self._pod(r) for r in self._active()]
        )

    async def Get(self, request: Any, context: Any) -> Any:
        for running in self._active():
            meta = running.pod["metadata"]
            if (meta["name"], meta["namespace"]) == (request.pod_name, request.pod_namespace):
                return podresources_pb2.GetPodResourcesResponse(pod_resources=self._pod(running))
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"pod {request.pod_name} not found in namespace {request.pod_namespace}",
        )


class DevicePluginEndpoint:
    """One registered plugin: its channel, options and the devices it last listed."""

    def __init__(self, resource: str, channel: Any, options: Any) -> None:
        self.resource = resource
        self.channel = channel
        self.stub = api_pb2_grpc.DevicePluginStub(channel)
        self.options = options
        self.devices: dict[str, str] = {}  # id -> health
        self.task: asyncio.Task[None] | None = None


class DeviceManager:
    """The kubelet's device manager for one node (its side of the device-plugin API)."""

    def __init__(self, agent: NodeAgent, node: str, directory: Path) -> None:
        self.agent = agent
        self.node = node
        self.directory = directory
        self.plugins: dict[str, DevicePluginEndpoint] = {}
        #: pod uid -> container -> resource -> device ids
        self.allocated: dict[str, dict[str, dict[str, list[str]]]] = {}
        #: the kubelet admits one pod at a time
        self.admission = asyncio.Lock()
        self.server: Any = None

    @property
    def pod_resources_dir(self) -> Path:
        """``<root dir>/pod-resources`` beside ``<root dir>/device-plugins``."""
        return self.directory.parent / "pod-resources"

    async def start(self) -> None:
        self.server = grpc.aio.server()
        for directory in (self.directory, self.pod_resources_dir):
            directory.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (directory / "kubelet.sock").unlink()
            self.server.add_insecure_port(f"unix://{directory / 'kubelet.sock'}")
        api_pb2_grpc.add_RegistrationServicer_to_server(_Registration(self), self.server)
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(
            _PodResources(self), self.server
        )
        await self.server.start()

    async def stop(self) -> None:
        for plugin in self.plugins.values():
            if plugin.task is not None:
                plugin.task.cancel()
            await plugin.channel.close()
        if self.server is not None:
            await self.server.stop(0)

    async def connect(self, resource: str, endpoint: str, options: Any) -> None:
        if "/" in endpoint:
            raise AdmissionError(f"endpoint {endpoint!r} is not a socket name")
        old = self.plugins.pop(resource, None)
        if old is not None:  # re-registration (a restarted plugin): the new one replaces it
            if old.task is not None:
                old.task.cancel()
            await old.channel.close()
        channel = grpc.aio.insecure_channel(f"unix://{self.directory / endpoint}")
        plugin = DevicePluginEndpoint(resource, channel, options)
        self.plugins[resource] = plugin
        plugin.task = asyncio.create_task(self._list_and_watch(plugin))
        log.info("%s: device plugin for %s registered at %s", self.node, resource, endpoint)

    async def _list_and_watch(self, plugin: DevicePluginEndpoint) -> None:
        try:
            async for reply in plugin.stub.ListAndWatch(api_pb2.Empty()):
                plugin.devices = {d.ID: d.health for d in reply.devices}
                healthy = sum(1 for h in plugin.devices.values() if h == "Healthy")
                self.agent.extended[self.node][plugin.resource] = str(healthy)
                await self.agent.node_status(self.node)
                log.info(
                    "%s: %s: %d healthy of %d devices",
                    self.node,
                    plugin.resource,
                    healthy,
                    len(plugin.devices),
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s: ListAndWatch of %s ended: %s", self.node, plugin.resource, exc)

    def requests(self, container: dict[str, Any]) -> dict[str, int]:
        """The registered resources the container asks, with their counts."""
        limits = (container.get("resources") or {}).get("limits") or {}
        requests = (container.get("resources") or {}).get("requests") or {}
        asked = {}
        for resource in self.plugins:
            value = limits.get(resource, requests.get(resource))
            if value is not None and int(str(value)) > 0:
                asked[resource] = int(str(value))
        return asked

    async def allocate(self, pod_uid: str, container: dict[str, Any]) -> dict[str, Any]:
        """Devices for one container, and what the plugins answered (merged)."""
        result: dict[str, Any] = {
            "envs": {},
            "mounts": [],
            "devices": [],
            "cdi_devices": [],
            "device_ids": {},
        }
        for resource, count in self.requests(container).items():
            plugin = self.plugins[resource]
            taken = {
                i
                for per_pod in self.allocated.values()
                for per_container in per_pod.values()
                for i in per_container.get(resource, [])
            }
            free = [i for i, h in plugin.devices.items() if h == "Healthy" and i not in taken]
            if len(free) < count:
                raise AdmissionError(
                    f"Allocate failed due to requested number of devices "
                    f"unavailable for {resource}. Requested: {count}, "
                    f"Available: {len(free)}, which is unexpected"
                )
            ids = free[:count]
            if plugin.options.get_preferred_allocation_available:
                preferred = await plugin.stub.GetPreferredAllocation(
                    api_pb2.PreferredAllocationRequest(
                        container_requests=[
                            api_pb2.ContainerPreferredAllocationRequest(
                                available_deviceIDs=free, allocation_size=count
                            )
                        ]
                    ),
                    timeout=10,
                )
                chosen = list(preferred.container_responses[0].deviceIDs)
                if len(chosen) == count and set(chosen) <= set(free):
                    ids = chosen
            try:
                reply = await plugin.stub.Allocate(
                    api_pb2.AllocateRequest(
                        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
                    ),
                    timeout=30,
                )
            except grpc.aio.AioRpcError as exc:
                raise AdmissionError(
                    f"Allocate failed due to {exc.details()}, which is unexpected"
                ) from None
            # recorded before the admission ends (PodResources shows them from now on)
            self.allocated.setdefault(pod_uid, {}).setdefault(container["name"], {})[resource] = ids
            answer = reply.container_responses[0]
            result["envs"].update(dict(answer.envs))
            result["mounts"] += [
                {
                    "container_path": m.container_path,
                    "host_path": m.host_path,
                    "read_only": m.read_only,
                }
                for m in answer.mounts
            ]
            result["devices"] += [
                {
                    "container_path": d.container_path,
                    "host_path": d.host_path,
                    "permissions": d.permissions,
                }
                for d in answer.devices
            ]
            result["cdi_devices"] += [d.name for d in answer.cdi_devices]
            result["device_ids"][resource] = ids
        return result

    async def pre_start(self, pod_uid: str, container: dict[str, Any]) -> None:
        """The kubelet's ``callPreStartContainerIfNeeded``, as the container is about to
        start: each plugin that asked for it is told the container's device IDs."""
        for resource, ids in self.allocated.get(pod_uid, {}).get(container["name"], {}).items():
            plugin = self.plugins.get(resource)
            if plugin is None or not plugin.options.pre_start_required:
                continue
            try:
                await plugin.stub.PreStartContainer(
                    api_pb2.PreStartContainerRequest(devices_ids=ids), timeout=30
                )
            except grpc.aio.AioRpcError as exc:
                raise PreStartError(
                    f"device plugin PreStartContainer rpc failed with err: rpc error: "
                    f"code = {exc.code().name} desc = {exc.details()}"
                ) from None

    def release(self, pod_uid: str) -> None:
        self.allocated.pop(pod_uid, None)


class RunningPod:
    def __init__(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.name = pod["metadata"]["name"]
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.task: asyncio.Task[None] | None = None
        self.stopping = False
        self.reason: str | None = None  # Evicted / OOMKilled when we killed it on purpose
        self.message = ""
        self.finished = False
        #: per container: what the device plugins' Allocate answered (envs, mounts, devices)
        self.devices: dict[str, dict[str, Any]] = {}


class NodeAgent:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        workdir: Path,
        nodes: dict[str, str],
        cpu: str,
        memory: str,
        accounts: dict[str, str] | None = None,
    ) -> None:
        self.kube = kube
        self.accounts = accounts or {}  # "namespace/name" -> kubeconfig of that identity
        self.cgroups = Cgroups()
        self.namespace = namespace
        self.workdir = workdir
        self.nodes = nodes
        self.cpu = cpu
        self.memory = memory
        self.pods: dict[str, RunningPod] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: extended resources on each node's capacity, from its device plugins
        self.extended: dict[str, dict[str, str]] = {n: {} for n in nodes}
        self.device_managers = {
            n: DeviceManager(self, n, self.host_path(n, DEVICE_PLUGIN_DIR)) for n in nodes
        }

    def host_path(self, node: str, host: str) -> Path:
        """Where a host path of ``node`` is on this machine: per node for the node's own
        directories and for paths this machine lacks, else the path itself."""
        if Path(host).is_relative_to(self.workdir):  # a path the node's pods were given
            return Path(host)
        if host.rstrip("/") in PER_NODE_HOST_PATHS or not Path(host).exists():
            return self.workdir / node / "host" / host.lstrip("/")
        return Path(host)

    # -- nodes ---------------------------------------------------------------------------------

    async def register(self) -> None:
        if self.cgroups.root is None:
            log.warning("no writable cgroup hierarchy: pod processes cannot be identified")
        for name, simulate in self.nodes.items():
            (self.workdir / name / "run" / "gpushare").mkdir(parents=True, exist_ok=True)
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            }
            if simulate:
                labels[SIMULATE_LABEL] = simulate
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
            }
            with contextlib.suppress(ApiException):
                await self.kube.core.create_node(body)
            await self.kube.core.patch_node(name, {"metadata": {"labels": labels}})
            await self.device_managers[name].start()
            await self.node_status(name)
            await self._untaint(name)

    async def node_status(self, name: str) -> None:
        stamp = now()
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110", **self.extended[name]}
        conditions = [
            {
                "type": t,
                "status": "False",
                "reason": "AgentOK",
                "message": "ok",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "node agent (test double of the kubelet) is ready",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
        await self.kube.core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": capacity,
                    "allocatable": capacity,
                    "conditions": conditions,
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": name},
                    ],
                    "nodeInfo": {
                        "kubeletVersion": "v1.20.2-gpushare-node-agent",
                        "osImage": "test",
                        "operatingSystem": "linux",
                        "architecture": "amd64",
                        "containerRuntimeVersion": "local-process://0",
                        "kernelVersion": "",
                        "kubeProxyVersion": "",
                        "machineID": "",
                        "systemUUID": "",
                        "bootID": "",
                    },
                }
            },
        )

    async def _untaint(self, name: str) -> None:
        """Drop the ``not-ready`` taint that nodes created through the API start with."""
        node = await self.kube.core.read_node(name)
        taints = self.kube.api.sanitize_for_serialization(node.spec.taints or [])
        kept = [t for t in taints if t["key"] != "node.kubernetes.io/not-ready"]
        if kept != taints:
            await self.kube.core.patch_node(
                name, [{"op": "replace", "path": "/spec/taints", "value": kept}]
            )

    async def heartbeat(self, interval: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval)
            for name in self.nodes:
                try:
                    await self.node_status(name)
                    await self._untaint(name)
                except Exception as exc:
                    log.warning("heartbeat of %s failed: %s", name, exc)

    # -- pods ----------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                listing = await self.kube.list_pods(self.namespace)
                for pod in listing.get("items") or []:
                    await self.on_pod(pod, deleted=False)
                async for event in self.kube.watch(
                    "pods", self.namespace, listing["metadata"]["resourceVersion"]
                ):
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        await self.on_pod(event["object"], deleted=event["type"] == "DELETED")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("pod watch restarts: %s", exc)
                await asyncio.sleep(0.5)

    async def on_pod(self, pod: dict[str, Any], deleted: bool) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        if node not in self.nodes:
            return
        meta = pod["metadata"]
        running = self.pods.get(meta["uid"])
        if deleted:
            if running is not None:
                await self._stop(running, 0)
                self.pods.pop(meta["uid"], None)
            return
        if meta.get("deletionTimestamp"):
            if running is None or running.finished:
                await self._finalize(pod)
                self.pods.pop(meta["uid"], None)
            elif running.task is not None and not getattr(running, "deleting", False):
                running.deleting = True  # type: ignore[attr-defined]
                task = asyncio.create_task(self._delete_gracefully(running, pod))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        if running is None:
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            running = RunningPod(pod)
            self.pods[meta["uid"]] = running
            running.task = asyncio.create_task(self._run_pod(running, node))
            return
        annotations = meta.get("annotations") or {}
        if EVICT in annotations and running.reason is None:
            running.reason, running.message = "Evicted", annotations[EVICT]
            await self._stop(running, 0)
        elif OOM in annotations and running.reason is None:
            running.reason, running.message = "OOMKilled", ""
            await self._stop(running, 0)

    async def _delete_gracefully(self, running: RunningPod, pod: dict[str, Any]) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        await self._stop(running, float(grace if grace is not None else 30))
        if running.task is not None:
            with contextlib.suppress(Exception):
                await running.task
        await self._finalize(pod)
        self.pods.pop(running.uid, None)

    async def _finalize(self, pod: dict[str, Any]) -> None:
        """The kubelet's last word on a deleted pod: its containers are gone, remove it."""
        meta = pod["metadata"]
        try:
            await self.kube.core.delete_namespaced_pod(
                meta["name"],
                meta["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )
            log.info("pod %s: deleted", meta["name"])
        except ApiException as exc:
            if exc.status != 404:
                log.warning(
                    "pod %s: final delete failed: %s %s", meta["name"], exc.status, exc.reason
                )
        self.device_managers[pod["spec"]["nodeName"]].release(meta["uid"])
        root = self.workdir / "pods" / meta["uid"]
        for log_file in root.glob("*.log"):
            (self.workdir / "logs").mkdir(exist_ok=True)
            shutil.move(log_file, self.workdir / "logs" / f"{meta['name']}.{log_file.name}")
        shutil.rmtree(root, ignore_errors=True)
        self.cgroups.remove(meta["uid"])

    async def _stop(self, running: RunningPod, grace: float) -> None:
        running.stopping = True
        live = [p for p in running.processes.values() if p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        if grace > 0 and live:
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), grace)
            except (asyncio.TimeoutError, TimeoutError):
                for proc in live:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)

    async def _run_pod(self, running: RunningPod, node: str) -> None:
        pod = running.pod
        spec = pod["spec"]
        delay = ((pod["metadata"].get("annotations") or {}).get(ADMIT_AFTER)) or 0
        await asyncio.sleep(float(delay))
        inits, containers = spec.get("initContainers") or [], spec["containers"]
        missing = [c for c in [*inits, *containers] if "does-not-exist" in c.get("image", "")]
        if missing:
            await self._status(
                pod,
                "Pending",
                [
                    self._cstatus(
                        missing[0],
                        {
                            "waiting": {
                                "reason": "ErrImagePull",
                                "message": "rpc error: code = NotFound desc = "
                                "failed to pull and unpack "
                                f'image "{missing[0]["image"]}": not found',
                            }
                        },
                    )
                ],
            )
            running.finished = True
            return
        try:
            manager = self.device_managers[node]
            async with manager.admission:
                for container in [*inits, *containers]:
                    if manager.requests(container):
                        running.devices[container["name"]] = await manager.allocate(
                            running.uid, container
                        )
        except AdmissionError as exc:  # the kubelet rejects the pod at admission
            log.warning("pod %s: %s", running.name, exc)
            await self._status(
                pod, "Failed", [], reason="UnexpectedAdmissionError", message=str(exc)
            )
            running.finished = True
            return
        await asyncio.sleep(float((pod["metadata"].get("annotations") or {}).get(START_AFTER, 0)))
        try:
            root, mounts = await self._volumes(pod, node)
            if running.devices:
                (root / "devices.json").write_text(json.dumps(running.devices, indent=1))
            for init in inits:
                code = await (await self._start(running, pod, init, node, root, mounts)).wait()
                if code != 0:
                    await self._status(
                        pod,
                        "Pending",
                        [
                            self._cstatus(
                                init,
                                {
                                    "waiting": {
                                        "reason": "Init:Error",
                                        "message": f"exit code {code}",
                                    }
                                },
                            )
                        ],
                    )
                    running.finished = True
                    return
            for container in containers:
                await self._start(running, pod, container, node, root, mounts)
        except Exception as exc:
            log.exception("pod %s could not run", running.name)
            reason = (
                "CreateContainerConfigError"
                if isinstance(exc, ContainerConfigError)
                else "CreateContainerError"
            )
            await self._status(
                pod,
                "Pending",
                [
                    self._cstatus(
                        containers[0], {"waiting": {"reason": reason, "message": str(exc)}}
                    )
                ],
            )
            running.finished = True
            return
        started = now()
        await self._status(
            pod,
            "Running",
            [self._cstatus(c, {"running": {"startedAt": started}}, ready=True) for c in containers],
            ready=True,
        )
        if spec.get("restartPolicy", "Always") == "Always":
            await self._keep_running(running, pod, node, root, mounts)
        code = await running.processes[containers[0]["name"]].wait()
        for container in containers[1:]:
            await running.processes[container["name"]].wait()
        await self._terminated(running, pod, containers[0], code, started)

    async def _keep_running(
        self,
        running: RunningPod,
        pod: dict[str, Any],
        node: str,
        root: Path,
        mounts: dict[str, str],
    ) -> None:
        """``restartPolicy: Always``: a container that exits is started again (after 1 s)."""
        containers = {c["name"]: c for c in pod["spec"]["containers"]}  # not the init ones
        restarts = dict.fromkeys(containers, 0)
        while not running.stopping:
            waits = {asyncio.ensure_future(running.processes[n].wait()): n for n in containers}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if running.stopping:
                return
            await asyncio.sleep(1.0)
            for task in done:
                name = waits[task]
                container = containers[name]
                restarts[name] += 1
                log.info(
                    "pod %s: container %s exited (%s); restart %d",
                    running.name,
                    name,
                    task.result(),
                    restarts[name],
                )
                await self._start(running, pod, container, node, root, mounts)

    async def _terminated(
        self,
        running: RunningPod,
        pod: dict[str, Any],
        container: dict[str, Any],
        code: int,
        started: str,
    ) -> None:
        code = 128 - code if code < 0 else code
        reason = running.reason or ("Completed" if code == 0 else "Error")
        if running.reason == "OOMKilled":
            code = 137
        term = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": now(),
            }
        }
        phase = "Succeeded" if code == 0 and running.reason is None else "Failed"
        extra = {}
        if running.reason == "Evicted":
            extra = {"reason": "Evicted", "message": running.message}
        running.finished = True
        log.info("pod %s: exited %d (%s)", running.name, code, phase)
        try:
            await self._status(pod, phase, [self._cstatus(container, term)], **extra)
        except ApiException as exc:
            log.info("pod %s: final status not written (%s)", running.name, exc.status)

    async def _start(
        self,
        running: RunningPod,
        pod: dict[str, Any],
        container: dict[str, Any],
        node: str,
        root: Path,
        mounts: dict[str, str],
    ) -> asyncio.subprocess.Process:
        await self._pre_start(running, pod, container, node)
        name = container["name"]
        device = running.devices.get(name) or {}
        for m in device.get("mounts") or []:  # the device plugin's mounts are host paths
            mounts = {
                **mounts,
                f"device:{m['container_path']}": str(self.host_path(node, m["host_path"])),
            }
        argv, env = self._command(pod, container, mounts, device)
        _check_executable(argv[0], env)
        user = run_as(pod, container)
        if user.uid is not None and user.uid != 0:
            home = root / f"home-{name}"
            home.mkdir(mode=0o700, exist_ok=True)
            os.chown(home, user.uid, user.gid if user.gid is not None else user.uid)
            env["HOME"] = str(home)
        cgroup = self.cgroups.path(running.uid, name)
        with open(root / f"{name}.log", "ab") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *user.wrap(argv, cgroup),
                env=env,
                cwd=str(root),
                stdout=log_file,
                stderr=subprocess_stdout(),
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        running.processes[name] = proc
        log.info(
            "pod %s on %s: %s runs pid %d: %s", running.name, node, name, proc.pid, " ".join(argv)
        )
        return proc

    async def _pre_start(
        self, running: RunningPod, pod: dict[str, Any], container: dict[str, Any], node: str
    ) -> None:
        """PreStartContainer before each start; while it fails the container waits in
        CreateContainerConfigError (the pod Pending) and is tried again."""
        while True:
            try:
                await self.device_managers[node].pre_start(running.uid, container)
                return
            except PreStartError as exc:
                log.warning("pod %s: %s", running.name, exc)
                waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
                with contextlib.suppress(ApiException):
                    await self._status(
                        pod, "Pending", [self._cstatus(container, {"waiting": waiting})]
                    )
                if running.stopping:
                    raise ContainerConfigError(str(exc)) from None
                await asyncio.sleep(PRE_START_RETRY)
                if running.stopping:
                    raise ContainerConfigError(str(exc)) from None

    async def _volumes(self, pod: dict[str, Any], node: str) -> tuple[Path, dict[str, str]]:
        """The pod's directory and its volumes as local directories, by volume name."""
        root = self.workdir / "pods" / pod["metadata"]["uid"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = {}
        for vol in pod["spec"].get("volumes") or []:
            volumes[vol["name"]] = str(await self._volume(vol, root, node, pod))
        return root, volumes

    def _command(
        self,
        pod: dict[str, Any],
        container: dict[str, Any],
        volumes: dict[str, str],
        device: dict[str, Any] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        mounts = {
            m["mountPath"].rstrip("/"): volumes[m["name"]]
            for m in container.get("volumeMounts") or []
            if m["name"] in volumes
        }
        for m in (device or {}).get("mounts") or []:
            mounts[m["container_path"].rstrip("/")] = volumes[f"device:{m['container_path']}"]

        # one pass, longest mount path first, each followed by "/" or the end of a path
        pattern = (
            re.compile(
                "|".join(
                    re.escape(m) + r"(?=/|$|[:;,\s])"
                    for m in sorted(mounts, key=len, reverse=True)
                    if m
                )
            )
            if any(mounts)
            else None
        )

        def translate(text: str) -> str:
            if pattern is None:
                return text
            return pattern.sub(lambda m: mounts[m.group(0)], text)

        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("KUBECONFIG", "GPUSHARE_", "JPY_", "JUPYTER_"))
        }
        account = f"{pod['metadata']['namespace']}/{pod['spec'].get('serviceAccountName')}"
        if pod["spec"].get("automountServiceAccountToken") is not False and (
            account in self.accounts
        ):
            env["KUBECONFIG"] = self.accounts[account]
        # the device plugins' envs first: the spec's env has the last word (as in the kubelet)
        declared: dict[str, str] = {
            k: translate(v) for k, v in ((device or {}).get("envs") or {}).items()
        }
        for item in container.get("env") or []:
            value = item.get("value")
            if value is None and "valueFrom" in item:
                value = self._field(pod, item["valueFrom"].get("fieldRef", {}).get("fieldPath"))
            declared[item["name"]] = translate(str(value or ""))
        env.update(declared)
        if "NVIDIA_VISIBLE_DEVICES" in env and env["NVIDIA_VISIBLE_DEVICES"] != "all":
            env["CUDA_VISIBLE_DEVICES"] = env["NVIDIA_VISIBLE_DEVICES"]
        if env.get("LD_PRELOAD") and not Path(env["LD_PRELOAD"]).exists():
            env.pop("LD_PRELOAD")  # no interposer installed on this node
        argv = [
            translate(VAR_REF.sub(lambda m: declared.get(m.group(1), m.group(0)), a))
            for a in [*(container.get("command") or []), *(container.get("args") or [])]
        ]
        # Every pod here shares this machine's network (podIP 127.0.0.1): a fixed port such as
        # the node daemon's metrics port would collide between nodes, so it gets a free one,
        # on loopback (not every address of this shared machine).
        argv = [
            "--metrics-host=127.0.0.1" if a.startswith("--metrics-host=") else a
            for a in (METRICS_PORT.sub("--metrics-port=-1", a) for a in argv)
        ]
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        elif argv and shutil.which(argv[0], path=str(Path(sys.executable).parent)):
            argv[0] = str(Path(sys.executable).parent / argv[0])  # the image's entry points
        return argv, env

    async def _volume(
        self, vol: dict[str, Any], root: Path, node: str, pod: dict[str, Any]
    ) -> Path:
        if "secret" in vol:
            path = root / "volumes" / vol["name"]
            path.mkdir(parents=True, exist_ok=True)
            secret = await self.kube.core.read_namespaced_secret(
                vol["secret"]["secretName"], pod["metadata"]["namespace"]
            )
            # as the kubelet writes them: root's files, mode defaultMode; with an fsGroup, the
            # group is fsGroup and read-only volumes get group read (volume ownership)
            fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
            mode = int(vol["secret"].get("defaultMode", 0o644))
            if fs_group is not None:
                mode |= 0o440
            for key, data in (secret.data or {}).items():
                target = path / key
                target.write_bytes(base64.b64decode(data))
                os.chown(target, 0, int(fs_group) if fs_group is not None else 0)
                target.chmod(mode)
            return path
        if "hostPath" in vol:
            path = self.host_path(node, vol["hostPath"]["path"])
            path.mkdir(parents=True, exist_ok=True)
            return path
        if "projected" in vol:
            return await self._projected(vol, root, pod)
        path = root / "volumes" / vol["name"]
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def _projected(self, vol: dict[str, Any], root: Path, pod: dict[str, Any]) -> Path:
        """A projected volume's ``serviceAccountToken`` sources, as the kubelet makes them: a
        token of the pod's service account from the TokenRequest API, for the source's
        audience and lifetime, bound to the pod (not rotated here: tests are shorter than the
        shortest lifetime, 600 s). Other sources are not played."""
        path = root / "volumes" / vol["name"]
        path.mkdir(parents=True, exist_ok=True)
        meta = pod["metadata"]
        for source in vol["projected"].get("sources") or []:
            request = source.get("serviceAccountToken")
            if request is None:
                continue
            spec: dict[str, Any] = {
                "expirationSeconds": int(request.get("expirationSeconds", 3600)),
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            }
            if request.get("audience"):
                spec["audiences"] = [request["audience"]]
            core: Any = self.kube.core
            account = pod["spec"].get("serviceAccountName") or "default"
            try:
                reply = await self.kube._json(
                    core.create_namespaced_service_account_token(
                        account, meta["namespace"], {"spec": spec}, _preload_content=False
                    )
                )
            except ApiException as exc:  # the file stays missing: its reader says so
                log.warning("pod %s: no token for %s: %s", meta["name"], account, exc.reason)
                continue
            target = path / request["path"]
            target.write_text(reply["status"]["token"])
            target.chmod(0o644)  # the kubelet's default mode for projected files
        return path

    @staticmethod
    def _field(pod: dict[str, Any], path: str | None) -> str:
        return {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "metadata.uid": pod["metadata"]["uid"],
            "spec.nodeName": pod["spec"].get("nodeName", ""),
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }.get(path or "", "")

    @staticmethod
    def _cstatus(
        container: dict[str, Any], state: dict[str, Any], ready: bool = False
    ) -> dict[str, Any]:
        return {
            "name": container["name"],
            "image": container.get("image", ""),
            "imageID": "",
            "ready": ready,
            "started": "running" in state,
            "restartCount": 0,
            "state": state,
        }

    async def _status(
        self,
        pod: dict[str, Any],
        phase: str,
        containers: list[dict[str, Any]],
        ready: bool = False,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        stamp = now()
        flag = "True" if ready else "False"
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": stamp,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
                {"type": "Ready", "status": flag, "lastTransitionTime": stamp},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": stamp},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            ],
            "containerStatuses": containers,
        }
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        await self.kube.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
        )


def _check_executable(program: str, env: dict[str, str]) -> None:
    """The runtime resolves the command before the container starts (runc's exec check): a
    missing one never runs, it is a CreateContainerError with runc's words."""
    found = (
        program
        if "/" in program and os.access(program, os.X_OK)
        else shutil.which(program, path=env.get("PATH", os.defpath))
        if "/" not in program
        else None
    )
    if found is None:
        raise FileNotFoundError(
            f'exec: "{program}": executable file not found in $PATH'
            if "/" not in program
            else f'exec: "{program}": stat {program}: no such file or directory'
        )


#: util-linux's setpriv (drops to a user, no_new_privs) by absolute path: containers' PATH varies
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"


class RunAs:
    """The identity a container runs as (None: the image's, which is root here)."""

    def __init__(
        self, uid: int | None, gid: int | None, groups: list[int], no_new_privs: bool
    ) -> None:
        self.uid, self.gid, self.groups, self.no_new_privs = uid, gid, groups, no_new_privs

    def wrap(self, argv: list[str], cgroup: Path | None) -> list[str]:
        """``argv`` run by programs that join the container's cgroup (as root) and drop to the
        user, each exec-ing the next in the same process. No Python runs between fork and exec:
        this agent has gRPC threads, and Python code in a forked child of a threaded process
        (a preexec_fn) aborted kernel pods now and then (exit 134)."""
        if self.uid is not None:
            groups = (
                ["--groups", ",".join(map(str, self.groups))] if self.groups else ["--clear-groups"]
            )
            argv = [
                SETPRIV,
                "--reuid",
                str(self.uid),
                "--regid",
                str(self.gid if self.gid is not None else 0),
                *groups,
                *(["--no-new-privs"] if self.no_new_privs else []),
                "--",
                *argv,
            ]
        elif self.no_new_privs:
            argv = [SETPRIV, "--no-new-privs", "--", *argv]
        if cgroup is not None:
            argv = [
                "/bin/sh",
                "-c",
                'echo $$ > "$0" && exec "$@"',
                str(cgroup / "cgroup.procs"),
                *argv,
            ]
        return argv


def run_as(pod: dict[str, Any], container: dict[str, Any]) -> RunAs:
    """runAsUser/runAsGroup (the container's over the pod's), fsGroup and supplementalGroups
    as supplementary groups; ``runAsNonRoot`` with uid 0 refused as the kubelet does."""
    psc = pod["spec"].get("securityContext") or {}
    csc = container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and not uid:
        raise ContainerConfigError(
            "container has runAsNonRoot and image will run as root "
            f"(pod: {pod['metadata']['name']!r}, container: {container['name']})"
        )
    groups = [
        g for g in (psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])) if g is not None
    ]
    if gid is not None:
        groups.append(gid)
    return RunAs(uid, gid, sorted(set(groups)), csc.get("allowPrivilegeEscalation") is False)


class ContainerConfigError(Exception):
    """The kubelet's CreateContainerConfigError."""


def subprocess_stdout() -> int:
    return asyncio.subprocess.STDOUT


async def amain(args: argparse.Namespace) -> None:
    kube = await connect(args.kubeconfig)
    nodes = dict(n.split("=", 1) if "=" in n else (n, "") for n in args.node)
    accounts = dict(a.split("=", 1) for a in args.service_account)
    agent = NodeAgent(
        kube, args.namespace, Path(args.workdir), nodes, args.cpu, args.memory, accounts
    )
    await agent.register()
    print("node agent ready", flush=True)
    try:
        await asyncio.gather(agent.run(), agent.heartbeat())
    finally:
        for running in list(agent.pods.values()):
            await agent._stop(running, 0)
        await kube.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="kubelet test double for fake GPU nodes")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", default="gpushare")
    parser.add_argument("--workdir", required=True)
    parser.add_argument(
        "--node", action="append", default=[], help="NAME=SIMULATE, e.g. gpu-node-1=2xA100 (repeat)"
    )
    parser.add_argument(
        "--service-account",
        action="append",
        default=[],
        metavar="NS/NAME=KUBECONFIG",
        help="credentials given to pods of that service account (repeat)",
    )
    parser.add_argument("--cpu", default="4")
    parser.add_argument("--memory", default="16Gi")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-agent %(message)s")
    loop = asyncio.new_event_loop()
    task = loop.create_task(amain(args))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(task)


if __name__ == "__main__":
    main()
