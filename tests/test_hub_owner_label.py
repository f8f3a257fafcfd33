"""The owner label on a user's server pod (issue 15 "Network"), set in the Hub: KubeSpawner
builds the pod from our profile list, and the label is the one the controller puts on that
user's kernel pods, so the controller's per-user NetworkPolicy admits exactly this server.

Real JupyterHub user and KubeSpawner (as in test_hub.py); ``get_pod_manifest`` is what
KubeSpawner creates the pod from (no API server is contacted)."""

from __future__ import annotations

from pathlib import Path

from test_hub import gpu_form, kubeconfig, ledger, make_spawner, submit  # noqa: F401 - fixtures

from jupyter_gpushare.hub import label_owner, owner_labels
from jupyter_gpushare.k8s.manifests import LABEL_OWNER, owner_label
from jupyter_gpushare.ledger.sqlite import SQLiteLedger


async def test_every_profile_labels_the_server_pod_with_its_owner(
    tmp_path: Path,
    ledger: SQLiteLedger,  # noqa: F811
) -> None:
    admin_labels = {"kubespawner_override": {"extra_labels": {"team": "ml"}}}
    spawner, _ = make_spawner(
        tmp_path,
        ledger,
        gpu_profile={"display_name": "GPU", "slug": "gpu", **admin_labels},
        cpu_profiles=[{"display_name": "CPU", "slug": "cpu"}],
    )
    expected = owner_label(spawner.user.name)
    assert expected == owner_labels(spawner)[LABEL_OWNER] and len(expected) == 20
    await submit(spawner, gpu_form(gpu_type="A100", gpu_share="0.25-0.5"))
    pod = await spawner.get_pod_manifest()
    labels = pod.metadata.labels
    assert labels[LABEL_OWNER] == expected
    assert labels["team"] == "ml"  # the admin's own labels stay
    assert labels["component"] == "singleuser-server"  # what the policies select servers by
    # the CPU-only profile too (a label never depends on the user's choices)
    await submit(spawner, {"profile": "cpu"})
    assert (await spawner.get_pod_manifest()).metadata.labels[LABEL_OWNER] == expected


async def test_modify_pod_hook_labels_without_gpu_profiles(
    tmp_path: Path,
    ledger: SQLiteLedger,  # noqa: F811
) -> None:
    spawner, _ = make_spawner(tmp_path, ledger)
    pod = await spawner.get_pod_manifest()
    # a label the user's own options could have put there is overwritten, not trusted
    pod.metadata.labels[LABEL_OWNER] = owner_label("someone-else")
    pod = label_owner(spawner, pod)
    assert pod.metadata.labels[LABEL_OWNER] == owner_label(spawner.user.name)
    assert pod.metadata.labels["component"] == "singleuser-server"
