"""``jupyter gpushare k8s kernel-pod``: print, as YAML, the kernel pod and connection Secret
(without its key) that a Jupyter server with this configuration would create, built by the same
manifest functions (``k8s/manifests.py``), with the Pod Security "restricted" verdict
(``k8s/podsecurity.py``), so an admin can review them against their policies.

The values that exist only at launch are placeholders: the kernel id, the allocation id, the
node and GPU (``--node``/``--gpu``), the server id and the owner Lease's uid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

PLACEHOLDER_KERNEL = "00000000-0000-0000-0000-000000000000"
PLACEHOLDER_ALLOCATION = "a-0000000000000000"


def add_parser(sub: Any) -> None:
    """``jupyter gpushare k8s …`` on the CLI's sub-parsers."""
    k8s = sub.add_parser("k8s", help="Kubernetes: review what gpushare creates")
    actions = k8s.add_subparsers(dest="k8s_action", required=True)
    pod = actions.add_parser(
        "kernel-pod",
        help="print the kernel pod (and Secret, without its key) a server with "
        "this configuration would create, as YAML",
    )
    pod.add_argument("--gpu-request", metavar="R", help="guaranteed fraction of a GPU, (0, 1]")
    pod.add_argument("--gpu-limit", metavar="L", help="burst limit, a fraction in (0, 1]")
    pod.add_argument("--gpu-memory", metavar="M", help="memory cap, e.g. 10GiB")
    pod.add_argument("--gpu-type", metavar="T", help="GPU type, e.g. A100")
    pod.add_argument("--gpu-count", metavar="N", help="whole GPUs")
    pod.add_argument(
        "--config",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="jupyter_server_config.py/.json with c.KubernetesBackendConfig and "
        "c.GpuShare settings (repeat; later files win); default: none",
    )
    pod.add_argument("--node", default="NODE", help="node name shown (placeholder)")
    pod.add_argument(
        "--gpu",
        default="GPU-00000000-0000-0000-0000-000000000000",
        help="GPU UUID shown (placeholder)",
    )
    pod.add_argument(
        "--simulated",
        metavar="N[xTYPE]",
        default=None,
        help="show the pod for a demo node with these simulated GPUs",
    )
    pod.set_defaults(func=cmd_kernel_pod)


def load_config(files: list[Path]) -> Any:
    from traitlets.config import Config
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    config = Config()
    for f in files:
        if not f.is_file():
            raise ValueError(f"--config {f}: no such file")
        loader = PyFileConfigLoader if f.suffix == ".py" else JSONFileConfigLoader
        try:
            config.merge(loader(f.name, path=str(f.parent)).load_config())
        except Exception as exc:
            raise ValueError(f"--config {f}: {exc}") from None
    return config


def kernel_objects(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The kernel pod and its Secret (``data`` left out) for ``args``."""
    from ..config import GpuShare
    from ..inventory import simulated_gpus, simulator_device_list
    from ..share import ShareSpec
    from . import manifests
    from .config import KubernetesBackendConfig

    config = load_config(list(args.config))
    share = GpuShare(config=config)
    kcfg = KubernetesBackendConfig(config=config)
    spec = ShareSpec.from_args(
        args.gpu_request,
        args.gpu_limit,
        args.gpu_memory,
        args.gpu_type,
        args.gpu_count,
        defaults=share.default_spec(),
    )
    settings = manifests.PodSettings.from_config(kcfg)
    gpus = [args.gpu] * max(1, spec.gpu_count)
    simulated = ""
    if args.simulated:
        sim = simulated_gpus(args.simulated, args.node)
        gpus = [g.uuid for g in sim[: max(1, spec.gpu_count)]]
        simulated = simulator_device_list(sim)
    name = f"gpushare-kernel-{PLACEHOLDER_KERNEL[:8]}"
    owner = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "name": manifests.lease_name("SERVER-ID"),
        "uid": "LEASE-UID",
        "controller": False,
        "blockOwnerDeletion": False,
    }
    request = manifests.KernelPodRequest(
        name=name,
        namespace=kcfg.namespace,
        kernel_id=PLACEHOLDER_KERNEL,
        allocation_id=PLACEHOLDER_ALLOCATION,
        node=args.node,
        gpus=gpus,
        command=[kcfg.python, "-m", "ipykernel_launcher", "-f", settings.connection_file],
        env={},
        server_id="SERVER-ID",
        owner=owner,
        simulated_devices=simulated,
        gpu_request=spec.gpu_request,
        gpu_memory=spec.gpu_memory or 0,
    )
    pod = manifests.kernel_pod(request, settings)
    secret = manifests.connection_secret(name, kcfg.namespace, {}, owner, PLACEHOLDER_KERNEL)
    secret.pop("data")  # the key and ports exist only per kernel, in the Secret alone
    return pod, secret


def cmd_kernel_pod(args: argparse.Namespace) -> int:
    import yaml

    from .podsecurity import restricted_violations

    try:
        pod, secret = kernel_objects(args)
    except ValueError as exc:  # a config file that does not load (share errors: the CLI's)
        if type(exc).__name__ == "ShareError":
            raise
        print(f"gpushare: {exc}", file=sys.stderr)
        return 2
    found = restricted_violations(pod)
    print(
        "# The kernel pod and connection Secret (its data, the kernel's key and ports, left "
        "out) a server\n# with this configuration creates. Placeholders: kernel and "
        "allocation ids, node, GPU, owner Lease."
    )
    if found:
        print("# Pod Security 'restricted': FAILS:")
        for line in found:
            print(f"#   - {line}")
    else:
        print("# Pod Security 'restricted': passes.")
    sys.stdout.write(yaml.safe_dump_all([pod, secret], sort_keys=False))
    return 0


__all__ = ["add_parser", "cmd_kernel_pod", "kernel_objects"]
