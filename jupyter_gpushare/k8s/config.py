"""Admin configuration of the Kubernetes backend (traitlets), next to the box it configures.

``c.KubernetesBackendConfig.namespace = "jupyter"`` and so on in ``jupyter_server_config.py``.
It is created with the server's :class:`~jupyter_gpushare.config.GpuShare` as parent, so the same
config file reaches both.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from traitlets import Bool, Dict, Float, Int, List, Unicode, default
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
        default_value={"requests": {"cpu": "100m", "memory": "256Mi"},
                       "limits": {"memory": "4Gi"}},
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
        "",
        config=True,
        help="runtimeClassName of kernel pods, e.g. 'nvidia' so that NVIDIA_VISIBLE_DEVICES "
        "is honoured by the NVIDIA container runtime.",
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
    termination_grace = Int(
        5, config=True, help="terminationGracePeriodSeconds of kernel pods."
    )
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
