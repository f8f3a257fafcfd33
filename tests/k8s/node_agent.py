"""A test double of the kubelet (and of the NVIDIA container runtime) for fake GPU nodes.

NOT a product part. It lets the real control plane of ``cluster.py`` run gpushare kernel pods on
this machine:

- registers Nodes (``--node NAME=2xA100``) with CPU/memory capacity, Ready, no ``not-ready``
  taint; heartbeats keep them Ready;
- runs each pod bound to one of its nodes as a local process: the container's
  ``command``/``args`` (the image is ignored, except that an image containing
  ``does-not-exist`` reports ``ErrImagePull`` as a kubelet would), its ``env`` (``fieldRef``
  resolved), Secret volumes written to a directory, hostPaths mapped (the daemon socket
  directory per node, other existing host paths as they are), and mount paths replaced by
  those directories in argv and env. ``NVIDIA_VISIBLE_DEVICES`` becomes
  ``CUDA_VISIBLE_DEVICES`` (what the NVIDIA runtime's device isolation amounts to for the
  simulator);
- reports ``phase``, ``podIP`` (127.0.0.1) and container states (running, terminated with exit
  code) back through the API, and honours graceful deletion (SIGTERM, SIGKILL after the grace
  period, then the final delete);
- runs init containers in order, then all containers; restarts the containers of pods with
  ``restartPolicy: Always`` (the DaemonSet's node daemon) when they exit; expands ``$(VAR)``
  in command and args as the kubelet does;
- puts each container's processes into a cgroup named after the pod's UID, with the kubelet's
  cgroupfs layout (``kubepods/pod<uid>/<container>``, in the first writable hierarchy), so
  the node daemon identifies kernel pods as it does on a real node (``/proc/<pid>/cgroup``);
- gives pods of a service account the agent knows (``--service-account NS/NAME=KUBECONFIG``)
  that account's credentials as ``KUBECONFIG`` (what the projected token is on a real node);
  pods with ``automountServiceAccountToken: false`` (kernel pods) get none;
- labels its nodes ``gpushare.jupyter.org/simulate=<N>x<TYPE>`` as an admin labels demo
  nodes; the node daemon (the DaemonSet of ``deploy/daemonset.yaml``) then simulates those GPUs
  and publishes them on the Node;
- test hooks, as annotations on a pod: ``test.gpushare/evict: <message>`` evicts it the way the
  kubelet does under node pressure (phase Failed, reason Evicted); ``test.gpushare/oom: "1"``
  kills it as the OOM killer would (terminated, reason OOMKilled, exit code 137).
"""

# A test double: its few small local file operations may block the agent's own loop.
# ruff: noqa: ASYNC230, ASYNC240

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from jupyter_gpushare.k8s.client import Kube, connect

log = logging.getLogger("node-agent")
EVICT = "test.gpushare/evict"
OOM = "test.gpushare/oom"
PER_NODE_HOST_PATHS = ("/run/gpushare",)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


SIMULATE_LABEL = "gpushare.jupyter.org/simulate"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class Cgroups:
    """Per-container cgroups in the kubelet's cgroupfs layout, in the first hierarchy this
    machine lets us write (None: the pods' processes stay where they are, unidentifiable)."""

    CANDIDATES = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")

    def __init__(self) -> None:
        self.root: Path | None = None
        for candidate in self.CANDIDATES:
            base = Path(candidate) / "kubepods"
            try:
                base.mkdir(exist_ok=True)
                (base / "cgroup.procs").stat()
            except OSError:
                continue
            self.root = base
            break

    def wrap(self, uid: str, container: str, argv: list[str]) -> list[str]:
        """``argv`` run from a shell that first moves itself into the container's cgroup."""
        if self.root is None:
            return argv
        path = self.root / f"pod{uid}" / container
        path.mkdir(parents=True, exist_ok=True)
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path), *argv]

    def remove(self, uid: str) -> None:
        if self.root is None:
            return
        pod = self.root / f"pod{uid}"
        for path in sorted(pod.glob("*"), reverse=True):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            pod.rmdir()


class RunningPod:
    def __init__(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.name = pod["metadata"]["name"]
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.task: asyncio.Task[None] | None = None
        self.stopping = False
        self.reason: str | None = None  # Evicted / OOMKilled when we killed it on purpose
        self.message = ""
        self.finished = False


class NodeAgent:
    def __init__(self, kube: Kube, namespace: str, workdir: Path, nodes: dict[str, str],
                 cpu: str, memory: str, accounts: dict[str, str] | None = None) -> None:
        self.kube = kube
        self.accounts = accounts or {}  # "namespace/name" -> kubeconfig of that identity
        self.cgroups = Cgroups()
        self.namespace = namespace
        self.workdir = workdir
        self.nodes = nodes
        self.cpu = cpu
        self.memory = memory
        self.pods: dict[str, RunningPod] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- nodes ---------------------------------------------------------------------------------

    async def register(self) -> None:
        if self.cgroups.root is None:
            log.warning("no writable cgroup hierarchy: pod processes cannot be identified")
        for name, simulate in self.nodes.items():
            (self.workdir / name / "run" / "gpushare").mkdir(parents=True, exist_ok=True)
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64"}
            if simulate:
                labels[SIMULATE_LABEL] = simulate
            body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name,
                                                                     "labels": labels}}
            with contextlib.suppress(ApiException):
                await self.kube.core.create_node(body)
            await self.kube.core.patch_node(name, {"metadata": {"labels": labels}})
            await self._node_status(name)
            await self._untaint(name)

    async def _node_status(self, name: str) -> None:
        stamp = now()
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        conditions = [{"type": t, "status": "False", "reason": "AgentOK", "message": "ok",
                       "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
                      for t in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                           "message": "node agent (test double of the kubelet) is ready",
                           "lastHeartbeatTime": stamp, "lastTransitionTime": stamp})
        await self.kube.core.patch_node_status(name, {"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.20.2-gpushare-node-agent", "osImage": "test",
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "local-process://0", "kernelVersion": "",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
                         "bootID": ""},
        }})

    async def _untaint(self, name: str) -> None:
        """Drop the ``not-ready`` taint that nodes created through the API start with."""
        node = await self.kube.core.read_node(name)
        taints = self.kube.api.sanitize_for_serialization(node.spec.taints or [])
        kept = [t for t in taints if t["key"] != "node.kubernetes.io/not-ready"]
        if kept != taints:
            await self.kube.core.patch_node(
                name, [{"op": "replace", "path": "/spec/taints", "value": kept}])

    async def heartbeat(self, interval: float = 10.0) -> None:
        while True:
            await asyncio.sleep(interval)
            for name in self.nodes:
                try:
                    await self._node_status(name)
                    await self._untaint(name)
                except Exception as exc:
                    log.warning("heartbeat of %s failed: %s", name, exc)

    # -- pods ----------------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                listing = await self.kube.list_pods(self.namespace)
                for pod in listing.get("items") or []:
                    await self.on_pod(pod, deleted=False)
                async for event in self.kube.watch(
                    "pods", self.namespace, listing["metadata"]["resourceVersion"]
                ):
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        await self.on_pod(event["object"], deleted=event["type"] == "DELETED")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("pod watch restarts: %s", exc)
                await asyncio.sleep(0.5)

    async def on_pod(self, pod: dict[str, Any], deleted: bool) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        if node not in self.nodes:
            return
        meta = pod["metadata"]
        running = self.pods.get(meta["uid"])
        if deleted:
            if running is not None:
                await self._stop(running, 0)
                self.pods.pop(meta["uid"], None)
            return
        if meta.get("deletionTimestamp"):
            if running is None or running.finished:
                await self._finalize(pod)
                self.pods.pop(meta["uid"], None)
            elif running.task is not None and not getattr(running, "deleting", False):
                running.deleting = True  # type: ignore[attr-defined]
                task = asyncio.create_task(self._delete_gracefully(running, pod))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        if running is None:
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            running = RunningPod(pod)
            self.pods[meta["uid"]] = running
            running.task = asyncio.create_task(self._run_pod(running, node))
            return
        annotations = meta.get("annotations") or {}
        if EVICT in annotations and running.reason is None:
            running.reason, running.message = "Evicted", annotations[EVICT]
            await self._stop(running, 0)
        elif OOM in annotations and running.reason is None:
            running.reason, running.message = "OOMKilled", ""
            await self._stop(running, 0)

    async def _delete_gracefully(self, running: RunningPod, pod: dict[str, Any]) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        await self._stop(running, float(grace if grace is not None else 30))
        if running.task is not None:
            with contextlib.suppress(Exception):
                await running.task
        await self._finalize(pod)
        self.pods.pop(running.uid, None)

    async def _finalize(self, pod: dict[str, Any]) -> None:
        """The kubelet's last word on a deleted pod: its containers are gone, remove it."""
        meta = pod["metadata"]
        try:
            await self.kube.core.delete_namespaced_pod(
                meta["name"], meta["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
            log.info("pod %s: deleted", meta["name"])
        except ApiException as exc:
            if exc.status != 404:
                log.warning("pod %s: final delete failed: %s %s", meta["name"], exc.status,
                            exc.reason)
        root = self.workdir / "pods" / meta["uid"]
        for log_file in root.glob("*.log"):
            (self.workdir / "logs").mkdir(exist_ok=True)
            shutil.move(log_file, self.workdir / "logs" / f"{meta['name']}.{log_file.name}")
        shutil.rmtree(root, ignore_errors=True)
        self.cgroups.remove(meta["uid"])

    async def _stop(self, running: RunningPod, grace: float) -> None:
        running.stopping = True
        live = [p for p in running.processes.values() if p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        if grace > 0 and live:
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in live)), grace)
            except (asyncio.TimeoutError, TimeoutError):
                for proc in live:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)

    async def _run_pod(self, running: RunningPod, node: str) -> None:
        pod = running.pod
        spec = pod["spec"]
        inits, containers = spec.get("initContainers") or [], spec["containers"]
        missing = [c for c in [*inits, *containers] if "does-not-exist" in c.get("image", "")]
        if missing:
            await self._status(pod, "Pending", [self._cstatus(missing[0], {"waiting": {
                "reason": "ErrImagePull",
                "message": f'rpc error: code = NotFound desc = failed to pull and unpack '
                           f'image "{missing[0]["image"]}": not found'}})])
            running.finished = True
            return
        try:
            root, mounts = await self._volumes(pod, node)
            for init in inits:
                code = await (await self._start(running, pod, init, node, root, mounts)).wait()
                if code != 0:
                    await self._status(pod, "Pending", [self._cstatus(init, {"waiting": {
                        "reason": "Init:Error", "message": f"exit code {code}"}})])
                    running.finished = True
                    return
            for container in containers:
                await self._start(running, pod, container, node, root, mounts)
        except Exception as exc:
            log.exception("pod %s could not run", running.name)
            await self._status(pod, "Pending", [self._cstatus(containers[0], {"waiting": {
                "reason": "CreateContainerError", "message": str(exc)}})])
            running.finished = True
            return
        started = now()
        await self._status(pod, "Running", [self._cstatus(
            c, {"running": {"startedAt": started}}, ready=True) for c in containers], ready=True)
        if spec.get("restartPolicy", "Always") == "Always":
            await self._keep_running(running, pod, node, root, mounts)
        code = await running.processes[containers[0]["name"]].wait()
        for container in containers[1:]:
            await running.processes[container["name"]].wait()
        await self._terminated(running, pod, containers[0], code, started)

    async def _keep_running(self, running: RunningPod, pod: dict[str, Any], node: str,
                            root: Path, mounts: dict[str, str]) -> None:
        """``restartPolicy: Always``: a container that exits is started again (after 1 s)."""
        containers = {c["name"]: c for c in pod["spec"]["containers"]}  # not the init ones
        restarts = dict.fromkeys(containers, 0)
        while not running.stopping:
            waits = {asyncio.ensure_future(running.processes[n].wait()): n for n in containers}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if running.stopping:
                return
            await asyncio.sleep(1.0)
            for task in done:
                name = waits[task]
                container = containers[name]
                restarts[name] += 1
                log.info("pod %s: container %s exited (%s); restart %d", running.name, name,
                         task.result(), restarts[name])
                await self._start(running, pod, container, node, root, mounts)

    async def _terminated(self, running: RunningPod, pod: dict[str, Any],
                          container: dict[str, Any], code: int, started: str) -> None:
        code = 128 - code if code < 0 else code
        reason = running.reason or ("Completed" if code == 0 else "Error")
        if running.reason == "OOMKilled":
            code = 137
        term = {"terminated": {"exitCode": code, "reason": reason, "startedAt": started,
                               "finishedAt": now()}}
        phase = "Succeeded" if code == 0 and running.reason is None else "Failed"
        extra = {}
        if running.reason == "Evicted":
            extra = {"reason": "Evicted", "message": running.message}
        running.finished = True
        log.info("pod %s: exited %d (%s)", running.name, code, phase)
        try:
            await self._status(pod, phase, [self._cstatus(container, term)], **extra)
        except ApiException as exc:
            log.info("pod %s: final status not written (%s)", running.name, exc.status)

    async def _start(self, running: RunningPod, pod: dict[str, Any], container: dict[str, Any],
                     node: str, root: Path, mounts: dict[str, str]) -> asyncio.subprocess.Process:
        argv, env = self._command(pod, container, mounts)
        name = container["name"]
        with open(root / f"{name}.log", "ab") as log_file:
            proc = await asyncio.create_subprocess_exec(
                *self.cgroups.wrap(running.uid, name, argv), env=env, cwd=str(root),
                stdout=log_file, stderr=subprocess_stdout(), stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True)
        running.processes[name] = proc
        log.info("pod %s on %s: %s runs pid %d: %s", running.name, node, name, proc.pid,
                 " ".join(argv))
        return proc

    async def _volumes(self, pod: dict[str, Any], node: str) -> tuple[Path, dict[str, str]]:
        """The pod's directory and its volumes as local directories, by volume name."""
        root = self.workdir / "pods" / pod["metadata"]["uid"]
        root.mkdir(parents=True, exist_ok=True)
        volumes = {}
        for vol in pod["spec"].get("volumes") or []:
            volumes[vol["name"]] = str(await self._volume(vol, root, node, pod))
        return root, volumes

    def _command(self, pod: dict[str, Any], container: dict[str, Any],
                 volumes: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        mounts = {m["mountPath"].rstrip("/"): volumes[m["name"]]
                  for m in container.get("volumeMounts") or [] if m["name"] in volumes}

        def translate(text: str) -> str:
            for mount_path in sorted(mounts, key=len, reverse=True):
                if mount_path and mount_path in text:
                    text = text.replace(mount_path, mounts[mount_path])
            return text

        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KUBECONFIG", "GPUSHARE_", "JPY_", "JUPYTER_"))}
        account = f"{pod['metadata']['namespace']}/{pod['spec'].get('serviceAccountName')}"
        if pod["spec"].get("automountServiceAccountToken") is not False and (
                account in self.accounts):
            env["KUBECONFIG"] = self.accounts[account]
        declared: dict[str, str] = {}
        for item in container.get("env") or []:
            value = item.get("value")
            if value is None and "valueFrom" in item:
                value = self._field(pod, item["valueFrom"].get("fieldRef", {}).get("fieldPath"))
            declared[item["name"]] = translate(str(value or ""))
        env.update(declared)
        if "NVIDIA_VISIBLE_DEVICES" in env and env["NVIDIA_VISIBLE_DEVICES"] != "all":
            env["CUDA_VISIBLE_DEVICES"] = env["NVIDIA_VISIBLE_DEVICES"]
        if env.get("LD_PRELOAD") and not Path(env["LD_PRELOAD"]).exists():
            env.pop("LD_PRELOAD")  # no interposer installed on this node
        argv = [translate(VAR_REF.sub(lambda m: declared.get(m.group(1), m.group(0)), a))
                for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        elif argv and shutil.which(argv[0], path=str(Path(sys.executable).parent)):
            argv[0] = str(Path(sys.executable).parent / argv[0])  # the image's entry points
        return argv, env

    async def _volume(self, vol: dict[str, Any], root: Path, node: str,
                      pod: dict[str, Any]) -> Path:
        if "secret" in vol:
            path = root / "volumes" / vol["name"]
            path.mkdir(parents=True, exist_ok=True)
            secret = await self.kube.core.read_namespaced_secret(
                vol["secret"]["secretName"], pod["metadata"]["namespace"])
            for key, data in (secret.data or {}).items():
                target = path / key
                target.write_bytes(base64.b64decode(data))
                target.chmod(vol["secret"].get("defaultMode", 0o644))
            return path
        if "hostPath" in vol:
            host = vol["hostPath"]["path"]
            if host in PER_NODE_HOST_PATHS or not Path(host).exists():
                path = self.workdir / node / "host" / host.lstrip("/")
                path.mkdir(parents=True, exist_ok=True)
                return path
            return Path(host)
        path = root / "volumes" / vol["name"]
        path.mkdir(parents=True, exist_ok=True)
        return path

    @staticmethod
    def _field(pod: dict[str, Any], path: str | None) -> str:
        return {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "metadata.uid": pod["metadata"]["uid"],
            "spec.nodeName": pod["spec"].get("nodeName", ""),
            "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1",
        }.get(path or "", "")

    @staticmethod
    def _cstatus(container: dict[str, Any], state: dict[str, Any],
                 ready: bool = False) -> dict[str, Any]:
        return {"name": container["name"], "image": container.get("image", ""),
                "imageID": "", "ready": ready, "started": "running" in state,
                "restartCount": 0, "state": state}

    async def _status(self, pod: dict[str, Any], phase: str, containers: list[dict[str, Any]],
                      ready: bool = False, reason: str | None = None,
                      message: str | None = None) -> None:
        stamp = now()
        flag = "True" if ready else "False"
        status: dict[str, Any] = {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}], "startTime": stamp,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
                {"type": "Ready", "status": flag, "lastTransitionTime": stamp},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": stamp},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            ],
            "containerStatuses": containers,
        }
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        await self.kube.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status})


def subprocess_stdout() -> int:
    return asyncio.subprocess.STDOUT


async def amain(args: argparse.Namespace) -> None:
    kube = await connect(args.kubeconfig)
    nodes = dict(n.split("=", 1) if "=" in n else (n, "") for n in args.node)
    accounts = dict(a.split("=", 1) for a in args.service_account)
    agent = NodeAgent(kube, args.namespace, Path(args.workdir), nodes, args.cpu, args.memory,
                      accounts)
    await agent.register()
    print("node agent ready", flush=True)
    try:
        await asyncio.gather(agent.run(), agent.heartbeat())
    finally:
        for running in list(agent.pods.values()):
            await agent._stop(running, 0)
        await kube.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="kubelet test double for fake GPU nodes")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--namespace", default="gpushare")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--node", action="append", default=[], help="NAME=SIMULATE, e.g. "
                        "gpu-node-1=2xA100 (repeat)")
    parser.add_argument("--service-account", action="append", default=[],
                        metavar="NS/NAME=KUBECONFIG",
                        help="credentials given to pods of that service account (repeat)")
    parser.add_argument("--cpu", default="4")
    parser.add_argument("--memory", default="16Gi")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node-agent %(message)s")
    loop = asyncio.new_event_loop()
    task = loop.create_task(amain(args))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(task)


if __name__ == "__main__":
    main()
