"""Admin configuration of the Kubernetes backend (traitlets), next to the box it configures.

``c.KubernetesBackendConfig.namespace = "jupyter"`` and so on in ``jupyter_server_config.py``.
It is created with the server's :class:`~jupyter_gpushare.config.GpuShare` as parent, so the same
config file reaches both.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from traitlets import Bool, Dict, Float, Int, List, TraitError, Unicode, default, validate
from traitlets.config import SingletonConfigurable


class KubernetesBackendConfig(SingletonConfigurable):
    """How gpushare kernels run as pods, and where the ledger lives on the API server."""

    namespace = Unicode(
        config=True,
        help="Namespace of kernel pods, their Secrets, the server Lease and the GpuLedgers "
        "(default: the pod's own namespace in a cluster, else 'gpushare').",
    )
    kubeconfig = Unicode(
        "",
        config=True,
        help="Path of a kubeconfig file; empty: in-cluster service account, else $KUBECONFIG "
        "or ~/.kube/config.",
    )
    context = Unicode("", config=True, help="kubeconfig context (empty: the current one).")

    # -- the kernel pod --------------------------------------------------------------------------
    image = Unicode(
        "quay.io/jupyter/scipy-notebook:latest",
        config=True,
        help="Container image of kernel pods; it must have ipykernel and jupyter_gpushare.",
    )
    image_pull_policy = Unicode("IfNotPresent", config=True, help="imagePullPolicy of kernels.")
    python = Unicode(
        "python",
        config=True,
        help="The Python of the image; replaces the server's own sys.executable in the kernel "
        "command.",
    )
    resources = Dict(
        default_value={"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "4Gi"}},
        config=True,
        help="Container resources of kernel pods (requests/limits of cpu, memory, ...). GPUs "
        "are not requested here: the gpushare ledger assigns them.",
    )
    env = Dict(
        default_value={}, config=True, help="Extra environment variables of kernel containers."
    )
    volumes: List[Any] = List(
        default_value=[], config=True, help="Extra pod volumes (Kubernetes Volume objects)."
    )
    volume_mounts: List[Any] = List(
        default_value=[], config=True, help="Extra volumeMounts of the kernel container."
    )
    tolerations: List[Any] = List(default_value=[], config=True, help="Tolerations of kernel pods.")
    node_selector = Dict(default_value={}, config=True, help="Extra nodeSelector of kernel pods.")
    labels = Dict(default_value={}, config=True, help="Extra labels of kernel pods.")
    annotations = Dict(default_value={}, config=True, help="Extra annotations of kernel pods.")
    service_account = Unicode(
        "", config=True, help="serviceAccountName of kernel pods (empty: the namespace default)."
    )
    runtime_class = Unicode(
        "nvidia",
        config=True,
        help="runtimeClassName of kernel pods on nodes with real GPUs ('nvidia': GPU Operator "
        "v25.10+ injects devices with CDI through that runtime class, which is no longer the "
        "default runtime). Not set on nodes whose GPUs are simulated. Empty: none.",
    )
    device_plugin = Bool(
        True,
        config=True,
        help="Kernel pods get their GPU, interposer and agent socket from gpushare's device "
        "plugin (the node DaemonSet runs it with --device-plugin): they request share_resource "
        "and pass Pod Security 'restricted' (no hostPath, non-root, no capabilities). False: "
        "hostPath mounts of the daemon socket and interposer instead (the namespace must then "
        "allow privileged pods).",
    )
    share_resource = Unicode(
        "gpushare.jupyter.org/gpu-share",
        config=True,
        help="Extended resource a kernel pod requests: its compute request in hundredths of a "
        "GPU times its GPU count (limits = requests), advertised by the device plugin as 100 "
        "per healthy GPU, so the kube-scheduler accounts for shares.",
    )
    run_as_user = Int(
        1000, config=True, help="runAsUser of kernel pods (docker-stacks images: 1000, jovyan)."
    )
    run_as_group = Int(
        100, config=True, help="runAsGroup of kernel pods (docker-stacks images: 100, users)."
    )
    fs_group = Int(
        100,
        config=True,
        help="fsGroup of kernel pods: the connection Secret is mounted with this group, mode "
        "0440, so the image's user can read its connection file.",
    )
    pod_template = Dict(
        default_value={},
        config=True,
        help="A partial Pod manifest deep-merged over the generated one (last word on any "
        "field; lists replace). For settings the traits above do not cover.",
    )
    connection_dir = Unicode(
        "/var/run/gpushare-kernel",
        config=True,
        help="Where the per-kernel connection Secret is mounted in the pod.",
    )

    # -- the node's daemon and interposer (host paths) -------------------------------------------
    daemon_socket_host_path = Unicode(
        "/run/gpushare",
        config=True,
        help="Host directory holding the node daemon's unix socket (hostPath volume).",
    )
    daemon_socket_mount_path = Unicode(
        "/run/gpushare", config=True, help="Where that directory is mounted in kernel pods."
    )
    daemon_socket_name = Unicode("daemon.sock", config=True, help="The socket's file name.")
    interposer_host_path = Unicode(
        "/opt/gpushare/lib",
        config=True,
        help="Host directory with libgpushare.so (and sim/ for simulated GPUs), installed by the "
        "daemon's DaemonSet (hostPath volume).",
    )
    interposer_mount_path = Unicode(
        "/opt/gpushare/lib", config=True, help="Where that directory is mounted in kernel pods."
    )
    preload_interposer = Bool(
        True,
        config=True,
        help="LD_PRELOAD the interposer in kernel pods (enforcement). Off: shares are "
        "bookkeeping only.",
    )

    # -- timing ------------------------------------------------------------------------------
    start_timeout = Float(
        300.0,
        config=True,
        help="Seconds a kernel pod may take to run (image pulls included) before the start "
        "fails. Failures the cluster reports (Unschedulable, image pull errors, ...) fail at "
        "once, not after this timeout.",
    )
    admission_wait = Float(
        30.0,
        config=True,
        help="Seconds a kernel pod's start waits for the kubelet to admit the pods of the same "
        "node and share size created before it (the device plugin can tell which pod an "
        "Allocate is for only while one such pod waits; jupyter_gpushare.k8s.admission). "
        "After that its pod is created anyway, and the wait is logged.",
    )
    termination_grace = Int(5, config=True, help="terminationGracePeriodSeconds of kernel pods.")
    connect_timeout = Float(
        15.0,
        config=True,
        help="Seconds the server waits for the API server when it first needs the cluster; "
        "then kernel starts and REST calls fail with 503 and the reason, and the next use "
        "tries again.",
    )
    lease_duration = Float(
        30.0,
        config=True,
        help="Seconds after the server's last heartbeat when its Lease counts as expired; the "
        "reconciler then deletes it and the garbage collector removes its kernel pods.",
    )
    lease_renew_interval = Float(10.0, config=True, help="Seconds between Lease renewals.")
    server_id = Unicode(
        config=True,
        help="Name of this Jupyter server in the cluster (its Lease is gpushare-server-<id>).",
    )
    owner_pod = Unicode(
        config=True,
        help="Name of the pod this Jupyter server runs in (default $POD_NAME); when set, the "
        "server Lease is owned by it, so deleting the server pod removes its kernels at once.",
    )
    inventory_ttl = Float(
        2.0, config=True, help="Seconds a read of the Node inventory is reused by placement."
    )

    # -- controller mode (the server holds no Kubernetes rights) --------------------------------
    controller_url = Unicode(
        "",
        config=True,
        help="URL of the gpushare controller (e.g. http://gpushare-controller.jhub:8081). When "
        "set, this server is a thin client: the controller places shares and runs kernel pods, "
        "and the server needs no service account. Several URLs, comma-separated, are tried in "
        "order. Empty: the server talks to the API server itself (direct mode). Default: "
        "$GPUSHARE_CONTROLLER_URL.",
    )
    controller_token = Unicode(
        "",
        config=True,
        help="Token sent to the controller (empty: $JUPYTERHUB_API_TOKEN, the token JupyterHub "
        "gives every user server; the controller resolves it to the Hub user).",
    )
    controller_retry_for = Float(
        30.0,
        config=True,
        help="Seconds a call to the controller is retried while it fails over (standby "
        "answering 503 not_leader, or no replica reachable); then it fails with 503 and the "
        "reason. Keep it above the controller's lease_duration (15 s) plus a few seconds.",
    )

    @validate("run_as_user", "run_as_group", "fs_group")
    def _valid_id(self, proposal: Any) -> int:
        name, value = proposal["trait"].name, proposal["value"]
        lowest = 1 if name == "run_as_user" else 0  # kernel pods run as non-root
        if not lowest <= value <= 2**31 - 1:
            raise TraitError(
                f"KubernetesBackendConfig.{name}={value!r} is not allowed: an id "
                f"from {lowest} to 2147483647"
                + (" (kernel pods run as non-root)" if lowest else "")
            )
        return int(value)

    @default("namespace")
    def _default_namespace(self) -> str:
        path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        if os.path.exists(path):
            with open(path) as f:
                return f.read().strip()
        return os.environ.get("GPUSHARE_K8S_NAMESPACE", "gpushare")

    @default("kubeconfig")
    def _default_kubeconfig(self) -> str:
        return os.environ.get("GPUSHARE_KUBECONFIG", "")

    @default("controller_url")
    def _default_controller_url(self) -> str:
        return os.environ.get("GPUSHARE_CONTROLLER_URL", "")

    @default("server_id")
    def _default_server_id(self) -> str:
        return uuid.uuid4().hex[:12]

    @default("owner_pod")
    def _default_owner_pod(self) -> str:
        return os.environ.get("POD_NAME", "")

    @property
    def socket_path(self) -> str:
        return f"{self.daemon_socket_mount_path.rstrip('/')}/{self.daemon_socket_name}"


__all__ = ["KubernetesBackendConfig"]
