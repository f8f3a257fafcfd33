"""The simulated NVML, read through nvidia-ml-py (pynvml) in this process, while real processes
use the simulated driver."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pynvml
import pytest
from simmachine import SimMachine, bind_pynvml

from jupyter_gpushare.inventory import TypeAliases, discover_nvml
from jupyter_gpushare.simulator import nvml_library

T = TypeVar("T")


@pytest.fixture
def nvml(sim_machine: SimMachine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """pynvml bound to the simulated libnvidia-ml.so.1, looking at this test's machine."""
    yield from bind_pynvml(sim_machine.env, monkeypatch)


def handles(nvml: Any) -> list[Any]:
    return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]


def settled(read: Callable[[], T], ok: Callable[[T], bool], timeout: float = 30) -> T:
    """``read()`` again until ``ok`` says its reading is the one a test waits for, or until
    ``timeout`` s have passed: the last reading, for the test to assert on (a loaded machine
    starts a holder's work late; a fixed sleep and one reading made these tests flaky)."""
    deadline = time.monotonic() + timeout
    while True:
        reading = read()
        if ok(reading) or time.monotonic() > deadline:
            return reading
        time.sleep(0.05)


def test_devices_names_and_uuids(nvml: Any, sim_machine: SimMachine) -> None:
    found = handles(nvml)
    assert len(found) == len(sim_machine.gpus)
    for i, (h, gpu) in enumerate(zip(found, sim_machine.gpus, strict=True)):
        assert nvml.nvmlDeviceGetName(h) == gpu.name  # the product name, as a real GPU reports
        assert nvml.nvmlDeviceGetUUID(h) == gpu.uuid
        assert nvml.nvmlDeviceGetIndex(h) == i
        same = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        assert nvml.nvmlDeviceGetIndex(same) == i
        assert nvml.nvmlDeviceGetPciInfo(h).busId
        assert nvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == 0
        assert nvml.nvmlDeviceGetCudaComputeCapability(h) == (8, 0)
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    assert nvml.nvmlSystemGetCudaDriverVersion() == 13000
    assert nvml.nvmlSystemGetDriverVersion()


def test_idle_device(nvml: Any, sim_machine: SimMachine) -> None:
    h = handles(nvml)[0]
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    assert (mem.total, mem.used, mem.free) == (sim_machine.gpus[0].memory, 0, mem.total)
    mem2 = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
    assert (mem2.total, mem2.used) == (mem.total, 0)
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == 0
    assert nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU) == 35
    assert nvml.nvmlDeviceGetPowerUsage(h) == 60_000  # mW
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(h) == 400_000
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h) == []


def test_busy_process_shows_in_memory_utilisation_and_process_list(
    nvml: Any, sim_machine: SimMachine
) -> None:
    busy, idle = handles(nvml)
    holder = sim_machine.hold(5 << 30, 600_000, device=0)  # busy until it is killed below

    def device(h: Any) -> dict[str, int]:
        return {
            "util": nvml.nvmlDeviceGetUtilizationRates(h).gpu,
            "temperature": nvml.nvmlDeviceGetTemperature(h, 0),
            "power": nvml.nvmlDeviceGetPowerUsage(h),
            "used": nvml.nvmlDeviceGetMemoryInfo(h).used,
        }

    # once a full utilisation window (1 s) of the work has passed
    now = settled(lambda: device(busy), lambda d: d["util"] >= 98)
    assert now["util"] >= 98, now
    assert now["temperature"] >= 78, now
    assert now["power"] >= 390_000, now
    assert now["used"] == 5 << 30, now
    assert nvml.nvmlDeviceGetUtilizationRates(idle).gpu == 0
    assert nvml.nvmlDeviceGetMemoryInfo(idle).used == 0
    [proc] = nvml.nvmlDeviceGetComputeRunningProcesses(busy)
    assert (proc.pid, proc.usedGpuMemory) == (holder.pid, 5 << 30)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(idle) == []
    nvml.nvmlDeviceGetProcessUtilization(busy, 0)  # starts a per-process sample
    time.sleep(0.1)  # a sample spans at least 100 ms
    samples = settled(
        lambda: nvml.nvmlDeviceGetProcessUtilization(busy, 0),
        lambda found: len(found) == 1 and found[0].smUtil >= 90,
    )
    [sample] = samples
    assert sample.pid == holder.pid
    assert sample.smUtil >= 90, sample.smUtil

    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # The dead process's memory is back and it is no longer listed.
    assert nvml.nvmlDeviceGetMemoryInfo(busy).used == 0
    assert nvml.nvmlDeviceGetComputeRunningProcesses(busy) == []


def test_utilisation_is_the_busy_fraction_of_the_last_second(
    nvml: Any, sim_machine: SimMachine
) -> None:
    h = handles(nvml)[0]
    # 400 ms of work, then idle: a reading whose last second holds all of the work is 40 %, one
    # taken a second after its end 0. The program prints when it started launching (start_ns)
    # and when the work was done (end_ns), CLOCK_MONOTONIC like time.monotonic_ns(): a reading
    # taken after end_ns and within a second of start_ns holds all of it. On a loaded machine
    # the run itself may take longer than that second: then its reading says nothing and the
    # test runs it again, until a deadline.
    second = 1_000_000_000
    deadline = time.monotonic() + 60
    while True:
        out = sim_machine.run("busy", "1000", "400")
        start, end = int(out["start_ns"]), int(out["end_ns"])
        time.sleep(max(0.0, (start + 0.7 * second - time.monotonic_ns()) / 1e9))
        before = time.monotonic_ns()
        util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
        after = time.monotonic_ns()
        if before >= end and after - second <= start:
            break
        assert time.monotonic() < deadline, "no run left a second to read its utilisation"
        time.sleep(max(0.0, (end + 1.1 * second - time.monotonic_ns()) / 1e9))  # idle again
    assert 35 <= util <= 45, util
    time.sleep(max(0.0, (end + 1.1 * second - time.monotonic_ns()) / 1e9))
    assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == 0  # the last second held none of it


def test_inventory_discovers_the_simulated_gpus(nvml: Any, sim_machine: SimMachine) -> None:
    """jupyter_gpushare.inventory reads the simulated NVML like a real one."""
    pynvml.nvmlShutdown()  # discover_nvml initialises on its own
    try:
        gpus = discover_nvml(TypeAliases(), node="simtest", library=str(nvml_library()))
    finally:
        pynvml.nvmlInit()
    assert [(g.uuid, g.name, g.memory) for g in gpus] == [
        (g.uuid, g.name, g.memory) for g in sim_machine.gpus
    ]
    assert all(g.simulated and g.healthy for g in gpus)
