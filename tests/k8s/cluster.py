"""A real Kubernetes control plane on 127.0.0.1, for tests, benchmarks and developers.

etcd (Debian's) + ``kube-apiserver``, ``kube-scheduler`` and ``kube-controller-manager`` built by
``.ci/setup.d/k8s.sh`` (cached in ``/var/cache/gpushare-k8s/bin``, or ``GPUSHARE_K8S_BIN``).
TLS comes from the API server's ``--cert-dir`` (self-signed), authentication from a static
``--token-auth-file``, authorization is RBAC. There is no kubelet: ``node_agent.py`` plays it.

Identities (one kubeconfig each, under ``<workdir>/kubeconfig-<name>``):

- ``admin``: ``system:masters`` (applies ``deploy/``, plays the kubelet in the node agent);
- ``scheduler`` / ``controller-manager``: the components' own users (bootstrap RBAC);
- ``server``: ``system:serviceaccount:gpushare:jupyter-gpushare`` — the Jupyter server, with
  nothing but what ``deploy/rbac.yaml`` grants that service account;
- ``daemon``: ``system:serviceaccount:gpushare:gpushare-daemon`` — the node daemon's reconciler;
- ``controller``: ``system:serviceaccount:gpushare:gpushare-controller`` — the cluster
  controller (controller mode), the only holder of the rights in controller mode.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CACHE_BIN = Path(os.environ.get("GPUSHARE_K8S_BIN", "/var/cache/gpushare-k8s/bin"))
BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")
NAMESPACE = "gpushare"

USERS = {
    "admin": ("admin", "system:masters"),
    "scheduler": ("system:kube-scheduler", ""),
    # The controller manager runs every controller (garbage collector included) under its own
    # user here (no per-controller service-account credentials), so it needs full rights.
    "controller-manager": ("system:kube-controller-manager", "system:masters"),
    "server": (
        f"system:serviceaccount:{NAMESPACE}:jupyter-gpushare",
        f"system:serviceaccounts,system:serviceaccounts:{NAMESPACE}",
    ),
    "daemon": (
        f"system:serviceaccount:{NAMESPACE}:gpushare-daemon",
        f"system:serviceaccounts,system:serviceaccounts:{NAMESPACE}",
    ),
    "controller": (
        f"system:serviceaccount:{NAMESPACE}:gpushare-controller",
        f"system:serviceaccounts,system:serviceaccounts:{NAMESPACE}",
    ),
}


class ControlPlaneUnavailable(RuntimeError):
    """The binaries are missing or a component did not come up."""


def missing_binaries() -> list[str]:
    missing = [b for b in BINARIES if not (CACHE_BIN / b).is_file()]
    if shutil.which("etcd") is None:
        missing.append("etcd")
    return missing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ControlPlane:
    workdir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    port: int = 0
    #: the address the API server listens on and advertises (a real node's pods reach it there)
    bind_host: str = "127.0.0.1"
    #: pods get service-account tokens (admission plugin, token controller) and the
    #: ``kubernetes`` Service its endpoint: what pods on a real node need (real_node.py)
    service_accounts: bool = False

    @property
    def server_url(self) -> str:
        return f"https://{self.bind_host}:{self.port}"

    def kubeconfig(self, user: str = "admin") -> Path:
        return self.workdir / f"kubeconfig-{user}"

    @property
    def ca_file(self) -> Path:
        return self.workdir / "certs" / "apiserver.crt"

    # -- start / stop ---------------------------------------------------------------------------

    def start(self, timeout: float = 90.0, components: bool = True) -> ControlPlane:
        """etcd and the API server; with ``components``, also the scheduler and the controller
        manager (without them nothing schedules pods or collects garbage: enough for the
        controller's caches and ``benchmarks/k8s_scale.py``, and every API request counted in
        ``/metrics`` is then the caller's own)."""
        missing = missing_binaries()
        if missing:
            raise ControlPlaneUnavailable(
                f"missing {', '.join(missing)} (run .ci/setup.d/k8s.sh as root to build them "
                f"into {CACHE_BIN})"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "certs").mkdir(exist_ok=True)
        self._write_credentials()
        deadline = time.monotonic() + timeout
        try:
            self._start_etcd()
            self._start_apiserver(deadline)
            for user in USERS:
                self._write_kubeconfig(user)
            if not components:
                self._wait_http("/healthz", "kube-apiserver", deadline)
                return self
            self._start_component(
                "kube-scheduler",
                "scheduler",
                [
                    "--leader-elect=false",
                    "--port=0",
                    f"--secure-port={free_port()}",
                    f"--authentication-kubeconfig={self.kubeconfig('scheduler')}",
                    f"--authorization-kubeconfig={self.kubeconfig('scheduler')}",
                ],
            )
            self._start_component(
                "kube-controller-manager",
                "controller-manager",
                [
                    "--leader-elect=false",
                    "--port=0",
                    f"--secure-port={free_port()}",
                    f"--authentication-kubeconfig={self.kubeconfig('controller-manager')}",
                    f"--authorization-kubeconfig={self.kubeconfig('controller-manager')}",
                    *self._controller_args(),
                    "--use-service-account-credentials=false",
                    "--node-monitor-period=2s",
                    "--node-monitor-grace-period=40s",
                    "--concurrent-gc-syncs=5",
                ],
            )
            self._wait_components(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _controller_args(self) -> list[str]:
        off = "-csrsigning,-bootstrapsigner,-tokencleaner,-nodeipam,-route,-service,"
        off += "-cloud-node-lifecycle"
        if not self.service_accounts:
            return [f"--controllers=*,-serviceaccount-token,{off}"]
        return [
            f"--controllers=*,{off}",
            f"--service-account-private-key-file={self.workdir / 'sa.key'}",
            f"--root-ca-file={self.ca_file}",
        ]

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            proc = self.processes.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def metrics(self) -> dict[tuple[str, str], int]:
        """``apiserver_request_total`` from the API server's ``/metrics``, summed by
        (verb, resource[/subresource]): every request any client made so far."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(
            self.server_url + "/metrics",
            headers={"Authorization": f"Bearer {self.tokens['admin']}"},
        )
        with urllib.request.urlopen(request, context=ctx, timeout=10) as reply:
            text = reply.read().decode()
        return parse_request_totals(text)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # -- pieces ---------------------------------------------------------------------------------

    def _write_credentials(self) -> None:
        rows = []
        for i, (name, (user, groups)) in enumerate(USERS.items()):
            self.tokens[name] = secrets.token_hex(16)
            rows.append(f'{self.tokens[name]},{user},uid-{i},"{groups}"')
        (self.workdir / "tokens.csv").write_text("\n".join(rows) + "\n")
        key = self.workdir / "sa.key"
        if not key.exists():
            subprocess.run(
                ["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True
            )
            subprocess.run(
                [
                    "openssl",
                    "rsa",
                    "-in",
                    str(key),
                    "-pubout",
                    "-out",
                    str(self.workdir / "sa.pub"),
                ],
                check=True,
                capture_output=True,
            )

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_unblock_signals,
        )
        log.close()
        self.processes[name] = proc
        return proc

    def _start_etcd(self) -> None:
        self.etcd_port = free_port()
        peer = free_port()
        self._spawn(
            "etcd",
            [
                shutil.which("etcd") or "etcd",
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes",
                str(2 * 2**30),
            ],
        )

    def _start_apiserver(self, deadline: float) -> None:
        self.port = free_port()
        self._spawn(
            "kube-apiserver",
            [
                str(CACHE_BIN / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                f"--bind-address={self.bind_host}",
                f"--advertise-address={self.bind_host}",
                f"--secure-port={self.port}",
                "--insecure-port=0",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                *([] if self.service_accounts else ["--disable-admission-plugins=ServiceAccount"]),
                f"--service-account-key-file={self.workdir / 'sa.pub'}",
                f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--api-audiences=https://kubernetes.default.svc",
                "--max-requests-inflight=800",
                "--max-mutating-requests-inflight=400",
                f"--endpoint-reconciler-type={'lease' if self.service_accounts else 'none'}",
            ],
        )
        self._wait_http("/readyz", "kube-apiserver", deadline)

    def _start_component(self, binary: str, user: str, args: list[str]) -> None:
        self._spawn(
            binary, [str(CACHE_BIN / binary), f"--kubeconfig={self.kubeconfig(user)}", *args]
        )

    def _wait_http(self, path: str, name: str, deadline: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        last = ""
        while time.monotonic() < deadline:
            proc = self.processes[name]
            if proc.poll() is not None:
                raise ControlPlaneUnavailable(
                    f"{name} exited ({proc.returncode}):\n" + self.log_tail(name)
                )
            request = urllib.request.Request(
                self.server_url + path, headers={"Authorization": f"Bearer {self.tokens['admin']}"}
            )
            try:
                with urllib.request.urlopen(request, context=ctx, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except Exception as exc:  # not up yet
                last = str(exc)
            time.sleep(0.2)
        raise ControlPlaneUnavailable(f"{name} not ready ({last}):\n" + self.log_tail(name))

    def _wait_components(self, deadline: float) -> None:
        time.sleep(0.5)
        for name in ("kube-scheduler", "kube-controller-manager"):
            proc = self.processes[name]
            if proc.poll() is not None:
                raise ControlPlaneUnavailable(
                    f"{name} exited ({proc.returncode}):\n" + self.log_tail(name)
                )
        # The API server may still be creating its bootstrap RBAC; wait for /healthz too.
        self._wait_http("/healthz", "kube-apiserver", deadline)

    def _write_kubeconfig(self, user: str) -> None:
        self.kubeconfig(user).write_text(
            "apiVersion: v1\nkind: Config\n"
            "clusters:\n- name: local\n  cluster:\n"
            f"    server: {self.server_url}\n    certificate-authority: {self.ca_file}\n"
            "users:\n"
            f"- name: {user}\n  user:\n    token: {self.tokens[user]}\n"
            "contexts:\n"
            f"- name: {user}\n  context:\n    cluster: local\n    user: {user}\n"
            f"current-context: {user}\n"
        )
        self.kubeconfig(user).chmod(0o600)


def parse_request_totals(text: str) -> dict[tuple[str, str], int]:
    """``apiserver_request_total`` lines summed by (verb, resource[/subresource])."""
    totals: dict[tuple[str, str], int] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line[len("apiserver_request_total{") :].rpartition("} ")
        labels = dict(
            (k, v.strip('"')) for k, _, v in (p.partition("=") for p in labels_text.split('",'))
        )
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        key = (labels.get("verb", ""), resource)
        totals[key] = totals.get(key, 0) + int(float(value))
    return totals


def apply_deploy(kubeconfig: Path, namespace: str = NAMESPACE) -> None:
    """Create the namespace and apply ``deploy/crds``, ``deploy/rbac.yaml`` and
    ``deploy/daemonset.yaml`` (as admin)."""
    from kubernetes import client, config, utils

    api = config.new_client_from_config(str(kubeconfig))
    core = client.CoreV1Api(api)
    with contextlib.suppress(client.ApiException):
        core.create_namespace({"metadata": {"name": namespace}})
    files = [
        *sorted((DEPLOY / "crds").glob("*.yaml")),
        DEPLOY / "rbac.yaml",
        DEPLOY / "daemonset.yaml",
    ]
    for path in files:
        try:
            utils.create_from_yaml(api, str(path), namespace=namespace)
        except utils.FailToCreateError as exc:
            if any(e.status != 409 for e in exc.api_exceptions):
                raise
    _wait_crds(api)


def register_gpu_nodes(kubeconfig: Path, nodes: dict[str, list]) -> None:
    """Create Node objects (no kubelet behind them) that publish ``nodes[name]`` (a list of
    :class:`~jupyter_gpushare.inventory.Gpu`) as a node daemon would, and mark them Ready."""
    from kubernetes import client, config

    from jupyter_gpushare.k8s import manifests

    api = config.new_client_from_config(str(kubeconfig))
    core = client.CoreV1Api(api)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ready = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "simulated",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ]
        }
    }
    for name, gpus in nodes.items():
        body = manifests.node_gpu_patch(gpus)
        body["metadata"]["name"] = name
        body["metadata"]["labels"] = {
            k: v for k, v in body["metadata"]["labels"].items() if v is not None
        }
        try:
            core.create_node(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        core.patch_node_status(name, ready)
    api.close()


def node_agent_argv(plane: ControlPlane, workdir: Path, nodes: dict[str, str]) -> list[str]:
    """The node agent for ``nodes`` (name -> simulated GPUs); the node daemon's pods get the
    ``daemon`` identity (its service account)."""
    return [
        sys.executable,
        str(Path(__file__).with_name("node_agent.py")),
        "--kubeconfig",
        str(plane.kubeconfig("admin")),
        "--workdir",
        str(workdir),
        "--cpu",
        "4",
        "--memory",
        "16Gi",
        f"--service-account={NAMESPACE}/gpushare-daemon={plane.kubeconfig('daemon')}",
        *[f"--node={name}={simulate}" for name, simulate in nodes.items()],
    ]


def node_daemon_socket(workdir: Path, node: str) -> Path:
    """Where the node agent puts node ``node``'s ``/run/gpushare/daemon.sock``."""
    return workdir / node / "host" / "run" / "gpushare" / "daemon.sock"


def _wait_crds(api: object, timeout: float = 30.0) -> None:
    from kubernetes import client

    ext = client.ApiextensionsV1Api(api)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        crds = ext.list_custom_resource_definition().items
        if crds and all(
            any(
                c.type == "Established" and c.status == "True"
                for c in (crd.status.conditions or [])
            )
            for crd in crds
        ):
            return
        time.sleep(0.2)
    raise ControlPlaneUnavailable("CRDs not established")


def _unblock_signals() -> None:
    """In each child: default signal mask, and SIGTERM when its parent dies (a killed test run
    must not leave a control plane behind)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main() -> None:
    """Start a control plane in the foreground (see scripts/k8s-control-plane)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/gpushare-k8s")
    parser.add_argument(
        "--nodes",
        default="gpu-node-1=2xA100,gpu-node-2=1xT4",
        help="fake GPU nodes for the node agent: NAME=SIMULATE,…; '' for none",
    )
    args = parser.parse_args()
    workdir = Path(args.workdir)
    # Block the stop signals so that sigwait() below receives them and the components (each in
    # its own session) are stopped, rather than left running by a default-handled SIGTERM.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    if (workdir / "etcd").exists():
        shutil.rmtree(workdir / "etcd")
    plane = ControlPlane(workdir).start()
    apply_deploy(plane.kubeconfig("admin"))
    agent = None
    if args.nodes:
        nodes = dict(n.split("=", 1) for n in args.nodes.split(","))
        agent = subprocess.Popen(
            preexec_fn=_unblock_signals, args=node_agent_argv(plane, workdir / "nodes", nodes)
        )
    print(f"control plane up at {plane.server_url}")
    print(f"export KUBECONFIG={plane.kubeconfig('admin')}")
    for user in USERS:
        print(f"  kubeconfig for {user}: {plane.kubeconfig(user)}")
    print("Ctrl-C stops it.", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(15)
        plane.stop()


if __name__ == "__main__":
    main()
