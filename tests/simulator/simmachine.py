"""Helpers for the GPU simulator's tests: compiling the driver-API test program and a simulated
machine of its own per test (its GPUs, state file, environment and child processes)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.simulator import SimState, nvml_library

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CSRC = REPO / "jupyter_gpushare" / "csrc"
PROGRAM_SOURCE = HERE / "sim_driver_test.c"
SANITIZED = REPO / "build" / "sanitize"


def compile_program(out: Path, *flags: str) -> Path:
    """Compiles the driver-API test program (it dlopen()s libcuda.so.1, links nothing of ours)."""
    cc = os.environ.get("CC", "cc")
    subprocess.run(
        [
            cc,
            "-std=gnu11",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pthread",
            *flags,
            f"-I{CSRC / 'include'}",
            str(PROGRAM_SOURCE),
            "-o",
            str(out),
            "-ldl",
        ],
        check=True,
    )
    return out


@dataclass
class SimMachine:
    """A simulated machine of its own for one test: its GPUs, state file and environment."""

    gpus: list[Gpu]
    state_path: Path
    env: dict[str, str]
    program: Path
    children: list[subprocess.Popen[str]] = field(default_factory=list)

    def state(self) -> SimState:
        return SimState(self.state_path)

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> dict[str, str]:
        """Runs the test program to completion; its key=value output as a dict."""
        proc = subprocess.run(
            [str(self.program), *args],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, f"{args}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return parse(proc.stdout)

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Starts the test program in the background (killed at the end of the test)."""
        proc = subprocess.Popen(
            [str(self.program), *args],
            env=env or self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.children.append(proc)
        return proc

    def hold(
        self, nbytes: int, busy_ms: int, device: int = 0, *extra: str
    ) -> subprocess.Popen[str]:
        """A process holding `nbytes` on `device` and keeping it busy for `busy_ms`."""
        proc = self.start("hold", str(nbytes), str(busy_ms), str(device), *extra)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.startswith("child="):
            proc.child_pid = int(line.split("=")[1])  # type: ignore[attr-defined]
            line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
        return proc


def parse(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


def bind_pynvml(env: dict[str, str], monkeypatch: Any) -> Iterator[Any]:
    """pynvml in this process, bound to the simulated libnvidia-ml.so.1 of the machine whose
    environment is `env` (its GPUSHARE_* variables); for a fixture to ``yield from``."""
    import pynvml

    for key, value in env.items():
        if key.startswith("GPUSHARE_"):
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(pynvml, "nvmlLib", ctypes.CDLL(str(nvml_library())))
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()


def gpushare_run(env: dict[str, str], *args: str, **kw: Any) -> subprocess.Popen[str]:
    """``gpushare run ARGS`` in the background, its output piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare", "run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@contextmanager
def other_share_holding(env: dict[str, str], program: Path, nbytes: int) -> Iterator[Any]:
    """Another tenant: ``gpushare run --gpu-memory 4GiB`` of `program` holding `nbytes`, ready;
    yields its holder (a psutil.Process, the share's child running `program`); ended with
    SIGTERM."""
    import psutil

    other = gpushare_run(
        env, "--gpu-memory", "4GiB", "--", str(program), "hold", str(nbytes), "600000", "0"
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
        (holder,) = [
            child
            for child in psutil.Process(other.pid).children()
            if child.cmdline()[:1] == [str(program)]
        ]
        yield holder
    finally:
        other.send_signal(signal.SIGTERM)
        other.communicate(timeout=30)
