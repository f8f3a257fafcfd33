"""``GpuShare.policy()`` is built once (every kernel start places with it) and again only after
what it is built from changes: the settings' config, ``type_aliases``, a trait of
``GpuShare.placement``."""

from __future__ import annotations

from traitlets.config import Config

from jupyter_gpushare.config import GpuShare


def _settings(**placement: object) -> GpuShare:
    return GpuShare(config=Config({"GpusharePlacement": placement}))


def test_the_policy_is_built_once_from_the_config() -> None:
    settings = _settings(node_policy="spread", cordoned_nodes=["n1"])
    policy = settings.policy()
    assert (policy.node, policy.gpu, policy.cordoned_nodes) == ("spread", "binpack", {"n1"})
    assert settings.policy() is policy  # not rebuilt per kernel start
    assert settings.aliases() is policy.type_aliases
    # another server's settings in the same process keep their own
    other = _settings(gpu_policy="spread")
    assert (other.policy().node, other.policy().gpu) == ("binpack", "spread")
    assert settings.policy() is policy


def test_a_config_change_is_seen_by_the_next_policy() -> None:
    settings = _settings(node_policy="spread")
    first = settings.policy()

    settings.update_config(Config({"GpusharePlacement": {"cordoned_gpus": ["GPU-1"]}}))
    merged = settings.policy()
    assert merged is not first
    assert (merged.node, merged.cordoned_gpus) == ("spread", {"GPU-1"})  # merged, not replaced
    assert settings.policy() is merged

    settings.config = Config({"GpusharePlacement": {"exclude_types": ["T4"]}})  # replaced
    replaced = settings.policy()
    assert (replaced.node, replaced.cordoned_gpus, replaced.exclude_types) == (
        "binpack",
        frozenset(),
        ("T4",),
    )


def test_new_type_aliases_make_a_new_policy() -> None:
    settings = _settings()
    before = settings.policy()
    assert before.type_aliases.canonical("big") is None
    settings.type_aliases = {"BIG": ["A100"]}
    after = settings.policy()
    assert after is not before and after.type_aliases.canonical("big") == "BIG"
    assert settings.aliases() is after.type_aliases
    assert settings.aliases().alias_for("NVIDIA A100-SXM4-80GB") == "BIG"
    # a config that sets them (the server's config file) is seen too
    settings.update_config(Config({"GpuShare": {"type_aliases": {"HUGE": ["A100"]}}}))
    assert settings.policy().type_aliases.canonical("huge") == "HUGE"
    assert settings.aliases().alias_for("NVIDIA A100-SXM4-80GB") == "HUGE"


def test_a_placement_trait_set_at_run_time_is_seen() -> None:
    settings = _settings()
    before = settings.policy()
    settings.placement.gpu_policy = "spread"
    settings.placement.cordoned_nodes = ["n2"]
    after = settings.policy()
    assert (before.gpu, after.gpu, after.cordoned_nodes) == ("binpack", "spread", {"n2"})
    settings.placement.cordoned_nodes = []
    assert settings.policy().cordoned_nodes == frozenset()
