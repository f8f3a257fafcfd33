"""JupyterHub GPU form (jupyter_gpushare.hub) with real JupyterHub and KubeSpawner objects.

The inventory is a real SQLite ledger holding simulated GPUs and live allocations. The form is
rendered by KubeSpawner from our callable ``profile_list``; the submitted form goes through the
spawner's ``options_from_form`` and ``load_user_options``, exactly as JupyterHub calls them
before starting a server (no Kubernetes API is contacted: only the kubeconfig is read).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jupyterhub import orm
from jupyterhub.objects import Hub
from jupyterhub.user import User
from kubernetes_asyncio.config import kube_config
from kubespawner import KubeSpawner
from traitlets.config import Config

from jupyter_gpushare.hub import (
    ENV_DEFAULT,
    ENV_MAX,
    GPU_RESOURCE,
    PRODUCT_LABEL,
    GpuOptionError,
    GpuProfiles,
    TypeOffer,
    apply_user_bound,
    ledger_inventory,
    share_environment,
    share_from_options,
)
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import place
from jupyter_gpushare.share import ShareError, ShareSpec, parse_memory

REPO = Path(__file__).resolve().parent.parent
KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: none, user: {token: none}}]
contexts: [{name: none, context: {cluster: none, user: none, namespace: jhub}}]
current-context: none
"""


@pytest.fixture
async def ledger(tmp_path: Path) -> SQLiteLedger:
    """Two A100s and a T4 (simulated), one A100 partly held."""
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    gpus = simulated_gpus("2xA100,1xT4", node="gpu-node-1")
    await ledger.put_gpus("gpu-node-1", gpus)
    await ledger.allocate(ShareSpec(0.5, 0.5, gpu_type="A100"), gpus, place, owner="kernel")
    await ledger.allocate(ShareSpec(0.25, 0.5, gpu_type="A100"), gpus, place, owner="kernel")
    return ledger


@pytest.fixture(autouse=True)
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KubeSpawner reads a kubeconfig when created (it contacts no API server here)."""
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))


def make_spawner(tmp_path: Path, ledger: SQLiteLedger, **profiles: Any) -> tuple[Any, GpuProfiles]:
    """A real KubeSpawner for a real JupyterHub user, configured with our profile list."""
    c = Config()
    c.GpuProfiles.inventory = ledger_inventory(ledger)
    for key, value in profiles.items():
        setattr(c.GpuProfiles, key, value)
    gpu = GpuProfiles(config=c)
    c.KubeSpawner.profile_list = gpu.profile_list
    c.KubeSpawner.options_from_form = gpu.options_from_form
    return spawner_for(c), gpu


def spawner_for(c: Config) -> Any:
    c.KubeSpawner.namespace = "jhub"
    db = orm.new_session_factory("sqlite:///:memory:")()
    orm_user = orm.User(name="alice")
    db.add(orm_user)
    db.commit()
    settings = {
        "spawner_class": KubeSpawner,
        "config": c,
        "hub": Hub(),
        "db": db,
        "users": {},
        "domain": "",
        "statsd": None,
    }
    return User(orm_user, settings=settings).spawner


async def submit(spawner: Any, form: dict[str, str]) -> dict[str, Any]:
    """What JupyterHub does with a POSTed spawn form, up to just before ``start()``."""
    formdata = {k: [v] for k, v in form.items()}
    spawner.user_options = spawner.run_options_from_form(formdata)
    await spawner.load_user_options()
    return spawner.user_options


def gpu_form(**options: str) -> dict[str, str]:
    return {"profile": "gpu", **{f"profile-option-gpu--{k}": v for k, v in options.items()}}


async def test_form_lists_live_inventory(tmp_path: Path, ledger: SQLiteLedger) -> None:
    # inventory_ttl=0: every open reads (the cache's period is tested below)
    spawner, _ = make_spawner(tmp_path, ledger, inventory_ttl=0)
    html = await spawner.get_options_form()
    snap = await ledger.snapshot()
    gpus = await ledger.gpus()
    free = {
        g.uuid: 1 - sum(a.spec.gpu_request for a in snap.allocations if g.uuid in a.gpus)
        for g in gpus
    }
    most_free_a100 = max(free[g.uuid] for g in gpus if g.type == "A100")
    assert f"up to {most_free_a100:g} of a GPU free now" in html
    assert re.search(r"T4 \(15GiB\) — 1 GPU, up to 1 of a GPU free now", html)
    assert 'value="A100"' in html and 'value="T4"' in html and 'value="any"' in html
    assert 'value="0.25-0.5"' in html and 'value="auto"' in html
    assert "profile-option-gpu--gpu_share--unlisted-choice" in html  # custom share allowed
    assert "CPU only" in html
    # live: a new allocation changes what the next rendering offers
    await ledger.allocate(ShareSpec(1.0, 1.0, gpu_type="T4"), gpus, place, owner="kernel")
    assert "T4 (15GiB) — 1 GPU, full now" in await spawner.get_options_form()


async def test_gpu_choice_becomes_default_and_bound(tmp_path: Path, ledger: SQLiteLedger) -> None:
    spawner, _ = make_spawner(tmp_path, ledger)
    await submit(spawner, gpu_form(gpu_type="A100", gpu_share="0.25-0.5", gpu_memory="16GiB"))
    # what the server process gets: KubeSpawner's get_env expands {...} templates in these
    default = json.loads(spawner.get_env()[ENV_DEFAULT])
    assert default == {
        "gpu_request": 0.25,
        "gpu_limit": 0.5,
        "gpu_memory": 16 * 2**30,
        "gpu_type": "A100",
    }
    assert json.loads(spawner.get_env()[ENV_MAX]) == default
    assert spawner.environment["NVIDIA_VISIBLE_DEVICES"] == "void"  # kernels hold the GPU
    assert GPU_RESOURCE not in spawner.extra_resource_limits
    # a custom share within bounds
    await submit(
        spawner,
        {
            **gpu_form(gpu_type="any", gpu_memory="auto"),
            "profile-option-gpu--gpu_share--unlisted-choice": "0.3-0.6",
        },
    )
    custom = json.loads(spawner.get_env()[ENV_DEFAULT])
    assert (custom["gpu_request"], custom["gpu_limit"]) == (0.3, 0.6)
    assert custom["gpu_type"] is None and custom["gpu_memory"] is None


async def test_cpu_profile_does_not_inherit_gpu(tmp_path: Path, ledger: SQLiteLedger) -> None:
    spawner, _ = make_spawner(tmp_path, ledger, mode="server-gpu")
    await submit(spawner, gpu_form(gpu_type="A100", gpu_share="0.5-1", gpu_memory="auto"))
    a100 = next(g for g in await ledger.gpus() if g.type == "A100")
    assert spawner.extra_resource_limits[GPU_RESOURCE] == "1"
    assert spawner.node_selector[PRODUCT_LABEL] == a100.name
    assert "NVIDIA_VISIBLE_DEVICES" not in spawner.environment
    assert ENV_DEFAULT in spawner.environment
    # the same spawner object (JupyterHub keeps it across restarts), now CPU only
    await submit(spawner, {"profile": "cpu"})
    assert GPU_RESOURCE not in spawner.extra_resource_limits
    assert GPU_RESOURCE not in spawner.extra_resource_guarantees
    assert PRODUCT_LABEL not in spawner.node_selector
    assert ENV_DEFAULT not in spawner.environment and ENV_MAX not in spawner.environment
    assert spawner.environment["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert spawner.environment["GPUSHARE_DISABLED"] == "1"
    # and back to a GPU profile: the CPU-only marks are gone again
    await submit(spawner, gpu_form(gpu_type="T4", gpu_share="0.25-0.5", gpu_memory="auto"))
    assert "GPUSHARE_DISABLED" not in spawner.environment
    assert spawner.extra_resource_limits[GPU_RESOURCE] == "1"
    assert spawner.node_selector[PRODUCT_LABEL] == "Tesla T4"


@pytest.mark.parametrize(
    ("custom", "message"),
    [
        ({"gpu_share--unlisted-choice": "0.6-0.5"}, "at most gpu_limit"),
        ({"gpu_share--unlisted-choice": "1.5"}, "gpu_request='1.5' is not allowed"),
        ({"gpu_memory--unlisted-choice": "12 parsecs"}, "gpu_memory='12 parsecs'"),
    ],
)
async def test_bad_custom_values_refused_on_form(
    tmp_path: Path, ledger: SQLiteLedger, custom: dict[str, str], message: str
) -> None:
    spawner, _ = make_spawner(tmp_path, ledger)
    form = gpu_form(gpu_type="A100", gpu_share="0.25-0.5", gpu_memory="auto")
    form.update({f"profile-option-gpu--{k}": v for k, v in custom.items()})
    with pytest.raises(GpuOptionError, match=re.escape(message)):
        spawner.run_options_from_form({k: [v] for k, v in form.items()})


async def test_bad_values_refused_at_start(tmp_path: Path, ledger: SQLiteLedger) -> None:
    """Options that bypass the form (JupyterHub REST API) are checked when the server starts,
    against the live inventory and the admin's bounds."""
    spawner, _ = make_spawner(tmp_path, ledger, max_request=0.5, max_memory="20GiB")
    spawner.user_options = {
        "profile": "gpu",
        "gpu_type": "T4",
        "gpu_share": "0.25-0.5",
        "gpu_memory--unlisted-choice": "18GiB",
    }
    with pytest.raises(GpuOptionError, match="at most 15GiB"):
        await spawner.load_user_options()
    spawner.user_options = {"profile": "gpu", "gpu_type": "A100", "gpu_share": "0.5-1"}
    with pytest.raises(GpuOptionError, match=re.escape("at most 0.5 of a GPU per user")):
        await spawner.load_user_options()
    spawner.user_options = {"profile": "gpu", "gpu_type--unlisted-choice": "H100"}
    with pytest.raises(ValueError, match="without being enabled"):
        await spawner.load_user_options()  # KubeSpawner: type takes no custom value here


def test_share_from_options_mirrors_share_spec() -> None:
    spec = share_from_options(
        {
            "gpu_type": "any",
            "gpu_share--unlisted-choice": "0.4",
            "gpu_memory--unlisted-choice": "10GiB",
        }
    )
    assert (spec.gpu_request, spec.gpu_limit, spec.gpu_type) == (0.4, 0.4, None)
    assert spec.gpu_memory == parse_memory("10GiB")
    with pytest.raises(GpuOptionError, match="no GPUs available"):
        share_from_options({"gpu_share": "0.25-0.5"}, offers=[])


async def test_z2jh_values_example(tmp_path: Path, ledger: SQLiteLedger) -> None:
    """deploy/z2jh/values.yaml's hub.extraConfig, run as z2jh runs it (with this test's ledger
    as the inventory instead of the cluster's)."""
    values = yaml.safe_load((REPO / "deploy" / "z2jh" / "values.yaml").read_text())
    c = Config()
    c.GpuProfiles.inventory = ledger_inventory(ledger)
    exec(values["hub"]["extraConfig"]["gpushare"], {"c": c})
    spawner = spawner_for(c)
    html = await spawner.get_options_form()
    assert "A100 (80GiB)" in html and "T4 (15GiB)" in html and 'value="40GiB"' in html
    await submit(spawner, gpu_form(gpu_type="A100", gpu_share="0.25-0.5", gpu_memory="10GiB"))
    assert json.loads(spawner.get_env()[ENV_DEFAULT])["gpu_memory"] == 10 * 2**30
    assert spawner.cpu_guarantee == 1
    await submit(spawner, {"profile": "cpu"})
    assert spawner.cpu_limit == 2 and ENV_DEFAULT not in spawner.environment
    form = gpu_form(gpu_type="A100", gpu_share="0.25-0.5")
    form["profile-option-gpu--gpu_memory--unlisted-choice"] = "60GiB"
    with pytest.raises(GpuOptionError, match="at most 40GiB per user"):
        spawner.run_options_from_form({k: [v] for k, v in form.items()})


def test_apply_user_bound() -> None:
    bound = ShareSpec(0.5, 1.0, gpu_memory=parse_memory("16GiB"), gpu_type="A100")
    within = apply_user_bound(ShareSpec(0.25, 0.5), bound)
    assert (within.gpu_type, within.gpu_memory) == ("A100", bound.gpu_memory)  # filled in
    assert apply_user_bound(ShareSpec(0.25, 0.5), None) == ShareSpec(0.25, 0.5)
    refusals = [
        (ShareSpec(0.75, 1.0), "gpu_request"),
        (ShareSpec(0.5, 1.0, gpu_type="T4"), "gpu_type"),
        (ShareSpec(0.5, 1.0, gpu_memory=parse_memory("20GiB")), "gpu_memory"),
        (ShareSpec(1.0, 1.0, gpu_count=2), "gpu_count"),
    ]
    for spec, field in refusals:
        with pytest.raises(ShareError) as caught:
            apply_user_bound(spec, bound)
        assert caught.value.field == field and "JupyterHub" in caught.value.allowed
    limit_bound = ShareSpec(0.25, 0.5)
    with pytest.raises(ShareError, match="gpu_limit"):
        apply_user_bound(ShareSpec(0.25, 0.75), limit_bound)


def test_user_server_honours_hub_choice(gpushare_env: dict[str, str], jupyter_server: Any) -> None:
    """A real jupyter_server started with the environment the GPU profile sets: the pick is the
    default share (what the Lab picker starts from) and the most any kernel may ask for."""
    picked = share_from_options(
        {"gpu_type": "A100", "gpu_share": "0.25-0.5", "gpu_memory": "16GiB"}
    )
    gpushare_env.update({k: v for k, v in share_environment(picked).items() if v is not None})
    server = jupyter_server("1xA100,1xT4")
    default = server.get("/gpushare/api/presets").json()["default"]
    assert (default["gpu_type"], default["gpu_memory"]) == ("A100", 16 * 2**30)
    too_much = server.post(
        "/gpushare/api/kernels",
        {"name": "gpushare-python", "share": {"gpu_request": 0.5, "gpu_limit": 1}},
    )
    assert too_much.status_code == 400, too_much.text
    assert too_much.json()["field"] == "gpu_request"
    assert "JupyterHub" in too_much.json()["message"]
    other_type = server.post(
        "/gpushare/api/kernels",
        {"name": "gpushare-python", "share": {"gpu_type": "T4", "gpu_memory": "8GiB"}},
    )
    assert other_type.status_code == 400 and other_type.json()["field"] == "gpu_type"
    ok = server.post(
        "/gpushare/api/kernels",
        {"name": "gpushare-python", "share": {"gpu_request": 0.25, "gpu_limit": 0.5}},
    )
    assert ok.status_code == 201, ok.text
    allocation = ok.json()["allocation"]
    assert (allocation["gpu_type"], allocation["gpu_memory"]) == ("A100", 16 * 2**30)
    assert server.delete(f"/api/kernels/{ok.json()['id']}").status_code == 204


async def test_inventory_down_keeps_cpu_profiles(tmp_path: Path, ledger: SQLiteLedger) -> None:
    """With the inventory unreachable the form still renders: CPU only works, GPU is refused
    with the reason; shares above the admin's bound are not offered."""

    async def unreachable(spawner: Any) -> list[Any]:
        raise ConnectionRefusedError("kube-apiserver: connection refused")

    spawner, _ = make_spawner(tmp_path, ledger, inventory=unreachable, max_request=0.5)
    html = await spawner.get_options_form()
    assert "GPU inventory unavailable (kube-apiserver: connection refused)" in html
    assert 'value="0.25-0.5"' in html and 'value="0.5-1"' not in html
    await submit(spawner, {"profile": "cpu"})
    assert spawner.environment["GPUSHARE_DISABLED"] == "1"
    with pytest.raises(GpuOptionError, match="no GPUs available"):
        await submit(spawner, gpu_form(gpu_type="any", gpu_share="0.25-0.5"))


class CountingInventory:
    """The test ledger as the inventory, counting reads; ``fail`` makes the next reads fail;
    ``gate`` holds every read until it is set (so opens overlap a read in flight)."""

    def __init__(self, ledger: SQLiteLedger) -> None:
        self.read = ledger_inventory(ledger)
        self.reads = 0
        self.fail: str = ""
        self.gate = asyncio.Event()
        self.gate.set()
        self.reading = asyncio.Event()

    def __deepcopy__(self, memo: dict[int, Any]) -> CountingInventory:
        return self  # traitlets' Config deep-copies values: the Hub must call this one

    async def __call__(self, spawner: Any) -> list[TypeOffer]:
        self.reads += 1
        self.reading.set()
        await self.gate.wait()
        if self.fail:
            raise ConnectionRefusedError(self.fail)
        return await self.read(spawner)


async def test_concurrent_form_opens_share_one_inventory_read(
    tmp_path: Path, ledger: SQLiteLedger
) -> None:
    """50 users opening the form at once (one GpuProfiles, as a Hub's config builds it, 50
    spawners): one inventory read (with the default inventory: one LIST of Nodes and one of
    GpuLedgers instead of 50 of each), and every form shows the offers."""
    inventory = CountingInventory(ledger)
    c = Config()
    c.GpuProfiles.inventory = inventory
    c.GpuProfiles.inventory_ttl = 60.0  # a window no loaded machine runs past
    gpu = GpuProfiles(config=c)
    c.KubeSpawner.profile_list = gpu.profile_list
    c.KubeSpawner.options_from_form = gpu.options_from_form
    spawners = [spawner_for(c) for _ in range(50)]
    inventory.gate.clear()  # the read stays in flight until every open has been started
    opens = [asyncio.ensure_future(s.get_options_form()) for s in spawners]
    await asyncio.wait_for(inventory.reading.wait(), 60)
    await asyncio.sleep(0.2)  # every other open reaches the cache while the read is held
    assert not any(o.done() for o in opens)
    inventory.gate.set()
    pages = await asyncio.gather(*opens)
    assert inventory.reads == 1
    assert all("T4 (15GiB) — 1 GPU, up to 1 of a GPU free now" in p for p in pages)
    # the start-time check (KubeSpawner builds the list again) reads nothing more either
    await submit(spawners[7], gpu_form(gpu_type="T4", gpu_share="0.25-0.5"))
    assert json.loads(spawners[7].get_env()[ENV_DEFAULT])["gpu_type"] == "T4"
    assert inventory.reads == 1


async def test_inventory_read_again_after_ttl(tmp_path: Path, ledger: SQLiteLedger) -> None:
    """Within the TTL the kept offers are shown (the ledger changed meanwhile); after it the
    next open reads again and shows the change."""
    inventory = CountingInventory(ledger)
    spawner, gpu = make_spawner(tmp_path, ledger, inventory=inventory, inventory_ttl=5.0)
    now = [1000.0]
    gpu.offers_cache.clock = lambda: now[0]  # the time under the test's control
    assert "T4 (15GiB) — 1 GPU, up to 1 of a GPU free now" in await spawner.get_options_form()
    gpus = await ledger.gpus()
    await ledger.allocate(ShareSpec(1.0, 1.0, gpu_type="T4"), gpus, place, owner="kernel")
    now[0] += 4.9
    assert "T4 (15GiB) — 1 GPU, up to 1 of a GPU free now" in await spawner.get_options_form()
    assert inventory.reads == 1
    now[0] += 0.2  # 5.1 s after the read
    assert "T4 (15GiB) — 1 GPU, full now" in await spawner.get_options_form()
    assert inventory.reads == 2


async def test_failed_inventory_read_is_not_kept(tmp_path: Path, ledger: SQLiteLedger) -> None:
    """Opens waiting on a read that fails all show the reason (one read); the next open reads
    again (the error was not kept) and shows the offers, which are then kept."""
    inventory = CountingInventory(ledger)
    spawner, gpu = make_spawner(tmp_path, ledger, inventory=inventory, inventory_ttl=60.0)
    others = [spawner_for(gpu.config) for _ in range(4)]
    inventory.fail = "kube-apiserver: connection refused"
    inventory.gate.clear()
    opens = [asyncio.ensure_future(s.get_options_form()) for s in [spawner, *others]]
    await asyncio.wait_for(inventory.reading.wait(), 60)
    await asyncio.sleep(0.2)
    inventory.gate.set()
    for page in await asyncio.gather(*opens):
        assert "GPU inventory unavailable (kube-apiserver: connection refused)" in page
        assert "CPU only" in page
    assert inventory.reads == 1
    inventory.fail = ""
    page = await spawner.get_options_form()
    assert inventory.reads == 2 and "GPU inventory unavailable" not in page
    assert "T4 (15GiB) — 1 GPU, up to 1 of a GPU free now" in page
    assert "T4 (15GiB)" in await others[0].get_options_form()
    assert inventory.reads == 2


async def test_a_closed_form_does_not_cancel_the_shared_read(
    tmp_path: Path, ledger: SQLiteLedger
) -> None:
    """The user who started the read closes the page (JupyterHub cancels that request): the
    others waiting on the same read still get the offers, from that one read."""
    inventory = CountingInventory(ledger)
    first, gpu = make_spawner(tmp_path, ledger, inventory=inventory, inventory_ttl=60.0)
    second = spawner_for(gpu.config)
    inventory.gate.clear()
    leaving = asyncio.ensure_future(first.get_options_form())
    await asyncio.wait_for(inventory.reading.wait(), 60)
    staying = asyncio.ensure_future(second.get_options_form())
    await asyncio.sleep(0.1)
    leaving.cancel()
    inventory.gate.set()
    assert "T4 (15GiB)" in await staying
    assert leaving.cancelled() and inventory.reads == 1
