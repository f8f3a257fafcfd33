"""NVML readings for the status API (informational: memory in use and utilisation per GPU).

Runs in a worker thread. With simulated GPUs the simulator's ``libnvidia-ml.so.1`` answers.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()


def sample(library: str | None) -> dict[str, dict[str, Any]]:
    """``{uuid: {"memory_used", "memory_total", "utilization_gpu"}}`` for every visible GPU."""
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
                    "memory_used": int(memory.used),
                    "memory_total": int(memory.total),
                }
                try:
                    entry["utilization_gpu"] = int(
                        pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    )
                except pynvml.NVMLError:
                    entry["utilization_gpu"] = None
                readings[uuid] = entry
            return readings
        finally:
            pynvml.nvmlShutdown()
            if library is not None:
                pynvml.nvmlLib = None
