"""gpushare's device plugin (issue 15): the pure decisions of ``k8s/device_plugin/plugin.py``,
then, on the real control plane with the kubelet double speaking the device-plugin API over
gRPC, what a kernel pod gets from ``Allocate`` and how the real kube-scheduler accounts for
shares: a pod asking ``nvidia.com/gpu`` cannot land on a gpushare node, a pod asking more share
units than are free stays Pending, and a pod that copies a kernel's labels and asks units is
refused at admission (it gets no GPU, socket or interposer); one admitted first, in the kernel
pod's second, is refused at PreStartContainer (the kubelet's PodResources API names the pod
holding its devices) and the kernel pod is served after it.

Where it runs: no node for the pure parts; then the kubelet double (``node_agent.py``: pods are
local processes, at 127.0.0.1) speaking the device-plugin API over real gRPC, because it needs the
double's hooks (several same-size pods admitted at chosen moments). The plugin with the real
kubelet 1.20: test_real_node_chart.py.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cluster import NAMESPACE, ControlPlane
from test_kernels import admin, eventually, execute, kernel_pods, kernel_records, shut_down

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.device_plugin import plugin, podresources_pb2, podresources_pb2_grpc
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec

pytestmark = pytest.mark.timeout(300)
RES = manifests.SHARE_RESOURCE
ALLOCATED = manifests.ALLOCATED_ANNOTATION
NVIDIA_PLUGIN_OFF = "nvidia.com/gpu.deploy.device-plugin"


# -- pure ----------------------------------------------------------------------------------------


def gpu(uuid_: str, index: int, healthy: bool = True) -> Gpu:
    return Gpu(
        node="n1",
        uuid=uuid_,
        index=index,
        name="A100",
        type="A100",
        memory=1 << 30,
        healthy=healthy,
    )


def pod(
    name: str,
    units: int,
    created: str,
    node: str = "n1",
    allocation: str = "a-" + "0" * 16,
    **meta: Any,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": name,
            "creationTimestamp": created,
            "labels": {manifests.LABEL_ALLOCATION: allocation},
            **meta,
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "kernel",
                    "resources": {"limits": {RES: str(units)}, "requests": {RES: str(units)}},
                }
            ],
        },
        "status": {"phase": "Pending"},
    }


def test_devices_are_100_units_per_gpu_and_follow_health() -> None:
    devs = plugin.devices([gpu("GPU-b", 1, healthy=False), gpu("GPU-a", 0)])
    assert len(devs) == 200 and devs[0] == ("GPU-a/0", "Healthy")
    assert {h for d, h in devs if d.startswith("GPU-b/")} == {"Unhealthy"}


def test_allocate_finds_the_oldest_unmarked_kernel_pod_of_that_size() -> None:
    t0, t1, t2 = "2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z"
    pods = [
        pod("newer", 25, t2),
        pod("older", 25, t1),
        pod("marked", 25, t0, annotations={manifests.ALLOCATED_ANNOTATION: "n1"}),
        pod("elsewhere", 25, t0, node="n2"),
        pod("other-size", 30, t0),
        pod("deleting", 25, t0, deletionTimestamp=t1),
        pod("forged-label", 25, t0, allocation="../../etc"),
    ]
    assert plugin.pending_pod(pods, "n1", RES, 25)["metadata"]["name"] == "older"
    assert plugin.pending_pod(pods, "n1", RES, 30)["metadata"]["name"] == "other-size"
    assert plugin.pending_pod(pods, "n1", RES, 7) is None
    done = pod("done", 25, t0)
    done["status"]["phase"] = "Succeeded"
    assert plugin.pending_pod([done], "n1", RES, 25) is None


def test_a_pod_copying_another_kernels_allocation_label_is_not_its_pod() -> None:
    """Anyone who may create pods in the namespace can copy a label: the ledger's record names
    the kernel's pod (name, namespace, then UID), and only that pod gets the allocation."""
    theirs = pod("gpushare-kernel-victim", 25, "2026-01-01T00:00:01Z")
    theirs["metadata"]["namespace"] = "gpushare"
    forged = pod("attacker", 25, "2026-01-01T00:00:00Z")  # older: matched first by size
    forged["metadata"]["namespace"] = "gpushare"
    record = Allocation(
        id="a-" + "0" * 16,
        node="n1",
        gpus=("GPU-a",),
        spec=ShareSpec(),
        memory=1,
        extra={"k8s_pod": "gpushare-kernel-victim", "k8s_namespace": "gpushare"},
    )
    order = plugin.pending_pods([theirs, forged], "n1", RES, 25)
    assert [p["metadata"]["name"] for p in order] == ["attacker", "gpushare-kernel-victim"]
    assert not plugin.allocation_is_the_pods(record, forged)
    assert plugin.allocation_is_the_pods(record, theirs)
    recorded_uid = replace(record, extra={**record.extra, "k8s_pod_uid": "other-uid"})
    assert not plugin.allocation_is_the_pods(recorded_uid, theirs)  # a pod of the same name
    elsewhere = replace(record, extra={**record.extra, "k8s_namespace": "other"})
    assert not plugin.allocation_is_the_pods(elsewhere, theirs)


def test_allocate_response_gives_gpu_socket_and_interposer() -> None:
    allocation = Allocation(
        id="a-" + "1" * 16,
        node="n1",
        gpus=("GPU-a",),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5),
        memory=1 << 30,
    )
    real = plugin.container_response(
        allocation,
        plugin.PluginSettings(node="n1", namespace="x"),
        Path("/run/gpushare/pods/a-1111111111111111"),
    )
    assert real["envs"]["GPUSHARE_ALLOCATION_ID"] == allocation.id
    assert real["envs"]["GPUSHARE_SOCKET"] == "/run/gpushare/daemon.sock"
    assert real["envs"]["NVIDIA_VISIBLE_DEVICES"] == "GPU-a"
    assert real["cdi_devices"] == ["nvidia.com/gpu=GPU-a"]
    mounts = {m["container_path"]: m for m in real["mounts"]}
    assert mounts["/opt/gpushare/lib"] == {
        "container_path": "/opt/gpushare/lib",
        "host_path": "/opt/gpushare/lib",
        "read_only": True,
    }
    assert mounts["/run/gpushare"]["host_path"] == "/run/gpushare/pods/a-1111111111111111"
    sim = plugin.container_response(
        allocation,
        plugin.PluginSettings(
            node="n1", namespace="x", simulated_devices="A100|GPU-a|1|108", sim_state="/s/sim.state"
        ),
        Path("/p"),
    )
    assert sim["cdi_devices"] == [] and sim["envs"]["GPUSHARE_SIMULATED"] == "1"
    assert {m["host_path"] for m in sim["mounts"]} == {"/opt/gpushare/lib", "/p", "/s/sim.state"}


def test_allocate_mounts_name_host_paths_when_the_socket_directory_is_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unit test (no kubelet). Found on the real node: with the chart's daemon.socketHostPath
    not /run/gpushare, Allocate handed the kubelet the agent's container paths
    (/run/gpushare/pods/<id>, /run/gpushare/sim.state), which the kubelet mounted from the
    host's /run/gpushare: the kernel saw an empty directory and its share read 'unreachable'."""
    monkeypatch.setenv(plugin.SOCKET_HOST_DIR_ENV, "/srv/gs")
    allocation = Allocation(
        id="a-" + "2" * 16,
        node="n1",
        gpus=("GPU-a",),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5),
        memory=1 << 30,
    )
    settings = plugin.PluginSettings(
        node="n1",
        namespace="x",
        pod_socket_dir=Path("/run/gpushare/pods"),
        interposer_dir=Path("/srv/lib"),
        simulated_devices="A100|GPU-a|1|108",
        sim_state="/run/gpushare/sim.state",
    )
    assert settings.socket_host_dir == Path("/srv/gs")
    reply = plugin.container_response(
        allocation, settings, Path("/run/gpushare/pods/a-2222222222222222")
    )
    assert {m["container_path"]: m["host_path"] for m in reply["mounts"]} == {
        "/opt/gpushare/lib": "/srv/lib",
        "/run/gpushare": "/srv/gs/pods/a-2222222222222222",
        "/run/gpushare-sim/sim.state": "/srv/gs/sim.state",
    }
    assert reply["envs"]["GPUSHARE_SOCKET"] == "/run/gpushare/daemon.sock"  # the pod's view
    monkeypatch.delenv(plugin.SOCKET_HOST_DIR_ENV)
    assert plugin.PluginSettings(node="n1", namespace="x").host_path("/run/gpushare/x") == (
        "/run/gpushare/x"
    )


def test_a_pods_socket_directory_keeps_its_inode_across_agent_restarts(tmp_path: Path) -> None:
    """Unit test (no kubelet). Found on the real node: the kubelet bind-mounts a kernel pod's
    socket directory, so the agent restarted after ``kill -9`` made its new socket in a new
    directory at the same path that the running pod never saw (the kernel stayed unconnected).
    The directory is now emptied in place; a link or another's entry there is replaced."""
    directory = tmp_path / "a-1111111111111111"
    plugin.fresh_directory(directory)
    inode = directory.stat().st_ino
    (directory / "daemon.sock").write_text("old socket")
    (directory / "junk").mkdir()
    plugin.fresh_directory(directory)
    assert directory.stat().st_ino == inode and list(directory.iterdir()) == []
    assert directory.stat().st_mode & 0o777 == 0o755
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    link = tmp_path / "a-2222222222222222"
    link.symlink_to(elsewhere)
    plugin.fresh_directory(link)
    assert link.is_dir() and not link.is_symlink() and (elsewhere / "keep").exists()


def test_preferred_allocation_keeps_units_on_the_allocations_gpu() -> None:
    available = [f"GPU-a/{i}" for i in range(3)] + [f"GPU-b/{i}" for i in range(3)]
    assert plugin.preferred(available, [], 2, ("GPU-b",)) == ["GPU-b/0", "GPU-b/1"]
    assert plugin.preferred(available, ["GPU-a/2"], 2, ("GPU-b",)) == ["GPU-a/2", "GPU-b/0"]
    assert plugin.preferred(available, [], 4, ()) == available[:4]


def test_device_holders_reads_the_kubelets_pod_resources() -> None:
    """Which pod holds each device ID of our resource, from PodResources ``List`` (other
    resources and containers without devices are skipped)."""
    pb = podresources_pb2
    reply = pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                name="kernel",
                namespace="gpushare",
                containers=[
                    pb.ContainerResources(
                        name="kernel",
                        devices=[
                            pb.ContainerDevices(resource_name=RES, device_ids=["G/0", "G/1"]),
                            pb.ContainerDevices(resource_name="other/dev", device_ids=["x"]),
                        ],
                    ),
                    pb.ContainerResources(name="sidecar"),
                ],
            ),
            pb.PodResources(name="web", namespace="default", containers=[]),
        ]
    )
    # the bytes the kubelet sends parse the same (field numbers as the kubelet's api.proto)
    again = pb.ListPodResourcesResponse.FromString(reply.SerializeToString())
    assert plugin.device_holders(again.pod_resources, RES) == {
        "G/0": ("gpushare", "kernel"),
        "G/1": ("gpushare", "kernel"),
    }
    assert plugin.PluginSettings("n", "ns").pod_resources_socket == Path(
        "/var/lib/kubelet/pod-resources/kubelet.sock"
    )


class _Kubelet(podresources_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources ``List`` holding ``held`` (device id -> (namespace, pod))."""

    def __init__(self, held: dict[str, tuple[str, str]]) -> None:
        self.held = held

    async def List(self, request: Any, context: Any) -> Any:
        pods: dict[tuple[str, str], list[str]] = {}
        for dev, owner in self.held.items():
            pods.setdefault(owner, []).append(dev)
        pb = podresources_pb2
        return pb.ListPodResourcesResponse(
            pod_resources=[
                pb.PodResources(
                    namespace=ns,
                    name=name,
                    containers=[
                        pb.ContainerResources(
                            name="kernel",
                            devices=[pb.ContainerDevices(resource_name=RES, device_ids=ids)],
                        )
                    ],
                )
                for (ns, name), ids in pods.items()
            ]
        )


class _Kube:
    """The two API calls PreStartContainer makes: list the kernel pods, patch a mark away."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.patched: list[tuple[str, str, dict[str, Any]]] = []
        self.core = self

    async def list_pods(self, namespace: str, label_selector: str) -> dict[str, Any]:
        return {"items": self.pods}

    async def patch_namespaced_pod(self, name: str, namespace: str, body: Any) -> None:
        self.patched.append((namespace, name, body))


async def test_pre_start_checks_the_pod_the_kubelet_says_holds_the_devices(
    tmp_path: Path,
) -> None:
    """PreStartContainer: the pod PodResources names must be the one Allocate took the devices
    for; a forgery holding them is refused and the kernel pod Allocate took them for is
    unmarked (it waits still); without an answer from the kubelet, every container is refused."""
    import grpc

    kubelet_dir = tmp_path / "kubelet" / "device-plugins"
    kubelet_dir.mkdir(parents=True)
    settings = plugin.PluginSettings("n1", "gpushare", kubelet_socket=kubelet_dir / "kubelet.sock")
    kernel = pod("zz-kernel", 10, "2026-01-01T00:00:00Z", namespace="gpushare")
    forged = pod("aa-forged", 10, "2026-01-01T00:00:00Z", namespace="gpushare")
    kube = _Kube([kernel, forged])
    share = plugin.SharePlugin(daemon=None, kube=kube, settings=settings)
    share.pre_start = True
    ids = ["GPU-a/0", "GPU-a/1"]
    guess = plugin.Guess("a-" + "0" * 16, "gpushare", "zz-kernel", "zz-kernel")

    with pytest.raises(plugin.PreStartRefused, match=r"PodResources API .* not started until"):
        await share._pre_start(ids)  # no kubelet socket: fail closed

    settings.pod_resources_socket.parent.mkdir()
    server = grpc.aio.server()
    podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(
        _Kubelet(dict.fromkeys(ids, ("gpushare", "aa-forged"))), server
    )
    server.add_insecure_port(f"unix://{settings.pod_resources_socket}")
    await server.start()
    try:
        share.guesses[frozenset(ids)] = guess
        forgery = r"aa-forged holds the .* gpushare/zz-kernel"
        with pytest.raises(plugin.PreStartRefused, match=forgery):
            await share._pre_start(ids)
        assert kube.patched == [
            ("gpushare", "zz-kernel", {"metadata": {"annotations": {ALLOCATED: None}}})
        ]
        assert not share.guesses
        with pytest.raises(plugin.PreStartRefused, match=r"no single pod holding .* GPU-a/7"):
            await share._pre_start(["GPU-a/7"])  # held by no pod
        # the kernel pod holding the devices Allocate took for it starts
        await server.stop(0)
        server = grpc.aio.server()
        podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(
            _Kubelet(dict.fromkeys(ids, ("gpushare", "zz-kernel"))), server
        )
        server.add_insecure_port(f"unix://{settings.pod_resources_socket}")
        await server.start()
        share.guesses[frozenset(ids)] = guess
        await share._pre_start(ids)
        assert not share.guesses and len(kube.patched) == 1
    finally:
        await server.stop(0)


@pytest.mark.parametrize("proto", ["api", "podresources"])
def test_generated_modules_match_the_proto(tmp_path: Path, proto: str) -> None:
    """<proto>_pb2*.py(i) are what grpcio-tools makes of <proto>.proto (regenerate:
    DEVELOPING.md)."""
    from grpc_tools import protoc

    here = Path(plugin.__file__).parent
    rel = Path("jupyter_gpushare/k8s/device_plugin")
    (tmp_path / rel).mkdir(parents=True)
    (tmp_path / rel / f"{proto}.proto").write_text((here / f"{proto}.proto").read_text())
    assert (
        protoc.main(
            [
                "protoc",
                f"-I{tmp_path}",
                f"--python_out={tmp_path}",
                f"--pyi_out={tmp_path}",
                f"--grpc_python_out={tmp_path}",
                str(tmp_path / rel / f"{proto}.proto"),
            ]
        )
        == 0
    )
    for name in (f"{proto}_pb2.py", f"{proto}_pb2.pyi", f"{proto}_pb2_grpc.py"):
        assert (tmp_path / rel / name).read_text() == (here / name).read_text(), name


# -- on the cluster --------------------------------------------------------------------------------


def raw_pod(name: str, resources: dict[str, str], node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {
                    "name": "c",
                    "image": "busybox",
                    "command": ["python", "-c", "import time; time.sleep(60)"],
                    "resources": {"limits": resources},
                }
            ],
        },
    }


async def pod_state(kube: Any, name: str) -> dict[str, Any]:
    return await kube.get_pod(NAMESPACE, name) or {}


def unschedulable(p: dict[str, Any]) -> str | None:
    for cond in (p.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            return str(cond.get("message"))
    return None


SEEN = """
import json, os
conn = os.path.join(os.environ["HOME"], "..", "volumes", "connection", "connection.json")
st = os.stat(conn)
sock = os.environ["GPUSHARE_SOCKET"]
try:
    open(conn, "a")
    writable = True
except OSError:
    writable = False
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                  "conn": [st.st_uid, st.st_gid, oct(st.st_mode & 0o777)], "writable": writable,
                  "socket_dir": sorted(os.listdir(os.path.dirname(sock))),
                  "preload": os.environ.get("LD_PRELOAD", "").endswith("libgpushare.so")}))
"""


async def test_kernel_pod_gets_its_share_through_the_kubelet_and_the_scheduler_counts_it(
    control_plane: ControlPlane, node_agent: Any, jupyter_server_factory: Any
) -> None:
    kube = await admin(control_plane)
    # the admin keeps GPU Operator's NVIDIA device plugin off gpushare nodes
    await kube.patch_node("gpu-node-2", {"metadata": {"labels": {NVIDIA_PLUGIN_OFF: "false"}}})
    node = await kube.read_node("gpu-node-2")
    assert node["status"]["allocatable"][RES] == "100"  # ListAndWatch: 1 T4 x 100 units
    assert "nvidia.com/gpu" not in node["status"]["allocatable"]

    server = jupyter_server_factory()
    reply = server.request(
        "POST",
        "/gpushare/api/kernels",
        json={"name": "gpushare-k8s-t4", "share": {"gpu_request": 0.6, "gpu_limit": 0.6}},
    )
    assert reply.status_code == 201, reply.text
    kernel = reply.json()["id"]
    suffix = uuid.uuid4().hex[:6]
    names = {k: f"h7-{k}-{suffix}" for k in ("nvidia", "too-many", "fits")}
    try:
        [record] = await kernel_records(kube, kernel)
        [kpod] = await kernel_pods(kube, kernel)
        assert record.node == "gpu-node-2"
        limits = kpod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[RES] == "60"
        assert kpod["metadata"]["annotations"][manifests.ALLOCATED_ANNOTATION] == "gpu-node-2"

        # what the kernel sees: its user, its Secret (root's, group fsGroup, 0440), a socket
        # directory holding its own socket only, the interposer preloaded
        seen = json.loads(await execute(server, kernel, SEEN))
        assert (seen["uid"], seen["gid"]) == (1000, 100) and 100 in seen["groups"]
        assert seen["conn"] == [0, 100, "0o440"] and seen["writable"] is False
        assert seen["socket_dir"] == ["daemon.sock"] and seen["preload"] is True

        # the scheduler: nvidia.com/gpu has no room on a gpushare node, 50 units are more
        # than the 40 left, 40 fit (and are then refused at admission: not the kernel's pod)
        await kube.create_pod(
            NAMESPACE, raw_pod(names["nvidia"], {"nvidia.com/gpu": "1"}, "gpu-node-2")
        )
        await kube.create_pod(NAMESPACE, raw_pod(names["too-many"], {RES: "50"}, "gpu-node-2"))
        # the pod that fits forges the kernel's labels (as anyone who may create pods can)
        forged = raw_pod(names["fits"], {RES: "40"}, "gpu-node-2")
        forged["metadata"]["labels"] = {
            k: v for k, v in kpod["metadata"]["labels"].items() if k != manifests.LABEL_KERNEL
        }
        await kube.create_pod(NAMESPACE, forged)

        async def refused(name: str, words: str) -> str | None:
            message = unschedulable(await pod_state(kube, name))
            return message if message and words in message else None

        message = await eventually(
            lambda: refused(names["nvidia"], "nvidia.com/gpu"),
            30,
            "the nvidia.com/gpu pod to be Unschedulable",
        )
        assert "Insufficient nvidia.com/gpu" in message, message
        message = await eventually(
            lambda: refused(names["too-many"], RES), 30, "the 50-unit pod to be Unschedulable"
        )
        assert f"Insufficient {RES}" in message, message

        async def admission_refused() -> dict[str, Any] | None:
            p = await pod_state(kube, names["fits"])
            return p if (p.get("status") or {}).get("phase") == "Failed" else None

        fits = await eventually(admission_refused, 30, "the 40-unit pod to be admitted or not")
        assert fits["spec"]["nodeName"] == "gpu-node-2"  # the scheduler placed it
        assert fits["status"]["reason"] == "UnexpectedAdmissionError", fits["status"]
        assert f"allocation {record.id} is not this pod's" in fits["status"]["message"], fits
        # the kernel's socket directory holds its own socket still, and it keeps working
        again = json.loads(await execute(server, kernel, SEEN))
        assert again["socket_dir"] == ["daemon.sock"]
    finally:
        for name in names.values():
            await kube.delete_pod(NAMESPACE, name, grace=0)
        await kube.patch_node("gpu-node-2", {"metadata": {"labels": {NVIDIA_PLUGIN_OFF: None}}})
        await shut_down(server, kube, kernel)


async def test_plugin_registers_again_when_the_kubelet_restarts(
    control_plane: ControlPlane, node_agent: Any
) -> None:
    """A restarting kubelet removes the plugins' sockets: the plugin serves and registers
    again, and the Node keeps its share capacity."""
    directory = node_agent / "gpu-node-1" / "host" / "var" / "lib" / "kubelet" / "device-plugins"
    log = control_plane.workdir / "node-agent.log"
    registered = "gpu-node-1: device plugin for gpushare.jupyter.org/gpu-share registered"
    before = log.read_text().count(registered)
    assert before >= 1 and (directory / "gpushare.sock").exists()
    (directory / "gpushare.sock").unlink()

    async def again() -> bool:
        return log.read_text().count(registered) > before and (directory / "gpushare.sock").exists()

    await eventually(again, 30, "the plugin to register again")
    kube = await admin(control_plane)
    try:
        node = await kube.read_node("gpu-node-1")
        assert node["status"]["allocatable"][RES] == "200"
    finally:
        await kube.close()


async def test_a_resource_quota_bounds_share_units(control_plane: ControlPlane) -> None:
    """Shares are an extended resource, so a namespace's ResourceQuota bounds them (the API
    server refuses a pod over it): GPU quotas are no longer bypassed by shared kernels."""
    from kubernetes_asyncio.client.exceptions import ApiException

    kube = await admin(control_plane)
    namespace = f"h7-quota-{uuid.uuid4().hex[:6]}"
    try:
        await kube.core.create_namespace({"metadata": {"name": namespace}})
        await kube.core.create_namespaced_resource_quota(
            namespace, {"metadata": {"name": "shares"}, "spec": {"hard": {f"requests.{RES}": "30"}}}
        )

        async def counted() -> bool:
            quota = await kube.core.read_namespaced_resource_quota("shares", namespace)
            return bool(quota.status and quota.status.hard)

        await eventually(counted, 30, "the quota controller to count the namespace")
        with pytest.raises(ApiException) as refused:
            await kube.create_pod(namespace, raw_pod("over", {RES: "40"}, "gpu-node-2"))
        assert refused.value.status == 403 and "exceeded quota" in str(refused.value.body)
        assert f"requested: requests.{RES}=40" in str(refused.value.body)
        await kube.create_pod(namespace, raw_pod("within", {RES: "30"}, "gpu-node-9"))
    finally:
        await kube.core.delete_namespace(namespace)
        await kube.close()


def held_pod(
    name: str,
    allocation: str,
    node: str,
    admit_after: float,
    units: int = 10,
    start_after: float = 0.0,
) -> dict[str, Any]:
    """A pod that looks like a kernel pod (component and allocation labels, ``units`` share
    units), created bound to ``node``, which the kubelet double admits ``admit_after`` seconds
    late and whose container it starts ``start_after`` seconds after admission."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                manifests.LABEL_COMPONENT: manifests.KERNEL_COMPONENT,
                manifests.LABEL_ALLOCATION: allocation,
            },
            "annotations": {
                "test.gpushare/admit-after": str(admit_after),
                "test.gpushare/start-after": str(start_after),
            },
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "kernel",
                    "image": "busybox",
                    "command": ["python", "-c", "import time; time.sleep(60)"],
                    "resources": {"limits": {RES: str(units)}},
                }
            ],
        },
    }


async def test_a_forged_pod_bound_in_the_kernels_second_does_not_fail_its_admission(
    control_plane: ControlPlane, node_agent: Any
) -> None:
    """Issue 15, the Allocate gap: Allocate does not say which pod it is for, so the plugin
    serves the first-bound waiting kernel pod. A pod that copies a kernel pod's labels and is
    bound in the same second (timestamps have one-second resolution), with a name that sorts
    first, used to come first and make the kernel's own admission fail. Now ties within a
    second go to the pod the ledger names (name, namespace, UID), and pods outside the kernel
    namespace are never candidates: the kernel is admitted and gets its share; the forgery in
    the kernel namespace fails admission, and neither forgery gets anything."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from jupyter_gpushare.k8s.ledger import KubernetesLedger

    node = "gpu-node-2"
    kube = await admin(control_plane)
    ledger = KubernetesLedger(kube, NAMESPACE)
    other_ns = "gpushare-forger"
    suffix = uuid.uuid4().hex[:6]
    kernel, forged, elsewhere = f"zz-kernel-{suffix}", f"aa-forged-{suffix}", f"aa-other-{suffix}"
    [t4] = [g for g in await ledger.gpus() if g.node == node]
    allocation = Allocation(
        id=Allocation.new_id(),
        node=node,
        gpus=(t4.uuid,),
        spec=ShareSpec(gpu_request=0.1, gpu_limit=0.1, gpu_memory=2**28, gpu_type=t4.type),
        memory=2**28,
        backend="kubernetes",
        extra={"k8s_pod": kernel, "k8s_namespace": NAMESPACE},
    )
    try:
        with contextlib.suppress(ApiException):
            await kube.core.create_namespace({"metadata": {"name": other_ns}})
        snap = await ledger.snapshot()
        assert await ledger.compare_and_swap(
            node, snap.versions.get(node, 0), [*snap.on_node(node), allocation]
        )
        # the kernel pod, admitted 2 s late: the forgeries are bound meanwhile, in its second
        for _attempt in range(3):
            made = await kube.create_pod(NAMESPACE, held_pod(kernel, allocation.id, node, 2.0))
            copy = await kube.create_pod(NAMESPACE, held_pod(forged, allocation.id, node, 4.0))
            if made["metadata"]["creationTimestamp"] == copy["metadata"]["creationTimestamp"]:
                break
            for name in (kernel, forged):  # crossed a second boundary: not the attack
                await kube.delete_pod(NAMESPACE, name, grace=0)
            await eventually(lambda: gone(kube, kernel, forged), 30, "the pods to go")
        else:
            pytest.fail("could not create two pods within one second in three attempts")
        assert forged < kernel  # by name, the forgery would sort first
        await kube.create_pod(other_ns, held_pod(elsewhere, allocation.id, node, 4.0))

        async def admitted() -> dict[str, Any] | None:
            p = await pod_state(kube, kernel)
            annotations = p.get("metadata", {}).get("annotations") or {}
            if (p.get("status") or {}).get("phase") == "Failed":
                return p  # refused: fails below with the reason
            return p if manifests.ALLOCATED_ANNOTATION in annotations else None

        p = await eventually(admitted, 30, "the kernel pod to be admitted")
        assert (p.get("status") or {}).get("phase") != "Failed", p.get("status")

        async def refused(namespace: str, name: str) -> dict[str, Any] | None:
            p = await kube.get_pod(namespace, name) or {}
            return p if (p.get("status") or {}).get("phase") == "Failed" else None

        p = await eventually(lambda: refused(NAMESPACE, forged), 30, f"{forged} to be refused")
        assert p["status"]["reason"] == "UnexpectedAdmissionError", p["status"]
        assert f"allocation {allocation.id} is not this pod's" in p["status"]["message"]
        # the kubelet double runs the kernel namespace's pods only: the other namespace's
        # forgery waits there unadmitted, and the plugin never took it for the kernel
        for namespace, name in ((NAMESPACE, forged), (other_ns, elsewhere)):
            p = await kube.get_pod(namespace, name) or {}
            assert manifests.ALLOCATED_ANNOTATION not in (p["metadata"].get("annotations") or {})
    finally:
        for namespace, name in ((NAMESPACE, kernel), (NAMESPACE, forged), (other_ns, elsewhere)):
            with contextlib.suppress(ApiException):
                await kube.delete_pod(namespace, name, grace=0)
        with contextlib.suppress(Exception):
            await ledger.release(allocation.id)
        await kube.close()


async def gone(kube: Any, *names: str) -> bool:
    return all(await kube.get_pod(NAMESPACE, n) is None for n in names)


def kernel_record(node: str, gpu: Gpu, pod: str, units: int) -> Allocation:
    share = units / manifests.SHARE_UNITS_PER_GPU
    return Allocation(
        id=Allocation.new_id(),
        node=node,
        gpus=(gpu.uuid,),
        spec=ShareSpec(gpu_request=share, gpu_limit=share, gpu_memory=2**28, gpu_type=gpu.type),
        memory=2**28,
        backend="kubernetes",
        extra={"k8s_pod": pod, "k8s_namespace": NAMESPACE},
    )


async def created_in_one_second(kube: Any, *pods: dict[str, Any]) -> None:
    """Create ``pods`` within one second (as creation is their binding here: nodeName set)."""
    names = [p["metadata"]["name"] for p in pods]
    for _attempt in range(3):
        made = [await kube.create_pod(NAMESPACE, p) for p in pods]
        if len({m["metadata"]["creationTimestamp"] for m in made}) == 1:
            return
        for name in names:  # crossed a second boundary: not the attack
            await kube.delete_pod(NAMESPACE, name, grace=0)
        await eventually(lambda: gone(kube, *names), 30, "the pods to go")
    pytest.fail("could not create the pods within one second in three attempts")


@pytest.mark.parametrize("pre_start", ["after", "before"])
async def test_a_forged_pod_admitted_first_in_the_kernels_second_is_refused_at_pre_start(
    control_plane: ControlPlane, node_agent: Path, pre_start: str
) -> None:
    """The residual gap of ``Allocate`` (it names devices, not the pod): a forged pod that
    copies a kernel pod's labels, bound in its second and admitted *first*, is taken for the
    kernel's pod, and its container is handed the kernel's allocation. PreStartContainer asks
    the kubelet's PodResources API which pod holds those devices: the forgery, so its container
    is never started (Pending, CreateContainerConfigError, with the plugin's message), and
    the kernel pod, admitted next (``pre_start``: before or after the forgery's PreStart), is
    served its share and runs."""
    from kubernetes_asyncio.client.exceptions import ApiException

    from jupyter_gpushare.k8s.ledger import KubernetesLedger

    node = "gpu-node-2"
    units = 12 if pre_start == "after" else 14  # not the other tests' sizes
    kube = await admin(control_plane)
    ledger = KubernetesLedger(kube, NAMESPACE)
    suffix = uuid.uuid4().hex[:6]
    kernel, forged = f"zz-kernel-{suffix}", f"aa-forged-{suffix}"
    [t4] = [g for g in await ledger.gpus() if g.node == node]
    allocation = kernel_record(node, t4, kernel, units)
    try:
        snap = await ledger.snapshot()
        assert await ledger.compare_and_swap(
            node, snap.versions.get(node, 0), [*snap.on_node(node), allocation]
        )
        # the forgery is admitted first; its container starts 3 s after (an image to pull):
        # after the kernel pod's admission, or (no delay) before it
        late = 3.0 if pre_start == "after" else 0.0
        await created_in_one_second(
            kube,
            held_pod(kernel, allocation.id, node, 1.5 if late else 2.5, units),
            held_pod(forged, allocation.id, node, 0.5, units, start_after=late),
        )

        async def running() -> dict[str, Any] | None:
            p = await pod_state(kube, kernel)
            phase = (p.get("status") or {}).get("phase")
            return p if phase in ("Running", "Failed") else None

        p = await eventually(running, 30, "the kernel pod to run")
        assert p["status"]["phase"] == "Running", p["status"]
        assert p["metadata"]["annotations"][manifests.ALLOCATED_ANNOTATION] == node
        # it was handed its own allocation
        seen = json.loads((node_agent / "pods" / p["metadata"]["uid"] / "devices.json").read_text())
        assert seen["kernel"]["envs"]["GPUSHARE_ALLOCATION_ID"] == allocation.id

        async def refused() -> dict[str, Any] | None:
            f = await pod_state(kube, forged)
            for status in (f.get("status") or {}).get("containerStatuses") or []:
                if "waiting" in status["state"]:
                    return f
            return None

        f = await eventually(refused, 30, "the forged pod's container to be refused")
        assert f["status"]["phase"] == "Pending", f["status"]
        [waiting] = [c["state"]["waiting"] for c in f["status"]["containerStatuses"]]
        assert waiting["reason"] == "CreateContainerConfigError", waiting
        assert "PreStartContainer" in waiting["message"], waiting
        assert f"pod {NAMESPACE}/{forged}" in waiting["message"], waiting
        assert "its container is not started" in waiting["message"], waiting
        assert manifests.ALLOCATED_ANNOTATION not in (f["metadata"].get("annotations") or {})
        assert not (node_agent / "pods" / f["metadata"]["uid"] / "kernel.log").exists()
    finally:
        for name in (kernel, forged):
            with contextlib.suppress(ApiException):
                await kube.delete_pod(NAMESPACE, name, grace=0)
        with contextlib.suppress(Exception):
            await ledger.release(allocation.id)
        await kube.close()
