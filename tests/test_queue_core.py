"""The queue's pure core (``jupyter_gpushare/queue``): order, ETA, words."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare.queue import (
    Deadline,
    Entry,
    Pass,
    QueuePolicy,
    Release,
    describe,
    estimate,
    fair_order,
    ordinal,
)
from jupyter_gpushare.queue.eta import erlang_quantile
from jupyter_gpushare.queue.words import span

GiB = 2**30


def entry(i: int, user: str, request: float = 0.5, since: float | None = None, **kw) -> Entry:
    return Entry(f"q-{i:04d}", user, request, 0, since=float(i if since is None else since), **kw)


entries = st.lists(
    st.builds(
        lambda i, u, r: entry(i, u, r),
        st.integers(0, 10_000),
        st.sampled_from(["ann", "bob", "cy", "dee"]),
        st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    ),
    max_size=30,
    unique_by=lambda e: e.id,
)
holdings = st.dictionaries(
    st.sampled_from(["ann", "bob", "cy", "dee"]),
    st.tuples(st.floats(0, 4), st.floats(0, 4 * 80 * GiB)),
)


@given(entries, holdings)
@settings(max_examples=200, deadline=None)
def test_order_is_a_permutation_keeping_each_users_arrival(items, held) -> None:
    ordered = fair_order(items, held, 4.0, 4 * 80 * GiB)
    assert sorted(e.id for e in ordered) == sorted(e.id for e in items)
    for user in {e.user for e in items}:
        mine = [e for e in ordered if e.user == user]
        assert mine == sorted(mine, key=lambda e: (e.since, e.id))


@given(entries, holdings, st.sets(st.sampled_from(["ann", "bob", "cy", "dee"])))
@settings(max_examples=200, deadline=None)
def test_a_higher_priority_group_always_goes_first(items, held, course) -> None:
    """A priority comes with a user's group: every start of a user in the course goes ahead
    of every start of a user outside it, whatever they hold."""
    items = [replace(e, priority=1 if e.user in course else 0) for e in items]
    ordered = fair_order(items, held, 4.0, 4 * 80 * GiB)
    priorities = [e.priority for e in ordered]
    assert priorities == sorted(priorities, reverse=True)


@given(st.integers(2, 12), st.floats(0, 3))
@settings(max_examples=100, deadline=None)
def test_ten_queued_kernels_of_one_user_do_not_starve_anothers_one(many, ann_holds) -> None:
    """ann queued ``many`` starts first; bob, who holds nothing, queues one later: bob's is
    among the first two, however much or little ann holds."""
    items = [entry(i, "ann", 0.25) for i in range(many)] + [entry(100, "bob", 0.25)]
    ordered = fair_order(items, {"ann": (ann_holds, 0.0)}, 4.0, 4 * 80 * GiB)
    assert [e.user for e in ordered].index("bob") <= 1


def test_dominant_share_counts_memory_and_weight() -> None:
    """ann holds little compute but most of the memory: bob (more compute, little memory)
    goes first; a weight of 4 on ann's group turns it round."""
    items = [entry(1, "ann", 0.1), entry(2, "bob", 0.1)]
    held = {"ann": (0.2, 150 * GiB), "bob": (1.0, 10 * GiB)}
    assert [e.user for e in fair_order(items, held, 4.0, 320 * GiB)] == ["bob", "ann"]
    items = [entry(1, "ann", 0.1, weight=4.0), entry(2, "bob", 0.1)]
    assert [e.user for e in fair_order(items, held, 4.0, 320 * GiB)] == ["ann", "bob"]


def test_a_waiting_start_without_a_memory_cap_counts_its_memory() -> None:
    """ann holds most of the memory and little compute; her waiting starts have no memory cap
    (they get their request's fraction of a GPU's memory). After her first 0.5 she holds 140 of
    320 GiB: bob (1.4 GPUs, 10 GiB) goes before her second. Counting a start without a cap as
    no memory put her second start ahead of bob's (seen: a1, a2, b1)."""
    items = [entry(1, "ann", 0.5), entry(2, "ann", 0.5), entry(3, "bob", 0.1)]
    held = {"ann": (0.1, 100 * GiB), "bob": (1.4, 10 * GiB)}
    ordered = fair_order(items, held, 4.0, 4 * 80 * GiB)
    assert [e.id for e in ordered] == ["q-0001", "q-0003", "q-0002"]


def test_policy_resolves_a_users_groups() -> None:
    policy = QueuePolicy(weights={"course": 3.0, "staff": 2.0}, priorities={"course": 1})
    assert policy.weight_of(["staff", "course"]) == 3.0
    assert policy.weight_of(["nobody"]) == 1.0
    assert policy.priority_of(["course"]) == 1
    assert policy.priority_of([]) == 0


def test_backfill_until_the_hold_then_its_gpus_are_kept_for_it() -> None:
    big = Entry("q-1", "ann", 1.0, 0, gpu_type="A100", since=0.0)
    pair = Entry("q-2", "bob", 1.0, 0, count=2, gpu_type="A100", since=0.0)
    young = Pass(now=100.0, hold_s=300.0)
    young.missed(big, ["GPU-b", "GPU-a"])
    assert young.held == set()  # still young: later starts may pass it anywhere
    old = Pass(now=400.0, hold_s=300.0)
    old.missed(big, ["GPU-b", "GPU-a", "GPU-c"])
    assert old.held == {"GPU-b"}  # the emptiest is kept for it, the others stay in use
    old.missed(pair, ["GPU-b", "GPU-a", "GPU-c"])
    assert old.held == {"GPU-b", "GPU-a", "GPU-c"}  # two more, not the one held already
    again = Entry("q-5", "ann", 1.0, 0, gpu_type="A100", since=0.0)
    old.missed(again, ["GPU-d"])
    assert "GPU-d" not in old.held  # one start per user holds GPUs


def test_erlang_quantiles() -> None:
    assert abs(erlang_quantile(1, 0.5) - 0.6931) < 1e-3  # ln 2
    for k in (1, 3, 20, 200):
        lo, mid, hi = (erlang_quantile(k, q) for q in (0.02, 0.5, 0.98))
        assert lo < mid < hi
        assert abs(mid - k) < max(1.0, 0.1 * k)  # the median is near the mean
    # empirical check of one: 20,000 draws
    rng = random.Random(1)
    draws = sorted(sum(rng.expovariate(1.0) for _ in range(5)) for _ in range(20_000))
    assert abs(draws[int(0.98 * len(draws))] - erlang_quantile(5, 0.98)) < 0.25


def test_eta_rests_only_on_what_it_has() -> None:
    now = 10_000.0
    none = estimate(0.5, "A100", now, [], [])
    assert not none.known and none.lo is None and none.basis == ()
    assert "no estimate" in describe(2, "0.5 of an A100", none)
    # two releases are not enough for a rate
    few = estimate(0.5, "A100", now, [Release(now - 10, 0.5, "A100")] * 2, [])
    assert not few.known
    # a deadline only: an upper bound, no low end
    by = estimate(
        0.5, "A100", now, [], [Deadline(now + 120, 0.25, "A100"), Deadline(now + 300, 0.25, "A100")]
    )
    assert by.known and by.lo is None and by.hi == 300 and by.reclaims == 2
    assert "2 idle shares are reclaimed by" in describe(1, "0.5 of an A100", by)
    # another type's releases and deadlines count for nothing
    assert not estimate(
        0.5,
        "A100",
        now,
        [Release(now - i, 0.5, "T4") for i in range(9)],
        [Deadline(now + 1, 1.0, "T4")],
    ).known
    # a rate: a range; with a deadline sooner than its high end, capped by it
    releases = [Release(now - 60 * i, 0.5, "A100") for i in range(1, 11)]
    rate = estimate(0.5, "A100", now, releases, [])
    assert rate.known and 0 < rate.lo < rate.hi
    capped = estimate(0.5, "A100", now, releases, [Deadline(now + 5, 0.5, "A100")])
    assert capped.hi == 5 and capped.lo <= 5
    text = describe(3, "0.5 of an A100", rate)
    assert text.startswith("3rd in line for 0.5 of an A100; expected within ")


def test_eta_of_a_poisson_stream_contains_about_nine_in_ten() -> None:
    """Releases of one size at a steady rate: the first range shown contains the actual wait
    for at least 90 % of starts (the model's own case; benchmarks/fair_queue.py measures the
    rest)."""
    rng = random.Random(7)
    inside = 0
    trials = 400
    for _ in range(trials):
        rate = 1 / 60
        history = []
        t = 0.0
        while t < 3600:
            t += rng.expovariate(rate)
            history.append(Release(t, 0.25, "A100"))
        now = 3600.0
        need = rng.choice([0.25, 0.5, 1.0])
        eta = estimate(need, "A100", now, [r for r in history if r.at <= now], [])
        k = round(need / 0.25)
        wait = sum(rng.expovariate(rate) for _ in range(k))
        inside += eta.contains(wait, slack=0.0)
    assert inside / trials >= 0.9


def test_words() -> None:
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 103, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "103rd", "111th",
    ]  # fmt: skip
    assert span(240, 720) == "4–12 min"
    assert span(30, 600) == "30 s–10 min"
