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
    assert "gpu_limit='1.5' is not allowed: a number in (0, 1]" in result.stderr
    assert not marker.exists()
    full = gpushare(env, "run", "--gpu-type", "H100", "--", "true")
    assert full.returncode == 2 and "gpu_type='H100'" in full.stderr


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
    args = argparse.Namespace(simulate=None, kubernetes_namespace=None, kubeconfig="", json=False)
    assert cli.cmd_status(args) == 0
    out = capsys.readouterr().out
    assert "a-0123456789abcdef: 0.5–0.5 of A100 GPU-1" in out
    assert "another user's share" in out
    assert "None" not in out and "k-secret" not in out and "4242" not in out
