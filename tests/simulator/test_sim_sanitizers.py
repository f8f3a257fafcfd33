"""The simulator and the driver-API test program under AddressSanitizer (+UBSan) and
ThreadSanitizer: `make -C jupyter_gpushare/csrc sim-asan sim-tsan` builds the libraries into
build/sanitize/, the test program is compiled with the same sanitizer, and every run must be
clean. Skipped where the compiler or the kernel cannot run sanitized programs."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from simmachine import CSRC, SANITIZED, SimMachine, compile_program

SANITIZERS = {
    "asan": (
        ["-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined"],
        {
            "ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        },
        ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"),
    ),
    "tsan": (
        ["-O1", "-fsanitize=thread"],
        {"TSAN_OPTIONS": "halt_on_error=1:exitcode=66"},
        ("WARNING: ThreadSanitizer", "ThreadSanitizer:"),
    ),
}


def _supported(kind: str, flags: list[str], tmp: Path) -> str | None:
    """None if a sanitized program compiles and runs here, else why not."""
    src = tmp / "probe.c"
    src.write_text("#include <pthread.h>\nint main(void) { return 0; }\n")
    exe = tmp / f"probe-{kind}"
    cc = os.environ.get("CC", "cc")
    built = subprocess.run([cc, *flags, "-pthread", str(src), "-o", str(exe)], capture_output=True)
    if built.returncode != 0:
        return f"{cc} cannot build with {flags[-1]}"
    ran = subprocess.run([str(exe)], capture_output=True, text=True)
    if ran.returncode != 0:
        return f"{flags[-1]} programs do not run here: {ran.stderr.strip()[:200]}"
    return None


@pytest.fixture(params=sorted(SANITIZERS))
def sanitized(
    request: pytest.FixtureRequest,
    sim_machine: SimMachine,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[SimMachine, tuple[str, ...]]:
    """The test machine with its program and libraries swapped for sanitized ones."""
    kind = request.param
    flags, options, reports = SANITIZERS[kind]
    tmp = tmp_path_factory.mktemp(f"san-{kind}")
    why = _supported(kind, flags, tmp)
    if why:
        pytest.skip(why)
    subprocess.run(["make", "-s", "-C", str(CSRC), f"sim-{kind}"], check=True)
    sim_machine.program = compile_program(tmp / f"sim_driver_test-{kind}", *flags)
    libs = str(SANITIZED / f"sim-{kind}")
    rest = sim_machine.env["LD_LIBRARY_PATH"].split(":")[1:]
    sim_machine.env.update(options, LD_LIBRARY_PATH=":".join([libs, *rest]))
    return sim_machine, reports


def _clean(proc: subprocess.Popen[str], reports: tuple[str, ...]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{err[-4000:]}"
    for marker in reports:
        assert marker not in err, err[-4000:]
    return out


def test_selftest_is_clean(sanitized: tuple[SimMachine, tuple[str, ...]]) -> None:
    machine, reports = sanitized
    assert "selftest ok" in _clean(machine.start("selftest"), reports)


def test_concurrent_processes_are_clean(sanitized: tuple[SimMachine, tuple[str, ...]]) -> None:
    """Two sanitized processes time-slicing one device, a third on the other device."""
    machine, reports = sanitized
    start = str(time.monotonic_ns() + 500_000_000)
    procs = [
        machine.start("busy", "500", "200", dev, kind, start)
        for dev, kind in (("0", "nb"), ("0", "b"), ("1", "nb"))
    ]
    for proc in procs:
        _clean(proc, reports)
    state = machine.state()
    assert state.device(machine.gpus[0].uuid).busy_total_ns == 2 * 200 * 500_000
    assert state.device(machine.gpus[1].uuid).busy_total_ns == 200 * 500_000
