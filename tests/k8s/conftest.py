"""Fixtures for the Kubernetes backend: a real control plane, the node agent, the reconciler, and
Jupyter servers configured with backend ``kubernetes``.

Under CI (``CI=true``) a control plane that cannot start FAILS the tests; elsewhere, without the
binaries (``.ci/setup.d/k8s.sh`` builds them), the tests skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.k8s.manifests import SHARE_RESOURCE, SHARE_UNITS_PER_GPU

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cluster import (  # noqa: E402
    NAMESPACE,
    ControlPlane,
    apply_deploy,
    node_agent_argv,
    node_daemon_socket,
)
from servers import JupyterServer, spawn, start_jupyter_server, stop_process  # noqa: E402

NODES = {"gpu-node-1": "2xA100", "gpu-node-2": "1xT4"}
SIMULATE_LABEL = "gpushare.jupyter.org/simulate"
#: the simulated GPUs of the real node
REAL_NODE_GPUS = "2xA100"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "control_plane" in names or "real_node" in names:
            item.add_marker(pytest.mark.k8s)
        if "real_node" in names:
            item.add_marker(pytest.mark.real_node)
    # the real node's tests last: its session fixture (kubelet, containerd, kube-proxy, a control
    # plane) then stops right after them instead of idling beside the rest of the suite
    items[:] = [i for i in items if not _on_real_node(i)] + [i for i in items if _on_real_node(i)]


def _on_real_node(item: pytest.Item) -> bool:
    return "real_node" in getattr(item, "fixturenames", ())


@pytest.fixture(scope="session")
def real_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real node (kubelet, containerd, CNI bridge, kube-proxy: ``real_node.py``) with its
    own control plane; yields the :class:`real_node.RealNode` (``.plane`` is the plane). At the
    end the host must be as before (processes, cgroups, mounts, links, iptables, sysctls): a
    leftover is an error of the last test."""
    from real_node import RealNode, start_real_node

    root = Path(tempfile.mkdtemp(prefix="gsr-"))  # short: unix socket paths under it
    root.chmod(0o755)
    node: RealNode | None = None
    try:
        plane, node = start_real_node(root, labels={SIMULATE_LABEL: REAL_NODE_GPUS})
    except Exception as exc:
        shutil.rmtree(root, ignore_errors=True)
        if IN_CI:
            pytest.fail(f"the real node did not start (CI): {exc}")
        pytest.skip(f"no real node: {exc}")
    yield node
    node.stop()
    plane.stop()
    node.release_host()
    shutil.rmtree(root, ignore_errors=True)
    left = node.leftovers()
    assert not left, "the real node left behind:\n" + "\n".join(left)


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


@pytest.fixture(scope="session")
def node_agent(control_plane: ControlPlane) -> Iterator[Path]:
    """Fake GPU nodes (2xA100, 1xT4) whose pods run as local processes; yields its workdir
    (a short path that kernel pods' users can traverse: they run as uid 1000, and their unix
    sockets' paths must stay under 108 bytes)."""
    if os.geteuid() != 0:
        pytest.skip("the node agent runs kernel pods as their user (setuid): run as root")
    probe = subprocess.run(
        [sys.executable, "-c", "import jupyter_gpushare, ipykernel"],
        capture_output=True,
        text=True,
        user=1000,
        group=100,
        extra_groups=[],
        cwd="/",
    )
    if probe.returncode != 0:
        reason = (
            "kernel pods run as uid 1000, which cannot run this Python and checkout "
            f"(run .ci/setup.d/k8s_pod_user.sh as root): {probe.stderr[-500:]}"
        )
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="gsn-"))
    workdir.chmod(0o755)
    log = control_plane.workdir / "node-agent.log"
    proc = spawn(node_agent_argv(control_plane, workdir, NODES), log)
    deadline = time.monotonic() + 60
    sockets = [node_daemon_socket(workdir, node) for node in NODES]
    # ready: the agent registered the nodes and the DaemonSet's node daemon answers on each
    while "node agent ready" not in log.read_text(errors="replace") or not all(
        DaemonClient(s, timeout=1.0).alive() for s in sockets
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            pytest.fail(
                "node agent or node daemons did not start:\n"
                + log.read_text(errors="replace")[-6000:]
            )
        time.sleep(0.3)
    try:
        wait_share_resources(control_plane, NODES, deadline=time.monotonic() + 60)
    except AssertionError as exc:
        stop_process(proc)
        pytest.fail(f"{exc}\nnode agent log:\n" + log.read_text(errors="replace")[-6000:])
    yield workdir
    stop_process(proc)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def share_resources_wait() -> Any:
    """:func:`wait_share_resources` and the fixture's ``NODES``, for tests of that wait (test
    modules cannot import this conftest by name: each test directory has one)."""
    return wait_share_resources, dict(NODES)


def expected_share_units(simulate: str) -> str:
    """The share units the device plugin advertises for ``simulate`` (``2xA100``: 2 GPUs)."""
    return str(int(simulate.split("x", 1)[0]) * SHARE_UNITS_PER_GPU)


def wait_share_resources(plane: ControlPlane, nodes: dict[str, str], deadline: float) -> None:
    """Wait until every node's status.allocatable has the device plugin's share resource at its
    full count: a daemon that answers on its socket may not have registered its device plugin
    with the kubelet yet, nor the kubelet published the resource (a kernel pod asking for it
    would then stay Pending). Times out with the resource, the node and what it showed."""
    from kubernetes import client, config

    api = config.new_client_from_config(str(plane.kubeconfig("admin")))
    core = client.CoreV1Api(api)
    try:
        while True:
            shown = {}
            for name in nodes:
                allocatable = core.read_node(name).status.allocatable or {}
                shown[name] = allocatable.get(SHARE_RESOURCE)
            missing = {
                name: value
                for name, value in shown.items()
                if value != expected_share_units(nodes[name])
            }
            if not missing:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the device plugin's {SHARE_RESOURCE} never reached the Nodes' "
                    "status.allocatable: "
                    + ", ".join(
                        f"{name} shows {value!r}, expected {expected_share_units(nodes[name])!r}"
                        for name, value in missing.items()
                    )
                )
            time.sleep(0.3)
    finally:
        api.close()


@pytest.fixture(scope="session")
def reconciler(control_plane: ControlPlane) -> Iterator[subprocess.Popen]:
    """The node daemon's reconciler, with the daemon's least-privilege identity."""
    log = control_plane.workdir / "reconciler.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare.k8s.reconcile",
            "--kubeconfig",
            str(control_plane.kubeconfig("daemon")),
            "--namespace",
            NAMESPACE,
            "--interval",
            "2",
            "--grace",
            "2",
        ],
        log,
    )
    yield proc
    stop_process(proc)


@pytest.fixture
def jupyter_server_factory(
    control_plane: ControlPlane, node_agent: Path, tmp_path: Path
) -> Iterator[Any]:
    """Start Jupyter servers with backend ``kubernetes`` (the server's own identity)."""
    servers: list[JupyterServer] = []

    def start(lease_duration: float = 30.0, extra: str = "", **share: Any) -> JupyterServer:
        server = start_jupyter_server(
            tmp_path / f"server{len(servers)}",
            control_plane,
            lease_duration=lease_duration,
            extra=extra,
            **share,
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        stop_process(server.proc)
