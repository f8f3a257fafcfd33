"""``jupyter gpushare run`` with native programs: a driver-API C program that calls ``cuInit``
first thing is enforced (never refused for "no process yet"), arguments after the first ``--``
reach the command verbatim, and exit statuses pass through."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from support import wait_for

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.paths import lib_dir

CSRC = Path(__file__).resolve().parent.parent / "jupyter_gpushare" / "csrc"

#: A native CUDA program, linked against libcuda.so.1 like any other: cuInit is its first call.
PROGRAM = r"""
#include <stdint.h>
#include <stdio.h>
#include "gpushare_cuda.h"
#define CK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { \
    fprintf(stderr, "%s = %d\n", #call, (int)r_); return 10; } } while (0)
int main(void)
{
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUdeviceptr ptr;
    uint64_t us = 200;
    void *params[] = {&us};
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuCtxCreate_v2(&ctx, 0, dev));
    CK(cuModuleLoadData(&mod, "any module"));
    CK(cuModuleGetFunction(&fn, mod, "busy_us"));
    CK(cuMemAlloc_v2(&ptr, 1 << 20));
    for (int i = 0; i < 5; i++)
        CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
    CK(cuCtxSynchronize());
    CK(cuMemFree_v2(ptr));
    CK(cuCtxDestroy_v2(ctx));
    printf("ok\n");
    return 0;
}
"""


def gpushare(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def cuda_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = os.environ.get("CC", "cc")
    sim = lib_dir() / "sim"
    if shutil.which(cc) is None or not (sim / "libcuda.so").exists():
        pytest.skip("needs a C compiler and the built simulator")
    folder = tmp_path_factory.mktemp("cudaprog")
    (folder / "prog.c").write_text(PROGRAM)
    subprocess.run(
        [
            cc,
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{CSRC / 'include'}",
            str(folder / "prog.c"),
            "-o",
            str(folder / "prog"),
            f"-L{sim}",
            "-lcuda",
        ],
        check=True,
    )
    return folder / "prog"


def test_a_native_program_calling_cuinit_at_once_runs_every_time(gpushare_env, cuda_program):
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    for attempt in range(10):
        done = gpushare(env, "run", "--gpu-request", "0.5", "--", str(cuda_program))
        assert done.returncode == 0 and done.stdout == "ok\n", (attempt, done.stderr)
        assert "CUDA_ERROR" not in done.stderr and "refused" not in done.stderr
    # the agent enforced every run: it accepted each hello and refused nobody
    status = DaemonClient(env["GPUSHARE_SOCKET"]).status()
    assert status["ok"] and status["daemon"]["refused"] == 0
    left = json.loads(gpushare(env, "status", "--json").stdout)["allocations"]
    assert left == []  # each run released its share


def test_runs_started_together_on_a_fresh_machine_share_one_agent(gpushare_env, cuda_program):
    """Eight runs at once each start an agent; one serves the socket, the others step aside
    (they exit 0) and every run uses the one that serves, enforced from its first call."""
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare",
                "run",
                "--gpu-request",
                "0.1",
                "--",
                str(cuda_program),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    results = [(run.wait(120), *run.communicate()) for run in runs]
    for code, out, err in results:
        assert (code, out) == (0, "ok\n"), err
        assert "gpushare:" not in err  # no "the gpushare daemon did not start", no refusal
    status = DaemonClient(env["GPUSHARE_SOCKET"]).status()
    assert status["ok"] and status["daemon"]["refused"] == 0

    def agents() -> list[int]:
        return [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if env["GPUSHARE_SOCKET"] in (p.info["cmdline"] or [])
            and "jupyter_gpushare.daemon" in (p.info["cmdline"] or [])
        ]

    wait_for(lambda: agents() == [status["daemon"]["pid"]], timeout=20)  # the others are gone


def test_the_simulator_state_directory_is_made_private_on_a_fresh_machine(
    gpushare_env, cuda_program, tmp_path
):
    state = tmp_path / "fresh" / "sim" / "sim.state"  # nothing of it exists yet
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100", "GPUSHARE_SIM_STATE": str(state)}
    done = gpushare(env, "run", "--", str(cuda_program))
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr  # was cuInit = 304
    assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700


def test_an_agent_killed_while_a_command_runs_is_started_again(gpushare_env):
    """No Jupyter server here: ``run`` itself keeps the agent up while its command runs."""
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    script = textwrap.dedent("""
        import os, signal, sys, time
        from jupyter_gpushare.daemon.client import DaemonClient
        client = DaemonClient(os.environ["GPUSHARE_SOCKET"], timeout=5.0)
        first = client.ping()["pid"]
        os.kill(first, signal.SIGKILL)
        # a new agent, and this run's share in force there (it answers while it reads the
        # ledger: the share may show a moment after its first answer); a loaded machine may
        # take a few seconds for either
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                second = client.ping()["pid"]
                shares = client.status(os.environ["GPUSHARE_ALLOCATION_ID"]).get("allocations")
                if second != first and shares:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            sys.exit("no new agent enforcing this share")
        print(first != second, shares[0]["request"])
    """)
    done = gpushare(
        env, "run", "--gpu-request", "0.3", "--", sys.executable, "-c", script, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0.3"]  # the new agent enforces this run's share
    assert "does not answer; starting a new one" in done.stderr


def test_without_an_agent_the_command_still_runs_fail_static(gpushare_env, cuda_program, tmp_path):
    """The agent cannot start (a file stands where its directory would be): ``run`` says so in
    one line and the command runs under the interposer's own limits; the share is released."""
    (tmp_path / "taken").write_text("")
    env = {
        **gpushare_env,
        "GPUSHARE_SIMULATE": "1xA100",
        "GPUSHARE_SOCKET": str(tmp_path / "taken" / "daemon.sock"),
        "GPUSHARE_SIM_STATE": str(tmp_path / "sim" / "sim.state"),
    }
    done = gpushare(env, "run", "--", str(cuda_program))
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    assert "gpushare: no node agent:" in done.stderr and "Traceback" not in done.stderr
    assert json.loads(gpushare(env, "status", "--json").stdout)["allocations"] == []


def test_run_keeps_every_argument_after_the_first_double_dash(gpushare_env):
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    done = gpushare(
        env,
        "run",
        "--",
        sys.executable,
        "-c",
        "import sys; print(sys.argv)",
        "--",
        "x",
        "--gpu-request",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(["-c", "--", "x", "--gpu-request", "1"])


def test_run_passes_exit_statuses_and_signals_through(gpushare_env):
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    assert gpushare(env, "run", "--", "sh", "-c", "exit 7").returncode == 7
    assert gpushare(env, "run", "--", "sh", "-c", "kill -TERM $$").returncode == 128 + 15
    refused = gpushare(env, "run", "--", str(Path(env["JUPYTER_DATA_DIR"])))  # a directory
    assert refused.returncode == 126 and "cannot run" in refused.stderr
