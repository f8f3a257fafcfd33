"""Starting Jupyter servers for the Kubernetes tests and benchmark (backend ``kubernetes`` with
the server's least-privilege identity, or ``local`` on simulated GPUs for comparison)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
from cluster import NAMESPACE, ControlPlane, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared helpers
from support import JupyterServer  # the one server helper


def spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kernelspec(root: Path, name: str = "gpushare-k8s", **share: Any) -> Path:
    spec_dir = root / "kernels" / name
    spec_dir.mkdir(parents=True, exist_ok=True)
    config = {"backend": "kubernetes", "gpu_request": 0.25, "gpu_limit": 0.5, **share}
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": f"Python (gpushare, {name})",
                "language": "python",
                "metadata": {
                    "kernel_provisioner": {
                        "provisioner_name": "gpushare-provisioner",
                        "config": config,
                    }
                },
            }
        )
    )
    return spec_dir


def start_jupyter_server(
    root: Path,
    plane: ControlPlane | None,
    backend: str = "kubernetes",
    lease_duration: float = 30.0,
    extra: str = "",
    simulate: str = "",
    **share: Any,
) -> JupyterServer:
    """A ``jupyter server`` subprocess with kernelspecs ``gpushare-k8s`` (the default share plus
    ``share``), ``gpushare-k8s-t4`` and ``gpushare-k8s-h100``; with ``backend='local'`` the same
    kernelspecs run as local processes on ``simulate`` GPUs."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data"
    kernelspec(data, backend=backend, **share)
    kernelspec(data, "gpushare-k8s-t4", backend=backend, gpu_type="T4")
    kernelspec(data, "gpushare-k8s-h100", backend=backend, gpu_type="H100")
    port, token = free_port(), f"tok{os.getpid()}{port_suffix(root)}"
    k8s = ""
    if plane is not None:
        k8s = f"""
c.KubernetesBackendConfig.kubeconfig = {str(plane.kubeconfig("server"))!r}
c.KubernetesBackendConfig.namespace = {NAMESPACE!r}
c.KubernetesBackendConfig.image = "gpushare-test:local"
c.KubernetesBackendConfig.lease_duration = {lease_duration}
c.KubernetesBackendConfig.lease_renew_interval = {max(1.0, lease_duration / 4)}
c.KubernetesBackendConfig.start_timeout = 60
c.KubernetesBackendConfig.resources = {{"requests": {{"cpu": "100m", "memory": "64Mi"}}}}
"""
    config = root / "jupyter_server_config.py"
    config.write_text(f"""
c.IdentityProvider.token = {token!r}
c.ServerApp.allow_root = True
c.ServerApp.jpserver_extensions = {{"jupyterlab": False, "jupyter_lsp": False,
    "notebook_shim": False, "jupyter_server_terminals": False, "jupyter_gpushare": True}}
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.open_browser = False
c.ServerApp.root_dir = {str(root)!r}
c.GpuShare.backend = {backend!r}
c.GpuShare.enforce = False
c.GpuShare.simulate = {simulate!r}
{k8s}
{extra}
""")
    env = {
        **os.environ,
        "JUPYTER_DATA_DIR": str(data),
        "JUPYTER_PATH": str(data),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
        "JUPYTER_CONFIG_DIR": str(root),
        "GPUSHARE_LEDGER": str(root / "ledger.sqlite"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("GPUSHARE_SIMULATE", None)
    log = root / "server.log"
    proc = spawn([sys.executable, "-m", "jupyter_server", f"--config={config}"], log, env)
    server = JupyterServer.adopt(proc, f"http://127.0.0.1:{port}", token, log, env, timeout=120)
    deadline = time.monotonic() + 60
    while True:
        try:
            if server.request("GET", "/api/status").status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError("jupyter server did not start:\n" + server.log_text())
        time.sleep(0.3)


def port_suffix(root: Path) -> str:
    return str(abs(hash(str(root))) % 10**6)
