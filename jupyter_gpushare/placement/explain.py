"""Refusals that explain themselves: why nothing fits now, in user terms, and what would.

Only reached when a placement failed, so it may scan the whole inventory. The message names the
first constraint that rules every GPU out (health and cordons, compute, memory, locality labels)
and ends with what would fit now, for example::

    no A100 has 0.5 free (4 A100s, most free 0.25); 0.25 on A100 or 0.5 on T4 would fit
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..inventory import GiB
from ..share import GpuLabels, ShareError, ShareSpec, format_bytes
from .policy import Policy, TypeFilter, resolve_types
from .state import MAX_SHARES_PER_GPU, UNITS, GpuState, PlacementRefused, from_units, to_units

if TYPE_CHECKING:
    from .engine import Placer

#: How many alternatives a refusal lists at most.
MAX_SUGGESTIONS = 4


def refusal(placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter) -> PlacementRefused:
    if spec.gpu_count > 1:
        reason = _whole_reason(placer, spec, policy, types)
        suggestions = _whole_suggestions(placer, spec, policy, types)
    else:
        reason = _share_reason(placer, spec, policy, types)
        suggestions = _share_suggestions(placer, spec, policy, types)
    suggestions = suggestions[:MAX_SUGGESTIONS]
    if suggestions:
        message = f"{reason}; {' or '.join(suggestions)} would fit"
    else:
        message = f"{reason}; nothing else fits now either"
    return PlacementRefused(message, suggestions)


# -- fractional shares ---------------------------------------------------------------------------


def _open(g: GpuState, policy: Policy) -> bool:
    return g.usable and g.uuid not in policy.cordoned_gpus and g.node not in policy.cordoned_nodes


def _share_reason(placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter) -> str:
    anchor = placer.anchor(spec.gpu_labels.affinity)
    if anchor is not None:
        return _affinity_reason(placer, spec, policy, types, anchor)
    what = types.label
    pool = [g for g in placer.gpus.values() if types.admits(g.kind)]
    request = to_units(spec.gpu_request)
    wanted = _fmt(spec.gpu_request)
    open_ = [g for g in pool if _open(g, policy)]
    if not open_:
        return f"no {what} takes new shares ({_census(pool, policy, what)})"
    by_compute = [g for g in open_ if g.free >= request]
    if not by_compute:
        most = max(g.free for g in open_)
        return (
            f"no {what} has {wanted} free ({_census(pool, policy, what)}, most free "
            f"{_fmt(from_units(max(most, 0)))})"
        )
    by_count = [g for g in by_compute if len(g.holders) < MAX_SHARES_PER_GPU]
    if not by_count:
        return (
            f"every {what} with {wanted} free already holds {MAX_SHARES_PER_GPU} shares, the "
            f"most one GPU holds ({_plural(len(by_compute), what)} with {wanted} free)"
        )
    by_memory = [g for g in by_count if g.mem_free >= spec.resolved_memory(g.gpu.memory)]
    if not by_memory:
        needs = {spec.resolved_memory(g.gpu.memory) for g in by_compute}
        need = format_bytes(needs.pop()) if len(needs) == 1 else "its share of"
        most_mem = max(g.mem_free for g in by_compute)
        return (
            f"no {what} has {wanted} free with {need} of memory ({_plural(len(by_compute), what)} "
            f"with {wanted} free, the most memory free on one is {format_bytes(max(most_mem, 0))})"
        )
    return f"every {what} with {wanted} free is ruled out by labels: " + _label_reasons(
        placer, spec, by_memory
    )


def _label_reasons(placer: Placer, spec: ShareSpec, gpus: list[GpuState]) -> str:
    labels = spec.gpu_labels
    parts = []
    if labels.anti_affinity:
        held = placer.anti.get(labels.anti_affinity, {})
        n = sum(1 for g in gpus if held.get(g.uuid))
        if n:
            parts.append(f"anti-affinity '{labels.anti_affinity}' is already on {n} of them")
    foreign = [g for g in gpus if not g.exclusive_ok(labels.exclusive)]
    if foreign:
        if labels.exclusive:
            parts.append(
                f"{_verb(len(foreign), 'holds', 'hold')} shares not labelled exclusive "
                f"'{labels.exclusive}'"
            )
        else:
            names = sorted({x for g in foreign for x in g.exclusive if x})
            owners = ", ".join(f"'{n}'" for n in names)
            parts.append(f"{_verb(len(foreign), 'is', 'are')} exclusive to {owners}")
    return "; ".join(parts) or "locality labels"


def _affinity_reason(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter, uuid: str
) -> str:
    label = spec.gpu_labels.affinity
    g = placer.gpus.get(uuid)
    where = f"the affinity group '{label}' is on "
    if g is None:
        return where + f"GPU {uuid}, which is not in the inventory"
    where += f"{g.node} GPU {g.index} ({g.type}), which "
    need = spec.resolved_memory(g.gpu.memory)
    if not g.usable:
        return where + ("is unhealthy" if not g.gpu.healthy else "is cordoned")
    if not _open(g, policy):
        return where + "is cordoned"
    if not types.admits(g.kind):
        return where + f"is not {_article(types.label)} {types.label}"
    if g.free < to_units(spec.gpu_request):
        return where + f"has {_fmt(from_units(max(g.free, 0)))} free, not {_fmt(spec.gpu_request)}"
    if g.mem_free < need:
        return where + (
            f"has {format_bytes(max(g.mem_free, 0))} of memory free, not {format_bytes(need)}"
        )
    if len(g.holders) >= MAX_SHARES_PER_GPU:
        return where + f"holds {MAX_SHARES_PER_GPU} shares, the most one GPU holds"
    return where + "is ruled out by labels: " + _label_reasons(placer, spec, [g])


def _share_suggestions(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter
) -> list[str]:
    found: list[str] = []
    found += _smaller_requests(placer, spec, policy, types)
    found += _other_types(placer, spec, policy, types)
    found += _without_labels(placer, spec, policy, types)
    return list(dict.fromkeys(found))


def _smaller_requests(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter
) -> list[str]:
    """The largest request (rounded down to 0.01) that fits now, per admitted type."""
    labels = spec.gpu_labels
    anchor = placer.anchor(labels.affinity)
    if anchor is None:
        pool: Iterable[GpuState] = placer.gpus.values()
    else:
        pool = [placer.gpus[anchor]] if anchor in placer.gpus else []
    best: dict[str, tuple[int, int]] = {}  # type -> (units, memory free)
    for g in pool:
        if not (types.admits(g.kind) and _open(g, policy)) or not _labels_ok(placer, spec, g):
            continue
        units = g.free
        if spec.gpu_memory is None:
            units = min(units, g.mem_free * UNITS // max(g.gpu.memory, 1))
        elif g.mem_free < spec.gpu_memory:
            units = 0
        units = units // 10_000 * 10_000  # whole hundredths, so the suggestion really fits
        if units >= 10_000 and units > best.get(g.type, (0, 0))[0]:
            best[g.type] = (units, g.mem_free)
    request = to_units(spec.gpu_request)
    found = []
    for gpu_type, (units, _) in sorted(best.items(), key=lambda kv: -kv[1][0]):
        if units < request:
            found.append(f"{_fmt(from_units(units))} on {gpu_type}")
    found += _less_memory(placer, spec, policy, types, pool)
    return found


def _less_memory(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter, pool: Iterable[GpuState]
) -> list[str]:
    """With an explicit memory cap that is what blocks: the request with the memory there is."""
    if spec.gpu_memory is None:
        return []
    request = to_units(spec.gpu_request)
    best: dict[str, int] = {}
    for g in pool:
        if (
            types.admits(g.kind)
            and _open(g, policy)
            and g.free >= request
            and _labels_ok(placer, spec, g)
            and 0 < g.mem_free < spec.gpu_memory
        ):
            best[g.type] = max(best.get(g.type, 0), g.mem_free)
    return [
        f"{_fmt(spec.gpu_request)} with {format_bytes(_round_down(mem))} on {t}"
        for t, mem in sorted(best.items(), key=lambda kv: -kv[1])
        if _round_down(mem) > 0
    ]


def _round_down(memory: int) -> int:
    """A size that prints exactly and is not more than ``memory``: whole GiB, else whole MiB."""
    unit = GiB if memory >= GiB else 2**20
    return memory // unit * unit


def _labels_ok(placer: Placer, spec: ShareSpec, g: GpuState) -> bool:
    """Whether ``g`` may take this share but for its compute and memory."""
    if len(g.holders) >= MAX_SHARES_PER_GPU:
        return False
    labels = spec.gpu_labels
    if labels.anti_affinity and placer.anti.get(labels.anti_affinity, {}).get(g.uuid):
        return False
    return g.exclusive_ok(labels.exclusive)


def _other_types(placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter) -> list[str]:
    """The same request on a type it did not ask for (only when it asked for some)."""
    if types.allowed is None:
        return []
    found = []
    admitted = {t for t, _ in types.allowed}
    others = {t for t, n in placer.kinds if (t, n) not in types.excluded} - admitted
    for gpu_type in sorted(others):
        other = spec.with_changes(gpu_type=gpu_type)
        try:
            other_types = resolve_types(other, policy, placer.kinds)
            placer.check(other, policy)
        except ShareError:
            continue
        if _fits_somewhere(placer, other, policy, other_types):
            if spec.gpu_count > 1:
                found.append(f"{spec.gpu_count} whole {gpu_type}s")
            else:
                found.append(f"{_fmt(spec.gpu_request)} on {gpu_type}")
    return found


def _without_labels(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter
) -> list[str]:
    labels = spec.gpu_labels
    found = []
    for kind in ("affinity", "anti_affinity", "exclusive"):
        label = getattr(labels, kind)
        if not label:
            continue
        fewer = GpuLabels(**{**_label_dict(labels), kind: None})
        other = spec.with_changes(gpu_labels=fewer)
        if _fits_somewhere(placer, other, policy, types):
            found.append(f"{_fmt(spec.gpu_request)} without {kind.replace('_', '-')} '{label}'")
    return found


def _label_dict(labels: GpuLabels) -> dict[str, str | None]:
    return {k: getattr(labels, k) for k in ("affinity", "anti_affinity", "exclusive")}


def _fits_somewhere(placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter) -> bool:
    if spec.gpu_count > 1:
        return placer._place_whole(spec, policy, types) is not None
    return placer._place_share(spec, policy, types) is not None


# -- whole GPUs ----------------------------------------------------------------------------------


def _whole_free(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter
) -> dict[str, int]:
    """Per type, the most whole GPUs free on one node."""
    most: dict[str, int] = {}
    for node in placer.nodes.values():
        for gpu_type, gpus in placer.whole_candidates(node, spec, policy, types).items():
            most[gpu_type] = max(most.get(gpu_type, 0), len(gpus))
    return most


def _whole_reason(placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter) -> str:
    what = types.label
    pool = [g for g in placer.gpus.values() if types.admits(g.kind)]
    most = max(_whole_free(placer, spec, policy, types).values(), default=0)
    nodes = len({g.node for g in pool})
    census = _census(pool, policy, what, f" on {_plural(nodes, 'node')}")
    most_text = f"at most {most} whole free on one node" if most else "none is whole free"
    return f"no node has {spec.gpu_count} whole {what}s free ({census}; {most_text})"


def _whole_suggestions(
    placer: Placer, spec: ShareSpec, policy: Policy, types: TypeFilter
) -> list[str]:
    found = []
    for gpu_type, most in sorted(
        _whole_free(placer, spec, policy, types).items(), key=lambda kv: (-kv[1], kv[0])
    ):
        if 1 <= most < spec.gpu_count:
            found.append(f"{most} whole {gpu_type}{'s' if most > 1 else ''} on one node")
    found += _other_types(placer, spec, policy, types)
    return found


# -- wording -------------------------------------------------------------------------------------


def _census(pool: list[GpuState], policy: Policy, what: str, where: str = "") -> str:
    text = _plural(len(pool), what) + where
    unhealthy = sum(1 for g in pool if not g.gpu.healthy)
    cordoned = sum(1 for g in pool if g.gpu.healthy and not _open(g, policy))
    if unhealthy:
        text += f", {unhealthy} unhealthy"
    if cordoned:
        text += f", {cordoned} cordoned"
    return text


def _plural(n: int, what: str) -> str:
    if " or " in what:
        return f"{n} GPU{'s' if n != 1 else ''} ({what})"
    return f"{n} {what}{'s' if n != 1 else ''}"


def _verb(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _fmt(x: float) -> str:
    return f"{round(x, 6):g}"


def _article(word: str) -> str:
    return "an" if word[:1].upper() in "AEFHILMNORSX" else "a"
