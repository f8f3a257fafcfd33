"""The interposer under AddressSanitizer (+UBSan) and ThreadSanitizer: the memory stress and a
saturating tenant next to a plain one, with the instrumented libgpushare and tenant builds."""

from __future__ import annotations

import pytest
from enforcement_support import LIB, add_allocation, sanitizer_preload, spawn_tenant

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("kind", ["asan", "tsan"])
def test_interposer_under_sanitizer(kind, daemon, ledger, gpus, tmp_path):
    binary = LIB / "test" / f"gs_tenant-{kind}"
    preload, env = sanitizer_preload(kind)
    mem = add_allocation(ledger, gpus[0], 0.5, 1.0, memory=32 * 2**20)
    spin = add_allocation(ledger, gpus[0], 0.5, 1.0)
    tm = spawn_tenant(
        daemon,
        ledger,
        mem,
        gpus,
        ["mem", "8", "150", str(8 * 2**20), "3"],
        tmp_path,
        binary=binary,
        preload=preload,
        extra_env=env,
    )
    ts = spawn_tenant(
        daemon,
        ledger,
        spin,
        gpus,
        ["spin", "2", "500", "4"],
        tmp_path,
        binary=binary,
        preload=preload,
        extra_env=env,
    )
    lines = tm.finish(timeout=150)
    ts.finish(timeout=150)
    for t in (tm, ts):
        assert "Sanitizer" not in t.stderr and "runtime error" not in t.stderr, t.stderr[-4000:]
        assert t.proc.returncode == 0, t.stderr[-4000:]
    assert lines[-1]["errors"] == 0 and lines[-1]["free_after"] == 32 * 2**20
