"""A real Kubernetes node on this machine, for the ``real_node`` tests and benchmarks.

Real components only: the control plane of ``cluster.py`` (started with service-account tokens
and the ``kubernetes`` Service's endpoints, which pods need), plus

- ``containerd`` (Debian's 1.6, CRI v1alpha2) with ``runc``, its own config, root and state
  (``restrict_oom_score_adj``: this machine has no CAP_SYS_RESOURCE; cgroupfs), importing the
  images of ``.ci/setup.d/kubelet.sh`` (pause, a plain python image) and, when they exist, the
  product's images from ``/var/cache/gpushare-images/out`` (``GPUSHARE_IMAGES_DIR``);
- the CNI ``bridge`` (bridge ``gsbr0``, 10.244.0.0/24, gateway 10.244.0.1, masquerade) and
  ``portmap`` plugins;
- ``kubelet`` 1.20 (built by ``kubelet.sh`` from the control plane's source) with its own root
  directory, cgroup root ``/gpushare-real`` (cgroupfs, v1), ports on 127.0.0.1, node name
  ``gpushare-real-1``;
- ``kube-proxy`` in iptables mode (Services' ClusterIPs work from pods and from this host).

One node: the chart's host paths (the daemon's socket, the interposer, the kubelet's
device-plugin directory) are per node, and two kubelets on one machine share one filesystem and
one iptables; a second node would need a mount namespace per kubelet (not done).

Service DNS: there is no CoreDNS. The kubelet gives pods ``nameserver 10.244.0.1`` and the
cluster's search path (``clusterDNS``/``clusterDomain``, as with CoreDNS), and :class:`ServiceDNS`
— a test double of cluster DNS, a few dozen lines in this process — answers ``A`` queries for
``<service>.<namespace>.svc.cluster.local`` with the Service's ClusterIP read from the API
server (anything else: NXDOMAIN). So the product's own URLs (``gpushare-controller.<ns>.svc``)
resolve in pods unchanged; processes on this host (the Jupyter servers of the tests) are given
``http://<ClusterIP>:<port>`` URLs instead.

The kubelet and kube-proxy use the admin identity (``system:masters``; there is no Node
authorizer here). Teardown leaves nothing behind: it deletes the pods, stops everything it
started, unmounts, removes the cgroups, the bridge, the network namespaces, the iptables
chains and rules of the kubelet, kube-proxy and CNI, and restores the sysctls the kubelet,
kube-proxy and the bridge plugin change; :meth:`RealNode.leftovers` compares the host with
the snapshot taken before start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster import CACHE_BIN, ControlPlane, ControlPlaneUnavailable, _unblock_signals, free_port

NODE_NAME = "gpushare-real-1"
BRIDGE = "gsbr0"
POD_SUBNET = "10.244.0.0/24"
GATEWAY = "10.244.0.1"
CGROUP_ROOT = "gpushare-real"
CACHE = CACHE_BIN.parent
#: containerd's image store, kept between runs (a cache, like the binaries)
CONTAINERD_ROOT = Path(os.environ.get("GPUSHARE_CONTAINERD_ROOT", str(CACHE / "containerd")))
TEST_IMAGES = CACHE / "images"
PRODUCT_IMAGES = Path(os.environ.get("GPUSHARE_IMAGES_DIR", "/var/cache/gpushare-images/out"))
PAUSE_IMAGE = "localhost/pause:3.4.1"
PYTHON_IMAGE = "localhost/gpushare-test-python:dev"
NODE_IMAGE = "localhost/jupyter-gpushare-node:dev"
KERNEL_IMAGE = "localhost/jupyter-gpushare-kernel:dev"
SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
#: host directories the runtime or kubelet may create whatever their configuration
HOST_DIRS = (
    "/var/lib/kubelet",
    "/run/containerd",
    "/var/run/netns",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/opt/containerd",
    "/etc/cni",
)
OUR_CHAINS = re.compile(r"^(KUBE-|CNI-)")


class NodeUnavailable(RuntimeError):
    """A part of the node is missing or did not come up."""


def missing_parts() -> list[str]:
    missing = [
        str(CACHE_BIN / b) for b in ("kubelet", "kube-proxy") if not (CACHE_BIN / b).is_file()
    ]
    for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip"):
        if shutil.which(tool) is None:
            missing.append(tool)
    for plugin in ("bridge", "portmap", "host-local", "loopback"):
        if not Path("/usr/lib/cni", plugin).is_file():
            missing.append(f"/usr/lib/cni/{plugin}")
    for image in ("pause.tar", "python.tar"):
        if not (TEST_IMAGES / image).is_file():
            missing.append(str(TEST_IMAGES / image))
    return missing


def product_images() -> dict[str, Path]:
    """The product's image archives that exist: ref -> archive."""
    found = {}
    for ref, name in ((NODE_IMAGE, "node.tar"), (KERNEL_IMAGE, "kernel.tar")):
        if (PRODUCT_IMAGES / name).is_file():
            found[ref] = PRODUCT_IMAGES / name
    return found


def run(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


# -- host state -----------------------------------------------------------------------------------


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        path = Path("/proc/sys", name)
        with contextlib.suppress(OSError):
            values[name] = path.read_text().strip()
    return values


def iptables_rules() -> set[str]:
    """Every table's chains and rules (no counters), as ``table chain-or-rule`` lines."""
    out = run("iptables-save", check=False).stdout
    lines, table = set(), ""
    for line in out.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":"):
            lines.add(f"{table} {line.split()[0]}")
        elif line.startswith("-A"):
            lines.add(f"{table} {line}")
    return lines


def cgroup_dirs() -> set[str]:
    found = set()
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / CGROUP_ROOT
        if top.is_dir():
            found.update(str(p) for p in top.rglob("*") if p.is_dir())
            found.add(str(top))
    return found


def mounts_under(prefixes: list[str]) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
            points.append(point)
    return points


def links() -> set[str]:
    return {
        line.split()[1].rstrip(":").split("@")[0]
        for line in run("ip", "-o", "link", "show").stdout.splitlines()
    }


def dir_entries(path: str) -> set[str]:
    p = Path(path)
    if not p.exists():
        return set()
    return {str(x) for x in p.rglob("*")} | {path}


@dataclass
class HostSnapshot:
    sysctls: dict[str, str]
    iptables: set[str]
    links: set[str]
    cgroups: set[str]
    dirs: dict[str, set[str]]

    @classmethod
    def take(cls) -> HostSnapshot:
        return cls(
            read_sysctls(),
            iptables_rules(),
            links(),
            cgroup_dirs(),
            {d: dir_entries(d) for d in HOST_DIRS},
        )


# -- service DNS ---------------------------------------------------------------------------------


class ServiceDNS:
    """A test double of cluster DNS (no CoreDNS here): ``A`` records of Services' ClusterIPs.

    Answers ``<service>.<namespace>.svc.<domain>`` from the API server (one Service read per
    query); names of Services without a ClusterIP, other names and other types: NXDOMAIN
    (``AAAA`` of a Service: no records), as CoreDNS answers for a cluster-only zone."""

    def __init__(self, kubeconfig: Path, host: str, domain: str = "cluster.local") -> None:
        from kubernetes import client, config

        self._api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
        self._suffix = f".svc.{domain}".lower()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 53))
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self.queries: list[str] = []
        self._thread = threading.Thread(target=self._serve, name="service-dns", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _lookup(self, name: str) -> str | None:
        if not name.endswith(self._suffix):
            return None
        parts = name[: -len(self._suffix)].split(".")
        if len(parts) != 2:
            return None
        service, namespace = parts
        try:
            svc = self._api.read_namespaced_service(service, namespace)
        except Exception:
            return None
        ip = svc.spec.cluster_ip
        return ip if ip and ip != "None" else None

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(512)
            except (TimeoutError, OSError):
                continue
            with contextlib.suppress(Exception):
                reply = self._answer(data)
                if reply:
                    self._sock.sendto(reply, peer)

    def _answer(self, data: bytes) -> bytes | None:
        if len(data) < 12:
            return None
        ident, flags, qdcount = struct.unpack(">HHH", data[:6])
        if flags & 0x8000 or qdcount != 1:
            return None
        labels, pos = [], 12
        while pos < len(data) and data[pos]:
            n = data[pos]
            labels.append(data[pos + 1 : pos + 1 + n].decode("ascii", "replace"))
            pos += 1 + n
        question = data[12 : pos + 5]
        qtype = struct.unpack(">H", data[pos + 1 : pos + 3])[0]
        name = ".".join(labels).lower()
        self.queries.append(name)
        ip = self._lookup(name)
        rd = flags & 0x0100
        header_flags = 0x8400 | rd  # response, authoritative
        if ip is None:
            return struct.pack(">HHHHHH", ident, header_flags | 3, 1, 0, 0, 0) + question
        if qtype != 1:  # the name exists, no record of that type
            return struct.pack(">HHHHHH", ident, header_flags, 1, 0, 0, 0) + question
        answer = struct.pack(">HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip)
        return struct.pack(">HHHHHH", ident, header_flags, 1, 1, 0, 0) + question + answer


# -- the node ------------------------------------------------------------------------------------


@dataclass
class RealNode:
    workdir: Path
    plane: ControlPlane | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    before: HostSnapshot | None = None
    dns: ServiceDNS | None = None
    name: str = NODE_NAME

    # paths -------------------------------------------------------------------------------------
    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        """The kubelet's default root directory: kubelet 1.20 puts its device-plugin socket in
        /var/lib/kubelet/device-plugins whatever its ``--root-dir`` (a constant of the
        device-plugin API), so a second directory would only split the two sockets."""
        return Path("/var/lib/kubelet")

    @property
    def device_plugin_dir(self) -> Path:
        return self.kubelet_root / "device-plugins"

    def host_path(self, path: str) -> Path:
        """Where the chart's host path ``path`` (e.g. /run/gpushare) lives for this node."""
        return self.workdir / "host" / path.lstrip("/")

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log(name)
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        return run(
            "ctr",
            "--address",
            str(self.containerd_socket),
            "-n",
            "k8s.io",
            *args,
            check=check,
            timeout=timeout,
        ).stdout

    def pod_logs(self, namespace: str, pod: str, container: str) -> str:
        """What a container of a pod of this node wrote (the kubelet's CRI log files; the API
        server has no client certificate for the kubelet here, so no ``kubectl logs``)."""
        lines = []
        for path in sorted(Path("/var/log/pods").glob(f"{namespace}_{pod}_*/{container}/*.log")):
            for line in path.read_text(errors="replace").splitlines():
                parts = line.split(" ", 3)
                lines.append(parts[3] if len(parts) == 4 else line)
        return "\n".join(lines)

    def create_namespace(self, name: str, timeout: float = 30) -> None:
        """Create ``name`` and wait for its ``default`` service account's token (the
        ServiceAccount admission refuses pods until then)."""
        from kubernetes import client, config

        assert self.plane is not None
        api = config.new_client_from_config(str(self.plane.kubeconfig()))
        core = client.CoreV1Api(api)
        try:
            with contextlib.suppress(client.ApiException):
                core.create_namespace({"metadata": {"name": name}})
            deadline = time.monotonic() + timeout
            while True:
                with contextlib.suppress(client.ApiException):
                    if core.read_namespaced_service_account("default", name).secrets:
                        return
                if time.monotonic() > deadline:
                    raise NodeUnavailable(f"no token for {name}/default")
                time.sleep(0.2)
        finally:
            api.close()

    # start -------------------------------------------------------------------------------------
    def prepare_host(self) -> None:
        """Snapshot the host, then make the bridge (its address is where pods reach the API
        server) before the control plane starts."""
        if os.geteuid() != 0:
            raise NodeUnavailable("a real node needs root (containerd, the kubelet, iptables)")
        missing = missing_parts()
        if missing:
            raise NodeUnavailable(
                "missing " + ", ".join(missing) + " (run .ci/setup.d/k8s.sh and kubelet.sh as root)"
            )
        if BRIDGE in links():
            raise NodeUnavailable(f"bridge {BRIDGE} exists: another real node runs or leaked")
        if (self.kubelet_root / "device-plugins" / "kubelet.sock").exists():
            raise NodeUnavailable(f"{self.kubelet_root} has a kubelet's socket: one runs or leaked")
        self.before = HostSnapshot.take()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir.chmod(0o755)
        run("ip", "link", "add", BRIDGE, "type", "bridge")
        run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        run("ip", "link", "set", BRIDGE, "up")

    def start(
        self, plane: ControlPlane, labels: dict[str, str] | None = None, timeout: float = 120
    ) -> RealNode:
        self.plane = plane
        deadline = time.monotonic() + timeout
        self._set_sysctls()
        self._write_cni()
        self._start_containerd(deadline)
        self._import_images()
        self._clean_runtime()
        self.dns = ServiceDNS(plane.kubeconfig("admin"), GATEWAY)
        self._make_cgroup_root()
        self._start_kubelet(labels or {})
        self._start_kube_proxy()
        self.wait_ready(deadline)
        return self

    def _set_sysctls(self) -> None:
        for name, value in (
            ("net/bridge/bridge-nf-call-iptables", "1"),
            ("net/ipv4/ip_forward", "1"),
        ):
            Path("/proc/sys", name).write_text(value)

    def _write_cni(self) -> None:
        netd = self.workdir / "net.d"
        netd.mkdir(exist_ok=True)
        conf = {
            "cniVersion": "0.4.0",
            "name": "gpushare-real",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.workdir / "cni-ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
            ],
        }
        (netd / "10-gpushare.conflist").write_text(json.dumps(conf, indent=1))
        (self.workdir / "resolv.conf").write_text(f"nameserver {GATEWAY}\n")

    def _start_containerd(self, deadline: float) -> None:
        state = self.workdir / "containerd"
        state.mkdir(exist_ok=True)
        CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "containerd.toml"
        config.write_text(f"""
version = 2
root = "{CONTAINERD_ROOT}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{state}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{CONTAINERD_ROOT}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{shutil.which("runc")}"
        Root = "{state}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{self.workdir / "net.d"}"
    max_conf_num = 1
""")
        self._spawn("containerd", ["containerd", "--config", str(config)])
        while not self.containerd_socket.exists():
            self._check_alive("containerd", deadline)
            time.sleep(0.1)
        while (
            run("ctr", "--address", str(self.containerd_socket), "version", check=False).returncode
            != 0
        ):
            self._check_alive("containerd", deadline)
            time.sleep(0.2)

    def _import_images(self) -> None:
        stamps = CONTAINERD_ROOT / "gpushare-imported.json"
        done: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):
            done = json.loads(stamps.read_text())
        have = set(self.ctr("images", "ls", "-q").split())
        wanted = {
            PAUSE_IMAGE: TEST_IMAGES / "pause.tar",
            PYTHON_IMAGE: TEST_IMAGES / "python.tar",
            **product_images(),
        }
        for ref, archive in wanted.items():
            st = archive.stat()
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
            if ref in have and done.get(ref) == stamp:
                continue
            self.ctr("images", "import", "--no-unpack", str(archive), timeout=900)
            if ref not in set(self.ctr("images", "ls", "-q").split()):
                raise NodeUnavailable(f"{archive} did not import as {ref}")
            done[ref] = stamp
            stamps.write_text(json.dumps(done))

    def _clean_runtime(self) -> None:
        """Containers a killed earlier run left in the persistent store."""
        for cid in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
            self.ctr("tasks", "rm", "-f", cid, check=False)
            self.ctr("containers", "rm", cid, check=False)

    def _make_cgroup_root(self) -> None:
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            if hierarchy.name == "unified" or not (hierarchy / "cgroup.procs").exists():
                continue
            top = hierarchy / CGROUP_ROOT
            top.mkdir(exist_ok=True)
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if (hierarchy / knob).exists() and not (top / knob).read_text().strip():
                    (top / knob).write_text((hierarchy / knob).read_text())

    def _start_kubelet(self, labels: dict[str, str]) -> None:
        assert self.plane is not None
        root = self.kubelet_root
        root.mkdir(exist_ok=True)
        self.device_plugin_dir.mkdir(exist_ok=True)
        self.kubelet_port, self.kubelet_healthz = free_port(), free_port()
        config = self.workdir / "kubelet.yaml"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "address": "127.0.0.1",
                    "port": self.kubelet_port,
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": self.kubelet_healthz,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": False},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "cgroupDriver": "cgroupfs",
                    "cgroupRoot": f"/{CGROUP_ROOT}",
                    "cgroupsPerQOS": True,
                    "enforceNodeAllocatable": ["pods"],
                    "failSwapOn": False,
                    "oomScoreAdj": 0,
                    "clusterDomain": "cluster.local",
                    "clusterDNS": [GATEWAY],
                    "resolvConf": str(self.workdir / "resolv.conf"),
                    # never collect images (the pause image and the product's are only local)
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "serializeImagePulls": False,
                    "maxPods": 60,
                    "nodeStatusUpdateFrequency": "4s",
                    "syncFrequency": "10s",
                    "protectKernelDefaults": False,
                    "makeIPTablesUtilChains": True,
                }
            )
        )
        label_arg = ",".join(f"{k}={v}" for k, v in labels.items())
        self._spawn(
            "kubelet",
            [
                str(CACHE_BIN / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.plane.kubeconfig('admin')}",
                "--container-runtime=remote",
                f"--container-runtime-endpoint=unix://{self.containerd_socket}",
                f"--root-dir={root}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={GATEWAY}",
                f"--pod-infra-container-image={PAUSE_IMAGE}",
                *([f"--node-labels={label_arg}"] if label_arg else []),
                "--v=1",
            ],
        )

    def restart_kubelet(self, labels: dict[str, str] | None = None) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same configuration."""
        self._stop_process("kubelet")
        self._start_kubelet(labels or {})

    def _start_kube_proxy(self) -> None:
        assert self.plane is not None
        self._spawn(
            "kube-proxy",
            [
                str(CACHE_BIN / "kube-proxy"),
                f"--kubeconfig={self.plane.kubeconfig('admin')}",
                f"--hostname-override={self.name}",
                "--proxy-mode=iptables",
                f"--cluster-cidr={POD_SUBNET}",
                f"--healthz-bind-address=127.0.0.1:{free_port()}",
                f"--metrics-bind-address=127.0.0.1:{free_port()}",
                "--conntrack-max-per-core=0",
                "--conntrack-min=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                "--oom-score-adj=0",
                "--v=1",
            ],
        )

    def wait_ready(self, deadline: float) -> None:
        from kubernetes import client, config

        assert self.plane is not None
        core = client.CoreV1Api(config.new_client_from_config(str(self.plane.kubeconfig())))
        while True:
            for name in ("containerd", "kubelet", "kube-proxy"):
                self._check_alive(name, deadline)
            with contextlib.suppress(client.ApiException):
                node = core.read_node(self.name)
                if any(
                    c.type == "Ready" and c.status == "True" for c in (node.status.conditions or [])
                ):
                    return
            if time.monotonic() > deadline:
                raise NodeUnavailable(f"node {self.name} not Ready:\n" + self.log_tail("kubelet"))
            time.sleep(0.3)

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.log(name), "ab") as out:
            self.processes[name] = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_unblock_signals,
            )

    def _check_alive(self, name: str, deadline: float) -> None:
        proc = self.processes[name]
        if proc.poll() is not None:
            raise NodeUnavailable(f"{name} exited ({proc.returncode}):\n" + self.log_tail(name))
        if time.monotonic() > deadline:
            raise NodeUnavailable(f"{name} not up in time:\n" + self.log_tail(name))

    def _stop_process(self, name: str, timeout: float = 15) -> None:
        proc = self.processes.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # stop --------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Delete the node's pods, stop everything, unmount, remove the cgroups and network
        namespaces (then :meth:`release_host`)."""
        with contextlib.suppress(Exception):
            self._drain(timeout=40)
        self._stop_process("kube-proxy")
        self._stop_process("kubelet")
        if "containerd" in self.processes:
            with contextlib.suppress(Exception):
                self._clean_runtime()
                for sandbox in self.ctr("containers", "ls", "-q", check=False).split():
                    self.ctr("containers", "rm", sandbox, check=False)
        self._stop_process("containerd")
        self._kill_leftover_processes()
        if self.dns is not None:
            self.dns.close()
            self.dns = None
        self._unmount()
        self._remove_cgroups()
        self._remove_netns()

    def release_host(self) -> None:
        """After :meth:`stop` and the control plane's stop (the API server talks to itself at
        the bridge's address until it has stopped): the bridge, the iptables chains and rules,
        the sysctls and the files the runtime left on the host."""
        with contextlib.suppress(subprocess.CalledProcessError):
            if BRIDGE in links():
                run("ip", "link", "del", BRIDGE)
        self._clean_iptables()
        if self.before is not None:
            for name, value in self.before.sysctls.items():
                with contextlib.suppress(OSError):
                    if Path("/proc/sys", name).read_text().strip() != value:
                        Path("/proc/sys", name).write_text(value)
            for path, entries in self.before.dirs.items():
                for entry in sorted(dir_entries(path) - entries, key=len, reverse=True):
                    p = Path(entry)
                    with contextlib.suppress(OSError):
                        if p.is_symlink() or p.is_file() or p.is_socket():
                            p.unlink()
                        elif p.is_dir():
                            shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _drain(self, timeout: float) -> None:
        from kubernetes import client, config

        if self.plane is None or "kubelet" not in self.processes:
            return
        core = client.CoreV1Api(config.new_client_from_config(str(self.plane.kubeconfig())))
        # the DaemonSet would put its pod back: delete DaemonSets first
        apps = client.AppsV1Api(core.api_client)
        for ds in apps.list_daemon_set_for_all_namespaces().items:
            with contextlib.suppress(client.ApiException):
                apps.delete_namespaced_daemon_set(ds.metadata.name, ds.metadata.namespace)
        for deploy in apps.list_deployment_for_all_namespaces().items:
            with contextlib.suppress(client.ApiException):
                apps.delete_namespaced_deployment(deploy.metadata.name, deploy.metadata.namespace)
        pods = core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}").items
        for pod in pods:
            with contextlib.suppress(client.ApiException):
                core.delete_namespaced_pod(
                    pod.metadata.name, pod.metadata.namespace, grace_period_seconds=1
                )
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            left = core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.name}"
            ).items
            # the kubelet stops a deleted pod's containers and its sandbox (network torn
            # down); the dead containers wait for its garbage collection, removed below
            running = [
                line
                for line in self.ctr("tasks", "ls", check=False).splitlines()[1:]
                if "RUNNING" in line
            ]
            if not left and not running:
                return
            time.sleep(0.5)

    def _kill_leftover_processes(self) -> None:
        """Shims of this containerd (they outlive it by design) and anything still in the
        node's cgroups."""
        pids: set[int] = set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
                if (
                    cmdline
                    and cmdline[0].endswith(b"containerd-shim-runc-v2")
                    and str(self.containerd_socket).encode() in cmdline
                ):
                    pids.add(int(proc.name))
        for directory in cgroup_dirs():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while pids and time.monotonic() < end:
            pids = {p for p in pids if Path(f"/proc/{p}").exists()}
            time.sleep(0.1)

    def _unmount(self) -> None:
        prefixes = [
            str(self.kubelet_root),
            str(self.workdir),
            str(CONTAINERD_ROOT),
            "/run/containerd",
            "/var/run/netns",
            "/run/netns",
        ]
        for point in sorted(set(mounts_under(prefixes)), key=len, reverse=True):
            run("umount", "-l", point, check=False)

    def _remove_cgroups(self) -> None:
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            top = hierarchy / CGROUP_ROOT
            if not top.is_dir():
                continue
            for directory in sorted(
                [p for p in top.rglob("*") if p.is_dir()], key=lambda p: len(p.parts), reverse=True
            ):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()

    def _remove_netns(self) -> None:
        before = self.before.dirs.get("/var/run/netns", set()) if self.before else set()
        netns = Path("/var/run/netns")
        if not netns.is_dir():
            return
        for entry in netns.iterdir():
            if str(entry) in before:
                continue
            run("umount", "-l", str(entry), check=False)
            with contextlib.suppress(OSError):
                entry.unlink()

    def _clean_iptables(self) -> None:
        """Delete the rules that jump to KUBE-*/CNI-* chains, then those chains."""
        out = run("iptables-save", check=False).stdout
        script: list[str] = []
        table = ""
        chains: list[str] = []
        deletes: list[str] = []
        for line in [*out.splitlines(), "*END"]:
            if line.startswith("*"):
                if table and (chains or deletes):
                    script += [f"*{table}", *deletes]
                    script += [f"-F {c}" for c in chains] + [f"-X {c}" for c in chains]
                    script.append("COMMIT")
                table, chains, deletes = line[1:], [], []
            elif line.startswith(":"):
                chain = line[1:].split()[0]
                if OUR_CHAINS.match(chain):
                    chains.append(chain)
            elif line.startswith("-A "):
                chain = line.split()[1]
                target = re.search(r" -j (\S+)", line)
                if not OUR_CHAINS.match(chain) and target and OUR_CHAINS.match(target.group(1)):
                    deletes.append("-D" + line[2:])
        if script:
            subprocess.run(
                ["iptables-restore", "--noflush"],
                input="\n".join(script) + "\n",
                text=True,
                capture_output=True,
                check=False,
            )

    def leftovers(self) -> list[str]:
        """What differs from the host before :meth:`prepare_host` (empty: nothing left)."""
        assert self.before is not None
        now = HostSnapshot.take()
        found = []
        for name, value in self.before.sysctls.items():
            if now.sysctls.get(name) != value:
                found.append(f"sysctl {name} = {now.sysctls.get(name)} (was {value})")
        found += [f"iptables + {r}" for r in sorted(now.iptables - self.before.iptables)]
        found += [f"iptables - {r}" for r in sorted(self.before.iptables - now.iptables)]
        found += [f"link {x}" for x in sorted(now.links - self.before.links)]
        found += [f"cgroup {x}" for x in sorted(now.cgroups - self.before.cgroups)]
        for path, entries in now.dirs.items():
            found += [f"file {x}" for x in sorted(entries - self.before.dirs[path])]
        found += [
            f"mount {m}"
            for m in mounts_under([str(self.workdir), str(CONTAINERD_ROOT), str(self.kubelet_root)])
        ]
        for name, proc in self.processes.items():
            if proc.poll() is None:
                found.append(f"process {name} {proc.pid}")
        if self.workdir.exists():
            found.append(f"file {self.workdir}")
        return found


def start_real_node(
    root: Path, labels: dict[str, str] | None = None
) -> tuple[ControlPlane, RealNode]:
    """The control plane and the node, with the node's prepared host (stops both on failure)."""
    node = RealNode(root / "node")
    plane = ControlPlane(root / "plane", bind_host=GATEWAY, service_accounts=True)
    try:
        node.prepare_host()
        plane.start()
        node.start(plane, labels)
    except BaseException:
        node.stop()
        plane.stop()
        node.release_host()
        raise
    return plane, node


__all__ = [
    "GATEWAY",
    "KERNEL_IMAGE",
    "NODE_IMAGE",
    "NODE_NAME",
    "PYTHON_IMAGE",
    "ControlPlaneUnavailable",
    "NodeUnavailable",
    "RealNode",
    "ServiceDNS",
    "product_images",
    "start_real_node",
]
