"""Placement properties over random clusters and request sequences (hypothesis).

For every request of a random sequence (with releases in between), on random clusters with
unhealthy and cordoned GPUs, cordoned nodes, several types, labels and whole-GPU requests:

* the engine placed it on a valid GPU (checked by trying every GPU against the rules, not by
  asking the engine), or refused it and no valid placement existed, or called it a bad request
  and no placement could be valid;
* the incremental index, a fresh ``place`` and the naive full-scan placer decide the same;
* after every step no GPU is over-allocated and every locality rule holds;
* every suggestion of a refusal really fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jupyter_gpushare.inventory import GiB
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.placement import ORDERS, Placement, PlacementRefused, Placer, Policy, place
from jupyter_gpushare.placement.naive import naive_place
from jupyter_gpushare.share import GpuLabels, ShareError, ShareSpec, parse_memory

try:
    from test_placement_support import gpu, record, valid_choices, violations
except ImportError:  # tests/ became a package
    from tests.test_placement_support import gpu, record, valid_choices, violations

TYPES = ("A100", "T4", "H100")
MEMORIES = (GiB, 4 * GiB, 10 * GiB, 20 * GiB, 40 * GiB)
FRACTIONS = (0.05, 0.1, 0.125, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5, 0.6, 2 / 3, 0.75, 0.9, 1.0)


@st.composite
def clusters(draw: st.DrawFn) -> list:  # type: ignore[type-arg]
    gpus = []
    for n in range(draw(st.integers(1, 4))):
        for i in range(draw(st.integers(1, 4))):
            gpus.append(
                gpu(
                    f"n{n}",
                    i,
                    draw(st.sampled_from(TYPES[:2] * 3 + TYPES[2:])),
                    healthy=draw(st.sampled_from((True,) * 7 + (False,))),
                    cordoned=draw(st.sampled_from((False,) * 7 + (True,))),
                )
            )
    return gpus


@st.composite
def specs(draw: st.DrawFn) -> ShareSpec:
    count = draw(st.sampled_from((1,) * 8 + (2, 3)))
    if count > 1:
        request = limit = 1.0
    else:
        request = draw(st.sampled_from(FRACTIONS) | st.floats(0.01, 1.0))
        limit = draw(st.sampled_from((request, 1.0)))
    labels = GpuLabels(
        # whole GPUs with affinity are a bad request: keep them rare
        affinity=draw(st.sampled_from((None,) * (20 if count > 1 else 2) + ("g1", "g2"))),
        anti_affinity=draw(st.sampled_from((None,) * 3 + ("r1", "r2"))),
        exclusive=draw(st.sampled_from((None,) * 5 + ("e1", "e2"))),
    )
    return ShareSpec(
        gpu_request=request,
        gpu_limit=limit,
        gpu_memory=draw(st.sampled_from((None,) * 4 + MEMORIES)),
        gpu_type=draw(st.sampled_from((None,) * 8 + TYPES + ("t4",))),
        gpu_count=count,
        gpu_labels=labels,
    )


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    return Policy(
        node=draw(st.sampled_from(tuple(ORDERS))),
        gpu=draw(st.sampled_from(tuple(ORDERS))),
        gpu_types=draw(st.sampled_from(((),) * 6 + (("A100", "T4"), ("t4",)))),
        exclude_types=draw(st.sampled_from(((),) * 4 + (("H100",), ("T4",)))),
        cordoned_nodes=frozenset(draw(st.sets(st.sampled_from(("n0", "n3")), max_size=1))),
    )


ops = st.lists(
    st.tuples(st.sampled_from(("place",) * 4 + ("release",)), specs(), st.integers(0, 99)),
    min_size=1,
    max_size=25,
)


@dataclass
class Refused:
    suggestions: tuple[str, ...]


def outcome(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except PlacementRefused as refused:
        return Refused(tuple(refused.suggestions))
    except ShareError:
        return ShareError


def same(a: object, b: object) -> bool:
    """Same decision (refusals compare as refusals; the naive placer does not explain)."""
    if isinstance(a, Refused) or isinstance(b, Refused):
        return isinstance(a, Refused) and isinstance(b, Refused)
    return a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=clusters(), policy=policies(), steps=ops)
def test_every_decision_is_valid_and_refusals_are_justified(gpus, policy, steps) -> None:  # type: ignore[no-untyped-def]
    placer = Placer(gpus, (), policy)
    allocations: list[Allocation] = []
    for op, spec, pick in steps:
        if op == "release":
            if allocations:
                gone = allocations.pop(pick % len(allocations))
                assert placer.remove(gone.id) == gone
            continue
        ours = outcome(placer.place, spec)
        kind = "ShareError" if ours is ShareError else type(ours).__name__
        event(
            f"{kind}{' labelled' if spec.gpu_labels else ''}"
            f"{' whole' if spec.gpu_count > 1 else ''}"
        )
        assert same(ours, outcome(place, gpus, allocations, spec, policy))
        assert same(ours, outcome(naive_place, gpus, allocations, spec, policy))
        choices = valid_choices(gpus, allocations, spec, policy)
        if isinstance(ours, Placement):
            assert ours.gpus in choices, (ours, choices)
            allocation = record(ours, spec, gpus)
            allocations.append(allocation)
            placer.add(allocation)
            assert not violations(gpus, allocations)
        else:
            assert choices == [], (ours, spec, choices)
        if isinstance(ours, Refused):
            for suggestion in ours.suggestions:
                fits = suggested(spec, suggestion)
                assert isinstance(placer.place(fits), Placement), suggestion


def suggested(spec: ShareSpec, text: str) -> ShareSpec:
    """The request a refusal's suggestion describes."""
    if m := re.fullmatch(r"([\d.]+) on (\S+)", text):
        return _fraction(spec, float(m[1])).with_changes(gpu_type=m[2])
    if m := re.fullmatch(r"([\d.]+) with (\S+) on (\S+)", text):
        return _fraction(spec, float(m[1])).with_changes(
            gpu_memory=parse_memory(m[2]), gpu_type=m[3]
        )
    if m := re.fullmatch(r"([\d.]+) without ([a-z-]+) '(\S+)'", text):
        kind = m[2].replace("-", "_")
        labels = GpuLabels(
            **{
                k: getattr(spec.gpu_labels, k)
                for k in ("affinity", "anti_affinity", "exclusive")
                if k != kind
            }
        )
        return spec.with_changes(gpu_labels=labels)
    if m := re.fullmatch(r"(\d+) whole (\S+?)s?(?: on one node)?", text):
        count = int(m[1])
        return ShareSpec(1.0, 1.0, spec.gpu_memory, m[2], count, spec.gpu_labels)
    raise AssertionError(f"unexpected suggestion {text!r}")


def _fraction(spec: ShareSpec, request: float) -> ShareSpec:
    return ShareSpec(
        request,
        max(request, min(spec.gpu_limit, 1.0)),
        spec.gpu_memory,
        spec.gpu_type,
        1,
        spec.gpu_labels,
    )


@settings(max_examples=60, deadline=None)
@given(gpus=clusters(), policy=policies(), plan=st.lists(specs(), min_size=1, max_size=30))
def test_sync_with_snapshots_matches_a_fresh_index(gpus, policy, plan) -> None:  # type: ignore[no-untyped-def]
    """A long-lived placer kept current with ``sync`` decides like a fresh one."""
    placer = Placer(gpus, (), policy)
    allocations: list[Allocation] = []
    for i, spec in enumerate(plan):
        placer.sync(allocations)
        ours = outcome(placer.place, spec)
        assert same(ours, outcome(place, gpus, allocations, spec, policy))
        if isinstance(ours, Placement):
            allocations.append(record(ours, spec, gpus))
        if i % 3 == 2:
            allocations = allocations[1:]
