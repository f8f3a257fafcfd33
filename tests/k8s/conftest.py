"""Fixtures for the Kubernetes backend: a real control plane, the node agent, the reconciler, and
Jupyter servers configured with backend ``kubernetes``.

Under CI (``CI=true``) a control plane that cannot start FAILS the tests; elsewhere, without the
binaries (``.ci/setup.d/k8s.sh`` builds them), the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import NAMESPACE, ROOT, ControlPlane, apply_deploy, free_port  # noqa: E402

NODES = {"gpu-node-1": "2xA100", "gpu-node-2": "1xT4"}
LIB_DIR = ROOT / "jupyter_gpushare" / "_lib"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    workdir = tmp_path_factory.mktemp("k8s")
    plane = ControlPlane(workdir)
    try:
        plane.start()
        apply_deploy(plane.kubeconfig("admin"))
    except Exception as exc:
        plane.stop()
        if IN_CI:
            pytest.fail(f"the Kubernetes control plane did not start (CI): {exc}")
        pytest.skip(f"no Kubernetes control plane: {exc}")
    yield plane
    plane.stop()


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def node_agent(control_plane: ControlPlane) -> Iterator[Path]:
    """Fake GPU nodes (2xA100, 1xT4) whose pods run as local processes; yields its workdir."""
    workdir = control_plane.workdir / "nodes"
    workdir.mkdir(exist_ok=True)
    log = control_plane.workdir / "node-agent.log"
    proc = _spawn([sys.executable, str(HERE / "node_agent.py"),
                   "--kubeconfig", str(control_plane.kubeconfig("admin")),
                   "--workdir", str(workdir), "--cpu", "4", "--memory", "16Gi",
                   *[f"--node={n}={s}" for n, s in NODES.items()]], log)
    deadline = time.monotonic() + 30
    while "node agent ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail("node agent did not start:\n" + log.read_text(errors="replace"))
        time.sleep(0.2)
    yield workdir
    _stop(proc)


@pytest.fixture(scope="session")
def reconciler(control_plane: ControlPlane) -> Iterator[subprocess.Popen]:
    """The node daemon's reconciler, with the daemon's least-privilege identity."""
    log = control_plane.workdir / "reconciler.log"
    proc = _spawn([sys.executable, "-m", "jupyter_gpushare.k8s.reconcile",
                   "--kubeconfig", str(control_plane.kubeconfig("daemon")),
                   "--namespace", NAMESPACE, "--interval", "2", "--grace", "2"], log)
    yield proc
    _stop(proc)


def kernelspec(root: Path, name: str = "gpushare-k8s", **share: Any) -> Path:
    spec_dir = root / "kernels" / name
    spec_dir.mkdir(parents=True, exist_ok=True)
    config = {"backend": "kubernetes", "gpu_request": 0.25, "gpu_limit": 0.5, **share}
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python (gpushare, {name})",
        "language": "python",
        "metadata": {"kernel_provisioner": {"provisioner_name": "gpushare-provisioner",
                                            "config": config}},
    }))
    return spec_dir


class JupyterServer:
    def __init__(self, proc: subprocess.Popen, url: str, token: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.token = token
        self.log = log

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        headers = {"Authorization": f"token {self.token}"}
        return requests.request(method, self.url + path, headers=headers, timeout=120,
                                **kwargs)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def jupyter_server_factory(
    control_plane: ControlPlane, node_agent: Path, tmp_path: Path
) -> Iterator[Any]:
    servers: list[JupyterServer] = []

    def start(lease_duration: float = 30.0, extra: str = "", **share: Any) -> JupyterServer:
        n = len(servers)
        root = tmp_path / f"server{n}"
        data = root / "data"
        kernelspec(data, **share)
        kernelspec(data, "gpushare-k8s-t4", gpu_type="T4")
        kernelspec(data, "gpushare-k8s-h100", gpu_type="H100")
        port, token = free_port(), f"tok{n}{os.getpid()}"
        config = root / "jupyter_server_config.py"
        config.write_text(f"""
c.ServerApp.token = {token!r}
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.open_browser = False
c.ServerApp.root_dir = {str(root)!r}
c.GpuShare.backend = "kubernetes"
c.GpuShare.enforce = False
c.KubernetesBackendConfig.kubeconfig = {str(control_plane.kubeconfig("server"))!r}
c.KubernetesBackendConfig.namespace = {NAMESPACE!r}
c.KubernetesBackendConfig.image = "gpushare-test:local"
c.KubernetesBackendConfig.interposer_host_path = {str(LIB_DIR)!r}
c.KubernetesBackendConfig.lease_duration = {lease_duration}
c.KubernetesBackendConfig.lease_renew_interval = {max(1.0, lease_duration / 4)}
c.KubernetesBackendConfig.start_timeout = 60
c.KubernetesBackendConfig.resources = {{"requests": {{"cpu": "100m", "memory": "64Mi"}}}}
{extra}
""")
        env = {**os.environ, "JUPYTER_DATA_DIR": str(data), "JUPYTER_PATH": str(data),
               "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
               "GPUSHARE_LEDGER": str(root / "ledger.sqlite"), "PYTHONUNBUFFERED": "1"}
        env.pop("GPUSHARE_SIMULATE", None)
        log = root / "server.log"
        proc = _spawn([sys.executable, "-m", "jupyter_server", f"--config={config}"], log, env)
        server = JupyterServer(proc, f"http://127.0.0.1:{port}", token, log)
        servers.append(server)
        deadline = time.monotonic() + 60
        while True:
            try:
                if server.request("GET", "/api/status").status_code == 200:
                    return server
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("jupyter server did not start:\n" + server.log_text())
            time.sleep(0.3)

    yield start
    for server in servers:
        _stop(server.proc)
