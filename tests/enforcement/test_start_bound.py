"""A limited tenant's first seconds: its queue must not hold more device time than its limit
allows from its very first lease (issue 18: a limit-0.125 tenant with a deep queue of 50 ms
kernels ran 1.1 s of kernels in its first ~1.5 s, then got nothing for ~7 s while it paid the
debt back; averaged over 10 s it looked right). The daemon published a tenant's runahead bound
only after waking its first lease's holder, which could read 0 (no bound) and queue 32 launches
unchecked: a race, so the test starts three tenants one after another (each one's first lease
is a fresh chance; about half lost it)."""

from __future__ import annotations

import pytest
from enforcement_support import add_allocation, device_shares, remove_allocation, spawn_tenant

pytestmark = pytest.mark.timeout(120)


def test_a_limited_deep_queue_stays_under_its_limit_from_the_start(daemon, ledger, gpus, tmp_path):
    """Limit 0.125 alone, 50 ms kernels queued without a sync: the device time each of three
    tenants in turn gets in its first 2 s (device-time reports of its queue) is at most
    0.125 x 2 s plus one kernel, the limit credit's cap (two 20 ms quanta) and 30 ms."""
    got = []
    for _ in range(3):
        a = add_allocation(ledger, gpus[0], 0.125, 0.125)
        argv = ["load", "2.2", "50000", "deep"]
        t = spawn_tenant(daemon, ledger, a, gpus, argv, tmp_path, drain=True)
        lines = t.finish(timeout=60)
        remove_allocation(ledger, a.id)
        t0 = lines[0]["start"]
        (share,) = device_shares([t], t0, t0 + 2_000_000_000)
        got.append(share * 2.0)  # seconds of device time in its first 2 s
    assert max(got) <= 0.125 * 2.0 + 0.050 + 0.040 + 0.030, got
    assert min(got) >= 0.125, got  # and each does run
