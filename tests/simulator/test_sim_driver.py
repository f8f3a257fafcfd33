"""The simulated CUDA driver, driven by a real driver-API program (sim_driver_test.c)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

from simmachine import SimMachine

from jupyter_gpushare.inventory import simulated_gpus, simulator_device_list
from jupyter_gpushare.simulator import SimState, default_state_path, simulator_env

MS = 1_000_000  # ns


def hex_uuid(gpu_uuid: str) -> str:
    return uuid.UUID(gpu_uuid.removeprefix("GPU-")).hex


def test_devices_come_from_the_device_list(sim_machine: SimMachine) -> None:
    info = sim_machine.run("info")
    assert info["driver"] == "13000"
    assert info["count"] == str(len(sim_machine.gpus))
    for i, gpu in enumerate(sim_machine.gpus):
        assert info[f"name{i}"] == gpu.name
        assert info[f"uuid{i}"] == hex_uuid(gpu.uuid)
        assert int(info[f"total{i}"]) == gpu.memory
        assert info[f"sms{i}"] == "108"
        assert info[f"cc{i}"] == "8.0"


def test_cuda_visible_devices_by_uuid_index_and_prefix(sim_machine: SimMachine) -> None:
    first, second = sim_machine.gpus
    cases = {
        second.uuid: [second],
        f"{second.uuid},{first.uuid}": [second, first],
        "1,0": [second, first],
        "1": [second],
        second.uuid[:12]: [second],  # a unique UUID prefix, as the real driver accepts
        f"0,{first.uuid}": [first],  # a repeated device ends the list
        "0,7,1": [first],  # so does an unknown one
    }
    for value, expected in cases.items():
        info = sim_machine.run("info", env={**sim_machine.env, "CUDA_VISIBLE_DEVICES": value})
        assert info["count"] == str(len(expected)), value
        assert [info[f"uuid{i}"] for i in range(len(expected))] == [
            hex_uuid(g.uuid) for g in expected
        ], value


def test_no_visible_device_fails_init(sim_machine: SimMachine) -> None:
    proc = sim_machine.start("info", env={**sim_machine.env, "CUDA_VISIBLE_DEVICES": ""})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "CUDA_ERROR_NO_DEVICE" in err


def test_driver_api_selftest(sim_machine: SimMachine) -> None:
    """Contexts, streams, events, memory, copies, pools, VMM, arrays, graphs, entry points."""
    proc = sim_machine.start("selftest")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "selftest ok" in out


def test_busy_kernels_take_their_time(sim_machine: SimMachine) -> None:
    out = sim_machine.run("busy", "1000", "500")
    # Events measure device time exactly; launching is asynchronous and cheap.
    assert 500.0 <= float(out["event_ms"]) <= 500.01
    assert float(out["launch_ms"]) < 100
    assert 500.0 <= float(out["wall_ms"]) < 650
    dev = sim_machine.state().device(sim_machine.gpus[0].uuid)
    assert dev.busy_total_ns == 500 * MS
    assert dev.launches == 500


def _together(
    machine: SimMachine,
    devices: tuple[int, int],
    env: dict[str, str] | None = None,
    stagger_ms: int = 0,
) -> tuple[float, list[dict[str, str]]]:
    """Two processes, each 500 x busy_us(1000), started at one instant (the second `stagger_ms`
    later); returns the time from that instant until the last one finished (ms) and their
    outputs, with "finish_ms" (from the common instant) added."""
    start = time.monotonic_ns() + 400 * MS
    procs = [
        machine.start(
            "busy", "1000", "500", str(dev), "nb", str(start + i * stagger_ms * MS), env=env
        )
        for i, dev in enumerate(devices)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outs.append(dict(line.split("=", 1) for line in out.splitlines()))
    for o in outs:
        o["finish_ms"] = str((float(o["end_ns"]) - start) / MS)
    finished = max(float(o["end_ns"]) for o in outs)
    return (finished - start) / MS, outs


def test_two_processes_share_one_device_in_time(sim_machine: SimMachine) -> None:
    span, outs = _together(sim_machine, (0, 0))
    # The device runs one kernel at a time: 1 s of kernels takes 1 s, whoever launched them.
    assert 1000.0 <= span < 1250, span
    dev = sim_machine.state().device(sim_machine.gpus[0].uuid)
    assert dev.busy_total_ns == 1000 * MS
    first_launch = min(int(float(o["start_ns"])) for o in outs)
    assert 1000 * MS <= dev.busy_until_ns - first_launch < 1010 * MS  # no idle gap inside


def test_queue_bound_sets_how_processes_interleave(sim_machine: SimMachine) -> None:
    """Work runs in the order it was queued. The second process starts 100 ms after the first.
    With the default bound (1 s of work ahead) the first has queued all its 500 ms by then and
    finishes at 500 ms; with a 5 ms bound it has only 5 ms queued, so from 100 ms on the two
    alternate in slices of about 5 ms, like a time-sliced GPU, and the first finishes near
    100 + 2 x 400 = 900 ms."""
    _, outs = _together(sim_machine, (0, 0), stagger_ms=100)
    first, second = (float(o["finish_ms"]) for o in outs)
    assert 500 <= first < 650 and 1000 <= second < 1250, (first, second)
    sliced = {**sim_machine.env, "GPUSHARE_SIM_QUEUE_AHEAD_US": "5000"}
    _, outs = _together(sim_machine, (0, 0), env=sliced, stagger_ms=100)
    earlier, later = sorted(float(o["finish_ms"]) for o in outs)  # either may finish first
    assert 850 <= earlier and 1000 <= later < 1250, (earlier, later)


def test_two_processes_on_two_devices_run_in_parallel(sim_machine: SimMachine) -> None:
    span, _ = _together(sim_machine, (0, 1))
    assert 500.0 <= span < 750, span
    for gpu in sim_machine.gpus:
        assert sim_machine.state().device(gpu.uuid).busy_total_ns == 500 * MS


def test_memory_is_charged_and_returned_when_a_process_dies(sim_machine: SimMachine) -> None:
    gpu = sim_machine.gpus[0]
    holder = sim_machine.hold(3 << 30, 10)
    state = sim_machine.state()
    assert state.device(gpu.uuid).mem_used == 3 << 30
    [proc] = [p for p in state.processes() if p.pid == holder.pid]
    assert proc.memory == {gpu.uuid: 3 << 30}
    assert proc.contexts == {gpu.uuid: 1}
    # Another process sees the device's memory as taken.
    second = sim_machine.hold(gpu.memory - (3 << 30), 10)
    assert state.device(gpu.uuid).mem_used == gpu.memory
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # Whoever looks next (here: a process that allocates) reaps the dead process's memory.
    third = sim_machine.hold(1 << 30, 10)
    assert state.device(gpu.uuid).mem_used == gpu.memory - (3 << 30) + (1 << 30)
    assert {p.pid for p in state.processes()} == {second.pid, third.pid}
    for proc in (second, third):
        proc.send_signal(signal.SIGTERM)
        proc.wait()


def test_allocation_beyond_free_memory_fails(sim_machine: SimMachine) -> None:
    gpu = sim_machine.gpus[0]
    sim_machine.hold(gpu.memory - (1 << 20), 10)
    proc = sim_machine.start("hold", str(2 << 20), "10")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "CUDA_ERROR_OUT_OF_MEMORY" in err


def test_processes_starting_together_share_one_state(sim_machine: SimMachine) -> None:
    """Many processes creating the state file at once: one initialisation, one device table."""
    procs = [sim_machine.start("info") for _ in range(8)]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "count=2" in out
    devices = sim_machine.state().devices()
    assert [d.uuid for d in devices] == [g.uuid for g in sim_machine.gpus]
    # A state file named by GPUSHARE_SIM_STATE is the machine's: every user's processes use it.
    assert stat.S_IMODE(sim_machine.state_path.stat().st_mode) == 0o666


def test_a_state_file_of_another_version_is_replaced(sim_machine: SimMachine) -> None:
    for junk in (b"not a state file", bytes(4096)):
        sim_machine.state_path.write_bytes(junk)
        assert sim_machine.run("info")["count"] == "2"
        assert len(sim_machine.state().devices()) == 2
    # Same size, other magic: replaced as well.
    size = sim_machine.state_path.stat().st_size
    sim_machine.state_path.write_bytes(b"\x01" * size)
    assert sim_machine.run("info")["count"] == "2"
    assert len(sim_machine.state().devices()) == 2


def test_default_state_path_is_shared_by_c_and_python(sim_machine: SimMachine) -> None:
    """Without GPUSHARE_SIM_STATE the simulator picks a per-user, per-device-list file; the
    Python helper computes the same name."""
    gpus = simulated_gpus("1xH100", node=f"default-path-{os.getpid()}")
    env = {k: v for k, v in sim_machine.env.items() if k != "GPUSHARE_SIM_STATE"}
    env.update(simulator_env(gpus, base=env))
    path = Path(env.pop("GPUSHARE_SIM_STATE"))
    assert path == default_state_path(simulator_device_list(gpus))
    assert not path.exists()
    try:
        info = sim_machine.run("info", env=env)
        assert info["name0"] == "NVIDIA H100 80GB HBM3" and info["cc0"] == "9.0"
        assert [d.uuid for d in SimState(path).devices()] == [gpus[0].uuid]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # private to the user
    finally:
        path.unlink(missing_ok=True)


def test_contexts_can_take_device_memory(sim_machine: SimMachine) -> None:
    """GPUSHARE_SIM_CONTEXT_BYTES: each context takes that much, as a real one takes a few
    hundred MiB; it shows in NVML's per-process memory and comes back with the context."""
    gpu = sim_machine.gpus[0]
    sim_machine.env["GPUSHARE_SIM_CONTEXT_BYTES"] = str(300 << 20)
    holder = sim_machine.hold(1 << 20, 10)
    time.sleep(0.05)  # its 10 ms of work done: the selftest below times kernels on an idle device
    state = sim_machine.state()
    assert state.device(gpu.uuid).mem_used == (300 << 20) + (1 << 20)
    [proc] = state.processes()
    assert proc.pid == holder.pid and proc.memory == {gpu.uuid: (300 << 20) + (1 << 20)}
    out, err = sim_machine.start("selftest").communicate(timeout=60)
    assert "selftest ok" in out, err
    holder.send_signal(signal.SIGTERM)
    holder.wait()
    sim_machine.run("info")  # any process that looks reaps the holder's record
    assert state.device(gpu.uuid).mem_used == 0


def test_a_forked_child_does_not_keep_its_parents_memory(sim_machine: SimMachine) -> None:
    """A child forked after the parent allocated (and never using CUDA itself) must not keep
    the parent's record alive: when the parent dies its memory comes back."""
    gpu = sim_machine.gpus[0]
    parent = sim_machine.hold(2 << 30, 10, 0, "fork")
    child = parent.child_pid  # type: ignore[attr-defined]
    try:
        assert sim_machine.state().device(gpu.uuid).mem_used == 2 << 30
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        os.kill(child, 0)  # the child lives on
        sim_machine.run("info")
        assert sim_machine.state().device(gpu.uuid).mem_used == 0
        assert sim_machine.state().processes() == []
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_cuda_runtime_is_told_once_why_it_cannot_run(sim_machine: SimMachine) -> None:
    """The CUDA runtime's first call asks for the driver's private export tables; the simulator
    refuses them (as before) and says once on stderr that it runs driver-API programs only."""
    probe = (
        "import ctypes, sys\n"
        "cuda = ctypes.CDLL('libcuda.so.1')\n"
        "table = ctypes.c_void_p(1)\n"
        "uuid = (ctypes.c_ubyte * 16)()\n"
        "codes = [cuda.cuGetExportTable(ctypes.byref(table), uuid) for _ in range(3)]\n"
        "print(codes, table.value)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe],
        env=sim_machine.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert ran.stdout.split() == ["[801,", "801,", "801]", "None"]  # CUDA_ERROR_NOT_SUPPORTED
    assert ran.stderr.count("driver-API programs only") == 1, ran.stderr
    assert "real NVIDIA GPU" in ran.stderr and "--simulate" in ran.stderr


def test_a_notebook_user_sees_the_cuda_runtime_note(sim_machine: SimMachine) -> None:
    """The note is written to the process's stderr descriptor; in a Jupyter kernel (ipykernel
    forwards what its descriptors get) it reaches the cell's output, where the user looks."""
    from jupyter_client.manager import start_new_kernel

    # (ipykernel does not forward descriptors while PYTEST_CURRENT_TEST is set)
    env = {k: v for k, v in sim_machine.env.items() if k != "PYTEST_CURRENT_TEST"}
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    streams: list[tuple[str, str]] = []
    try:
        kc.execute_interactive(
            "import ctypes, time\n"
            "cuda = ctypes.CDLL('libcuda.so.1')\n"
            "uuid = (ctypes.c_ubyte * 16)()\n"
            "print(cuda.cuGetExportTable(ctypes.byref(ctypes.c_void_p()), uuid))\n"
            "time.sleep(0.5)\n",  # ipykernel forwards descriptor output from a thread
            output_hook=lambda m: (
                streams.append((m["content"].get("name"), m["content"].get("text")))
                if m["msg_type"] == "stream"
                else None
            ),
            timeout=60,
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    stderr = "".join(text for name, text in streams if name == "stderr")
    assert "driver-API programs only" in stderr and "real NVIDIA GPU" in stderr, streams
    assert ("stdout", "801\n") in streams
