"""Placement policy: how to choose among the GPUs a share fits on, and which GPUs may be chosen.

A :class:`Policy` is plain, frozen data. A deployment configures one (see :mod:`.config`); a
request may narrow it (the server builds a per-request policy with :meth:`Policy.narrowed`). The
share itself carries the rest of the request: ``spec.gpu_type`` (one wanted type) and
``spec.gpu_labels`` (affinity / anti-affinity / exclusive).

Type names match case-insensitively, by alias (``a100`` -> ``A100``) or through the configured
:class:`~jupyter_gpushare.inventory.TypeAliases` (so an NVML product name or a
``nvidia.com/gpu.product`` label such as ``NVIDIA-A100-SXM4-80GB`` selects ``A100``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..inventory import TypeAliases
from ..share import ShareError, ShareSpec
from .orders import BINPACK, Order, order_named

_DEFAULT_ALIASES = TypeAliases()


@dataclass(frozen=True)
class Policy:
    """How placement chooses, for one deployment or one request.

    ``node`` / ``gpu``: the name of the :class:`~.orders.Order` that ranks nodes / GPUs
    (``binpack`` fills the fullest that still fits, keeping whole nodes and GPUs free for big
    requests; ``spread`` picks the emptiest, least interference; :data:`~.orders.ORDERS` has
    them all).
    ``gpu_types``: the types that may be used (any of them; empty = all). ``exclude_types``: types
    never used. ``cordoned_nodes`` / ``cordoned_gpus`` (node names / GPU UUIDs): kept out of new
    placements, running shares untouched (on top of ``Gpu.cordoned``). ``aliases``: how type
    names given by users resolve (default: the inventory's ``DEFAULT_TYPE_ALIASES``).
    """

    node: str = BINPACK.name
    gpu: str = BINPACK.name
    gpu_types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    cordoned_nodes: frozenset[str] = frozenset()
    cordoned_gpus: frozenset[str] = frozenset()
    aliases: TypeAliases | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        order_named(self.node, "policy.node")
        order_named(self.gpu, "policy.gpu")
        # Accept any iterable (lists from config / JSON) but store hashable, frozen values.
        object.__setattr__(self, "gpu_types", _names(self.gpu_types, "policy.gpu_types"))
        object.__setattr__(self, "exclude_types", _names(self.exclude_types, "exclude_types"))
        object.__setattr__(self, "cordoned_nodes", frozenset(self.cordoned_nodes))
        object.__setattr__(self, "cordoned_gpus", frozenset(self.cordoned_gpus))

    @property
    def node_order(self) -> Order:
        return order_named(self.node, "policy.node")

    @property
    def gpu_order(self) -> Order:
        return order_named(self.gpu, "policy.gpu")

    @property
    def type_aliases(self) -> TypeAliases:
        return self.aliases if self.aliases is not None else _DEFAULT_ALIASES

    def narrowed(self, **changes: Any) -> Policy:
        """A per-request policy: this one with ``changes``; ``gpu_types`` and ``exclude_types``
        given here are combined with the deployment's (wanted: both must allow; excluded: either
        excludes) rather than replacing them."""
        wanted = changes.pop("gpu_types", None)
        excluded = changes.pop("exclude_types", None)
        policy = replace(self, **changes)
        if excluded:
            added = _names(excluded, "exclude_types")
            policy = replace(policy, exclude_types=(*self.exclude_types, *added))
        if wanted:
            wanted = _names(wanted, "gpu_types")
            if self.gpu_types:
                allowed = {_fold(t) for t in self.gpu_types}
                kept = tuple(t for t in wanted if _fold(t) in allowed)
                if not kept:
                    raise ShareError(
                        "gpu_type", ",".join(wanted), "one of " + ", ".join(self.gpu_types)
                    )
                wanted = kept
            policy = replace(policy, gpu_types=wanted)
        return policy

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpu": self.gpu,
            "gpu_types": list(self.gpu_types),
            "exclude_types": list(self.exclude_types),
            "cordoned_nodes": sorted(self.cordoned_nodes),
            "cordoned_gpus": sorted(self.cordoned_gpus),
        }


def _fold(name: str) -> str:
    return name.strip().lower()


def _names(value: Iterable[str] | str, field_name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    names = []
    for name in value:
        if not isinstance(name, str) or not name.strip():
            raise ShareError(field_name, name, "GPU type names such as A100, H100 or T4")
        names.append(name.strip())
    return tuple(dict.fromkeys(names))


#: What a type filter looks at: a GPU's (type alias, product name).
Kind = tuple[str, str]


@dataclass(frozen=True)
class TypeFilter:
    """The GPU kinds (type alias, product name) one request may use, resolved against the kinds
    an inventory has.

    ``allowed`` is None when every (non-excluded) kind is allowed. ``label`` is the user-facing
    name of what was asked for (``A100``, ``A100 or H100``, ``GPU``)."""

    allowed: frozenset[Kind] | None
    excluded: frozenset[Kind]
    label: str

    def admits(self, kind: Kind) -> bool:
        if kind in self.excluded:
            return False
        return self.allowed is None or kind in self.allowed


def resolve_types(spec: ShareSpec, policy: Policy, known: Iterable[Kind]) -> TypeFilter:
    """Resolve the wanted and excluded type names of ``spec`` + ``policy`` against ``known``
    (the kinds present in the inventory). Raises :class:`ShareError` for a type that does not
    exist or for a request whose every wanted type is excluded."""
    kinds = sorted(set(known))
    types = sorted({t for t, _ in kinds})
    aliases = policy.type_aliases
    excluded: set[Kind] = set()
    for name in policy.exclude_types:
        matched = _match(name, kinds, aliases)
        if not matched and aliases.canonical(name) is None:
            raise ShareError("exclude_types", name, "GPU types such as " + _listing(types))
        excluded |= matched
    wanted: set[Kind] | None = None
    names: list[str] = []
    for source, group in (("policy.gpu_types", policy.gpu_types), ("gpu_type", _spec_types(spec))):
        if not group:
            continue
        matched = set()
        for name in group:
            found = _match(name, kinds, aliases)
            if not found and source == "policy.gpu_types" and aliases.canonical(name):
                continue  # a deployment may list a known type that this cluster lacks
            if not found:
                raise ShareError(source, name, "one of " + _listing(types))
            matched |= found
        wanted = matched if wanted is None else wanted & matched
        names = [_spelled(name, found, aliases) for name in group]
    if wanted is not None and not wanted:
        raise ShareError(
            "gpu_type",
            spec.gpu_type,
            "one of the deployment's types: " + ", ".join(policy.gpu_types),
        )
    if wanted is not None and not wanted - excluded:
        raise ShareError(
            "gpu_type",
            spec.gpu_type or ",".join(names),
            "a type that is not excluded (excluded: " + ", ".join(policy.exclude_types) + ")",
        )
    if wanted is None:
        return TypeFilter(None, frozenset(excluded), "GPU")
    label = " or ".join(dict.fromkeys(names))
    return TypeFilter(frozenset(wanted - excluded), frozenset(excluded), label)


def _spec_types(spec: ShareSpec) -> tuple[str, ...]:
    return (spec.gpu_type,) if spec.gpu_type else ()


def _match(name: str, kinds: list[Kind], aliases: TypeAliases) -> set[Kind]:
    """The kinds ``name`` designates, ignoring case: the type alias itself, the product name,
    the alias the configured map gives ``name`` (read as a product name or a
    ``nvidia.com/gpu.product`` label), or the alias the map gives the product name."""
    folded = _fold(name)
    via_alias = _fold(aliases.alias_for(name))
    return {
        (t, n)
        for t, n in kinds
        if _fold(t) in (folded, via_alias)
        or _fold(n) == folded
        or _fold(aliases.alias_for(n)) == folded
    }


def _spelled(name: str, found: set[Kind], aliases: TypeAliases) -> str:
    """How to write a wanted name back to the user: the configured alias, else the type."""
    canonical = aliases.canonical(name)
    if canonical is not None:
        return canonical
    types = sorted({t for t, _ in found})
    return types[0] if len(types) == 1 else name


def _listing(types: Iterable[str]) -> str:
    types = sorted(types)
    return ", ".join(types) if types else "(none)"
