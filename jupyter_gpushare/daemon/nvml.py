"""NVML readings for the status API (informational: memory in use and utilisation per GPU).

Runs in a worker thread. With simulated GPUs the simulator's ``libnvidia-ml.so.1`` answers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


@contextlib.contextmanager
def _nvml(library: str | None) -> Iterator[Any]:
    """``pynvml`` initialised on ``library`` (None: the driver's own), under the module's lock
    (NVML's state and pynvml's library handle are the process's), shut down after."""
    import ctypes

    import pynvml

    with _lock:
        if library is not None:
            pynvml.nvmlLib = ctypes.CDLL(library)
        pynvml.nvmlInit()
        try:
            yield pynvml
        finally:
            pynvml.nvmlShutdown()
            if library is not None:
                pynvml.nvmlLib = None


def _devices(pynvml: Any) -> Iterator[tuple[int, Any, str]]:
    """``(index, handle, uuid)`` of every GPU NVML sees."""
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        yield index, handle, uuid.decode() if isinstance(uuid, bytes) else uuid


def sample(library: str | None) -> dict[str, dict[str, Any]]:
    """``{uuid: {"memory_used", "memory_total", "utilization_gpu", "temperature_c",
    "power_w"}}`` for every visible GPU."""
    with _nvml(library) as pynvml:
        readings: dict[str, dict[str, Any]] = {}
        for index, handle, uuid in _devices(pynvml):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            entry: dict[str, Any] = {
                "index": index,  # NVML's index: DCGM exporter's ``gpu`` label
                "memory_used": int(memory.used),
                "memory_total": int(memory.total),
            }
            try:
                entry["utilization_gpu"] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                entry["utilization_gpu"] = None
            entry.update(_thermal(pynvml, handle))
            readings[uuid] = entry
        return readings


def _thermal(pynvml: Any, handle: Any) -> dict[str, Any]:
    """Temperature (°C) and power draw (W), None where the device does not report them."""
    entry: dict[str, Any] = {"temperature_c": None, "power_w": None}
    try:
        entry["temperature_c"] = int(pynvml.nvmlDeviceGetTemperature(handle, 0))  # GPU sensor
    except pynvml.NVMLError:
        pass
    try:
        entry["power_w"] = round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, 1)  # mW
    except pynvml.NVMLError:
        pass
    return entry


def processes(library: str | None, last_seen: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """The driver's per-process figures (the node agent's check, :mod:`.driver_check`):
    ``{uuid: [{"pid", "memory", "busy"}]}`` for every visible GPU — ``memory`` the bytes the
    driver accounts to the process (``nvmlDeviceGetComputeRunningProcesses``, _v3 where the
    library has it), ``busy`` its share of the device since the previous call (the mean of
    ``nvmlDeviceGetProcessUtilization``'s samples newer than ``last_seen[uuid]``, a fraction;
    None where the driver has no sample). ``last_seen`` is the caller's, updated here."""
    with _nvml(library) as pynvml:
        found: dict[str, list[dict[str, Any]]] = {}
        for _index, handle, uuid in _devices(pynvml):
            rows: dict[int, dict[str, Any]] = {}
            for info in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                pid = int(info.pid)
                used = info.usedGpuMemory
                # NVML_VALUE_NOT_AVAILABLE (all ones, None in pynvml) where it cannot say
                memory = int(used) if isinstance(used, int) and 0 <= used < 2**63 else 0
                row = rows.setdefault(pid, {"pid": pid, "memory": 0, "busy": None})
                row["memory"] += memory
            samples: dict[int, list[int]] = {}
            newest = last_seen.get(uuid, 0)
            try:
                for sample in pynvml.nvmlDeviceGetProcessUtilization(handle, newest):
                    stamp = int(sample.timeStamp)
                    if stamp <= last_seen.get(uuid, 0):
                        continue
                    newest = max(newest, stamp)
                    samples.setdefault(int(sample.pid), []).append(
                        max(0, min(100, int(sample.smUtil)))
                    )
            except pynvml.NVMLError:  # NOT_FOUND: no sample since then; NOT_SUPPORTED
                pass
            last_seen[uuid] = newest
            for pid, utils in samples.items():
                row = rows.setdefault(pid, {"pid": pid, "memory": 0, "busy": None})
                row["busy"] = sum(utils) / len(utils) / 100.0
            found[uuid] = list(rows.values())
        return found
