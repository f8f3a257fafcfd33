"""The backend seam (jupyter_gpushare.backends): backends are found by entry point, by name.

A third backend, installed by a distribution of its own (a ``.dist-info`` with an entry point in
``jupyter_gpushare.backends`` on ``sys.path``), is picked up by ``c.GpuShare.backend`` and by a
kernelspec's ``backend`` key with no edit to the package; an unknown name is refused naming the
installed ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jupyter_gpushare import backends
from jupyter_gpushare.backends.kubernetes import KubernetesBackend
from jupyter_gpushare.backends.local import LocalBackend
from jupyter_gpushare.config import GpuShare
from jupyter_gpushare.provisioner import GpushareProvisioner, ShareRefused
from jupyter_gpushare.share import ShareError

THIRD = """
from jupyter_gpushare.backends import Backend
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.usage import UsageView


class Usage:
    async def read(self, fresh=False):
        return UsageView("third", message="third usage")

    async def changed(self):
        pass


class ThirdBackend(Backend):
    name = "third"

    async def ledger(self):
        return SQLiteLedger(self.settings.ledger_path)

    async def inventory(self):
        return [], "the third backend has no GPUs"

    async def usage(self):
        return Usage()

    def kernel_backend(self, provisioner):
        return ("third launcher", provisioner.kernel_id)

    def may_touch(self, record):
        return record.get("third") == "mine"
"""

PROBE = """
import asyncio, json
from jupyter_gpushare import backends
from jupyter_gpushare.config import GpuShare
from jupyter_gpushare.provisioner import GpushareProvisioner

settings = GpuShare(backend="third", ledger_path=LEDGER)
backend = settings.get_backend()
ledger = asyncio.run(settings.ledger())


async def main():
    usage = await backend.usage()
    return (await usage.read()).message, await backend.inventory()

message, inventory = asyncio.run(main())
provisioner = GpushareProvisioner(kernel_id="k-1", backend="third")
provisioner._settings = settings
print(json.dumps({
    "names": backends.names(),
    "class": type(backend).__module__ + "." + type(backend).__name__,
    "ledger": type(ledger).__name__ + ":" + str(ledger.path),
    "usage": message,
    "inventory": inventory[1],
    "touch": [backend.may_touch({"third": "mine"}), backend.may_touch({})],
    "launcher": list(provisioner.kernel_backend),
}))
"""


def install_third(site: Path) -> None:
    """A distribution of its own: a module and its .dist-info with the entry point."""
    (site / "third_backend.py").write_text(THIRD)
    info = site / "third_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: third-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{backends.GROUP}]\nthird = third_backend:ThirdBackend\n"
    )


def test_a_third_backend_is_found_by_entry_point(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    install_third(site)
    ledger = tmp_path / "ledger.sqlite"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", f"LEDGER = {str(ledger)!r}\n" + textwrap.dedent(PROBE)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["names"] == ["kubernetes", "local", "third"]
    assert got["class"] == "third_backend.ThirdBackend"
    assert got["ledger"] == f"SQLiteLedger:{ledger}"
    assert got["usage"] == "third usage"
    assert got["inventory"] == "the third backend has no GPUs"
    assert got["touch"] == [True, False]
    assert got["launcher"] == ["third launcher", "k-1"]


def test_the_two_shipped_backends_are_registered() -> None:
    assert {"local", "kubernetes"} <= set(backends.names())
    assert backends.backend_class("local") is LocalBackend
    assert backends.backend_class("kubernetes") is KubernetesBackend
    settings = GpuShare()
    assert isinstance(settings.get_backend(), LocalBackend)
    assert settings.get_backend() is settings.get_backend()  # one per server and name
    assert settings.get_backend().agent_beside_server
    assert settings.get_backend().may_touch({"k8s_server": "someone-else"})  # all of the machine


def test_kubernetes_backend_touches_only_its_servers_records() -> None:
    backend = GpuShare().get_backend("kubernetes")
    mine = backend.server_id()
    assert mine
    assert backend.may_touch({"k8s_server": mine})
    assert not backend.may_touch({"k8s_server": mine + "-other"})
    assert not backend.may_touch({})
    assert not backend.agent_beside_server


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ShareError) as refused:
        GpuShare(backend="nowhere")
    assert refused.value.field == "backend"
    assert refused.value.value == "nowhere"
    assert "'kubernetes'" in refused.value.allowed and "'local'" in refused.value.allowed
    with pytest.raises(ShareRefused) as start:
        GpushareProvisioner(kernel_id="k-2", backend="nowhere")
    assert start.value.status_code == 400
    assert start.value.body["field"] == "backend"
    assert "'local'" in start.value.body["allowed"]
