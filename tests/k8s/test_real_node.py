"""The real node itself (``real_node.py``): runs on the REAL node — kubelet 1.20, containerd,
runc, the CNI bridge and kube-proxy — not on the kubelet double.

A plain pod of the python test image runs; this host reaches it at its pod IP and through a
Service's ClusterIP (kube-proxy's iptables rules); a second pod reaches the Service by its DNS
name (``real_node.ServiceDNS``, the stand-in for cluster DNS) and the API server through the
``kubernetes`` Service with its service-account token, as in-cluster clients do.

Where it runs: the real node (``real_node.py``).
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import pytest
from real_node import GATEWAY, PYTHON_IMAGE, RealNode

pytestmark = pytest.mark.timeout(300)

NS = "real-node-test"

CLIENT = """
import json, os, ssl, socket, urllib.request
ip = socket.gethostbyname("web.__NS__.svc")
url = "http://web.__NS__.svc:8080/hello.txt"
body = urllib.request.urlopen(url, timeout=10).read().decode().strip()
ctx = ssl.create_default_context(cafile="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
host = os.environ["KUBERNETES_SERVICE_HOST"]
req = urllib.request.Request(f"https://{host}/api/v1/namespaces/__NS__/services/web",
                             headers={"Authorization": "Bearer " + token})
svc = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))
print(json.dumps({"ip": ip, "body": body, "clusterIP": svc["spec"]["clusterIP"]}))
""".replace("__NS__", NS)


def wait_pod(core: Any, name: str, phases: set[str], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        pod = core.read_namespaced_pod(name, NS)
        if pod.status.phase in phases:
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} is {pod.status.phase}: {pod.status}")
        time.sleep(0.3)


def test_a_plain_pod_runs_and_is_reachable_on_the_pod_network(real_node: RealNode) -> None:
    """Runs on the real node: a pod's container runs (containerd, runc), gets a pod IP of the
    bridge's subnet, and this host reaches its port there and through a Service's ClusterIP;
    another pod resolves the Service's name, fetches from it, and reads the Service from the
    API server with its projected service-account token via the ``kubernetes`` Service."""
    from kubernetes import client, config

    assert real_node.plane is not None
    api = config.new_client_from_config(str(real_node.plane.kubeconfig()))
    core = client.CoreV1Api(api)
    real_node.create_namespace(NS)
    client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(
        NS,
        {
            "metadata": {"name": "default-view"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "view",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": NS}],
        },
    )
    try:
        word = uuid.uuid4().hex
        core.create_namespaced_pod(
            NS,
            {
                "metadata": {"name": "web", "labels": {"app": "web"}},
                "spec": {
                    "containers": [
                        {
                            "name": "web",
                            "image": PYTHON_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": [
                                "sh",
                                "-c",
                                f"cd /tmp && echo {word} > hello.txt && "
                                "exec python3 -m http.server 8080",
                            ],
                            "ports": [{"containerPort": 8080}],
                            "securityContext": {"runAsUser": 1000, "runAsNonRoot": True},
                        }
                    ]
                },
            },
        )
        core.create_namespaced_service(
            NS,
            {
                "metadata": {"name": "web"},
                "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]},
            },
        )
        pod = wait_pod(core, "web", {"Running"})
        assert pod.spec.node_name == real_node.name
        assert pod.status.pod_ip.startswith(GATEWAY.rsplit(".", 1)[0] + ".")

        def fetch(url: str) -> str:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=5) as reply:
                        return str(reply.read().decode().strip())
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.3)

        assert fetch(f"http://{pod.status.pod_ip}:8080/hello.txt") == word
        cluster_ip = core.read_namespaced_service("web", NS).spec.cluster_ip
        assert fetch(f"http://{cluster_ip}:8080/hello.txt") == word

        core.create_namespaced_pod(
            NS,
            {
                "metadata": {"name": "client"},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "client",
                            "image": PYTHON_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["python3", "-c", CLIENT],
                        }
                    ],
                },
            },
        )
        done = wait_pod(core, "client", {"Succeeded", "Failed"})
        logs = (real_node.pod_logs(NS, "client", "client") or "").strip()
        assert done.status.phase == "Succeeded", logs
        seen = json.loads(logs.splitlines()[-1])
        assert seen == {"ip": cluster_ip, "body": word, "clusterIP": cluster_ip}
    finally:
        core.delete_namespace(NS)
        api.close()
