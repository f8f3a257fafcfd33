"""The simulator's shared state (``sim.state``) is writable by every user, as /dev/nvidia* are:
whatever another user writes into it, a CUDA or NVML call of the simulated driver returns (an
error code is fine) and never crashes (SIGSEGV, SIGBUS) or hangs (issue 23, item 11).

Each case writes a damaged state (one field at its boundary values, every process record taken,
random bytes over a field, a region or the whole file) and runs ``sim_state_fuzz.c`` (the
driver's device queries, a context, an allocation, launches and a synchronise; NVML's device,
memory, utilisation and per-process queries) on it with a time limit; then more programs run
while another thread keeps writing random damage under them.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from simmachine import CSRC, HERE, SimMachine

from jupyter_gpushare.simulator import _State

SOURCE = HERE / "sim_state_fuzz.c"
#: one program's run on one damaged state (it takes ~10 ms on a sound one)
RUN_LIMIT_S = 5.0
#: the whole test (a loaded 2-core machine)
BUDGET_S = 20.0

U64 = [0, 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
U32 = [0, 1, 63, 64, 65, 255, 256, 2**31 - 1, 2**31, 2**32 - 1]
I32 = [0, 1, -1, 2**31 - 1, -(2**31), os.getpid(), 1 - 2**31]


@pytest.fixture(scope="module")
def fuzz_program(sim_program: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sim_state_fuzz.c``, compiled as the other test programs are (after the libraries:
    ``sim_program`` built them)."""
    out = tmp_path_factory.mktemp("fuzz") / "sim_state_fuzz"
    flags = ["-std=gnu11", "-g", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{CSRC / 'include'}"]
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, *flags, str(SOURCE), "-o", str(out), "-ldl"], check=True)
    return out


def offset(path: str) -> tuple[int, int]:
    """Byte offset and size of a field of ``struct sim_state``: "dev.1.busy_until",
    "proc.0.dev.1.mem", "ndev"."""
    parts = path.split(".")
    kind: Any = _State
    at = 0
    while parts:
        name = parts.pop(0)
        field = getattr(kind, name)
        at += field.offset
        kind = dict(kind._fields_)[name]
        if parts and parts[0].isdigit():
            index = int(parts.pop(0))
            at += index * ctypes.sizeof(kind._type_)
            kind = kind._type_
            if not parts:
                return at, ctypes.sizeof(kind)
    return at, ctypes.sizeof(kind)


def put(image: bytearray, path: str, value: int | bytes) -> None:
    at, size = offset(path)
    data = value if isinstance(value, bytes) else (value % 2 ** (8 * size)).to_bytes(size, "little")
    image[at : at + size] = data[:size].ljust(size, b"\0")


def cases(pristine: bytes, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what was damaged, the damaged state)."""

    def one(path: str, value: int | bytes) -> tuple[str, bytes]:
        image = bytearray(pristine)
        put(image, path, value)
        return f"{path}={value!r:.40}", bytes(image)

    for v in U32:
        yield one("ndev", v)
    for d in (0, 1):  # the machine's two devices
        for name in ("total_bytes", "created_ns", "busy_until", "busy_total", "mem_used"):
            for v in U64:
                yield one(f"dev.{d}.{name}", v)
        for v in U32:
            yield one(f"dev.{d}.sms", v)
        for name in ("uuid", "name"):
            yield one(f"dev.{d}.{name}", b"GPU-" + b"\xff" * 92)  # no NUL, not UTF-8
            yield one(f"dev.{d}.{name}", b"")
        for s in (0, 63):
            for name in ("seq", "t", "done", "until"):
                for v in (1, 2**63, 2**64 - 1):
                    yield one(f"dev.{d}.samples.{s}.{name}", v)
    for v in I32:
        yield one("proc.0.pid", v)
        yield one("proc.0.host_pid", v)
    for name in ("mem", "busy", "last_end", "sample_t", "sample_busy"):
        for v in (2**63, 2**64 - 1):
            yield one(f"proc.0.dev.0.{name}", v)
    yield one("proc.0.dev.0.contexts", 2**32 - 1)
    for pid in (1, os.getpid(), -(2**31)):  # every record taken (by init, by us, half-reaped)
        image = bytearray(pristine)
        for i in range(len(_State().proc)):
            put(image, f"proc.{i}.pid", pid)
            put(image, f"proc.{i}.start_time", 2**64 - 1)
        yield f"every proc.pid={pid}", bytes(image)
    for path in ("dev.0", "dev.1", "proc.0", "proc.1"):  # random bytes over a whole record
        for _ in range(4):
            at, size = offset(path)
            image = bytearray(pristine)
            image[at : at + size] = rng.randbytes(size)
            yield f"random {path}", bytes(image)
    for _ in range(6):  # random regions, the header kept
        image = bytearray(pristine)
        at = rng.randrange(32, len(image) - 4096)
        image[at : at + 4096] = rng.randbytes(4096)
        yield f"random 4 KiB at {at}", bytes(image)
    yield "random file", rng.randbytes(len(pristine))
    yield "zeros", bytes(len(pristine))


def write_state(path: Path, data: bytes) -> None:
    """Over the file in place (the processes map it), as another user would."""
    with open(path, "r+b") as f:
        f.write(data)


def run_once(program: Path, machine: SimMachine, what: str = "both") -> tuple[int, str]:
    proc = subprocess.run(
        [str(program), what],
        env=machine.env,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    return proc.returncode, proc.stderr[-500:]


def test_no_state_crashes_or_hangs_a_cuda_or_nvml_call(
    sim_machine: SimMachine, fuzz_program: Path
) -> None:
    began = time.monotonic()
    machine = sim_machine
    rc, err = run_once(fuzz_program, machine)
    assert rc == 0, err
    path = machine.state_path
    pristine = path.read_bytes()
    assert len(pristine) == ctypes.sizeof(_State)
    rng = random.Random(23)
    failures: list[str] = []

    def check(label: str, run: Callable[[], tuple[int, str]]) -> None:
        try:
            rc, err = run()
        except subprocess.TimeoutExpired:
            failures.append(f"{label}: no answer within {RUN_LIMIT_S} s")
            return
        if rc < 0:
            failures.append(f"{label}: killed by signal {-rc}: {err}")

    count = 0
    for label, damaged in cases(pristine, rng):
        write_state(path, damaged)
        check(label, lambda: run_once(fuzz_program, machine))
        count += 1
    write_state(path, pristine)

    # damage written while the programs run (a reader between two reads of one value)
    stop = threading.Event()
    labels = [label for label, _ in cases(pristine, random.Random(5))]

    def damage() -> None:
        mine = random.Random(7)
        all_cases = list(cases(pristine, random.Random(5)))
        while not stop.is_set():
            write_state(path, mine.choice(all_cases)[1])
            time.sleep(0.001)

    writer = threading.Thread(target=damage, daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            check("while damage was written", lambda: run_once(fuzz_program, machine))
            count += 1
    finally:
        stop.set()
        writer.join(5)
    took = time.monotonic() - began
    assert not failures, f"{len(failures)} of {count} runs failed:\n" + "\n".join(failures[:20])
    assert len(labels) > 100 and took < BUDGET_S, (len(labels), took)
