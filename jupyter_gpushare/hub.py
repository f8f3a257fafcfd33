"""JupyterHub side of box 10: a KubeSpawner ``profile_list`` with a real GPU form.

In ``jupyterhub_config.py`` (or z2jh ``hub.extraConfig``, see ``deploy/z2jh/values.yaml``)::

    from jupyter_gpushare.hub import GpuProfiles
    gpu = GpuProfiles(config=c)
    c.KubeSpawner.profile_list = gpu.profile_list          # a callable: built per request
    c.KubeSpawner.options_from_form = gpu.options_from_form  # refuses bad custom values

The list is rebuilt each time the form is shown and again when the server starts, so the GPU
types and their free capacity come from the live inventory (the gpushare ledger: GPUs published
by the node daemons and the allocations held now) and from the admin's config. The inventory is
read at most once per ``GpuProfiles.inventory_ttl`` seconds (default 5) for all users of the
Hub (:class:`OffersCache`), so the free capacity shown is at most that old. The GPU profile
offers a GPU type, a share (request, limit) and a memory cap, each with a custom value allowed;
the user's pick becomes the default share *and* the upper bound of the kernels in their server,
passed to the single-user server as environment variables:

- ``GPUSHARE_DEFAULT_SHARE``: JSON share (``gpu_request``, ``gpu_limit``, ``gpu_memory``,
  ``gpu_type``) that kernels get when they ask for nothing;
- ``GPUSHARE_MAX_SHARE``: the same JSON, the most a kernel of this server may ask for.

CPU-only profiles clear every GPU setting explicitly (KubeSpawner *merges* dict overrides into a
spawner object that lives across server restarts, so a GPU choice would otherwise leak into the
next CPU-only start): the GPUSHARE variables are removed, ``GPUSHARE_DISABLED=1``,
``NVIDIA_VISIBLE_DEVICES=void`` (no GPU even in CUDA images that default to ``all``), and the
GPU resource limit and product node selector are dropped.

Two modes (``GpuProfiles.mode``): ``kernel-pods`` (default) — the user's server pod holds no GPU;
gpushare starts each kernel in a pod of its own on a GPU node (the Kubernetes backend).
``server-gpu`` — the user's pod gets one whole GPU of the chosen type (``nvidia.com/gpu: 1``
and a ``nvidia.com/gpu.product`` node selector) and gpushare shares it among that user's kernels.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from traitlets import Any as AnyTrait
from traitlets import Dict, Enum, Float, List, Unicode
from traitlets.config import LoggingConfigurable

from .bound import ENV_DEFAULT, ENV_MAX, apply_user_bound, share_from_environment
from .errors import GpushareError
from .inventory import Gpu, TypeAliases
from .k8s.manifests import LABEL_OWNER, owner_label
from .ledger import Allocation, Ledger
from .share import (
    MEMORY_PATTERN,
    SHARE_PATTERN,
    TYPE_PATTERN,
    ShareError,
    ShareSpec,
    format_bytes,
    parse_memory,
    share_from_text,
    share_text,
)

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
ENV_DISABLED = "GPUSHARE_DISABLED"

#: Option names in the form (and in ``user_options``).
OPT_TYPE, OPT_SHARE, OPT_MEMORY = "gpu_type", "gpu_share", "gpu_memory"
ANY_TYPE, AUTO_MEMORY = "any", "auto"
# The custom values' grammar (checked in the browser, then again on the server) is share.py's:
# SHARE_PATTERN / share_from_text, MEMORY_PATTERN / parse_memory, TYPE_PATTERN.


class GpuOptionError(GpushareError, ValueError):
    """A GPU choice that cannot be accepted; the message is shown on the spawn form."""

    code = "invalid_share"
    status = 400


@dataclass(frozen=True)
class TypeOffer:
    """One GPU type as offered in the form: how many, how big, how much is free now."""

    type: str
    products: tuple[str, ...]
    count: int
    memory: int
    most_free_request: float
    most_free_memory: int

    def label(self) -> str:
        free = (
            "full now"
            if self.most_free_request <= 0
            else f"up to {self.most_free_request:g} of a GPU free now"
        )
        plural = "s" if self.count != 1 else ""
        return f"{self.type} ({format_bytes(self.memory)}) — {self.count} GPU{plural}, {free}"


def offers_from(gpus: Sequence[Gpu], allocations: Sequence[Allocation]) -> list[TypeOffer]:
    """Per-type offers from an inventory and the allocations held on it (healthy GPUs only)."""
    held_request: dict[str, float] = defaultdict(float)
    held_memory: dict[str, int] = defaultdict(int)
    for a in allocations:
        for uuid in a.gpus:
            held_request[uuid] += a.spec.gpu_request
            held_memory[uuid] += a.memory
    by_type: dict[str, list[Gpu]] = defaultdict(list)
    for g in gpus:
        if g.healthy and not g.cordoned:
            by_type[g.type].append(g)
    return [
        TypeOffer(
            type=kind,
            products=tuple(sorted({g.name for g in items})),
            count=len(items),
            memory=max(g.memory for g in items),
            most_free_request=round(max(max(0.0, 1 - held_request[g.uuid]) for g in items), 4),
            most_free_memory=max(max(0, g.memory - held_memory[g.uuid]) for g in items),
        )
        for kind, items in sorted(by_type.items())
    ]


def ledger_inventory(ledger: Ledger) -> Callable[[Any], Awaitable[list[TypeOffer]]]:
    """An inventory callable over any gpushare ledger (SQLite on one machine, the Kubernetes
    ``GpuLedger`` objects in a cluster)."""

    async def inventory(spawner: Any) -> list[TypeOffer]:
        snap = await ledger.snapshot()
        return offers_from(await ledger.gpus(), snap.allocations)

    return inventory


async def kubernetes_inventory(spawner: Any) -> list[TypeOffer]:
    """The default inventory: the cluster's gpushare ledger in the spawner's namespace."""
    from .k8s.ledger import cluster_ledger  # lazy on purpose: only this default needs a cluster

    async with cluster_ledger(spawner.namespace) as ledger:
        return await ledger_inventory(ledger)(spawner)


class OffersCache:
    """The offers of one Hub, read at most once per ``ttl`` seconds per key and shared by every
    spawner of that Hub. JupyterHub's config deep-copies ``gpu.profile_list`` (and with it the
    :class:`GpuProfiles`) into each spawner; a deep copy of this cache is the cache itself, so
    the copies share it.

    Why an in-process cache and not the controller's ``GET /api/gpus``: the controller
    authenticates each request as a JupyterHub *user* (their API token) and is not always
    deployed (the Hub also serves single-machine spawners); asking it would give the Hub a
    service token, a chart change and a dependency on the controller being up to render a form.
    A short TTL in the Hub turns ~5,000 users opening the form into at most one inventory read
    (a LIST of Nodes and one of GpuLedgers) per namespace per ``ttl``, and the free capacity on
    the form is at most ``ttl`` (plus one read) old; placement checks the real capacity when a
    kernel starts either way.

    Concurrent opens while nothing fresh is kept share one read in flight (one open being
    cancelled does not cancel it); a failed read is not kept (every open waiting on it gets the
    error, the next open reads again). ``clock`` is the time source (seconds, monotonic).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._kept: dict[Any, tuple[float, list[TypeOffer]]] = {}
        self._reading: dict[Any, asyncio.Future[list[TypeOffer]]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> OffersCache:
        return self  # shared by every copy of its GpuProfiles (see above)

    def __copy__(self) -> OffersCache:
        return self

    async def get(
        self, key: Any, ttl: float, read: Callable[[], Awaitable[list[TypeOffer]]]
    ) -> list[TypeOffer]:
        """The offers for ``key`` read less than ``ttl`` seconds ago, else from ``read()``."""
        kept = self._kept.get(key)
        if kept is not None and self.clock() - kept[0] < ttl:
            return list(kept[1])
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._read(key, ttl, read))
            reading.add_done_callback(_retrieved)
            self._reading[key] = reading
        # shielded: one user closing the page does not cancel the read the others wait on
        return list(await asyncio.shield(reading))

    async def _read(
        self, key: Any, ttl: float, read: Callable[[], Awaitable[list[TypeOffer]]]
    ) -> list[TypeOffer]:
        started = self.clock()
        try:
            offers = list(await read())
        finally:
            self._reading.pop(key, None)
        now = self.clock()
        self._kept = {k: v for k, v in self._kept.items() if now - v[0] < ttl}
        self._kept[key] = (started, offers)  # kept only when the read succeeded
        return offers


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Marks a shared read's error as seen (every open waiting on it may have gone)."""
    if not future.cancelled():
        future.exception()


# -- parsing the user's choices (pure) ----------------------------------------------------------


def share_from_options(
    options: Mapping[str, Any],
    offers: Sequence[TypeOffer] | None = None,
    max_request: float = 1.0,
    max_memory: int | None = None,
) -> ShareSpec:
    """The share a user picked, from KubeSpawner ``user_options`` (choices or custom values).

    With ``offers`` the type must be one on offer and the memory must fit that type's GPU.
    Raises :class:`GpuOptionError` naming the field, the value and what is allowed.
    """
    gpu_type = _picked(options, OPT_TYPE) or ANY_TYPE
    share = _picked(options, OPT_SHARE) or ""
    memory = _picked(options, OPT_MEMORY) or AUTO_MEMORY
    data: dict[str, Any] = {"gpu_type": gpu_type, **share_from_text(share)}
    if memory != AUTO_MEMORY:
        data["gpu_memory"] = memory
    try:
        spec = ShareSpec.from_mapping(data)
    except ShareError as exc:
        raise GpuOptionError(f"GPU share refused: {exc}") from None
    if spec.gpu_limit > max_request:
        raise GpuOptionError(
            f"GPU share refused: gpu_limit={spec.gpu_limit:g} is not allowed: at most "
            f"{max_request:g} of a GPU per user on this hub"
        )
    if max_memory is not None and spec.gpu_memory is not None and spec.gpu_memory > max_memory:
        raise GpuOptionError(
            f"GPU share refused: gpu_memory={format_bytes(spec.gpu_memory)} is not allowed: at "
            f"most {format_bytes(max_memory)} per user on this hub"
        )
    if offers is not None:
        _check_against(spec, offers)
    return spec


def _picked(options: Mapping[str, Any], name: str) -> str | None:
    custom = options.get(f"{name}--unlisted-choice")
    value = custom if custom not in (None, "") else options.get(name)
    return None if value is None else str(value)


def _check_against(spec: ShareSpec, offers: Sequence[TypeOffer]) -> None:
    if not offers:
        raise GpuOptionError("GPU share refused: this hub has no GPUs available right now")
    if spec.gpu_type is None:
        candidates = list(offers)
    else:
        candidates = [o for o in offers if o.type.lower() == spec.gpu_type.lower()]
        if not candidates:
            names = ", ".join(o.type for o in offers)
            raise GpuOptionError(
                f"GPU share refused: gpu_type={spec.gpu_type!r} is not allowed: one of {names} "
                "or any"
            )
    biggest = max(o.memory for o in candidates)
    if spec.gpu_memory is not None and spec.gpu_memory > biggest:
        raise GpuOptionError(
            f"GPU share refused: gpu_memory={format_bytes(spec.gpu_memory)} is not allowed: at "
            f"most {format_bytes(biggest)} (the largest {spec.gpu_type or 'GPU'})"
        )


def owner_labels(spawner: Any) -> dict[str, str]:
    """The label naming the Hub user on their server's pod (``gpushare.jupyter.org/owner``, as
    the controller puts it on their kernel pods): the controller's per-user NetworkPolicy lets
    pods with it into that user's kernels only. Set here, in the Hub, because users cannot
    change their own pod's labels (they hold no Kubernetes rights); every profile of
    :class:`GpuProfiles` sets it. Without GpuProfiles: ``c.KubeSpawner.modify_pod_hook =
    jupyter_gpushare.hub.label_owner``."""
    return {LABEL_OWNER: owner_label(spawner.user.name)}


def label_owner(spawner: Any, pod: Any) -> Any:
    """A KubeSpawner ``modify_pod_hook`` that adds :func:`owner_labels` to the pod."""
    pod.metadata.labels = {**(pod.metadata.labels or {}), **owner_labels(spawner)}
    return pod


def share_environment(spec: ShareSpec) -> dict[str, str | None]:
    """The single-user server's environment for a GPU profile (None removes a variable)."""
    data = spec.to_json()
    data.pop("gpu_count", None)
    text = json.dumps(data, sort_keys=True)
    return {ENV_DEFAULT: text, ENV_MAX: text, ENV_DISABLED: None}


#: What a CPU-only profile applies, whatever was applied before (dict overrides merge).
CPU_ONLY_ENVIRONMENT: dict[str, str | None] = {
    ENV_DEFAULT: None,
    ENV_MAX: None,
    ENV_DISABLED: "1",
    "NVIDIA_VISIBLE_DEVICES": "void",
}


# -- the configurable ------------------------------------------------------------------------


class GpuProfiles(LoggingConfigurable):
    """Builds KubeSpawner's ``profile_list`` with GPU options from live inventory and config."""

    mode = Enum(
        ["kernel-pods", "server-gpu"],
        default_value="kernel-pods",
        config=True,
        help="'kernel-pods': the user's server holds no GPU; each gpushare kernel runs in a pod "
        "of its own on a GPU node. 'server-gpu': the user's server pod gets one whole GPU of the "
        "chosen type and gpushare shares it among that user's kernels.",
    )
    inventory = AnyTrait(
        default_value=None,
        allow_none=True,
        config=True,
        help="Callable(spawner) -> list of TypeOffer (may be async) giving the GPU types with "
        "their free capacity now. Default: the gpushare ledger in the spawner's namespace "
        "(jupyter_gpushare.hub.kubernetes_inventory); jupyter_gpushare.hub.ledger_inventory "
        "wraps any ledger.",
    )
    inventory_ttl = Float(
        5.0,
        min=0.0,
        config=True,
        help="Seconds the GPU offers read from the inventory are reused for every spawn form "
        "this Hub shows (one read per namespace per period instead of one per open: with the "
        "default inventory each read LISTs Nodes and GpuLedgers). Opens while a read is under "
        "way share it; a failed read is not kept. The free capacity shown is at most this "
        "old. 0: read on every open.",
    )
    offered_types = List(
        Unicode(),
        default_value=[],
        config=True,
        help="GPU types offered in the form (aliases such as A100, T4); empty: every type in "
        "the inventory.",
    )
    shares = List(
        Dict(),
        default_value=[
            {"gpu_request": 0.25, "gpu_limit": 0.5},
            {"gpu_request": 0.5, "gpu_limit": 1.0},
            {"gpu_request": 1.0, "gpu_limit": 1.0},
        ],
        config=True,
        help="The share choices: objects with gpu_request and gpu_limit (fractions of one GPU). "
        "The first is the default.",
    )
    memory_choices = List(
        Unicode(),
        default_value=["auto", "8GiB", "16GiB", "32GiB"],
        config=True,
        help="Memory cap choices per GPU; 'auto' = the request's fraction of the GPU's memory.",
    )
    allow_custom = List(
        Enum([OPT_TYPE, OPT_SHARE, OPT_MEMORY]),
        default_value=[OPT_SHARE, OPT_MEMORY],
        config=True,
        help="Options that accept a custom (unlisted) value; custom values are validated as "
        "the gpushare server validates shares.",
    )
    max_request = Float(
        1.0, config=True, help="The largest gpu_limit a user may choose (custom values too)."
    )
    max_memory = Unicode(
        "", config=True, help="The largest memory cap a user may choose, e.g. 40GiB; empty: any."
    )
    gpu_profile = Dict(
        default_value={
            "display_name": "GPU share",
            "slug": "gpu",
            "description": "Python kernels on a fraction of a GPU: pick the type, the share and "
            "the memory; each kernel gets at most this.",
            "default": True,
        },
        config=True,
        help="The GPU profile's display_name, slug, description and any extra "
        "kubespawner_override (image, cpu/mem guarantees).",
    )
    cpu_profiles = List(
        Dict(),
        default_value=[
            {"display_name": "CPU only", "slug": "cpu", "description": "No GPU."},
        ],
        config=True,
        help="Profiles without a GPU (display_name, slug, description, kubespawner_override); "
        "GPU settings are cleared in each.",
    )
    type_aliases = Dict(
        default_value={},
        config=True,
        help="Alias -> patterns for GPU product names (as GpuShare.type_aliases); empty: the "
        "built-in aliases.",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: the offers read from the inventory, shared by every spawner of this Hub
        self.offers_cache = OffersCache()

    # -- the two callables KubeSpawner is given -------------------------------------------------

    async def profile_list(self, spawner: Any) -> list[dict[str, Any]]:
        """KubeSpawner ``profile_list`` callable: the GPU profile with live choices, then the
        CPU-only profiles."""
        try:
            offers = await self.offers(spawner)
            problem = ""
        except Exception as exc:  # the CPU-only profiles must stay usable
            self.log.warning("gpushare: GPU inventory unavailable: %s", exc)
            offers, problem = [], f"GPU inventory unavailable ({exc})."
        profiles = [self._gpu_profile(offers, problem)]
        profiles.extend(self._cpu_profile(p) for p in self.cpu_profiles)
        return profiles

    def options_from_form(self, formdata: Mapping[str, list[str]], spawner: Any) -> dict[str, Any]:
        """KubeSpawner's form parsing, then the GPU values checked; a refusal is shown on the
        form with its reason (JupyterHub re-renders the form with the exception's message)."""
        options: dict[str, Any] = spawner._options_from_form(formdata)
        if options.get("profile") == self.gpu_profile.get("slug", "gpu"):
            share_from_options(options, None, self.max_request, self._max_memory())
        return options

    # -- building blocks ----------------------------------------------------------------------

    async def offers(self, spawner: Any) -> list[TypeOffer]:
        """The offers for ``spawner``'s form, through this Hub's :class:`OffersCache` (keyed by
        the spawner's namespace, which is what the default inventory reads)."""
        source = self.inventory or kubernetes_inventory

        async def read() -> list[TypeOffer]:
            found = source(spawner)
            if inspect.isawaitable(found):
                found = await found
            return list(found)

        namespace = getattr(spawner, "namespace", None)
        offers = await self.offers_cache.get(namespace, self.inventory_ttl, read)
        aliases = TypeAliases(self.type_aliases or None)
        if self.offered_types:
            wanted = {(aliases.canonical(t) or t).lower() for t in self.offered_types}
            offers = [o for o in offers if o.type.lower() in wanted]
        return offers

    def _max_memory(self) -> int | None:
        return parse_memory(self.max_memory, "max_memory") if self.max_memory else None

    def _gpu_profile(self, offers: Sequence[TypeOffer], problem: str = "") -> dict[str, Any]:
        profile: dict[str, Any] = dict(self.gpu_profile)
        profile.setdefault("slug", "gpu")
        override = dict(profile.pop("kubespawner_override", {}) or {})
        settings = _Settings(list(offers), self.max_request, self._max_memory(), self.mode)
        # Callables run when the server starts, with the user's options and this list's
        # offers; they are plain functions (KubeSpawner deep-copies the list).
        override["environment"] = _merged(override.get("environment"), _environment_for(settings))
        override["extra_labels"] = _merged(override.get("extra_labels"), owner_labels)
        if self.mode == "server-gpu":
            override["extra_resource_limits"] = _resource_limits
            override["node_selector"] = _node_selector_for(settings)
        profile["kubespawner_override"] = override
        profile["profile_options"] = {
            OPT_TYPE: self._type_option(offers),
            OPT_SHARE: self._share_option(),
            OPT_MEMORY: self._memory_option(),
        }
        if not offers:
            note = problem or "No GPU is available right now."
            profile["description"] = f"{profile.get('description', '')} {note}".strip()
        return profile

    def _type_option(self, offers: Sequence[TypeOffer]) -> dict[str, Any]:
        choices: dict[str, Any] = {
            ANY_TYPE: {"display_name": "Any type (wherever the share fits)", "default": True}
        }
        for offer in offers:
            choices[offer.type] = {"display_name": offer.label()}
        option: dict[str, Any] = {"display_name": "GPU type", "choices": choices}
        if OPT_TYPE in self.allow_custom:
            option["unlisted_choice"] = {
                "enabled": True,
                "display_name": "Other GPU type",
                "validation_regex": TYPE_PATTERN,
                "validation_message": "A GPU type name such as A100, H100 or T4",
            }
        return option

    def _share_option(self) -> dict[str, Any]:
        choices: dict[str, Any] = {}
        offered = [ShareSpec.from_mapping(share) for share in self.shares]
        for i, spec in enumerate(s for s in offered if s.gpu_limit <= self.max_request):
            key = share_text(spec)
            label = (
                f"{spec.gpu_request:g} of a GPU"
                if spec.gpu_request == spec.gpu_limit
                else f"{spec.gpu_request:g} of a GPU guaranteed, bursts to {spec.gpu_limit:g}"
            )
            choices[key] = {"display_name": label, "default": i == 0}
        option: dict[str, Any] = {"display_name": "Share per kernel", "choices": choices}
        if OPT_SHARE in self.allow_custom:
            option["unlisted_choice"] = {
                "enabled": True,
                "display_name": "Custom share: REQUEST or REQUEST-LIMIT, e.g. 0.3-0.6",
                "validation_regex": SHARE_PATTERN,
                "validation_message": "A fraction of one GPU in steps of 0.01, or two: "
                "request-limit (0.3-0.6)",
            }
        return option

    def _memory_option(self) -> dict[str, Any]:
        choices: dict[str, Any] = {}
        for i, value in enumerate(self.memory_choices):
            label = (
                "Auto (the share's fraction of the GPU's memory)"
                if value == AUTO_MEMORY
                else f"{value} of GPU memory"
            )
            choices[value] = {"display_name": label, "default": i == 0}
        option: dict[str, Any] = {"display_name": "GPU memory per kernel", "choices": choices}
        if OPT_MEMORY in self.allow_custom:
            option["unlisted_choice"] = {
                "enabled": True,
                "display_name": "Custom memory, e.g. 12GiB",
                "validation_regex": MEMORY_PATTERN,
                "validation_message": "A size such as 12GiB, 512MiB or 20G",
            }
        return option

    def _cpu_profile(self, given: Mapping[str, Any]) -> dict[str, Any]:
        profile = {k: v for k, v in given.items() if k != "profile_options"}
        override = dict(profile.get("kubespawner_override") or {})
        override["environment"] = _merged(override.get("environment"), CPU_ONLY_ENVIRONMENT)
        override["extra_labels"] = _merged(override.get("extra_labels"), owner_labels)
        override["extra_resource_limits"] = {
            **(override.get("extra_resource_limits") or {}),
            GPU_RESOURCE: None,
        }
        override["extra_resource_guarantees"] = {
            **(override.get("extra_resource_guarantees") or {}),
            GPU_RESOURCE: None,
        }
        override["node_selector"] = {**(override.get("node_selector") or {}), PRODUCT_LABEL: None}
        profile["kubespawner_override"] = override
        return profile


@dataclass(frozen=True)
class _Settings:
    """What the start-time callables of one rendered profile list check against."""

    offers: list[TypeOffer]
    max_request: float
    max_memory: int | None
    mode: str


def _spec_of(spawner: Any, settings: _Settings) -> ShareSpec:
    return share_from_options(
        spawner.user_options or {}, settings.offers, settings.max_request, settings.max_memory
    )


def _environment_for(settings: _Settings) -> Callable[[Any], dict[str, str | None]]:
    def environment(spawner: Any) -> dict[str, str | None]:
        env = share_environment(_spec_of(spawner, settings))
        # Only a server-gpu pod sees its GPU; in kernel-pods mode the GPU is the kernels'.
        env["NVIDIA_VISIBLE_DEVICES"] = None if settings.mode == "server-gpu" else "void"
        # KubeSpawner expands {...} templates in these values (str.format, in get_env): the
        # JSON's braces are doubled so that the server gets the JSON as written (undoubled,
        # every GPU server's start failed with KeyError '"gpu_limit"')
        return {k: None if v is None else _template_literal(v) for k, v in env.items()}

    return environment


def _template_literal(text: str) -> str:
    """``text`` as a KubeSpawner template that expands to ``text``."""
    return text.replace("{", "{{").replace("}", "}}")


def _resource_limits(spawner: Any) -> dict[str, str]:
    return {GPU_RESOURCE: "1"}


def _node_selector_for(settings: _Settings) -> Callable[[Any], dict[str, str | None]]:
    def node_selector(spawner: Any) -> dict[str, str | None]:
        spec = _spec_of(spawner, settings)
        wanted = (spec.gpu_type or "").lower()
        products = [p for o in settings.offers if o.type.lower() == wanted for p in o.products]
        # One product label value can be selected; several products of one alias: any GPU.
        return {PRODUCT_LABEL: products[0] if len(products) == 1 else None}

    return node_selector


def _merged(given: Any, ours: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]) -> Any:
    """An admin's override dict (or callable) combined with ours; ours wins."""
    if not given:
        return ours
    if not callable(given) and not callable(ours):
        return {**given, **ours}

    def combined(spawner: Any) -> dict[str, Any]:
        first = given(spawner) if callable(given) else given
        second = ours(spawner) if callable(ours) else ours
        return {**first, **second}

    return combined


__all__ = [
    "ENV_DEFAULT",
    "ENV_MAX",
    "GpuOptionError",
    "GpuProfiles",
    "OffersCache",
    "TypeOffer",
    "apply_user_bound",
    "kubernetes_inventory",
    "label_owner",
    "ledger_inventory",
    "offers_from",
    "owner_labels",
    "share_environment",
    "share_from_environment",
    "share_from_options",
]
