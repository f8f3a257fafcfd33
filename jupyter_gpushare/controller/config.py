"""Admin configuration of the controller (traitlets), next to the box it configures.

``c.GpushareController.*`` in the controller's config file (``--config``). The kernel pod
template, namespace and kubeconfig are ``c.KubernetesBackendConfig.*`` as in direct mode, and
type aliases and the placement policy ``c.GpuShare.*`` / ``c.GpusharePlacement.*``: one file
configures the same pods either way.
"""

from __future__ import annotations

import os
import socket

from traitlets import Bool, Dict, Float, Int, Unicode, default
from traitlets.config import Configurable


class GpushareController(Configurable):
    """The cluster control point: HTTP API, Hub authentication, bounds, leader election."""

    ip = Unicode("0.0.0.0", config=True, help="Address the HTTP API listens on.")
    port = Int(8081, config=True, help="Port of the HTTP API.")
    hub_url = Unicode(
        config=True,
        help="Base URL of JupyterHub's API server (callers' tokens are resolved with GET "
        "{hub_url}/hub/api/user). Default: $JUPYTERHUB_URL, else http://hub:8081.",
    )
    auth_cache_ttl = Float(
        30.0, config=True, help="Seconds a resolved Hub token (user, admin flag, groups) is reused."
    )
    auth_cache_size = Int(
        4096,
        config=True,
        help="Most tokens kept in the resolution cache (least recently used go first).",
    )
    user_bounds = Dict(
        default_value={},
        config=True,
        help="Most one share of a user may hold, by Hub user name: {'alice': {'gpu_request': "
        "0.5, 'gpu_limit': 1.0, 'gpu_memory': '20GiB'}}. With group_bounds, the tightest "
        "field wins.",
    )
    group_bounds = Dict(
        default_value={},
        config=True,
        help="Most one share may hold, by JupyterHub group: {'students': {'gpu_request': 0.25, "
        "'gpu_limit': 0.5}}.",
    )
    default_bound = Dict(
        default_value={},
        config=True,
        help="Bound of users with no user or group entry (empty: none). Hub admins have no "
        "default bound.",
    )
    user_quotas = Dict(
        default_value={},
        config=True,
        help="Most compute all of a user's shares may request together, in GPUs, by Hub user "
        "name: {'alice': 2.0}. With group_quotas, the smallest applies.",
    )
    group_quotas = Dict(
        default_value={},
        config=True,
        help="Most compute all shares of one user may request together, by JupyterHub group: "
        "{'students': 0.5}.",
    )
    default_quota = Float(
        0.0,
        config=True,
        help="Quota of users with no user or group entry, in GPUs (0: none). Hub admins have "
        "no default quota.",
    )
    lease_name = Unicode(
        "gpushare-controller",
        config=True,
        help="Name of the Lease the replicas elect their leader on.",
    )
    lease_duration = Float(
        15.0,
        config=True,
        help="Seconds a leader's Lease lasts without renewal; a standby takes over after it.",
    )
    renew_interval = Float(5.0, config=True, help="Seconds between the leader's renewals.")
    retry_interval = Float(
        2.0, config=True, help="Seconds between a standby's attempts to take the Lease."
    )
    identity = Unicode(
        config=True, help="This replica's name in the Lease (default: $POD_NAME, else host/pid)."
    )
    server_lease_duration = Float(
        60.0,
        config=True,
        help="Seconds a user server's Lease lasts after its last heartbeat; then the "
        "reconciler releases its kernels.",
    )
    reconcile_interval = Float(5.0, config=True, help="Seconds between reconciliation passes.")
    reconcile_grace = Float(
        10.0,
        config=True,
        help="Seconds a server Lease may be overdue or a kernel pod missing before its share "
        "is reclaimed.",
    )
    daemon_service_account = Unicode(
        "gpushare-daemon",
        config=True,
        help="Service account (in the controller's namespace) of the node daemons: only its "
        "tokens may report node usage (PUT /api/usage/<node>, checked with a TokenReview).",
    )
    network_policies = Bool(
        True,
        config=True,
        help="Keep one NetworkPolicy per Hub user with kernels (gpushare-kernels-<h>, "
        "jupyter_gpushare.controller.network): a user's kernel pods accept connections only "
        "from that user's server pods (label gpushare.jupyter.org/owner, set by the Hub) and "
        "the controller. Needs networkpolicies create/list/watch/delete in the namespace; the "
        "chart sets this from networkPolicy.enabled.",
    )
    server_namespace_selector = Dict(
        default_value={"matchLabels": {"kubernetes.io/metadata.name": "jhub"}},
        allow_none=True,
        config=True,
        help="Label selector of the namespace(s) users' Jupyter server pods run in (the "
        "chart's networkPolicy.servers.namespaceSelector; z2jh's hub namespace). None: the "
        "kernels' own namespace; {}: every namespace.",
    )
    server_pod_selector = Dict(
        default_value={"matchLabels": {"component": "singleuser-server"}},
        config=True,
        help="Label selector of users' Jupyter server pods (the chart's "
        "networkPolicy.servers.podSelector); each user's policy adds their owner label.",
    )
    controller_pod_labels = Dict(
        default_value={
            "app.kubernetes.io/name": "jupyter-gpushare",
            "app.kubernetes.io/component": "controller",
        },
        config=True,
        help="Labels of the controller's own pods (the chart's), admitted into kernel pods.",
    )
    network_policy_grace = Float(
        60.0,
        config=True,
        help="Seconds a user's NetworkPolicy is kept after their last kernel pod is gone "
        "(and after their last launch began), before the reconcile pass deletes it.",
    )
    connect_timeout = Float(
        30.0, config=True, help="Seconds to wait for the API server's first pod listing."
    )

    @default("hub_url")
    def _default_hub_url(self) -> str:
        return os.environ.get("JUPYTERHUB_URL", "http://hub:8081")

    @default("identity")
    def _default_identity(self) -> str:
        return os.environ.get("POD_NAME") or f"{socket.gethostname()}/{os.getpid()}"


__all__ = ["GpushareController"]
