"""Real NVML tools on the simulated GPUs: nvitop, gpustat and nvidia-ml-py's own example run
against the simulated libnvidia-ml.so.1 (found through LD_LIBRARY_PATH, as on a real machine)
without a traceback and show what a real board of that product shows - and, inside a share
(through the interposer), memory and process lists that agree with each other."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from simmachine import SimMachine, bind_pynvml, gpushare_run, other_share_holding

from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.simulator import nvml_library, simulator_env

# Looked up, not imported: importing nvitop patches pynvml in this process (other tests use it).
pytestmark = pytest.mark.skipif(
    find_spec("nvitop") is None or find_spec("gpustat") is None,
    reason="needs nvitop and gpustat (the test extras)",
)

GiB = 1 << 30

#: What the tools call (traced from nvitop 1.7 --once and its Device/process snapshots, gpustat
#: 1.1 --json, nvidia-ml-py's example.py) and what DCGM-style collectors and device plugins read
#: (field values, clocks and their event reasons, ECC, remapped rows, PCIe, NVLink, health events).
#: Each must exist; the product decides whether it answers or says NOT_SUPPORTED.
TOOL_FUNCTIONS = """
nvmlInit_v2 nvmlInitWithFlags nvmlShutdown nvmlErrorString nvmlSystemGetDriverVersion
nvmlSystemGetNVMLVersion nvmlSystemGetCudaDriverVersion nvmlSystemGetCudaDriverVersion_v2
nvmlSystemGetProcessName nvmlDeviceGetCount_v2 nvmlDeviceGetHandleByIndex_v2
nvmlDeviceGetHandleByUUID nvmlDeviceGetHandleByPciBusId_v2 nvmlDeviceGetHandleBySerial
nvmlDeviceGetName nvmlDeviceGetUUID nvmlDeviceGetSerial nvmlDeviceGetIndex
nvmlDeviceGetMinorNumber nvmlDeviceGetPciInfo_v3 nvmlDeviceGetBrand nvmlDeviceGetArchitecture
nvmlDeviceGetCudaComputeCapability nvmlDeviceGetBoardPartNumber nvmlDeviceGetVbiosVersion
nvmlDeviceGetAttributes_v2 nvmlDeviceGetNumGpuCores nvmlDeviceGetMemoryBusWidth
nvmlDeviceGetVirtualizationMode nvmlDeviceGetGridLicensableFeatures_v4
nvmlDeviceGetDriverModel nvmlDeviceGetDriverModel_v2 nvmlDeviceGetDisplayMode
nvmlDeviceGetDisplayActive nvmlDeviceGetPersistenceMode nvmlDeviceGetComputeMode
nvmlDeviceGetConfComputeMemSizeInfo nvmlDeviceGetMemoryInfo nvmlDeviceGetMemoryInfo_v2
nvmlDeviceGetBAR1MemoryInfo nvmlDeviceGetUtilizationRates nvmlDeviceGetEncoderUtilization
nvmlDeviceGetDecoderUtilization nvmlDeviceGetJpgUtilization nvmlDeviceGetOfaUtilization
nvmlDeviceGetTemperature nvmlDeviceGetTemperatureV nvmlDeviceGetTemperatureThreshold
nvmlDeviceGetFanSpeed nvmlDeviceGetPowerUsage nvmlDeviceGetTotalEnergyConsumption
nvmlDeviceGetEnforcedPowerLimit nvmlDeviceGetPowerManagementLimit
nvmlDeviceGetPowerManagementDefaultLimit nvmlDeviceGetPowerManagementLimitConstraints
nvmlDeviceGetPowerManagementMode nvmlDeviceGetPerformanceState nvmlDeviceGetPowerState
nvmlDeviceGetClockInfo nvmlDeviceGetMaxClockInfo nvmlDeviceGetClock
nvmlDeviceGetApplicationsClock nvmlDeviceGetMaxCustomerBoostClock
nvmlDeviceGetCurrentClocksEventReasons nvmlDeviceGetCurrentClocksThrottleReasons
nvmlDeviceGetSupportedClocksEventReasons nvmlDeviceGetViolationStatus nvmlDeviceGetEccMode
nvmlDeviceGetTotalEccErrors nvmlDeviceGetMemoryErrorCounter nvmlDeviceGetRetiredPages
nvmlDeviceGetRetiredPagesPendingStatus nvmlDeviceGetRemappedRows
nvmlDeviceGetCurrPcieLinkGeneration nvmlDeviceGetCurrPcieLinkWidth
nvmlDeviceGetMaxPcieLinkGeneration nvmlDeviceGetMaxPcieLinkWidth nvmlDeviceGetPcieThroughput
nvmlDeviceGetPcieReplayCounter nvmlDeviceGetNvLinkState nvmlDeviceGetNvLinkVersion
nvmlDeviceGetNvLinkErrorCounter nvmlDeviceGetMigMode nvmlDeviceGetMaxMigDeviceCount
nvmlDeviceGetMigDeviceHandleByIndex nvmlDeviceIsMigDeviceHandle
nvmlDeviceGetDeviceHandleFromMigDeviceHandle nvmlDeviceGetGpuInstanceId
nvmlDeviceGetComputeInstanceId nvmlDeviceGetComputeRunningProcesses_v3
nvmlDeviceGetGraphicsRunningProcesses_v3 nvmlDeviceGetMPSComputeRunningProcesses_v3
nvmlDeviceGetRunningProcessDetailList nvmlDeviceGetProcessUtilization
nvmlDeviceGetProcessesUtilizationInfo nvmlDeviceGetAccountingMode nvmlDeviceGetFieldValues
nvmlDeviceGetSupportedEventTypes nvmlEventSetCreate nvmlDeviceRegisterEvents
nvmlEventSetWait_v2 nvmlEventSetFree nvmlDeviceGetCpuAffinity nvmlDeviceGetMemoryAffinity
nvmlDeviceGetTopologyCommonAncestor nvmlDeviceGetTopologyNearestGpus nvmlSystemGetTopologyGpuSet
nvmlDeviceGetP2PStatus
""".split()


def tool(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``python -m <tool> ...`` with the simulator's environment; asserts a clean exit."""
    done = subprocess.run(
        [sys.executable, "-m", *args],
        env={**env, "COLUMNS": "79", "TERM": "xterm"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Traceback" not in output and "ERROR" not in output, output
    return done


def gpu_rows(nvitop_out: str) -> dict[int, list[str]]:
    """nvitop's two lines per GPU, by index: cells split on the box character."""
    lines = nvitop_out.splitlines()
    rows: dict[int, list[str]] = {}
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if cells and cells[0].split()[0].isdigit() and "A100" in line:
            rows[int(cells[0].split()[0])] = cells + [
                c.strip() for c in lines[i + 1].split("│") if c.strip()
            ]
    return rows


@pytest.fixture
def tenant(sim_machine: SimMachine) -> Iterator[subprocess.Popen[str]]:
    """A process holding 3 GiB on GPU 0 and keeping it busy about half of the time (the load at
    which the simulator used to report P8 and idle clocks)."""
    proc = sim_machine.start("pulse", str(3 * GiB), "50", "0")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.2)  # a utilisation window of the pulsed load
    yield proc


def test_every_function_the_tools_call_exists() -> None:
    lib = ctypes.CDLL(str(nvml_library()))
    missing = [name for name in TOOL_FUNCTIONS if not hasattr(lib, name)]
    assert missing == []


def test_nvitop_shows_a_busy_a100_as_a_real_one(
    sim_machine: SimMachine, tenant: subprocess.Popen[str]
) -> None:
    out = tool(sim_machine.env, "nvitop", "--once").stdout
    rows = gpu_rows(out)
    assert sorted(rows) == [0, 1], out
    for index, cells in rows.items():
        # GPU/name/persistence, bus id + display active, MIG mode + ECC, then fan/temp/perf/power,
        # memory, utilisation + compute mode
        _name, bus, mig_ecc, fan_etc, _memory, _util = cells
        assert bus.endswith("Off"), cells  # display active: disabled, as on a data-centre board
        assert mig_ecc.split() == ["Disabled", "0"], cells  # MIG capable and off; no ECC errors
        fan, rest = fan_etc.split(maxsplit=1)
        assert fan == "N/A"  # passively cooled: a real A100 has no fan to report
        assert "N/A" not in rest, cells
        perf = rest.split()[1]
        assert perf == ("P0" if index == 0 else "P8"), cells  # half busy is busy: P0
    assert "3072MiB / 80.00GiB" in out  # the tenant's memory
    assert f" {tenant.pid} " in out and "3072MiB" in out.split(f" {tenant.pid} ")[1]


def test_gpustat_reports_the_tenant_and_every_a100_reading(
    sim_machine: SimMachine, tenant: subprocess.Popen[str]
) -> None:
    report = json.loads(tool(sim_machine.env, "gpustat", "--json").stdout)
    busy, idle = report["gpus"]
    for gpu in (busy, idle):
        readings = {k: v for k, v in gpu.items() if k != "processes"}
        assert readings.pop("fan.speed") is None  # no fan on a passively cooled board
        assert None not in readings.values(), readings  # encoder/decoder included
    assert busy["memory.used"] == 3072 and idle["memory.used"] == 0
    assert busy["utilization.gpu"] > 0 and busy["power.draw"] > idle["power.draw"] == 60
    assert [(p["pid"], p["gpu_memory_usage"]) for p in busy["processes"]] == [(tenant.pid, 3072)]
    assert idle["processes"] == []


def test_nvitop_device_api_load_dependent_readings(
    sim_machine: SimMachine, tenant: subprocess.Popen[str]
) -> None:
    """P-state, clocks, PCIe link and power follow load (P0 and boost clocks when busy, P8 and
    idle clocks otherwise); per-process utilisation counts from the process's first launch."""
    script = textwrap.dedent("""
        import json
        from nvitop import Device
        out = []
        for d in Device.all():
            procs = d.processes()
            out.append({
                "pstate": d.performance_state(), "clocks": list(d.clock_infos()),
                "max": list(d.max_clock_infos()), "power": d.power_usage(),
                "mig": d.mig_mode(), "ecc": d.total_volatile_uncorrected_ecc_errors(),
                "enc": d.encoder_utilization(), "dec": d.decoder_utilization(),
                "sm": {p.pid: p.gpu_sm_utilization() for p in procs.values()},
            })
        print(json.dumps(out))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=sim_machine.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    busy, idle = json.loads(done.stdout)
    assert busy["pstate"] == "P0" and idle["pstate"] == "P8"
    assert busy["clocks"] == busy["max"] == [1410, 1410, 1593, 1275]  # A100 SXM4 boost
    assert idle["clocks"][:2] == [210, 210]
    assert busy["power"] > idle["power"] == 60_000
    assert (busy["mig"], busy["ecc"], busy["enc"], busy["dec"]) == ("Disabled", 0, 0, 0)
    assert busy["sm"][str(tenant.pid)] > 0  # not 0 on the first look


def test_nvidia_ml_py_example_finds_every_function(sim_machine: SimMachine) -> None:
    out = tool(sim_machine.env, "example").stdout
    assert out.count("<product_brand>NVIDIA</product_brand>") == 2
    assert "Not Found" not in out and "Not Supported" not in out, out


@pytest.fixture
def a100_and_t4(sim_program: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """pynvml in this process, bound to the simulated NVML of a machine with an A100 and a T4."""
    gpus = simulated_gpus("1xA100,1xT4", node="simtools")
    yield from bind_pynvml(simulator_env(gpus, tmp_path / "sim.state"), monkeypatch)


def test_each_product_answers_like_the_real_board(a100_and_t4: Any) -> None:
    nvml = a100_and_t4
    a100, t4 = (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    unsupported = nvml.NVMLError_NotSupported
    assert nvml.nvmlDeviceGetName(t4) == "Tesla T4"
    # MIG: capable and disabled on the A100, absent on the T4
    assert nvml.nvmlDeviceGetMigMode(a100) == [0, 0]
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(a100) == 7
    assert nvml.nvmlDeviceIsMigDeviceHandle(a100).value == 0
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetMigDeviceHandleByIndex(a100, 0)
    with pytest.raises(unsupported):
        nvml.nvmlDeviceGetMigMode(t4)
    # memory errors: Ampere remaps rows, Turing retires pages
    assert nvml.nvmlDeviceGetRemappedRows(a100) == (0, 0, 0, 0)
    with pytest.raises(unsupported):
        nvml.nvmlDeviceGetRemappedRows(t4)
    assert nvml.nvmlDeviceGetRetiredPages(t4, 0) == []
    with pytest.raises(unsupported):
        nvml.nvmlDeviceGetRetiredPages(a100, 0)
    for h, arch, links, gen in ((a100, 7, 12, 4), (t4, 6, 0, 3)):
        assert nvml.nvmlDeviceGetEccMode(h) == [1, 1]
        assert nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0) == 0
        assert nvml.nvmlDeviceGetDisplayActive(h) == nvml.nvmlDeviceGetDisplayMode(h) == 0
        assert nvml.nvmlDeviceGetEncoderUtilization(h) == [0, 167000]
        assert nvml.nvmlDeviceGetArchitecture(h) == arch
        assert nvml.nvmlDeviceGetMaxPcieLinkGeneration(h) == gen
        assert nvml.nvmlDeviceGetCurrPcieLinkGeneration(h) == 1  # idle: link trained down
        assert nvml.nvmlDeviceGetPerformanceState(h) == 8
        assert nvml.nvmlDeviceGetCurrentClocksEventReasons(h) == 1  # GPU idle
        for call in (nvml.nvmlDeviceGetFanSpeed, nvml.nvmlDeviceGetCurrentDriverModel):
            with pytest.raises(unsupported):
                call(h)
        (count,) = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
        assert (count.nvmlReturn, count.value.uiVal) == (0, links)
        (mem_temp,) = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_MEMORY_TEMP])
        assert mem_temp.nvmlReturn == (0 if h is a100 else nvml.NVML_ERROR_NOT_SUPPORTED)
        # a health watcher (device plugins, DCGM): events register, a healthy GPU raises none
        events = nvml.nvmlEventSetCreate()
        nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, events)
        with pytest.raises(nvml.NVMLError_Timeout):
            nvml.nvmlEventSetWait(events, 10)
        nvml.nvmlEventSetFree(events)
    # topology (device plugins' aligned allocation, `nvidia-smi topo`): one node, PCIe peers
    assert nvml.nvmlDeviceGetTopologyCommonAncestor(a100, a100) == nvml.NVML_TOPOLOGY_INTERNAL
    assert nvml.nvmlDeviceGetTopologyCommonAncestor(a100, t4) == nvml.NVML_TOPOLOGY_NODE
    assert len(nvml.nvmlSystemGetTopologyGpuSet(0)) == 2
    assert nvml.nvmlDeviceGetP2PStatus(a100, t4, nvml.NVML_P2P_CAPS_INDEX_WRITE) == 0
    assert nvml.nvmlDeviceGetP2PStatus(a100, t4, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == 5
    assert nvml.nvmlDeviceGetCpuAffinity(a100, 1)[0] & 1
    assert nvml.nvmlDeviceGetPowerManagementLimitConstraints(t4) == [60_000, 70_000]
    assert nvml.nvmlDeviceGetMaxClockInfo(t4, nvml.NVML_CLOCK_SM) == 1590
    assert nvml.nvmlDeviceGetMaxClockInfo(a100, nvml.NVML_CLOCK_MEM) == 1593


#: Runs inside a share: starts a process of the share holding 1 GiB, then the tools.
INSIDE = textwrap.dedent("""
    import json, subprocess, sys
    holder = subprocess.Popen([sys.argv[1], "hold", str(1 << 30), "600000", "0"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    env = {"COLUMNS": "79", "TERM": "xterm"}
    run = lambda *args: subprocess.run([sys.executable, "-m", *args], capture_output=True,
                                       text=True, env={**__import__("os").environ, **env})
    gpustat, nvitop = run("gpustat", "--json"), run("nvitop", "--once")
    holder.kill()
    print(json.dumps({"pid": holder.pid, "gpustat": gpustat.stdout, "nvitop": nvitop.stdout,
                      "errors": gpustat.stderr + nvitop.stderr}))
""")


def test_inside_a_share_memory_and_processes_agree(
    gpushare_env: dict[str, str], sim_program: Path, tmp_path: Path
) -> None:
    """Another tenant holds 3 GiB of the GPU. Inside a 2 GiB share the tools see a 2 GiB GPU
    whose used memory is the share's own 1 GiB, and the share's own process using it - not the
    other tenant, whose 3 GiB would not fit the totals shown."""
    env = {
        **gpushare_env,
        "GPUSHARE_SIMULATE": "1xA100",
        "GPUSHARE_SIM_STATE": str(tmp_path / "sim" / "sim.state"),
    }
    with other_share_holding(env, sim_program, 3 * GiB) as other_holder:
        mine = gpushare_run(
            env, "--gpu-request", "0.2", "--gpu-memory", "2GiB", "--",
            sys.executable, "-c", INSIDE, str(sim_program),
        )  # fmt: skip
        out, err = mine.communicate(timeout=180)
        assert mine.returncode == 0, err
        seen = json.loads(out)
        assert "Traceback" not in seen["errors"] and "ERROR" not in seen["errors"], seen["errors"]
        (gpu,) = json.loads(seen["gpustat"])["gpus"]
        assert (gpu["memory.total"], gpu["memory.used"]) == (2048, 1024)
        assert [(p["pid"], p["gpu_memory_usage"]) for p in gpu["processes"]] == [
            (seen["pid"], 1024)
        ]
        assert "1024MiB / 2048MiB" in seen["nvitop"], seen["nvitop"]
        assert f" {seen['pid']} " in seen["nvitop"]
        assert f" {other_holder.pid} " not in seen["nvitop"] and "3072MiB" not in seen["nvitop"]
