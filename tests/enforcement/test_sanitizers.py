"""The interposer under AddressSanitizer (+UBSan) and ThreadSanitizer: the memory stress and a
saturating tenant next to a plain one, with the instrumented libgpushare and tenant builds."""

from __future__ import annotations

import subprocess

import pytest
from enforcement_support import LIB, add_allocation, spawn_tenant

pytestmark = pytest.mark.timeout(180)

SANITIZERS = {
    "asan": {
        "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=66",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=66",
        "LSAN_OPTIONS": "suppressions=" + str(LIB / "test" / "lsan.supp"),
    },
    "tsan": {"TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0"},
}


@pytest.mark.parametrize("kind", ["asan", "tsan"])
def test_interposer_under_sanitizer(kind, daemon, ledger, gpus, tmp_path):
    (LIB / "test" / "lsan.supp").write_text(
        "# the simulated driver keeps per-process state for the process lifetime\n"
        "leak:libcuda.so.1\n"
    )
    binary = LIB / "test" / f"gs_tenant-{kind}"
    # preloaded libraries come before the program's own: the sanitizer runtime must be first
    runtimes = ["libasan.so", "libubsan.so"] if kind == "asan" else ["libtsan.so"]
    paths = [
        subprocess.run(
            ["cc", f"-print-file-name={r}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        for r in runtimes
    ]
    preload = ":".join([*paths, str(LIB / "test" / f"libgpushare-{kind}.so")])
    env = SANITIZERS[kind]
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
