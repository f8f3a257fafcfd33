"""Inventory: the GPUs that exist (DEVELOPING.md, box 2).

A :class:`Gpu` is one physical (or simulated) device on one node. Type aliases (``A100``,
``H100``, ``T4``) map NVML product names and the ``nvidia.com/gpu.product`` node label to the
names users pick; the map is configurable (:class:`TypeAliases`).

Discovery on this machine goes through ``nvidia-ml-py``. With simulated GPUs
(``--simulate 2xA100`` / ``GPUSHARE_SIMULATE``) the same NVML calls go to the simulator's
``libnvidia-ml.so.1`` when it is built; every simulated GPU says so (``simulated=True``).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid as uuidlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from .errors import GpushareError
from .share import ShareError, ShareSpec, format_bytes

GiB = 2**30

#: Default alias -> patterns (case-insensitive regexes matched against NVML product names and
#: ``nvidia.com/gpu.product`` labels such as ``NVIDIA-A100-SXM4-80GB``). A pattern must match a
#: whole token, so ``A10`` does not match ``A100``.
DEFAULT_TYPE_ALIASES: dict[str, list[str]] = {
    "H200": ["H200"],
    "H100": ["H100"],
    "A100": ["A100"],
    "A10": ["A10G?"],
    "L40S": ["L40S"],
    "L4": ["L4"],
    "T4": ["T4"],
    "V100": ["V100"],
    "A30": ["A30"],
}

#: Simulated products: alias -> (NVML product name, memory bytes, SM count).
SIMULATED_PRODUCTS: dict[str, tuple[str, int, int]] = {
    "A100": ("NVIDIA A100-SXM4-80GB", 80 * GiB, 108),
    "H100": ("NVIDIA H100 80GB HBM3", 80 * GiB, 132),
    "H200": ("NVIDIA H200", 141 * GiB, 132),
    "A10": ("NVIDIA A10", 24 * GiB, 72),
    "L4": ("NVIDIA L4", 24 * GiB, 58),
    "T4": ("Tesla T4", 15 * GiB, 40),
    "V100": ("Tesla V100-SXM2-32GB", 32 * GiB, 80),
}


class NoGpuError(GpushareError, RuntimeError):
    """This machine has no usable GPU (and no simulated GPUs were asked for)."""

    code = "no_gpu"
    status = 409


@dataclass(frozen=True)
class Gpu:
    """One GPU on one node."""

    node: str
    uuid: str
    index: int
    name: str
    type: str
    memory: int
    healthy: bool = True
    cordoned: bool = False
    simulated: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Gpu:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class TypeAliases:
    """Maps product names / node labels to user-facing type aliases (case-insensitive)."""

    def __init__(self, aliases: Mapping[str, Sequence[str]] | None = None) -> None:
        self.aliases = dict(aliases if aliases is not None else DEFAULT_TYPE_ALIASES)
        self._patterns = [
            (alias, re.compile(rf"(?<![A-Za-z0-9])(?:{p})(?![A-Za-z0-9])", re.IGNORECASE))
            for alias, patterns in self.aliases.items()
            for p in patterns
        ]

    def alias_for(self, product: str) -> str:
        """The alias of a product name; the product name itself when no alias matches."""
        for alias, pattern in self._patterns:
            if pattern.search(product):
                return alias
        return product

    def canonical(self, wanted: str) -> str | None:
        """The configured alias spelled as configured (``a100`` -> ``A100``), or None."""
        for alias in self.aliases:
            if alias.lower() == wanted.lower():
                return alias
        return None


def local_node_name() -> str:
    return os.environ.get("GPUSHARE_NODE_NAME") or socket.gethostname()


# -- simulated GPUs ------------------------------------------------------------------------------


def parse_simulate(text: str) -> list[tuple[int, str]]:
    """``"2xA100"`` -> ``[(2, "A100")]``; ``"1xA100,2xT4"`` and ``"3"`` (A100s) also work."""
    groups: list[tuple[int, str]] = []
    allowed = "N or NxTYPE (comma-separated), TYPE one of " + ", ".join(SIMULATED_PRODUCTS)
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*([A-Za-z0-9]+))?\s*", part)
        if not match:
            raise ShareError("simulate", text, allowed)
        count = int(match.group(1))
        kind = (match.group(2) or "A100").upper()
        if kind not in SIMULATED_PRODUCTS or not 1 <= count <= 64:
            raise ShareError("simulate", text, allowed + "; 1 to 64 GPUs")
        groups.append((count, kind))
    return groups


def simulated_gpus(text: str, node: str | None = None) -> list[Gpu]:
    """The simulated GPUs of a ``--simulate`` value, with stable UUIDs per node and index."""
    node = node or local_node_name()
    gpus: list[Gpu] = []
    for count, kind in parse_simulate(text):
        product, memory, _sms = SIMULATED_PRODUCTS[kind]
        for _ in range(count):
            index = len(gpus)
            ident = uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpushare-sim://{node}/{index}/{kind}")
            gpus.append(
                Gpu(
                    node=node,
                    uuid=f"GPU-{ident}",
                    index=index,
                    name=product,
                    type=kind,
                    memory=memory,
                    simulated=True,
                )
            )
    return gpus


def simulate_text(gpus: Iterable[Gpu]) -> str:
    """The ``--simulate`` value that :func:`simulated_gpus` reads back as ``gpus`` (counts per
    type, in index order): ``2xA100,1xT4``."""
    groups: list[tuple[int, str]] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        if groups and groups[-1][1] == gpu.type:
            groups[-1] = (groups[-1][0] + 1, gpu.type)
        else:
            groups.append((1, gpu.type))
    return ",".join(f"{n}x{t}" for n, t in groups)


def simulator_device_list(gpus: Iterable[Gpu]) -> str:
    """The ``GPUSHARE_SIM_DEVICES`` value the C simulator reads: ``name|uuid|bytes|sms;…``."""
    parts = []
    for gpu in gpus:
        sms = SIMULATED_PRODUCTS.get(gpu.type, ("", 0, 80))[2]
        parts.append(f"{gpu.name}|{gpu.uuid}|{gpu.memory}|{sms}")
    return ";".join(parts)


# -- NVML discovery ------------------------------------------------------------------------------

_nvml_lock = threading.Lock()


def _load_nvml(library: str | None) -> Any:
    import ctypes

    import pynvml

    if library is not None:
        pynvml.nvmlLib = ctypes.CDLL(library)
    return pynvml


def discover_nvml(
    aliases: TypeAliases, node: str | None = None, library: str | None = None
) -> list[Gpu]:
    """GPUs visible through NVML. Raises :class:`NoGpuError` when there is no driver or GPU."""
    node = node or local_node_name()
    with _nvml_lock:
        try:
            pynvml = _load_nvml(library)
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, OSError …
            raise NoGpuError(
                f"no NVIDIA GPU on this machine ({exc}); run with --simulate 2xA100 "
                "(or GPUSHARE_SIMULATE=2xA100) to use simulated GPUs"
            ) from exc
        try:
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = _text(pynvml.nvmlDeviceGetName(handle))
                gpus.append(
                    Gpu(
                        node=node,
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        index=index,
                        name=name,
                        type=aliases.alias_for(name),
                        memory=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                        healthy=_healthy(pynvml, handle),
                        simulated=library is not None,
                    )
                )
        finally:
            pynvml.nvmlShutdown()
            if library is not None:
                pynvml.nvmlLib = None
    if not gpus:
        raise NoGpuError("the NVIDIA driver is loaded but reports no GPU on this machine")
    return gpus


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _healthy(pynvml: Any, handle: Any) -> bool:
    """A GPU is unhealthy when NVML reports pending page retirement or a lost device."""
    try:
        pynvml.nvmlDeviceGetMemoryInfo(handle)
        pending = pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
        return not pending
    except pynvml.NVMLError_NotSupported:
        return True
    except pynvml.NVMLError:
        return False


def discover_local(
    simulate: str | None, aliases: TypeAliases | None = None, node: str | None = None
) -> list[Gpu]:
    """This machine's GPUs: simulated ones when ``simulate`` is set, else real ones via NVML."""
    aliases = aliases or TypeAliases()
    if simulate:
        gpus = simulated_gpus(simulate, node)
        # Apply the configured aliases to simulated product names too.
        return [
            replace(g, type=aliases.alias_for(g.name)) if aliases.canonical(g.type) is None else g
            for g in gpus
        ]
    return discover_nvml(aliases, node)


# -- validation of a spec against what exists ----------------------------------------------------


def check_spec(spec: ShareSpec, gpus: Sequence[Gpu], aliases: TypeAliases) -> ShareSpec:
    """Refuse a spec that no GPU of this inventory could ever hold; returns it with the type
    alias spelled canonically. Capacity *now* is placement's question, not this one's."""
    if not gpus:
        raise ShareError("gpu_type", spec.gpu_type, "there are no GPUs in the inventory")
    known = sorted({g.type for g in gpus})
    candidates = list(gpus)
    if spec.gpu_type is not None:
        wanted = aliases.canonical(spec.gpu_type) or next(
            (t for t in known if t.lower() == spec.gpu_type.lower()), None
        )
        if wanted is None or wanted not in known:
            raise ShareError("gpu_type", spec.gpu_type, "one of " + ", ".join(known))
        spec = spec.with_changes(gpu_type=wanted)
        candidates = [g for g in gpus if g.type == wanted]
    if spec.gpu_count > 1:
        by_node: dict[str, int] = {}
        for g in candidates:
            by_node[g.node] = by_node.get(g.node, 0) + 1
        most = max(by_node.values())
        if spec.gpu_count > most:
            raise ShareError(
                "gpu_count", spec.gpu_count, f"at most {most} (GPUs of that type on one node)"
            )
    if spec.gpu_memory is not None:
        largest = max(g.memory for g in candidates)
        if spec.gpu_memory > largest:
            kind = spec.gpu_type or "GPU"
            raise ShareError(
                "gpu_memory",
                format_bytes(spec.gpu_memory),
                f"at most {format_bytes(largest)} (the memory of the largest {kind} here)",
            )
    return spec
