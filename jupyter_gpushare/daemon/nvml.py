"""NVML readings for the status API (informational: memory in use and utilisation per GPU).

Runs in a worker thread. With simulated GPUs the simulator's ``libnvidia-ml.so.1`` answers.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()


def sample(library: str | None) -> dict[str, dict[str, Any]]:
    """``{uuid: {"memory_used", "memory_total", "utilization_gpu", "temperature_c",
    "power_w"}}`` for every visible GPU."""
    import ctypes

    import pynvml

    with _lock:
        if library is not None:
            pynvml.nvmlLib = ctypes.CDLL(library)
        pynvml.nvmlInit()
        try:
            readings: dict[str, dict[str, Any]] = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
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
        finally:
            pynvml.nvmlShutdown()
            if library is not None:
                pynvml.nvmlLib = None


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
