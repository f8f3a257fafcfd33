"""The kernel's environment, built once (jupyter_gpushare.kernel_env): a local kernel, a kernel
pod's spec (hostPath mode) and the device plugin's Allocate give the same contract."""

from __future__ import annotations

from pathlib import Path

from jupyter_gpushare.daemon.env import interposer_path, kernel_env
from jupyter_gpushare.inventory import simulated_gpus, simulator_device_list
from jupyter_gpushare.k8s import manifests
from jupyter_gpushare.k8s.device_plugin import plugin
from jupyter_gpushare.kernel_env import preload_last
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec

CONTRACT = {
    "GPUSHARE_ALLOCATION_ID",
    "GPUSHARE_SOCKET",
    "GPUSHARE_NODE",
    "LD_PRELOAD",
    "GPUSHARE_SIMULATED",
    "GPUSHARE_SIM_DEVICES",
    "GPUSHARE_SIM_STATE",
    "LD_LIBRARY_PATH",
}
FAIL_STATIC = {"GPUSHARE_GPU_REQUEST", "GPUSHARE_GPU_MEMORY"}


def test_the_interposer_is_preloaded_last_and_once() -> None:
    assert preload_last("/lib/gs.so") == "/lib/gs.so"
    assert preload_last("/lib/gs.so", "/a.so::/lib/gs.so:/b.so") == "/a.so:/b.so:/lib/gs.so"


def test_three_starters_one_contract(tmp_path: Path) -> None:
    gpus = simulated_gpus("1xA100", node="n1")
    allocation = Allocation(
        id="a-0123456789abcdef",
        node="n1",
        gpus=(gpus[0].uuid,),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5),
        memory=1 << 30,
    )
    local = kernel_env(allocation, tmp_path / "daemon.sock", gpus, base={"LD_PRELOAD": "/x.so"})
    assert CONTRACT | FAIL_STATIC | {"CUDA_VISIBLE_DEVICES"} == set(local)
    assert local["LD_PRELOAD"] == f"/x.so:{interposer_path()}"
    assert local["CUDA_VISIBLE_DEVICES"] == gpus[0].uuid
    assert local["GPUSHARE_GPU_REQUEST"] == "0.25" and local["GPUSHARE_GPU_MEMORY"] == str(1 << 30)

    request = manifests.KernelPodRequest(
        name="k",
        namespace="ns",
        kernel_id="kid",
        allocation_id=allocation.id,
        node="n1",
        gpus=allocation.gpus,
        command=["python"],
        env={},
        server_id="srv",
        owner={},
        simulated_devices=simulator_device_list(gpus),
        gpu_request=0.25,
        gpu_memory=1 << 30,
    )
    pod = manifests.kernel_environment(
        request, manifests.PodSettings(image="i", device_plugin=False)
    )
    assert CONTRACT | FAIL_STATIC | {"NVIDIA_VISIBLE_DEVICES"} == set(pod)

    settings = plugin.PluginSettings(node="n1", namespace="ns", simulated_devices="d")
    allocate = plugin.container_response(allocation, settings, tmp_path)["envs"]
    assert CONTRACT | {"NVIDIA_VISIBLE_DEVICES"} == set(allocate)  # the pod spec has the rest
    for env in (pod, allocate):
        assert env["GPUSHARE_ALLOCATION_ID"] == allocation.id
        assert env["NVIDIA_VISIBLE_DEVICES"] == local["CUDA_VISIBLE_DEVICES"]
        assert env["LD_PRELOAD"].endswith("/libgpushare.so")
