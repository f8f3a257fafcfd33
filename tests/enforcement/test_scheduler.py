"""The token scheduler's pure decision (jupyter_gpushare.daemon.scheduler)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpushare.daemon.scheduler import (
    LimitCredit,
    TenantView,
    UsageWindow,
    backfill_allowance,
    pick,
)

Q = 20_000_000
W = 1_000_000_000


@st.composite
def tenants(draw):
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        limit = draw(st.floats(0.01, 1.0))
        request = draw(st.floats(0.01, 1.0).filter(lambda r, lim=limit: r <= lim))
        out.append(
            TenantView(
                key=f"t{i}",
                request=request,
                limit=limit,
                used_ns=draw(st.integers(0, W)),
                waiting=draw(st.booleans()),
                last_grant_ns=draw(st.integers(0, 10**9)),
                credit_ns=draw(st.integers(-Q, 2 * Q)),
            )
        )
    return out


@given(tenants())
@settings(max_examples=200, deadline=None)
def test_pick_respects_limits_and_priorities(views):
    grant = pick(views, Q, W)
    eligible = [v for v in views if v.waiting and (v.credit_ns > 0 or v.limit >= 1.0)]
    if grant is None:
        assert not eligible
        return
    chosen = next(v for v in views if v.key == grant.key)
    assert chosen.waiting
    # never granted without limit credit; one quantum at a time
    assert chosen.credit_ns > 0 or chosen.limit >= 1.0
    assert grant.lease_ns == Q
    below = [v for v in eligible if v.used_ns < v.request * W]
    if below:  # someone below its request waits: one of them is served, the most behind
        assert grant.below_request
        ratio = chosen.used_ns / (chosen.request * W)
        assert all(ratio <= v.used_ns / (v.request * W) + 1e-12 for v in below)
    else:
        assert not grant.below_request


def test_nobody_waiting_means_no_grant():
    views = [TenantView("a", 0.5, 1.0, 0, False)]
    assert pick(views, Q, W) is None


def test_no_credit_no_lease():
    assert pick([TenantView("a", 0.5, 0.5, 0, True, credit_ns=0)], Q, W) is None
    assert pick([TenantView("a", 0.5, 1.0, 0, True, credit_ns=0)], Q, W) is not None


def test_limit_credit_accrues_caps_and_charges():
    c = LimitCredit(0, cap_ns=2 * Q)
    assert c.value(10 * Q, 0.5) == 2 * Q  # capped burst
    c.charge(3 * Q)
    assert c.value(10 * Q, 0.5) == -Q
    assert c.eligible_at(10 * Q, 0.5) == 12 * Q + 1


def test_limit_credit_is_not_capped_while_held():
    c = LimitCredit(0, cap_ns=2 * Q)
    c.hold(0, 0.5)
    # a 5-quantum kernel: what the lease earns while it runs pays for it, beyond the cap
    assert c.value(5 * Q, 0.5) == int(2.5 * Q)
    c.charge(5 * Q, 5 * Q, 0.5)
    assert c.value(5 * Q, 0.5) == int(-2.5 * Q)  # the debt is carried over
    assert c.eligible_at(5 * Q, 0.5) == 10 * Q + 1
    assert c.value(20 * Q, 0.5) == 2 * Q  # not held: capped again


@pytest.mark.parametrize("kernel_ms", [50, 100])
def test_simulated_shares_with_kernels_longer_than_the_quantum(kernel_ms):
    """Limits that add up to 1 and leases of one long kernel each: no tenant's credit is lost
    to the cap, so they never all sit in debt (an idle device)."""
    shares = simulate({"a": (0.3, 0.3), "b": (0.7, 0.7)}, seconds=30, kernel_ns=kernel_ms * 10**6)
    assert abs(shares["a"] - 0.3) <= 0.01 and abs(shares["b"] - 0.7) <= 0.01, shares
    assert shares["a"] + shares["b"] >= 0.99, shares
    assert simulate({"a": (0.5, 0.5)}, kernel_ns=kernel_ms * 10**6)["a"] <= 0.5 + 0.01


def test_usage_window_trims_and_counts_running_lease():
    w = UsageWindow()
    w.charge(0, 100)
    w.charge(500, 700)
    assert w.used(1000, 1000) == 300
    assert w.used(1050, 1000) == 250  # [50, 100) and [500, 700)
    assert w.used(1050, 1000, running_since=1000) == 300
    assert w.total_ns == 300
    # when does it drop to 100 ns in the window? [500,700) must slide out to 100 left
    assert w.time_when_below(100, 1050, 1000) == 1600


def simulate(specs, seconds=10.0, quantum=Q, window=W, idle_after=None, kernel_ns=0):
    """Saturating tenants on one GPU driven by `pick` (no I/O): each grant runs its full lease,
    or one kernel of `kernel_ns` when that is longer (a lease cannot end inside a kernel); the
    credit is held during the lease and the cap follows the leases' length, as GpuLoop does."""
    windows = {k: UsageWindow() for k in specs}
    credits = {k: LimitCredit(0, 2 * quantum) for k in specs}
    last = dict.fromkeys(specs, 0)
    now = 0
    end = int(seconds * 1e9)
    while now < end:
        views = [
            TenantView(
                k,
                r,
                lim,
                windows[k].used(now, window),
                waiting=idle_after is None or k not in idle_after or now < idle_after[k],
                last_grant_ns=last[k],
                credit_ns=credits[k].value(now, lim),
            )
            for k, (r, lim) in specs.items()
        ]
        grant = pick(views, quantum, window)
        if grant is None:
            now += 1_000_000  # idle millisecond
            continue
        ran = max(grant.lease_ns, kernel_ns)
        credit = credits[grant.key]
        credit.hold(now, specs[grant.key][1])
        windows[grant.key].charge(now, now + ran)
        last[grant.key] = now
        now += ran
        credit.cap_ns = max(2 * quantum, 2 * ran, (3 * credit.cap_ns) // 4)
        credit.charge(ran, now, specs[grant.key][1])
    return {k: w.total_ns / end for k, w in windows.items()}


def test_simulated_shares_follow_requests():
    shares = simulate({"a": (0.3, 0.3), "b": (0.7, 0.7)})
    assert abs(shares["a"] - 0.3) <= 0.01
    assert abs(shares["b"] - 0.7) <= 0.01


def test_simulated_limit_alone_and_work_conserving():
    assert simulate({"a": (0.5, 0.5)})["a"] <= 0.5 + 2 * Q / 10e9
    assert simulate({"a": (0.3, 1.0)})["a"] >= 0.99


def test_simulated_idle_time_is_taken_up():
    shares = simulate({"a": (0.3, 1.0), "b": (0.7, 1.0)}, seconds=10, idle_after={"b": 5e9})
    # b ran for 5 s at ~0.7, then a took everything: a ≈ 0.3*0.5 + 1.0*0.5
    assert abs(shares["a"] - 0.65) <= 0.02
    assert abs(shares["b"] - 0.35) <= 0.02


def test_simulated_eight_tenants():
    specs = {f"t{i}": (0.125, 0.125) for i in range(8)}
    shares = simulate(specs)
    assert all(abs(s - 0.125) <= 0.01 for s in shares.values())


def _view(key, request, limit, used_s, credit_ns=Q):
    return TenantView(key, request, limit, int(used_s * W), False, 0, credit_ns)


def test_backfill_goes_to_shares_with_limit_credit_only():
    """A limited share backfills at most its credit (never past its limit); one in debt, the
    holder itself, or any share while no lease runs, none."""
    holder = _view("h", 0.7, 0.7, 0.5)
    assert (
        backfill_allowance(_view("a", 0.3, 0.3, 0.1, credit_ns=Q // 2), holder, W, 2 * Q) == Q // 2
    )
    assert backfill_allowance(_view("a", 0.3, 0.3, 0.1, credit_ns=-1), holder, W, 2 * Q) == 0
    assert backfill_allowance(holder, holder, W, 2 * Q) == 0
    assert backfill_allowance(_view("a", 0.3, 0.3, 0.1), None, W, 2 * Q) == 0
    assert backfill_allowance(_view("a", 0.3, 1.0, 0.9, credit_ns=-Q), holder, W, 2 * Q) == 2 * Q


def test_backfill_between_shares_above_their_requests_goes_by_request():
    """Idle time is split by request: a share above its request backfills a holder above its
    own only when it is not further ahead (used / request), unless the holder's leases leave the
    device idle (host-bound: its gaps are nobody's) or the holder is below its request."""
    holder = _view("h", 0.3, 1.0, 0.45)  # 1.5 x its request
    ahead = _view("a", 0.2, 1.0, 0.4)  # 2 x
    behind = _view("b", 0.2, 1.0, 0.25)  # 1.25 x
    assert backfill_allowance(ahead, holder, W, 2 * Q) == 0
    assert backfill_allowance(behind, holder, W, 2 * Q) == 2 * Q
    assert backfill_allowance(ahead, holder, W, 2 * Q, holder_idles=True) == 2 * Q
    owed = _view("h", 0.7, 1.0, 0.5)  # below its request but cannot use its gaps
    assert backfill_allowance(ahead, owed, W, 2 * Q) == 2 * Q
