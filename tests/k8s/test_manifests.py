"""The pure parts of the Kubernetes backend: manifests, Node inventory, pod status, staleness.
(No cluster needed.)

Where it runs: no cluster.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timedelta, timezone

from jupyter_gpushare.inventory import TypeAliases, simulated_gpus
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.reconcile import stale_reason
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec

OWNER = {
    "apiVersion": "coordination.k8s.io/v1",
    "kind": "Lease",
    "name": "l",
    "uid": "u",
    "controller": False,
    "blockOwnerDeletion": False,
}


def request(**over: object) -> manifests.KernelPodRequest:
    base = dict(
        name="gpushare-kernel-abc",
        namespace="ns",
        kernel_id="k-1",
        allocation_id="a-1",
        node="n1",
        gpus=("GPU-1",),
        command=["python", "-m", "ipykernel_launcher", "-f", "/x/connection.json"],
        env={"JPY_SESSION_NAME": "s"},
        server_id="srv",
        owner=OWNER,
    )
    base.update(over)
    return manifests.KernelPodRequest(**base)  # type: ignore[arg-type]


def test_kernel_pod_places_on_node_and_mounts_everything() -> None:
    """The hostPath mode (``device_plugin=False``); the restricted default: test_pod_security."""
    settings = manifests.PodSettings(
        image="img:1",
        resources={"requests": {"cpu": "1"}},
        device_plugin=False,
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        volumes=[{"name": "home", "emptyDir": {}}],
        volume_mounts=[{"name": "home", "mountPath": "/home/jovyan"}],
        pod_template={
            "spec": {"priorityClassName": "interactive"},
            "metadata": {"labels": {"team": "a"}},
        },
    )
    pod = manifests.kernel_pod(request(simulated_devices="A100|GPU-1|1|108"), settings)
    spec = pod["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]
    assert "nodeName" not in spec  # the scheduler binds it (and can refuse, in its words)
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
    assert env["LD_PRELOAD"] == "/opt/gpushare/lib/libgpushare.so"
    assert env["GPUSHARE_SOCKET"] == "/run/gpushare/daemon.sock"
    assert env["GPUSHARE_SIM_DEVICES"] == "A100|GPU-1|1|108"
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["connection"]["secret"]["secretName"] == "gpushare-kernel-abc"
    assert vols["gpushare-socket"]["hostPath"]["path"] == "/run/gpushare"
    assert vols["gpushare-lib"]["hostPath"]["path"] == "/opt/gpushare/lib"
    assert "home" in vols and spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert spec["priorityClassName"] == "interactive"
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["labels"][manifests.LABEL_KERNEL] == "k-1"
    assert pod["metadata"]["ownerReferences"] == [OWNER]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False


def test_secret_holds_the_connection_and_nothing_leaks_into_the_pod() -> None:
    conn = {"key": "s3cr3t-key-0123456789abcdef", "shell_port": 1, "ip": "0.0.0.0"}
    secret = manifests.connection_secret("p", "ns", conn, OWNER, "k-1")
    assert manifests.secret_payload(secret) == conn
    pod = manifests.kernel_pod(request(), manifests.PodSettings(image="i"))
    assert conn["key"] not in json.dumps(pod)


def test_labels_only_gpus_use_indices() -> None:
    node = {
        "metadata": {
            "name": "n2",
            "labels": {
                manifests.PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB",
                manifests.COUNT_LABEL: "2",
                manifests.MEMORY_LABEL: "81920",
            },
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
    gpus = manifests.gpus_from_node(node, TypeAliases())
    assert [(g.uuid, g.type, g.memory) for g in gpus] == [
        ("n2/0", "A100", 81920 * 2**20),
        ("n2/1", "A100", 81920 * 2**20),
    ]
    assert manifests.visible_devices([g.uuid for g in gpus]) == "0,1"


def test_annotation_round_trip_and_node_health() -> None:
    gpus = simulated_gpus("2xT4", "n3")
    patch = manifests.node_gpu_patch(gpus)
    node = {
        "metadata": {"name": "n3", **patch["metadata"]},
        "spec": {"unschedulable": True},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    back = manifests.gpus_from_node(node, TypeAliases())
    assert [g.uuid for g in back] == [g.uuid for g in gpus]
    assert all(g.type == "T4" and g.cordoned and not g.healthy and g.simulated for g in back)
    assert patch["metadata"]["labels"][manifests.COUNT_LABEL] == "2"


def _pod(status: dict) -> dict:
    return {"metadata": {"name": "p"}, "status": status}


def test_pod_failure_speaks_the_clusters_words() -> None:
    unsched = _pod(
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/2 nodes are available: 2 Insufficient cpu.",
                }
            ],
        }
    )
    assert manifests.pod_failure(unsched) == (
        "pod p is Unschedulable: 0/2 nodes are available: 2 Insufficient cpu."
    )
    pull = _pod(
        {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "state": {
                        "waiting": {
                            "reason": "ImagePullBackOff",
                            "message": "Back-off pulling image",
                        }
                    }
                }
            ],
        }
    )
    assert "ImagePullBackOff: Back-off pulling image" in manifests.pod_failure(pull)
    oom = _pod(
        {
            "phase": "Failed",
            "containerStatuses": [
                {"state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
            ],
        }
    )
    assert manifests.pod_failure(oom) == "pod p Failed: OOMKilled (exit code 137)"
    assert manifests.pod_exit_code(oom) == 137
    evicted = _pod({"phase": "Failed", "reason": "Evicted", "message": "low on memory"})
    assert manifests.pod_failure(evicted) == "pod p Failed: Evicted: low on memory"
    assert manifests.pod_exit_code(evicted) == -9
    running = _pod({"phase": "Running", "podIP": "10.0.0.3"})
    assert manifests.pod_failure(running) is None and manifests.pod_exit_code(running) is None
    assert manifests.pod_running(running) and manifests.pod_exit_code(None) == -9
    creating = _pod(
        {
            "phase": "Pending",
            "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}],
        }
    )
    assert manifests.pod_failure(creating) is None


def test_lease_expiry() -> None:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    lease = manifests.server_lease("s", "ns", "h", 10, now=now - timedelta(seconds=12))
    assert lease["metadata"]["name"] == "gpushare-server-s"
    assert manifests.lease_expired(lease, now)
    assert not manifests.lease_expired(lease, now, grace=5)
    assert manifests.parse_time(lease["spec"]["renewTime"]) == now - timedelta(seconds=12)


def test_stale_reasons() -> None:
    now = datetime.now(timezone.utc)
    spec = ShareSpec(gpu_request=0.5, gpu_limit=0.5)
    base = Allocation(
        id="a-1",
        node="n",
        gpus=("G",),
        spec=spec,
        memory=1,
        backend="kubernetes",
        state="active",
        extra={"k8s_server": "s", "k8s_pod": "p"},
    )
    lease = manifests.server_lease("s", "ns", "h", 30, now=now)
    leases = {"s": lease}
    pods = {"p": {}}
    assert stale_reason(base, leases, pods, now, None, 5, 100.0) is None
    # a record placed a moment ago can come before its server's Lease (separate watches)
    assert stale_reason(base, {}, pods, now, None, 5, 100.0) is None
    placed_before = replace(base, created=now.timestamp() - 6)
    assert "is gone" in stale_reason(placed_before, {}, pods, now, None, 5, 100.0)
    old = {"s": manifests.server_lease("s", "ns", "h", 30, now=now - timedelta(seconds=60))}
    assert "stopped renewing" in stale_reason(base, old, pods, now, None, 5, 100.0)
    # A missing pod counts only after the grace period (a restart re-points the record).
    assert stale_reason(base, leases, {}, now, 98.0, 5, 100.0) is None
    assert "pod p is gone" in stale_reason(base, leases, {}, now, 90.0, 5, 100.0)
    local = Allocation(id="a-2", node="n", gpus=("G",), spec=spec, memory=1)
    assert stale_reason(local, {}, {}, now, None, 5, 100.0) is None


def test_every_setting_is_documented_and_feeds_the_pod() -> None:
    from jupyter_gpushare.k8s.config import KubernetesBackendConfig

    cfg = KubernetesBackendConfig(
        image="my/image:2",
        tolerations=[{"key": "k"}],
        interposer_host_path="/host/lib",
        preload_interposer=False,
        device_plugin=False,
        run_as_user=1234,
    )
    for name, trait in cfg.traits(config=True).items():
        assert trait.help, f"{name} has no help"
    settings = manifests.PodSettings.from_config(cfg)
    pod = manifests.kernel_pod(request(), settings)
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert pod["spec"]["containers"][0]["image"] == "my/image:2"
    assert pod["spec"]["tolerations"] == [{"key": "k"}] and "LD_PRELOAD" not in env
    assert {"path": "/host/lib", "type": "DirectoryOrCreate"} in [
        v.get("hostPath") for v in pod["spec"]["volumes"]
    ]
    assert settings.run_as_user == 1234 and not settings.device_plugin
