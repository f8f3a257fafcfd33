"""Placement (box 4): policies, types, labels, cordons, whole GPUs, refusals and bad requests."""

from __future__ import annotations

import asyncio
from dataclasses import FrozenInstanceError, replace

import pytest
from traitlets import TraitError

from jupyter_gpushare.inventory import GiB, TypeAliases
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import Placement, PlacementRefused, Placer, Policy, place
from jupyter_gpushare.placement.config import GpusharePlacement
from jupyter_gpushare.placement.naive import naive_place
from jupyter_gpushare.placement.orders import ORDERS, Order
from jupyter_gpushare.share import GpuLabels, ShareError, ShareSpec

try:
    from test_placement_support import cluster, gpu, record, violations
except ImportError:  # tests/ became a package
    from tests.test_placement_support import cluster, gpu, record, violations


DEFAULT = Policy()


def share(request: float = 0.25, **kw: object) -> ShareSpec:
    kw.setdefault("gpu_limit", max(request, 0.5))
    labels = kw.pop("labels", None)
    if labels:
        kw["gpu_labels"] = GpuLabels(**labels)
    return ShareSpec(gpu_request=request, **kw)  # type: ignore[arg-type]


def fill(gpus, plan, policy=DEFAULT):  # type: ignore[no-untyped-def]
    """Place each spec of ``plan`` in turn; returns the allocations."""
    allocations = []
    for spec in plan:
        allocations.append(record(place(gpus, allocations, spec, policy), spec, gpus))
    return allocations


def uuids(allocations):  # type: ignore[no-untyped-def]
    return [a.gpus[0] for a in allocations]


# -- contract ------------------------------------------------------------------------------------


def test_policy_defaults_and_frozen() -> None:
    policy = Policy()
    assert (policy.node, policy.gpu) == ("binpack", "binpack")
    with pytest.raises(FrozenInstanceError):
        policy.node = "spread"  # type: ignore[misc]
    assert Policy(gpu_types=["a100"]).gpu_types == ("a100",)
    with pytest.raises(ShareError, match=r"^policy\.node='random' is not allowed: one of bin"):
        Policy(node="random")


def test_third_half_of_one_a100_is_refused_with_reason() -> None:
    gpus = cluster("1xA100")
    fill(gpus, [share(0.5, gpu_type="A100")] * 2)
    allocations = fill(gpus, [share(0.5, gpu_type="A100")] * 2)
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, allocations, share(0.5, gpu_type="A100"))
    assert "no A100 has 0.5 free" in refused.value.message
    assert refused.value.to_json() == {
        "error": "no_fit",
        "message": refused.value.message,
        "suggestions": refused.value.suggestions,
    }


def test_refusal_says_what_would_fit_now() -> None:
    gpus = cluster("4xA100", "1xT4")
    allocations = fill(gpus, [share(0.75, gpu_type="A100")] * 4)
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, allocations, share(0.5, gpu_type="A100"))
    assert refused.value.message == (
        "no A100 has 0.5 free (4 A100s, most free 0.25); 0.25 on A100 or 0.5 on T4 would fit"
    )
    assert refused.value.suggestions == ["0.25 on A100", "0.5 on T4"]
    # The suggestions are true: each of them is placed.
    place(gpus, allocations, share(0.25, gpu_type="A100"))
    place(gpus, allocations, share(0.5, gpu_type="T4"))


def test_memory_refusal_names_memory() -> None:
    gpus = cluster("1xA100")
    allocations = fill(gpus, [share(0.25, gpu_memory=70 * GiB)])
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, allocations, share(0.25, gpu_memory=20 * GiB))
    assert "no GPU has 0.25 free with 20GiB of memory" in refused.value.message
    assert "0.25 with 10GiB on A100" in refused.value.suggestions


# -- policies ------------------------------------------------------------------------------------


def test_binpack_fills_one_gpu_and_one_node_first() -> None:
    gpus = cluster("2xA100", "2xA100")
    allocations = fill(gpus, [share(0.25)] * 5)
    assert uuids(allocations) == ["GPU-n0-0"] * 4 + ["GPU-n0-1"]


def test_spread_uses_every_node_and_gpu() -> None:
    gpus = cluster("2xA100", "2xA100")
    policy = Policy(node="spread", gpu="spread")
    allocations = fill(gpus, [share(0.25)] * 4, policy)
    assert sorted(uuids(allocations)) == ["GPU-n0-0", "GPU-n0-1", "GPU-n1-0", "GPU-n1-1"]


def test_node_binpack_gpu_spread() -> None:
    gpus = cluster("2xA100", "2xA100")
    allocations = fill(gpus, [share(0.25)] * 3, Policy(node="binpack", gpu="spread"))
    assert uuids(allocations) == ["GPU-n0-0", "GPU-n0-1", "GPU-n0-0"]


#: a third order, defined here only: the last node by name, then its highest-indexed GPU
LAST = Order(
    "last",
    "the last node by name, its highest-indexed GPU",
    node_key=lambda free, name: (tuple(-ord(c) for c in name),),
    gpu_key=lambda free, memory, index: (-index,),
)


def test_an_order_registered_elsewhere_is_used_everywhere(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Adding a policy is one registry entry: nothing in the package names it, yet the policy,
    the engine (a long-lived index kept current with add), the naive placer and the deployment
    configuration all take it."""
    with pytest.raises(ShareError, match=r"one of binpack, spread$"):
        Policy(gpu="last")
    monkeypatch.setitem(ORDERS, LAST.name, LAST)
    gpus = cluster("2xA100", "2xA100")
    policy = Policy(node="last", gpu="last")
    placer = Placer(gpus, [], policy)
    allocations = []
    for _ in range(5):
        spec = share(0.25)
        placed = placer.place(spec)
        assert naive_place(gpus, allocations, spec, policy) == placed
        allocations.append(record(placed, spec, gpus))
        placer.add(allocations[-1])
    assert uuids(allocations) == ["GPU-n1-1"] * 4 + ["GPU-n1-0"]
    assert place(gpus, [], share(), Policy(node="last")).gpus == ("GPU-n1-0",)  # binpack GPU
    from traitlets.config import Config

    config = Config()
    config.GpusharePlacement.node_policy = "last"
    assert GpusharePlacement(config=config).policy().node == "last"
    config.GpusharePlacement.gpu_policy = "random"
    with pytest.raises(TraitError) as refused:
        GpusharePlacement(config=config)
    assert str(refused.value) == (
        "GpusharePlacement.gpu_policy='random' is not allowed: one of binpack, spread, last"
    )


def test_unknown_order_in_configuration_is_refused_by_name() -> None:
    from traitlets.config import Config

    config = Config()
    config.GpusharePlacement.node_policy = "Binpack"
    with pytest.raises(TraitError) as refused:
        GpusharePlacement(config=config)
    assert str(refused.value) == (
        "GpusharePlacement.node_policy='Binpack' is not allowed: one of binpack, spread"
    )
    assert "'binpack' fills the fullest" in GpusharePlacement.node_policy.help


def test_binpack_prefers_fuller_node() -> None:
    gpus = cluster("1xA100", "1xA100")
    allocations = fill(gpus, [share(0.5)])
    allocations.append(record(Placement("n1", ("GPU-n1-0",), 10), share(0.75), gpus))
    assert place(gpus, allocations, share(0.25)).gpus == ("GPU-n1-0",)
    assert place(gpus, allocations, share(0.25), Policy(node="spread")).gpus == ("GPU-n0-0",)


# -- types ---------------------------------------------------------------------------------------


def test_type_is_case_insensitive_and_accepts_product_labels() -> None:
    gpus = cluster("1xT4", "1xA100")
    assert place(gpus, [], share(gpu_type="a100")).node == "n1"
    label = Policy(gpu_types=("NVIDIA-A100-SXM4-80GB",))  # nvidia.com/gpu.product
    assert place(gpus, [], share(), label).node == "n1"
    custom = Policy(gpu_types=("big",), aliases=TypeAliases({"big": ["A100"]}))
    assert place(gpus, [], share(), custom).node == "n1"


def test_node_labels_and_product_names_map_to_aliases() -> None:
    """``nvidia.com/gpu.product`` labels and NVML names select by alias, case-insensitively, and
    a shorter alias does not swallow a longer one (A10 is not A100)."""
    aliases = TypeAliases()
    for label, alias in (
        ("NVIDIA-A100-SXM4-80GB", "A100"),
        ("nvidia-a100-pcie-40gb", "A100"),
        ("NVIDIA-A10G", "A10"),
        ("Tesla-T4", "T4"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA-H100-80GB-HBM3", "H100"),
    ):
        assert aliases.alias_for(label) == alias, label
    gpus = [*cluster("1xA100"), gpu("n1", 0, "L4")]
    assert place(gpus, [], share(gpu_type="nvidia-l4")).node == "n1"
    assert place(gpus, [], share(), Policy(exclude_types=("NVIDIA-A100-PCIE-40GB",))).node == "n1"


def test_several_wanted_types_and_excluded_types() -> None:
    gpus = cluster("1xT4", "1xA100", "1xH100")
    policy = Policy(gpu_types=("A100", "H100"), node="spread")
    placed = fill(gpus, [share(0.5)] * 4, policy)
    assert {a.node for a in placed} == {"n1", "n2"}
    with pytest.raises(PlacementRefused, match=r"no GPU \(A100 or H100\)|A100 or H100"):
        place(gpus, placed, share(0.5), policy)
    assert place(gpus, [], share(), Policy(exclude_types=("A100", "H100"))).node == "n0"


def test_bad_type_requests_are_errors() -> None:
    gpus = cluster("1xT4", "1xA100")
    with pytest.raises(ShareError, match="one of A100, T4") as err:
        place(gpus, [], share(gpu_type="V200"))
    assert err.value.field == "gpu_type"
    with pytest.raises(ShareError, match="not excluded"):
        place(gpus, [], share(gpu_type="A100"), Policy(exclude_types=("a100",)))
    with pytest.raises(ShareError, match="deployment's types"):
        place(gpus, [], share(gpu_type="T4"), Policy(gpu_types=("A100",)))
    with pytest.raises(ShareError, match="exclude_types"):
        place(gpus, [], share(), Policy(exclude_types=("Banana",)))
    # A known alias that this cluster lacks may be listed (deployment-wide settings).
    assert place(gpus, [], share(), Policy(exclude_types=("V100",)))
    assert place(gpus, [], share(), Policy(gpu_types=("V100", "T4"))).node == "n0"
    with pytest.raises(ShareError, match=r"policy\.gpu_types"):
        place(gpus, [], share(), Policy(gpu_types=("T4", "Banana")))
    with pytest.raises(ShareError, match="gpu_memory"):
        place(gpus, [], share(gpu_type="T4", gpu_memory=40 * GiB))


def test_narrowed_policy_combines_deployment_and_request() -> None:
    deployment = Policy(gpu_types=("A100", "T4"), exclude_types=("H100",))
    narrowed = deployment.narrowed(gpu_types=["t4"], exclude_types=["L4"], gpu="spread")
    assert narrowed.gpu_types == ("t4",)
    assert set(narrowed.exclude_types) == {"H100", "L4"}
    assert narrowed.gpu == "spread"
    with pytest.raises(ShareError):
        deployment.narrowed(gpu_types=["H100"])


# -- health and cordons --------------------------------------------------------------------------


def test_unhealthy_and_cordoned_gpus_and_nodes_are_skipped() -> None:
    gpus = [
        gpu("n0", 0, healthy=False),
        gpu("n0", 1, cordoned=True),
        gpu("n1", 0),
        gpu("n2", 0),
    ]
    policy = Policy(cordoned_nodes=frozenset({"n1"}))
    assert place(gpus, [], share(), policy).gpus == ("GPU-n2-0",)
    policy = Policy(cordoned_nodes=frozenset({"n1"}), cordoned_gpus=frozenset({"GPU-n2-0"}))
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, [], share(), policy)
    assert refused.value.message.startswith(
        "no GPU takes new shares (4 GPUs, 1 unhealthy, 3 cordoned)"
    )


def test_cordon_keeps_running_shares() -> None:
    gpus = cluster("1xA100", "1xA100")
    allocations = fill(gpus, [share(0.5)])
    policy = Policy(cordoned_nodes=frozenset({"n0"}))
    # The running share still counts (n0 stays half used) and nothing new goes to n0.
    assert place(gpus, allocations, share(0.5), policy).node == "n1"
    placer = Placer(gpus, allocations, policy)
    assert placer.gpus["GPU-n0-0"].free == 500_000


# -- locality labels -----------------------------------------------------------------------------


def test_affinity_puts_a_group_on_one_gpu_whatever_the_policy() -> None:
    gpus = cluster("2xA100", "2xA100")
    spread = Policy(node="spread", gpu="spread")
    allocations = fill(gpus, [share(0.25, labels={"affinity": "g"})] * 4, spread)
    assert len(set(uuids(allocations))) == 1
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, allocations, share(0.25, labels={"affinity": "g"}), spread)
    assert "affinity group 'g' is on" in refused.value.message
    assert "has 0 free" in refused.value.message
    assert "0.25 without affinity 'g'" in refused.value.suggestions


def test_anti_affinity_keeps_a_group_apart() -> None:
    gpus = cluster("3xA100")
    allocations = fill(gpus, [share(0.1, labels={"anti_affinity": "r"})] * 3)
    assert len(set(uuids(allocations))) == 3
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, allocations, share(0.1, labels={"anti_affinity": "r"}))
    assert "anti-affinity 'r' is already on 3 of them" in refused.value.message
    assert not violations(gpus, allocations)


def test_exclusive_gpus_hold_only_their_label() -> None:
    gpus = cluster("2xA100")
    team = share(0.25, labels={"exclusive": "team"})
    both = fill(gpus, [share(0.25), team, share(0.25), team])
    # Binpack would stack everything on GPU 0; "team" takes GPU 1 and keeps it.
    assert uuids(both) == ["GPU-n0-0", "GPU-n0-1", "GPU-n0-0", "GPU-n0-1"]
    assert not violations(gpus, both)
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, both, share(0.25, labels={"exclusive": "other"}))
    assert "2 hold shares not labelled exclusive 'other'" in refused.value.message
    assert "0.25 without exclusive 'other'" in refused.value.suggestions
    full = [*both, record(Placement("n0", ("GPU-n0-0",), 1), share(0.5), gpus)]
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, full, share(0.25))
    assert "1 is exclusive to 'team'" in refused.value.message


def test_conflicting_labels_are_errors() -> None:
    gpus = cluster("2xA100")
    with pytest.raises(ShareError, match="cannot be with and apart"):
        place(gpus, [], share(labels={"affinity": "x", "anti_affinity": "x"}))
    with pytest.raises(ShareError, match="whole GPUs") as err:
        place(gpus, [], ShareSpec(1, 1, gpu_count=2, gpu_labels=GpuLabels(affinity="x")))
    assert err.value.field == "gpu_labels.affinity"


# -- whole GPUs ----------------------------------------------------------------------------------


def test_whole_gpus_on_one_node() -> None:
    gpus = cluster("2xA100", "4xA100")
    allocations = fill(gpus, [share(0.25)])  # n0 GPU 0 is shared now
    two = ShareSpec(1, 1, gpu_count=2)
    placed = place(gpus, allocations, two)
    assert placed.node == "n1" and placed.gpus == ("GPU-n1-0", "GPU-n1-1")
    assert placed.memory == 80 * GiB
    with pytest.raises(ShareError, match="at most 4"):
        place(gpus, allocations, ShareSpec(1, 1, gpu_count=5))
    allocations.append(record(placed, two, gpus))
    allocations.append(record(place(gpus, allocations, two), two, gpus))
    with pytest.raises(PlacementRefused) as refused:
        place(gpus, allocations, two)
    assert refused.value.message.startswith("no node has 2 whole GPUs free")
    assert "1 whole A100 on one node" in refused.value.suggestions
    assert not violations(gpus, allocations)


def test_whole_gpus_of_one_type() -> None:
    gpus = cluster("1xA100+1xT4", "2xT4")
    assert place(gpus, [], ShareSpec(1, 1, gpu_count=2)).node == "n1"


# -- the engine as an index ----------------------------------------------------------------------


def test_placer_updates_match_a_fresh_index() -> None:
    gpus = cluster("2xA100", "2xA100+1xT4", "1xT4")
    placer = Placer(gpus)
    allocations = []
    plan = [share(0.25), share(0.5, gpu_type="T4"), share(0.75), share(0.3), share(0.6)]
    for spec in plan * 2:
        try:
            allocation = record(placer.place(spec), spec, gpus)
        except PlacementRefused:
            continue
        placer.add(allocation)
        allocations.append(allocation)
    placer.remove(allocations[1].id)
    del allocations[1]
    for spec in plan:
        ours, fresh = (
            _outcome(lambda s: placer.place(s), spec),
            _outcome(lambda s: place(gpus, allocations, s), spec),
        )
        assert ours == fresh
        assert ours == _outcome(lambda s: naive_place(gpus, allocations, s), spec)
    placer.sync(allocations[:2])
    assert _outcome(placer.place, plan[2]) == _outcome(
        lambda s: place(gpus, allocations[:2], s), plan[2]
    )


def _outcome(fn, spec):  # type: ignore[no-untyped-def]
    try:
        return fn(spec)
    except PlacementRefused:
        return "refused"


def test_place_is_pure_across_calls() -> None:
    """place() reuses its thread's index between calls; a different inventory, a flag flipped
    on one GPU, or a different snapshot must never leak from one call into the next."""
    gpus = cluster("2xA100")
    allocations = fill(gpus, [share(0.5)])
    assert place(gpus, allocations, share(0.5)).gpus == ("GPU-n0-0",)
    cordoned = [replace(gpus[0], cordoned=True), gpus[1]]
    assert place(cordoned, allocations, share(0.5)).gpus == ("GPU-n0-1",)
    assert place(gpus, [], share(0.75)).gpus == ("GPU-n0-0",)
    moved = [replace(allocations[0], gpus=("GPU-n0-1",))]
    assert place(gpus, moved, share(0.75)).gpus == ("GPU-n0-0",)
    assert place(gpus, moved, share(0.5)).gpus == ("GPU-n0-1",)
    assert place(gpus, [*moved, *moved], share(0.5)).gpus == ("GPU-n0-1",)  # an id counts once


def test_affinity_anchor_is_the_earliest_member() -> None:
    """Racing placers may leave a group on two GPUs for a moment; every placer agrees the group's
    GPU is its earliest member's."""
    gpus = cluster("2xA100")
    spec = share(0.25, labels={"affinity": "g"})
    later = replace(record(Placement("n0", ("GPU-n0-0",), 1), spec, gpus), created=2.0)
    first = replace(record(Placement("n0", ("GPU-n0-1",), 1), spec, gpus), created=1.0)
    assert place(gpus, [later, first], spec).gpus == ("GPU-n0-1",)
    assert naive_place(gpus, [later, first], spec).gpus == ("GPU-n0-1",)


# -- configuration -------------------------------------------------------------------------------


def test_traitlets_configuration_builds_the_policy() -> None:
    from traitlets.config import Config

    config = Config()
    config.GpusharePlacement.node_policy = "spread"
    config.GpusharePlacement.exclude_types = ["T4"]
    config.GpusharePlacement.cordoned_nodes = ["n9"]
    aliases = TypeAliases({"big": ["A100"], "small": ["T4"]})
    policy = GpusharePlacement(config=config).policy(aliases)
    assert replace(policy, aliases=None) == Policy(
        node="spread", exclude_types=("T4",), cordoned_nodes=frozenset({"n9"})
    )
    assert policy.type_aliases.alias_for("NVIDIA A100-SXM4-80GB") == "big"


# -- through the real ledger ---------------------------------------------------------------------


def test_ledger_allocate_uses_the_engine(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    gpus = cluster("1xA100")

    async def go() -> PlacementRefused:
        for _ in range(4):
            await ledger.allocate(share(0.25, gpu_type="A100"), gpus, place)
        try:
            await ledger.allocate(share(0.25, gpu_type="A100"), gpus, place)
        except PlacementRefused as refused:
            return refused
        raise AssertionError("a fifth quarter of one A100 was placed")

    refused = asyncio.run(go())
    assert "no A100 has 0.25 free (1 A100, most free 0)" in refused.message
    assert not violations(gpus, ledger.snapshot_sync().allocations)
