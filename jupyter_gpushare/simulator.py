"""The GPU simulator seen from Python: the environment that points a process at the simulated
``libcuda.so.1`` / ``libnvidia-ml.so.1``, and a read-only view of the simulator's shared state.

The simulator itself is C (``csrc/simulator/``, built into ``_lib/sim/``). Every process that
loads it maps one state file (``GPUSHARE_SIM_STATE``) holding the simulated devices' time lines,
memory in use and per-process accounting; :class:`SimState` reads that file with the same layout
(``csrc/simulator/sim_state.h``), for tests and diagnostics. The simulated NVML answers what
monitoring tools ask (nvitop, gpustat, DCGM-style collectors) the way the real board of each
product does (``csrc/simulator/product.c``), with P-state, clocks, power and temperature
following the device's load.

Tunables (environment of the processes using the simulated driver): ``GPUSHARE_SIM_KERNEL_US``
(duration of kernels other than ``busy_us``, default 5), ``GPUSHARE_SIM_QUEUE_AHEAD_US`` (work a
stream may queue beyond now before a launch blocks, default 1 s; a few ms interleaves processes
like time slices), ``GPUSHARE_SIM_CONTEXT_BYTES`` (device memory each context takes, default 0)
and ``GPUSHARE_SIM_HOST_PROC`` (a procfs of the host's pid namespace, default ``/proc``: NVML
reports each process by the pid its "self" link gives, the host's, as a real driver does for a
process in a container's pid namespace).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpushare.inventory import Gpu, simulator_device_list
from jupyter_gpushare.paths import lib_dir

#: Marker set in every simulated process's environment; UIs show "simulated" when they see it.
SIMULATED_MARKER = "GPUSHARE_SIMULATED"
#: the simulator's shared state file, next to the node agent's socket (also in kernel pods)
SIM_STATE_NAME = "sim.state"


def sim_lib_dir() -> Path:
    """Where the simulated ``libcuda.so.1`` and ``libnvidia-ml.so.1`` are built."""
    return lib_dir() / "sim"


def nvml_library() -> Path:
    """The simulated NVML, for ``pynvml.nvmlLib = ctypes.CDLL(...)``."""
    return sim_lib_dir() / "libnvidia-ml.so.1"


def cuda_library() -> Path:
    """The simulated CUDA driver."""
    return sim_lib_dir() / "libcuda.so.1"


def build(target: str = "all") -> None:
    """Builds the C libraries (``make -C jupyter_gpushare/csrc [target]``; ``sim``: only the
    simulator's) in a source checkout; a wheel ships them prebuilt."""
    csrc = Path(__file__).resolve().parent / "csrc"
    subprocess.run(["make", "-s", "-C", str(csrc), target], check=True)


def _fnv1a64(text: str) -> int:
    value = 1469598103934665603
    for byte in text.encode():
        value ^= byte
        value = (value * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return value


def default_state_path(devices: str) -> Path:
    """The state file the simulator uses when ``GPUSHARE_SIM_STATE`` is unset (same rule as the C
    code: per user and per device list, in /dev/shm when it exists)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"gpushare-sim-{os.getuid()}-{_fnv1a64(devices):016x}"


def ensure_state_dir(state_path: str | os.PathLike[str]) -> Path:
    """Create the directory of the simulator's state file (``GPUSHARE_SIM_STATE``) when it is
    missing, private to this user (0700), so that the first ``cuInit`` of a process that starts
    before any node agent finds it (otherwise ``CUDA_ERROR_OPERATING_SYSTEM``, 304). An existing
    directory is left as it is (``/dev/shm``, or one the agent made). Returns the directory."""
    directory = Path(state_path).parent
    if not directory.is_dir():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def simulator_env(
    gpus: Iterable[Gpu],
    state_path: str | os.PathLike[str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment variables that make a process use the simulated GPUs ``gpus``.

    Returns only the variables to set (merge them into the process's environment):
    ``GPUSHARE_SIMULATED=1``, ``GPUSHARE_SIM_DEVICES``, ``GPUSHARE_SIM_STATE`` and
    ``LD_LIBRARY_PATH`` with ``_lib/sim`` first (keeping ``base``'s value after it; ``base``
    defaults to ``os.environ``). Narrow the devices a process sees with ``CUDA_VISIBLE_DEVICES``
    (UUIDs or indices), as on a real machine.
    """
    base = os.environ if base is None else base
    devices = simulator_device_list(gpus)
    state = Path(state_path) if state_path is not None else default_state_path(devices)
    previous = base.get("LD_LIBRARY_PATH", "")
    parts = [str(sim_lib_dir())] + [p for p in previous.split(":") if p and p != str(sim_lib_dir())]
    return {
        SIMULATED_MARKER: "1",
        "GPUSHARE_SIM_DEVICES": devices,
        "GPUSHARE_SIM_STATE": str(state),
        "LD_LIBRARY_PATH": ":".join(parts),
    }


# -- reading the shared state (layout of csrc/simulator/sim_state.h) ------------------------------

MAX_DEVICES = 64
MAX_PROCS = 256
SAMPLES = 64
_MAGIC = 0x314D534853504721
_VERSION = 1


class _Sample(ctypes.Structure):
    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("t", ctypes.c_uint64),
        ("done", ctypes.c_uint64),
        ("until", ctypes.c_uint64),
    ]


class _Device(ctypes.Structure):
    _fields_ = [
        ("uuid", ctypes.c_char * 96),
        ("name", ctypes.c_char * 96),
        ("total_bytes", ctypes.c_uint64),
        ("sms", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32),
        ("created_ns", ctypes.c_uint64),
        ("busy_until", ctypes.c_uint64),
        ("busy_total", ctypes.c_uint64),
        ("mem_used", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("samples", _Sample * SAMPLES),
    ]


class _ProcDevice(ctypes.Structure):
    _fields_ = [
        ("mem", ctypes.c_uint64),
        ("busy", ctypes.c_uint64),
        ("last_end", ctypes.c_uint64),
        ("contexts", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("sample_t", ctypes.c_uint64),
        ("sample_busy", ctypes.c_uint64),
    ]


class _Proc(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_int32),
        ("host_pid", ctypes.c_int32),
        ("start_time", ctypes.c_uint64),
        ("instance", ctypes.c_uint64),
        ("dev", _ProcDevice * MAX_DEVICES),
    ]


class _State(ctypes.Structure):
    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("max_devices", ctypes.c_uint32),
        ("size", ctypes.c_uint64),
        ("ndev", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("dev", _Device * MAX_DEVICES),
        ("proc", _Proc * MAX_PROCS),
    ]


@dataclass(frozen=True)
class SimDevice:
    """One simulated device as the shared state holds it."""

    uuid: str
    name: str
    total_bytes: int
    sms: int
    mem_used: int
    busy_total_ns: int  # all kernel time ever scheduled on it
    busy_until_ns: int  # CLOCK_MONOTONIC instant its last scheduled kernel ends
    launches: int


@dataclass(frozen=True)
class SimProcess:
    """A process using the simulated devices: its memory and kernel time per device UUID."""

    pid: int
    memory: dict[str, int]
    busy_ns: dict[str, int]
    contexts: dict[str, int]


class SimState:
    """A read-only snapshot reader of a simulator state file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def _read(self) -> _State:
        size = ctypes.sizeof(_State)
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise ValueError(f"{self.path} is not a simulator state file of this version")
            with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as view:
                state = _State.from_buffer_copy(view)
        if state.magic != _MAGIC or state.version != _VERSION:
            raise ValueError(f"{self.path} is not a simulator state file of this version")
        return state

    def devices(self) -> list[SimDevice]:
        state = self._read()
        return [_device(state.dev[i]) for i in range(min(state.ndev, MAX_DEVICES))]

    def device(self, uuid: str) -> SimDevice:
        for dev in self.devices():
            if dev.uuid == uuid:
                return dev
        raise KeyError(uuid)

    def processes(self) -> list[SimProcess]:
        """Processes holding a record (the simulator reaps records of exited processes when it
        next looks, so a just-killed process may still be listed)."""
        state = self._read()
        uuids = [state.dev[i].uuid.decode() for i in range(min(state.ndev, MAX_DEVICES))]
        out = []
        for proc in state.proc:
            if proc.pid <= 0:
                continue
            out.append(
                SimProcess(
                    pid=proc.pid,
                    memory={u: proc.dev[i].mem for i, u in enumerate(uuids) if proc.dev[i].mem},
                    busy_ns={u: proc.dev[i].busy for i, u in enumerate(uuids) if proc.dev[i].busy},
                    contexts={
                        u: proc.dev[i].contexts for i, u in enumerate(uuids) if proc.dev[i].contexts
                    },
                )
            )
        return out


def _device(raw: _Device) -> SimDevice:
    return SimDevice(
        uuid=raw.uuid.decode(),
        name=raw.name.decode(),
        total_bytes=raw.total_bytes,
        sms=raw.sms,
        mem_used=raw.mem_used,
        busy_total_ns=raw.busy_total,
        busy_until_ns=raw.busy_until,
        launches=raw.launches,
    )
