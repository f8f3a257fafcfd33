"""Pure functions that build the Kubernetes objects of gpushare, and read Node inventory back.

No API calls here: every function maps plain data (config values, an allocation, a connection
info) to a manifest dict, so the shapes are testable without a cluster.

Objects and who owns them (``ownerReferences``, so the garbage collector cleans up):

- ``Lease gpushare-server-<id>``: the Jupyter server's liveness anchor, renewed while it runs
  (owned by the server's own pod when it runs in one);
- ``Pod gpushare-kernel-…``: one per kernel launch, owned by the server Lease;
- ``Secret`` of the same name: the kernel's connection file (key and ports), owned by the pod;
- ``GpuLedger <node>``: that node's allocation records, owned by the Node.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..inventory import Gpu, TypeAliases
from ..kernel_env import INTERPOSER, Simulated, share_environment
from ..simulator import SIM_STATE_NAME

GROUP = "gpushare.jupyter.org"
LEDGER_API = f"{GROUP}/v1alpha1"
GPUS_ANNOTATION = f"{GROUP}/gpus"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"  # MiB, as GPU feature discovery publishes it
SIMULATED_LABEL = f"{GROUP}/simulated"

LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_KERNEL = f"{GROUP}/kernel-id"
LABEL_ALLOCATION = f"{GROUP}/allocation"
LABEL_SERVER = f"{GROUP}/server"
#: The Hub user a kernel pod (set by the controller) or a user's server pod (set by the Hub,
#: :func:`jupyter_gpushare.hub.owner_labels`) belongs to, as :func:`owner_label`: the per-user
#: NetworkPolicy (:mod:`jupyter_gpushare.controller.network`) admits a kernel's own server only.
LABEL_OWNER = f"{GROUP}/owner"
#: The extended resource of a share, in hundredths of a GPU (the device plugin advertises 100 per
#: healthy GPU; a kernel pod requests its compute request x its GPU count, limits = requests).
SHARE_RESOURCE = f"{GROUP}/gpu-share"
SHARE_UNITS_PER_GPU = 100
#: Set by the node's device plugin on the kernel pod it has allocated for (so that a second
#: container start of the same size is matched with the next pod, as HAMi does).
ALLOCATED_ANNOTATION = f"{GROUP}/device-allocated"
KERNEL_COMPONENT = "gpushare-kernel"
#: the component label of the Leases that order kernel pods' admissions across servers (direct mode)
ADMISSION_COMPONENT = "gpushare-admission"
CONNECTION_KEY = "connection.json"


# -- the kernel pod ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSettings:
    """The admin's pod template (from :class:`~.config.KubernetesBackendConfig`), as data."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    resources: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    volumes: Sequence[Mapping[str, Any]] = ()
    volume_mounts: Sequence[Mapping[str, Any]] = ()
    tolerations: Sequence[Mapping[str, Any]] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    service_account: str = ""
    runtime_class: str = ""
    pod_template: Mapping[str, Any] = field(default_factory=dict)
    connection_dir: str = "/var/run/gpushare-kernel"
    socket_host_path: str = "/run/gpushare"
    socket_mount_path: str = "/run/gpushare"
    socket_name: str = "daemon.sock"
    interposer_host_path: str = "/opt/gpushare/lib"
    interposer_mount_path: str = "/opt/gpushare/lib"
    preload_interposer: bool = True
    termination_grace: int = 5
    #: True: restricted pods; the node's device plugin hands the container its socket,
    #: interposer and environment. False: hostPath mounts (clusters without the plugin).
    device_plugin: bool = True
    share_resource: str = SHARE_RESOURCE
    run_as_user: int = 1000
    run_as_group: int = 100
    fs_group: int = 100

    @classmethod
    def from_config(cls, cfg: Any) -> PodSettings:
        return cls(
            image=cfg.image,
            image_pull_policy=cfg.image_pull_policy,
            resources=dict(cfg.resources),
            env=dict(cfg.env),
            volumes=list(cfg.volumes),
            volume_mounts=list(cfg.volume_mounts),
            tolerations=list(cfg.tolerations),
            node_selector=dict(cfg.node_selector),
            labels=dict(cfg.labels),
            annotations=dict(cfg.annotations),
            service_account=cfg.service_account,
            runtime_class=cfg.runtime_class,
            pod_template=dict(cfg.pod_template),
            connection_dir=cfg.connection_dir,
            socket_host_path=cfg.daemon_socket_host_path,
            socket_mount_path=cfg.daemon_socket_mount_path,
            socket_name=cfg.daemon_socket_name,
            interposer_host_path=cfg.interposer_host_path,
            interposer_mount_path=cfg.interposer_mount_path,
            preload_interposer=cfg.preload_interposer,
            termination_grace=cfg.termination_grace,
            device_plugin=cfg.device_plugin,
            share_resource=cfg.share_resource,
            run_as_user=cfg.run_as_user,
            run_as_group=cfg.run_as_group,
            fs_group=cfg.fs_group,
        )

    @property
    def connection_file(self) -> str:
        return f"{self.connection_dir.rstrip('/')}/{CONNECTION_KEY}"

    @property
    def socket_path(self) -> str:
        return f"{self.socket_mount_path.rstrip('/')}/{self.socket_name}"


@dataclass(frozen=True)
class KernelPodRequest:
    """What one launch needs: names, the allocation, the command, the owner."""

    name: str  # pod and Secret name
    namespace: str
    kernel_id: str
    allocation_id: str
    node: str
    gpus: Sequence[str]
    command: Sequence[str]
    env: Mapping[str, str]
    server_id: str
    owner: Mapping[str, Any]  # an ownerReference (the server Lease)
    simulated_devices: str = ""  # GPUSHARE_SIM_DEVICES of the node, when its GPUs are simulated
    gpu_request: float = 0.0  # what the interposer enforces alone while the daemon is away
    gpu_memory: int = 0
    user_label: str = ""  # owner_label() of the Hub user (controller mode); "": no owner label


def visible_devices(gpus: Sequence[str]) -> str:
    """``NVIDIA_VISIBLE_DEVICES``: UUIDs; GPUs known only by node labels (``node/3``) by index."""
    return ",".join(g.rsplit("/", 1)[-1] if "/" in g else g for g in gpus)


def share_units(request: KernelPodRequest) -> int:
    """The share's extended resource quantity: hundredths of a GPU on each of its GPUs (at
    least 1, so that a limit-only share still goes through the device plugin)."""
    per_gpu = round(float(request.gpu_request) * SHARE_UNITS_PER_GPU)
    return max(1, per_gpu * max(1, len(request.gpus)))


def kernel_environment(request: KernelPodRequest, settings: PodSettings) -> dict[str, str]:
    """The kernel container's environment in the pod spec. With the device plugin it holds
    only what the kernel is given (and the fail-static share); the node's plugin adds the
    socket, the GPU and the interposer in ``Allocate`` (``k8s/device_plugin``)."""
    env = dict(request.env)
    env.update(settings.env)
    if settings.device_plugin:
        if request.gpu_memory:
            env["GPUSHARE_GPU_REQUEST"] = repr(float(request.gpu_request))
            env["GPUSHARE_GPU_MEMORY"] = str(int(request.gpu_memory))
        if not settings.preload_interposer:  # the spec's env overrides the plugin's
            env["LD_PRELOAD"] = ""
        return env
    lib = settings.interposer_mount_path.rstrip("/")
    sim_state = f"{settings.socket_mount_path.rstrip('/')}/{SIM_STATE_NAME}"
    env.update(
        share_environment(  # the one builder (jupyter_gpushare.kernel_env)
            allocation_id=request.allocation_id,
            node=request.node,
            socket=settings.socket_path,
            visible=("NVIDIA_VISIBLE_DEVICES", visible_devices(request.gpus)),
            interposer=f"{lib}/{INTERPOSER}" if settings.preload_interposer else None,
            fail_static=(request.gpu_request, request.gpu_memory) if request.gpu_memory else None,
            simulated=Simulated(request.simulated_devices, sim_state, f"{lib}/sim")
            if request.simulated_devices
            else None,
        )
    )
    return env


def kernel_pod(request: KernelPodRequest, settings: PodSettings) -> dict[str, Any]:
    """The kernel's Pod: on ``request.node`` (through the scheduler, so that CPU, memory,
    taints and the share's extended resource are checked and refusals come in the scheduler's
    words), the connection Secret mounted (group ``fs_group``, mode 0440).

    With the device plugin (default) the pod passes Pod Security "restricted": non-root,
    no privilege escalation, every capability dropped, seccomp RuntimeDefault, no hostPath;
    it asks ``share_resource: <hundredths>`` and the node's plugin hands it its GPU, the
    interposer (read-only) and a directory holding only its own agent socket. Without it, the
    daemon socket and the interposer are hostPath mounts and the GPU is named in the env."""
    env = kernel_environment(request, settings)
    if settings.device_plugin:
        return deep_merge(_restricted_pod(request, settings, env), settings.pod_template)
    container: dict[str, Any] = {
        "name": "kernel",
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(request.command),
        "env": [{"name": k, "value": str(v)} for k, v in sorted(env.items())],
        "resources": copy.deepcopy(dict(settings.resources)),
        "volumeMounts": [
            {"name": "connection", "mountPath": settings.connection_dir, "readOnly": True},
            {"name": "gpushare-socket", "mountPath": settings.socket_mount_path},
            {"name": "gpushare-lib", "mountPath": settings.interposer_mount_path, "readOnly": True},
            *copy.deepcopy(list(settings.volume_mounts)),
        ],
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.termination_grace,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "affinity": _on_node(request.node),
        "containers": [container],
        "volumes": [
            {"name": "connection", "secret": {"secretName": request.name, "defaultMode": 0o400}},
            {
                "name": "gpushare-socket",
                "hostPath": {"path": settings.socket_host_path, "type": "DirectoryOrCreate"},
            },
            {
                "name": "gpushare-lib",
                "hostPath": {"path": settings.interposer_host_path, "type": "DirectoryOrCreate"},
            },
            *copy.deepcopy(list(settings.volumes)),
        ],
    }
    _common_spec(spec, request, settings)
    return deep_merge(_pod_object(request, settings, spec), settings.pod_template)


def _restricted_pod(
    request: KernelPodRequest, settings: PodSettings, env: Mapping[str, str]
) -> dict[str, Any]:
    units = str(share_units(request))
    resources = copy.deepcopy(dict(settings.resources))
    for kind in ("requests", "limits"):
        resources[kind] = {**dict(resources.get(kind) or {}), settings.share_resource: units}
    container: dict[str, Any] = {
        "name": "kernel",
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(request.command),
        "env": [{"name": k, "value": str(v)} for k, v in sorted(env.items())],
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_group,
        },
        "volumeMounts": [
            {"name": "connection", "mountPath": settings.connection_dir, "readOnly": True},
            *copy.deepcopy(list(settings.volume_mounts)),
        ],
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.termination_grace,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_group,
            "fsGroup": settings.fs_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": _on_node(request.node),
        "containers": [container],
        "volumes": [
            {"name": "connection", "secret": {"secretName": request.name, "defaultMode": 0o440}},
            *copy.deepcopy(list(settings.volumes)),
        ],
    }
    _common_spec(spec, request, settings)
    return _pod_object(request, settings, spec)


def _on_node(node: str) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node]},
                        ]
                    }
                ],
            }
        }
    }


def _common_spec(spec: dict[str, Any], request: KernelPodRequest, settings: PodSettings) -> None:
    if settings.tolerations:
        spec["tolerations"] = copy.deepcopy(list(settings.tolerations))
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    # a runtime class injects real GPUs (CDI); a node whose GPUs are simulated has none to inject
    if settings.runtime_class and not request.simulated_devices:
        spec["runtimeClassName"] = settings.runtime_class


def _pod_object(
    request: KernelPodRequest, settings: PodSettings, spec: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": request.name,
            "namespace": request.namespace,
            "labels": {
                **settings.labels,
                LABEL_COMPONENT: KERNEL_COMPONENT,
                LABEL_KERNEL: request.kernel_id,
                LABEL_ALLOCATION: request.allocation_id,
                LABEL_SERVER: request.server_id,
                **({LABEL_OWNER: request.user_label} if request.user_label else {}),
            },
            "annotations": dict(settings.annotations),
            "ownerReferences": [dict(request.owner)],
        },
        "spec": spec,
    }


def owner_label(user: str) -> str:
    """The :data:`LABEL_OWNER` value of Hub user ``user``: the first 20 hex digits of the
    SHA-256 of the name (label-safe whatever the name holds; 80 bits, so two users of one Hub
    never share a value by accident, and a user cannot pick a name that collides with
    another's)."""
    return hashlib.sha256(user.encode()).hexdigest()[:20]


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: dicts recursively, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def connection_secret(
    name: str,
    namespace: str,
    connection: Mapping[str, Any],
    owner: Mapping[str, Any],
    kernel_id: str,
) -> dict[str, Any]:
    """The kernel's connection file (key, ports) as a Secret; the pod mounts it. The key is
    nowhere else in the cluster: not in the pod spec, its env or its logs."""
    data = json.dumps(dict(connection), sort_keys=True).encode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_COMPONENT: KERNEL_COMPONENT, LABEL_KERNEL: kernel_id},
            "ownerReferences": [dict(owner)],
        },
        "type": "Opaque",
        "data": {CONNECTION_KEY: base64.b64encode(data).decode()},
    }


def owner_reference(obj: Mapping[str, Any], controller: bool = False) -> dict[str, Any]:
    """An ownerReference to ``obj`` (a dict with apiVersion, kind, metadata.name/uid)."""
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": False,
    }


def node_owner(node: str, uid: str) -> dict[str, Any]:
    """An ownerReference to the Node ``node`` (so the garbage collector removes the object with
    the node)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node,
        "uid": uid,
        "blockOwnerDeletion": False,
    }


# -- the server's liveness anchor ----------------------------------------------------------------


def lease_name(server_id: str) -> str:
    return f"gpushare-server-{server_id}"


def server_lease(
    server_id: str,
    namespace: str,
    holder: str,
    duration: float,
    owner: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    labels = {LABEL_COMPONENT: "gpushare-server", LABEL_SERVER: server_id}
    return _lease(lease_name(server_id), namespace, labels, holder, duration, owner, now)


def _lease(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    holder: str,
    duration: float,
    owner: Mapping[str, Any] | None,
    now: datetime | None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    now = now or datetime.now(timezone.utc)
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    if owner:
        metadata["ownerReferences"] = [dict(owner)]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": max(1, round(duration)),
            "acquireTime": micro_time(now),
            "renewTime": micro_time(now),
        },
    }


def admission_lease(
    node: str,
    units: int,
    namespace: str,
    holder: str,
    duration: float,
    owner: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The Lease a server holds while its kernel pod of ``node`` and ``units`` waits for the
    kubelet's admission (:class:`jupyter_gpushare.k8s.admission.LeaseGate`); the node's name,
    which may be longer than a Lease name allows, is hashed (and kept in an annotation)."""
    digest = hashlib.sha256(node.encode()).hexdigest()[:20]
    return _lease(
        f"gpushare-admit-{units}-{digest}",
        namespace,
        {LABEL_COMPONENT: ADMISSION_COMPONENT},
        holder,
        duration,
        owner,
        now,
        {f"{GROUP}/node": node, f"{GROUP}/units": str(units)},
    )


def micro_time(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=timezone.utc)
        except ValueError:
            continue
    return None


def lease_expired(lease: Mapping[str, Any], now: datetime, grace: float = 0.0) -> bool:
    spec = lease.get("spec") or {}
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    if renewed is None:
        return True
    duration = float(spec.get("leaseDurationSeconds") or 0)
    return (now - renewed).total_seconds() > duration + grace


# -- the ledger object ---------------------------------------------------------------------------


def ledger_object(
    node: str,
    namespace: str,
    allocations: Sequence[Mapping[str, Any]],
    node_owner: Mapping[str, Any] | None = None,
    resource_version: str | None = None,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": node,
        "namespace": namespace,
        "labels": {LABEL_COMPONENT: "gpushare-ledger"},
    }
    if node_owner:
        metadata["ownerReferences"] = [dict(node_owner)]
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": LEDGER_API,
        "kind": "GpuLedger",
        "metadata": metadata,
        "spec": {"node": node, "allocations": [dict(a) for a in allocations]},
        "status": {"count": len(allocations)},
    }


# -- inventory on Node objects -------------------------------------------------------------------


def gpus_annotation(gpus: Sequence[Gpu]) -> str:
    """The ``gpushare.jupyter.org/gpus`` annotation the node daemon publishes on its Node."""
    return json.dumps(
        [
            {
                "uuid": g.uuid,
                "index": g.index,
                "name": g.name,
                "memory": g.memory,
                "healthy": g.healthy,
                "simulated": g.simulated,
            }
            for g in sorted(gpus, key=lambda g: g.index)
        ],
        separators=(",", ":"),
    )


def node_gpu_patch(gpus: Sequence[Gpu]) -> dict[str, Any]:
    """A merge patch publishing ``gpus`` on their Node (annotation and GFD-style labels)."""
    labels: dict[str, str | None] = {
        COUNT_LABEL: str(len(gpus)) if gpus else None,
        PRODUCT_LABEL: _label_value(gpus[0].name) if gpus else None,
    }
    if gpus and all(g.simulated for g in gpus):
        labels[SIMULATED_LABEL] = "true"
    return {"metadata": {"annotations": {GPUS_ANNOTATION: gpus_annotation(gpus)}, "labels": labels}}


def _label_value(text: str) -> str:
    value = "".join(c if c.isalnum() or c in "-_." else "-" for c in text.strip())
    return value[:63].strip("-_.")


def gpus_from_node(node: Mapping[str, Any], aliases: TypeAliases) -> list[Gpu]:
    """The GPUs of a Node object: the annotation when published, else the
    ``nvidia.com/gpu.product`` / ``gpu.count`` / ``gpu.memory`` labels (GPUs then known by
    index, ``<node>/<i>``). Unschedulable (cordoned) and not-Ready nodes mark their GPUs."""
    meta = node.get("metadata") or {}
    name = meta.get("name", "")
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    cordoned = bool((node.get("spec") or {}).get("unschedulable"))
    ready = _node_ready(node)
    raw = annotations.get(GPUS_ANNOTATION)
    gpus: list[Gpu] = []
    if raw:
        try:
            entries = json.loads(raw)
        except ValueError:
            entries = []
        for e in entries:
            product = str(e.get("name", labels.get(PRODUCT_LABEL, "GPU")))
            gpus.append(
                Gpu(
                    node=name,
                    uuid=str(e["uuid"]),
                    index=int(e.get("index", len(gpus))),
                    name=product,
                    type=aliases.alias_for(product),
                    memory=int(e.get("memory", 0)),
                    healthy=bool(e.get("healthy", True)) and ready,
                    cordoned=cordoned,
                    simulated=bool(e.get("simulated", False)),
                )
            )
        return gpus
    label = labels.get(PRODUCT_LABEL)
    if not label:
        return []
    product = str(label)
    try:
        count = int(labels.get(COUNT_LABEL, "1"))
        memory = int(labels.get(MEMORY_LABEL, "0")) * 2**20
    except ValueError:
        return []
    return [
        Gpu(
            node=name,
            uuid=f"{name}/{i}",
            index=i,
            name=product,
            type=aliases.alias_for(product),
            memory=memory,
            healthy=ready,
            cordoned=cordoned,
            simulated=labels.get(SIMULATED_LABEL) == "true",
        )
        for i in range(count)
    ]


def _node_ready(node: Mapping[str, Any]) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


# -- reading a pod's state -----------------------------------------------------------------------

#: Waiting reasons after which a container will not start without someone changing something.
FATAL_WAITING = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "CrashLoopBackOff",
}


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """Why this pod cannot (or no longer does) run its kernel, in the cluster's own words; None
    while it may still run. Covers Unschedulable (the scheduler's message), image pull and
    container creation errors, eviction, OOMKilled and other exits."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    name = (pod.get("metadata") or {}).get("name", "?")
    if phase in ("Failed", "Succeeded"):
        reason = status.get("reason") or ""
        message = status.get("message") or ""
        term = _terminated(status)
        if term:
            reason = reason or term.get("reason") or ""
            message = message or term.get("message") or ""
            code = term.get("exitCode")
            detail = f"{reason or 'exited'} (exit code {code})" if code is not None else reason
        else:
            detail = reason or phase
        return f"pod {name} {phase}: {detail}" + (f": {message}" if message else "")
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return f"pod {name} is Unschedulable: {cond.get('message', '')}".rstrip(": ")
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING:
            return f"pod {name}: {waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    return None


def _terminated(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return term
    return None


def pod_exit_code(pod: Mapping[str, Any] | None) -> int | None:
    """The exit status jupyter_client sees: None while running; the container's exit code once
    it ended; -9 when the pod is gone or was evicted/killed without one."""
    if pod is None:
        return -9
    status = pod.get("status") or {}
    if status.get("phase") not in ("Failed", "Succeeded"):
        return None
    term = _terminated(status)
    if term and term.get("exitCode") is not None:
        return int(term["exitCode"]) or (0 if status.get("phase") == "Succeeded" else 1)
    return 0 if status.get("phase") == "Succeeded" else -9


def requested_units(pod: Mapping[str, Any], resource: str) -> int:
    """Units of ``resource`` the pod's containers ask (limits; requests equal them)."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(resource) or (res.get("requests") or {}).get(resource)
        with contextlib.suppress(TypeError, ValueError):
            total += int(str(value)) if value is not None else 0
    return total


def pod_running(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and bool(status.get("podIP"))


def secret_payload(secret: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(base64.b64decode(secret["data"][CONNECTION_KEY]))
