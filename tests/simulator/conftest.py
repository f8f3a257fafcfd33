"""Fixtures for the GPU simulator's tests: the built libraries, the driver-API test program and
an isolated simulated machine per test."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from simmachine import SimMachine, compile_program

from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.simulator import build, simulator_env


@pytest.fixture(scope="session")
def sim_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The simulator libraries, built (incrementally), and the test program compiled against
    nothing but the driver API declarations."""
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("needs make and a C compiler")
    build("sim")
    return compile_program(tmp_path_factory.mktemp("simprog") / "sim_driver_test", "-O1")


@pytest.fixture
def sim_machine(sim_program: Path, tmp_path: Path) -> Iterator[SimMachine]:
    """Two simulated A100s with a fresh state file."""
    gpus = simulated_gpus("2xA100", node="simtest")
    state = tmp_path / "sim.state"
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    env.update(simulator_env(gpus, state, base=env))
    machine = SimMachine(gpus=gpus, state_path=state, env=env, program=sim_program)
    yield machine
    for proc in machine.children:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
