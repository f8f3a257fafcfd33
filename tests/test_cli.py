"""``jupyter gpushare`` commands as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys


def gpushare(env, *args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_run_passes_exit_code_through_and_releases(gpushare_env):
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    script = (
        "import os, json, subprocess, sys; "
        "st = subprocess.run([sys.executable, '-m', 'jupyter_gpushare', 'status', '--json'],"
        " capture_output=True, text=True); "
        "print(json.dumps({'id': os.environ['GPUSHARE_ALLOCATION_ID'], "
        "'gpu': os.environ['CUDA_VISIBLE_DEVICES'], 'status': json.loads(st.stdout)})); "
        "sys.exit(7)"
    )
    result = gpushare(
        env,
        "run",
        "--gpu-request",
        "0.5",
        "--gpu-memory",
        "8GiB",
        "--",
        sys.executable,
        "-c",
        script,
    )
    assert result.returncode == 7, result.stderr
    seen = json.loads(result.stdout)
    [alloc] = seen["status"]["allocations"]
    assert alloc["id"] == seen["id"] and alloc["gpus"] == [seen["gpu"]]
    assert alloc["gpu_request"] == 0.5 and alloc["gpu_memory"] == 8 * 2**30
    assert alloc["owner"] == "run" and alloc["state"] == "active"
    after = json.loads(gpushare(env, "status", "--json").stdout)
    assert after["allocations"] == [] and after["simulated"] is True


def test_run_refuses_bad_share_before_running(gpushare_env, tmp_path):
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    marker = tmp_path / "ran"
    result = gpushare(env, "run", "--gpu-limit", "1.5", "--", "touch", str(marker))
    assert result.returncode == 2
    # named by the flag the user typed, not the JSON key
    assert "--gpu-limit 1.5 is not allowed: a number in (0, 1]" in result.stderr
    assert "gpu_limit=" not in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()
    full = gpushare(env, "run", "--gpu-type", "H100", "--", "true")
    assert full.returncode == 2 and "--gpu-type H100 is not allowed" in full.stderr
    above = gpushare(env, "run", "--gpu-request", "0.75", "--gpu-limit", "0.5", "--", "true")
    assert above.returncode == 2
    assert "--gpu-request 0.75 is not allowed: at most --gpu-limit (0.5)" in above.stderr


def test_run_is_refused_when_nothing_fits(gpushare_env):
    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare",
            "run",
            "--gpu-request",
            "0.75",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(30)",
        ],
        env=env,
    )
    try:
        for _ in range(100):
            status = json.loads(gpushare(env, "status", "--json").stdout)
            if status["allocations"]:
                break
        result = gpushare(env, "run", "--gpu-request", "0.5", "--", "true")
        assert result.returncode == 3
        assert "0.5 free" in result.stderr
    finally:
        holder.terminate()
        assert holder.wait(30) != 0
    assert json.loads(gpushare(env, "status", "--json").stdout)["allocations"] == []


def test_no_gpu_is_said_clearly(gpushare_env):
    result = gpushare(gpushare_env, "run", "--", "true")
    if result.returncode == 4:  # no NVIDIA driver here (CI): the statement, and how to simulate
        assert "no NVIDIA GPU on this machine" in result.stderr
        assert "--simulate" in result.stderr
    status = gpushare(gpushare_env, "status")
    assert status.returncode == 0


def test_status_shows_another_users_share_as_theirs_without_details(monkeypatch, capsys):
    """Through a system agent a user sees other users' shares redacted (capacity only): the
    table says whose they are instead of printing empty fields ("other pid None")."""
    import argparse

    from jupyter_gpushare import cli
    from jupyter_gpushare.daemon.ledger_ops import redact
    from jupyter_gpushare.ledger import Allocation
    from jupyter_gpushare.share import ShareSpec

    theirs = redact(
        Allocation(
            id="a-0123456789abcdef",
            node="n",
            gpus=("GPU-1",),
            spec=ShareSpec(0.5, 0.5, 2**30, "A100"),
            memory=2**30,
            kernel_id="k-secret",
            pid=4242,
            user="alice",
        )
    )

    async def status(*_args):
        return {"simulated": True, "gpus": [], "allocations": [theirs.to_json()]}

    monkeypatch.setattr(cli, "_status", status)
    monkeypatch.setattr(cli, "_settings", lambda simulate: None)
    args = argparse.Namespace(
        simulate=None, kubernetes_namespace=None, kubeconfig="", json=False, watch=None
    )
    assert cli.cmd_status(args) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if "a-0123456789abcdef" in line]
    assert "another user" in row and "50 %" in row and "GPU-1" in row
    assert "None" not in out and "k-secret" not in out and "4242" not in out
    assert "alice" not in out


#: a command that holds 1 GiB of (simulated) GPU memory and keeps the GPU busy until killed
GPU_WORK = """
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p
cu.cuLaunchKernel.argtypes = [P] + [ctypes.c_uint] * 7 + [P, P, P]
dev, ctx, mod, fn, ptr = ctypes.c_int(), P(), P(), P(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)) == 0
assert cu.cuModuleLoadData(ctypes.byref(mod), b"any module") == 0
assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"busy_us") == 0
us = ctypes.c_uint64(2000)
params = (P * 1)(ctypes.cast(ctypes.byref(us), P))
print("ready", flush=True)
while True:
    cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
    cu.cuCtxSynchronize()
"""


def test_cli_says_each_thing_once_and_uses_the_running_simulated_agent(gpushare_env):
    """With a simulated agent running (started by a ``run --simulate``): ``run`` without
    ``--simulate`` uses its GPUs and says on one stderr line which GPU and share it got; a
    refusal's suggestion is printed once; ``status`` shows user, command, request, limit,
    achieved share and memory used / cap, and no "no NVIDIA GPU" above the simulated GPUs."""
    from support import wait_for

    holder = subprocess.Popen(
        [
            *(sys.executable, "-m", "jupyter_gpushare", "run", "--simulate", "2xA100"),
            *("--gpu-request", "0.5", "--gpu-memory", "4GiB", "--", sys.executable, "-c", GPU_WORK),
        ],
        env=gpushare_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        plain = {k: v for k, v in gpushare_env.items() if k != "GPUSHARE_SIMULATE"}

        refused = gpushare(plain, "run", "--gpu-count", "2", "--", "true")
        assert refused.returncode == 3, refused.stderr
        assert refused.stderr.count("1 whole A100 on one node") == 1, refused.stderr

        got = gpushare(plain, "run", "--gpu-request", "0.25", "--", "true")
        assert got.returncode == 0, got.stderr
        [line] = got.stderr.splitlines()
        assert line.startswith("gpushare run: share a-") and "on GPU " in line
        assert "(A100, simulated, GPU-" in line and "request 25 %, limit 50 %" in line, line

        def live() -> dict | None:
            status = json.loads(gpushare(plain, "status", "--json").stdout)
            [a] = status["allocations"]
            usage = a["usage"] or {}
            return status if usage.get("memory_used") == 1 << 30 else None

        status = wait_for(live, timeout=20)
        assert "message" not in status  # no "no NVIDIA GPU" above simulated GPUs
        [a] = status["allocations"]
        assert a["usage"]["achieved_share"] > 0
        table = gpushare(plain, "status", timeout=60)
        assert table.returncode == 0, table.stderr
        assert "no NVIDIA GPU" not in table.stdout + table.stderr
        [row] = [line for line in table.stdout.splitlines() if a["id"] in line]
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        _id, user, what, gpu, request, limit, achieved, memory, state = cells
        assert user == a["user"] and what.startswith(sys.executable) and gpu == "0 A100"
        assert (request, limit, state) == ("50 %", "50 %", "active")
        assert achieved.endswith(" %") and achieved != "–"
        assert memory == "1GiB / 4GiB"
    finally:
        holder.terminate()
        holder.wait(30)


def test_help_has_no_markup_and_lab_says_where_other_options_go():
    from jupyter_gpushare import cli

    parser = cli.build_parser()
    texts = [parser.format_help()]
    for action in parser._subparsers._group_actions:  # every sub-command's --help
        for name, sub in action.choices.items():
            if name != "controller":  # a traitlets app: its own --help-all
                texts.append(sub.format_help())
    for text in texts:
        assert "``" not in text and ":func:" not in text and ":class:" not in text, text
    lab = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "lab", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lab.returncode == 0
    assert "Every other option goes to JupyterLab" in " ".join(lab.stdout.split())


def test_the_node_agent_notice(gpushare_env, monkeypatch, capsys):
    """What ``jupyter gpushare lab`` says after JupyterLab exits: when this user's node agent
    still runs, that it does, its pid and how to stop it; nothing when none runs."""
    from jupyter_gpushare import cli
    from jupyter_gpushare.daemon.client import DaemonClient

    socket = gpushare_env["GPUSHARE_SOCKET"]
    monkeypatch.setenv("GPUSHARE_SOCKET", socket)
    assert cli.say_agent_left_running() is False  # no agent: nothing to say
    assert capsys.readouterr().err == ""
    held = gpushare({**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}, "run", "--", "true")
    assert held.returncode == 0, held.stderr  # it started the agent, which stays
    pid = DaemonClient(socket).ping()["pid"]
    assert cli.say_agent_left_running() is True
    said = " ".join(capsys.readouterr().err.split())
    assert f"node agent (pid {pid}) keeps running on {socket}" in said and f"kill {pid}" in said


def test_status_watch_redraws_in_place_until_ctrl_c(gpushare_env):
    """``status --watch`` on a terminal: the tables drawn again every interval over the last
    drawing (cursor moved up, lines erased), not appended; Ctrl-C ends it with status 0."""
    import os
    import pty
    import re
    import select
    import signal
    import time

    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100", "COLUMNS": "120", "LINES": "40"}
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare", "status", "--watch", "0.3"],
        env=env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    out = b""

    def read_for(seconds: float) -> None:
        nonlocal out
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    out += os.read(leader, 65536)
                except OSError:
                    return

    try:
        deadline = time.monotonic() + 60
        while out.count(b"every 0.3 s") < 3 and time.monotonic() < deadline:
            read_for(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        read_for(0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = out.decode(errors="replace")
    assert text.count("every 0.3 s") >= 3, text[-2000:]
    assert "no shares" in text and "A100" in text
    # redrawn in place: the cursor goes back up over the previous drawing (CSI n A)
    assert re.search(r"\x1b\[\d*A", text), text[-2000:]
    assert "Traceback" not in text


def test_status_prints_a_hostile_command_and_notebook_name_literally(monkeypatch, capsys):
    """An admin's ``status`` shows other users' command lines and notebook paths: escape
    sequences in them are written out (not sent to the terminal) and rich markup in them is
    text, not styling."""
    import argparse

    from jupyter_gpushare import cli
    from jupyter_gpushare.ledger import Allocation
    from jupyter_gpushare.share import ShareSpec

    def held(ident: str, **extra: object) -> dict:
        return Allocation(
            id=ident,
            node="n",
            gpus=("GPU-1",),
            spec=ShareSpec(0.25, 0.5, 2**30, "A100"),
            memory=2**30,
            owner="run" if "command" in extra else "kernel",
            kernel_id=None if "command" in extra else "k-1",
            user="mallory",
            extra=dict(extra),
        ).to_json()

    hostile = [
        held("a-0000000000000001", command=["rm", "\x1b]0;pwned\x07\x1b[2J", "[bold red]x[/]"]),
        held("a-0000000000000002", notebook="/home/m/\x1b[31mred[/].ipynb"),
    ]

    async def status(*_args):
        return {"simulated": True, "gpus": [], "allocations": hostile}

    monkeypatch.setattr(cli, "_status", status)
    monkeypatch.setattr(cli, "_settings", lambda simulate: None)
    args = argparse.Namespace(
        simulate=None, kubernetes_namespace=None, kubeconfig="", json=False, watch=None
    )
    assert cli.cmd_status(args) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J" in out and "[bold red]x[/]" in out
    assert "/home/m/\\x1b[31mred[/].ipynb" in out
    assert "25 %" in out and "50 %" in out and "– / 1GiB" in out


def test_kernelspecs_have_logos_drawn_from_their_share(gpushare_env):
    """Each gpushare kernelspec ships logo-32x32.png, logo-64x64.png and logo-svg.svg, the ones
    jupyter_gpushare.logos draws from its share (so they cannot drift), and jupyter_client
    finds them; the whole-GPU kernelspec says nothing of a share."""
    from pathlib import Path

    from jupyter_client.kernelspec import KernelSpecManager

    from jupyter_gpushare import logos

    root = Path(__file__).resolve().parent.parent / "kernelspecs"
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(folders) == 3
    for folder in folders:
        for name, data in logos.files(folder).items():
            assert (folder / name).read_bytes() == data, f"{folder.name}/{name}: regenerate"
    png = logos.png(0.25, 0.5, 32)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[16:24] == bytes.fromhex("0000002000000020")
    assert logos.png(0.25, 0.5, 64) != logos.png(0.5, 1.0, 64)  # the dial shows the share
    whole = json.loads((root / "gpushare-python-whole" / "kernel.json").read_text())
    assert "share" not in whole["display_name"].lower()
    kernels = Path(gpushare_env["JUPYTER_DATA_DIR"]) / "kernels"  # installed as by pip
    specs = KernelSpecManager(kernel_dirs=[str(kernels)]).get_all_specs()
    for folder in folders:
        installed = {f.name for f in Path(specs[folder.name]["resource_dir"]).iterdir()}
        assert {"logo-32x32.png", "logo-64x64.png", "logo-svg.svg"} <= installed, installed


def _status_as_this_user(socket: str, node: str) -> dict:
    """``jupyter gpushare status`` (table and --json) in this process, through the agent on
    ``socket`` (run in a forked child as another user)."""
    import contextlib
    import io
    import os

    from jupyter_gpushare import cli

    os.environ.update(GPUSHARE_SOCKET=socket, GPUSHARE_NODE_NAME=node, COLUMNS="200")
    out = {}
    for key, argv in (("table", ["status"]), ("json", ["status", "--json"])):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = cli.main(argv)
        out[key] = (code, buffer.getvalue())
    return out


def test_status_through_the_system_agent_shows_a_user_their_own_shares(tmp_path):
    """Two real users hold shares through a system agent: each one's ``status`` names their own
    share (user, command, request, limit) and shows the other's only as capacity; root (an
    admin) sees both, by user and command."""
    import os
    import shutil

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root (useradd, setuid)")
    from test_system_agent import (
        ALICE,
        BOB,
        NODE,
        Agent,
        agent_dir,
        as_user,
        gpushare_run,
        result_of,
        run_as,
        unix_user,
    )

    from jupyter_gpushare.daemon.client import DaemonClient

    alice, bob = unix_user(ALICE), unix_user(BOB)
    agent = Agent(agent_dir())
    socket = str(agent.socket)
    try:
        runs = [
            as_user(alice, gpushare_run, socket, "--gpu-request", "0.25", "--", "/bin/sleep", "9"),
            as_user(bob, gpushare_run, socket, "--gpu-request", "0.5", "--", "/bin/sleep", "8"),
        ]
        from support import wait_for

        wait_for(lambda: len(DaemonClient(socket).status().get("allocations", [])) == 2, 30)
        seen = {
            name: run_as(user, _status_as_this_user, socket, NODE)
            for name, user in (("alice", alice), ("bob", bob))
        }
        for name, user, other, mine, theirs in (
            ("alice", ALICE, BOB, "25 %", "50 %"),
            ("bob", BOB, ALICE, "50 %", "25 %"),
        ):
            assert seen[name][0] == "ok", seen[name]
            (code, table), (jcode, text) = seen[name][1]["table"], seen[name][1]["json"]
            assert code == 0 and jcode == 0, table
            rows = [line for line in table.splitlines() if "│ a-" in line]
            [own] = [r for r in rows if user in r]
            [other_row] = [r for r in rows if "another user" in r]
            assert "/bin/sleep" in own and f"{mine} " in own
            assert f"{theirs} " in other_row and "/bin/sleep" not in other_row
            assert other not in table
            assert "25 %, " in table  # the GPU's free capacity: 1 - 0.25 - 0.5
            records = json.loads(text)["allocations"]
            assert sorted(bool(r["extra"].get("redacted")) for r in records) == [False, True]
        import pwd

        root = run_as(pwd.getpwuid(0), _status_as_this_user, socket, NODE)  # an admin
        admin = root[1]["table"][1]
        assert ALICE in admin and BOB in admin and admin.count("/bin/sleep") == 2
        for run in runs:
            assert result_of(run)[0] == "ok"
    finally:
        agent.stop()
        shutil.rmtree(agent.dir, ignore_errors=True)


def test_lab_passes_sigterm_on_and_says_its_agent_lives_on(gpushare_env, tmp_path):
    """The real thing: ``jupyter gpushare lab --simulate`` starts JupyterLab (whose server starts
    the node agent); SIGTERM to the command reaches JupyterLab, which stops; the command then
    says the agent keeps running and how to stop it."""
    import signal
    import time

    from support import free_port, wait_for

    from jupyter_gpushare.daemon.client import DaemonClient

    port = free_port()
    log = tmp_path / "lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "jupyter_gpushare", "lab", "--simulate", "1xA100"),
                *("--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1"),
                *("--IdentityProvider.token=t", f"--ServerApp.root_dir={tmp_path}"),
            ],
            env=gpushare_env,
            stdin=subprocess.DEVNULL,  # no terminal: a SIGINT to the command is passed on
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    socket = gpushare_env["GPUSHARE_SOCKET"]
    try:
        wait_for(lambda: DaemonClient(socket, timeout=1).alive(), timeout=90)
        pid = DaemonClient(socket).ping()["pid"]
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # to the command alone (no terminal): passed on too
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, 128 + signal.SIGTERM, -signal.SIGTERM), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = " ".join(log.read_text().split())
    assert "SIMULATED GPUs (1xA100)" in text and "Interrupted" in text  # SIGINT reached it
    assert f"node agent (pid {pid}) keeps running on {socket}" in text, text[-3000:]
    assert DaemonClient(socket).alive()  # it did keep running (the fixture stops it)


def test_status_watch_into_a_pipe_appends_plain_drawings(gpushare_env):
    """``status --watch`` into a pipe (``| tee log``): each drawing follows the last, plain text
    without cursor movement, until SIGINT ends it with status 0."""
    import signal
    import time

    env = {**gpushare_env, "GPUSHARE_SIMULATE": "1xA100"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare", "status", "--watch", "0.3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the first drawing is out: the loop runs
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    text = first + out
    assert text.count("every 0.3 s") >= 2 and "\x1b" not in text, text[-2000:]
