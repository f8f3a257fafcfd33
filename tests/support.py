"""Test support: a real jupyter_server with gpushare in a subprocess, and a client that runs
code in its real ipykernel kernels (the fixtures that use them are in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from jupyter_client.blocking import BlockingKernelClient

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"

#: a saturating loop of simulated kernels in a thread of the kernel (cells still run).
BUSY = """
import ctypes, threading
cu = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p
cu.cuLaunchKernel.argtypes = [P] + [ctypes.c_uint] * 7 + [P, P, P]
dev, ctx, mod, fn = ctypes.c_int(), P(), P(), P()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
assert cu.cuModuleLoadData(ctypes.byref(mod), b"any module") == 0
assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"busy_us") == 0
us = ctypes.c_uint64(2000)
params = (P * 1)(ctypes.cast(ctypes.byref(us), P))
stop = threading.Event()
def spin():
    cu.cuCtxSetCurrent(ctx)
    while not stop.is_set():
        cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        cu.cuCtxSynchronize()
spinner = threading.Thread(target=spin, daemon=True)
spinner.start()
"""

#: run in a kernel holding a 1 GiB cap: what the interposer reports and allows (JSON line)
CUDA_PROBE = """
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
free, total, ptr = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_uint64()
cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
small = cu.cuMemAlloc_v2(ctypes.byref(ptr), 256 << 20)
big = cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 30)
print(json.dumps({"total": total.value, "small": small, "big": big}))
"""


def python_for(user: pwd.struct_passwd) -> str:
    """A Python interpreter ``user`` may run, with the standard library (``ctypes`` included:
    the tests' programs run as other users need nothing else); skips the test where none is."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run(
                [candidate, "-c", "import ctypes"],
                user=user.pw_uid,
                group=user.pw_gid,
                extra_groups=[],
                cwd="/",
                timeout=30,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return candidate
    pytest.skip(f"no Python interpreter {user.pw_name} may run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_kernelspec(env: dict[str, str], name: str, config: dict[str, Any]) -> None:
    """A gpushare kernelspec with the given provisioner config."""
    path = Path(env["JUPYTER_DATA_DIR"]) / "kernels" / name
    path.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name,
        "language": "python",
        "metadata": {
            "kernel_provisioner": {"provisioner_name": "gpushare-provisioner", "config": config}
        },
    }
    (path / "kernel.json").write_text(json.dumps(spec))


def isolated_env(tmp: Path, short: Path) -> dict[str, str]:
    """This environment with Jupyter dirs and gpushare state of its own under `tmp` (runtime dir
    and agent socket under `short`: unix socket paths must be short), the gpushare kernelspecs
    installed."""
    env = dict(os.environ)
    env.update(
        JUPYTER_DATA_DIR=str(tmp / "data"),
        JUPYTER_RUNTIME_DIR=str(short / "rt"),
        JUPYTER_CONFIG_DIR=str(tmp / "config"),
        JUPYTER_PLATFORM_DIRS="1",
        GPUSHARE_LEDGER=str(tmp / "ledger.sqlite"),
        GPUSHARE_SOCKET=str(short / "daemon.sock"),
        PYTHONUNBUFFERED="1",
    )
    env.pop("GPUSHARE_SIMULATE", None)
    for source in (REPO / "kernelspecs").iterdir():
        shutil.copytree(source, tmp / "data" / "kernels" / source.name)
    return env


def stop_daemons(socket_path: str) -> None:
    """End node daemons a test's server started (they are detached so that they outlive it):
    SIGTERM first, so that an agent with no share left removes its state directory (in
    /dev/shm), then SIGKILL for one that does not stop within 3 s."""
    procs = [
        proc
        for proc in psutil.process_iter(["cmdline"])
        if "jupyter_gpushare.daemon" in (cmdline := proc.info["cmdline"] or [])
        and socket_path in cmdline
    ]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    for proc in wait_exited(procs, timeout=3):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has exited; those still running after ``timeout`` s. A zombie
    has exited: a detached agent's parent is PID 1, which may reap it only a second or two later
    (psutil.wait_procs waits for that, ~1.7 s a test here)."""
    deadline = time.monotonic() + timeout
    running = list(procs)
    while running:
        still = []
        for proc in running:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    still.append(proc)
        running = still
        if not running or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return running


class JupyterServer:
    """A real ``jupyter server`` subprocess with the gpushare extension enabled: the one test
    helper for a server (started here with :meth:`start`, or one started by a test with a
    config file of its own and taken over with :meth:`adopt`, e.g. tests/k8s/servers.py)."""

    #: seconds a request may take (a kernel pod's start takes longer than a local kernel's)
    timeout = 60.0

    @classmethod
    def adopt(
        cls,
        proc: subprocess.Popen[bytes],
        url: str,
        token: str,
        log_path: Path,
        env: dict[str, str],
        timeout: float = 60.0,
    ) -> JupyterServer:
        """A server already started (``proc``), answering on ``url`` with ``token``."""
        server = cls.__new__(cls)
        server.env, server.url, server.token = env, url, token
        server.port = int(url.rsplit(":", 1)[1])
        server.root = Path(env.get("JUPYTER_CONFIG_DIR", log_path.parent))
        server.log_path, server.argv, server.proc = log_path, list(proc.args), proc
        server.timeout = timeout
        return server

    def __init__(self, env: dict[str, str], simulate: str = "1xA100", *extra: str) -> None:
        self.env = env
        self.port = free_port()
        self.token = "gpushare-test-token"
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = Path(env["JUPYTER_DATA_DIR"]).parent / "notebooks"
        self.root.mkdir(exist_ok=True)
        self.log_path = Path(env["JUPYTER_DATA_DIR"]).parent / f"server-{self.port}.log"
        self.argv = [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            f"--ServerApp.port={self.port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.jpserver_extensions=jupyter_gpushare=True",
            f"--GpuShare.simulate={simulate}",
            "--GpuShare.reconcile_interval=1",
            "--allow-root",
            "--ServerApp.jpserver_extensions=jupyterlab=False",
            "--ServerApp.jpserver_extensions=jupyter_lsp=False",
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> JupyterServer:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited:\n{self.log()}")
            try:
                if self.get("/api/status").status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"jupyter server did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def log_text(self) -> str:
        """The whole log (:meth:`log` is its end)."""
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, **kw: Any) -> requests.Response:
        headers = {"Authorization": f"token {self.token}"}
        return requests.request(
            method, self.url + path, headers=headers, timeout=self.timeout, **kw
        )

    def get(self, path: str) -> requests.Response:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> requests.Response:
        return self.request("POST", path, json=body if body is not None else {})

    def delete(self, path: str) -> requests.Response:
        return self.request("DELETE", path)

    def allocations(self) -> list[dict[str, Any]]:
        response = self.get("/gpushare/api/allocations")
        response.raise_for_status()
        return response.json()["allocations"]

    def start_kernel(self, name: str = "gpushare-python") -> dict[str, Any]:
        response = self.post("/api/kernels", {"name": name})
        assert response.status_code == 201, response.text
        return response.json()

    def client(self, kernel_id: str) -> KernelClient:
        path = Path(self.env["JUPYTER_RUNTIME_DIR"]) / f"kernel-{kernel_id}.json"
        return KernelClient(path)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # jupyter asks to confirm; a second ^C stops
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class KernelClient:
    """Runs code in a kernel over its real ZMQ channels."""

    def __init__(self, connection_file: Path) -> None:
        self.client = BlockingKernelClient()
        self.client.load_connection_file(str(connection_file))
        # No heartbeat: on a loaded 2-core machine a late first beat reads as a dead kernel.
        self.client.start_channels(hb=False)
        self.client.wait_for_ready(timeout=60)

    def execute(self, code: str, timeout: float = 60) -> str:
        out: list[str] = []

        def output(msg: dict[str, Any]) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                out.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                out.append("\n".join(content["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=output)
        text = "".join(out)
        if reply["content"]["status"] != "ok":
            raise AssertionError(f"kernel error: {text}")
        return text

    def close(self) -> None:
        self.client.stop_channels()


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
