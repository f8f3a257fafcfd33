"""The GPU form for one machine (jupyter_gpushare.hub_local) with real JupyterHub objects:
LocalProcessSpawner's ``options_form``/``options_from_form``/``get_env``, as JupyterHub calls them
for a spawn, with a real SQLite ledger of simulated GPUs as the inventory."""

from __future__ import annotations

import getpass
import json
import re
from pathlib import Path
from typing import Any

import pytest
from jupyterhub import orm
from jupyterhub.objects import Hub
from jupyterhub.spawner import LocalProcessSpawner
from jupyterhub.user import User
from traitlets.config import Config

from jupyter_gpushare.hub import ENV_DEFAULT, ENV_MAX, GpuOptionError, ledger_inventory
from jupyter_gpushare.hub_local import LocalGpuForm
from jupyter_gpushare.inventory import simulated_gpus
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.placement import place
from jupyter_gpushare.share import ShareSpec

GiB = 2**30


@pytest.fixture
async def ledger(tmp_path: Path) -> SQLiteLedger:
    ledger = SQLiteLedger(tmp_path / "ledger.sqlite")
    gpus = simulated_gpus("1xA100,1xT4", node="box")
    await ledger.put_gpus("box", gpus)
    await ledger.allocate(ShareSpec(0.75, 0.75, gpu_type="A100"), gpus, place, owner="kernel")
    return ledger


def local_spawner(ledger: SQLiteLedger, **settings: Any) -> Any:
    c = Config()
    c.GpuProfiles.inventory = ledger_inventory(ledger)
    for key, value in settings.items():
        setattr(c.GpuProfiles, key, value)
    gpu = LocalGpuForm(config=c)
    c.Spawner.options_form = gpu.options_form
    c.Spawner.options_from_form = gpu.options_from_form
    c.Spawner.environment = gpu.environment()
    db = orm.new_session_factory("sqlite:///:memory:")()
    orm_user = orm.User(name=getpass.getuser())  # a real account: get_env reads its passwd
    db.add(orm_user)
    db.commit()
    app = {
        "spawner_class": LocalProcessSpawner,
        "config": c,
        "hub": Hub(),
        "db": db,
        "users": {},
        "domain": "",
        "statsd": None,
    }
    return User(orm_user, settings=app).spawner


def submit(spawner: Any, form: dict[str, str]) -> dict[str, str]:
    """JupyterHub's handling of a POSTed form, then the environment the server gets."""
    spawner.user_options = spawner.run_options_from_form({k: [v] for k, v in form.items()})
    return spawner.get_env()


async def test_form_offers_the_machines_gpus_and_the_pick_reaches_the_server(
    ledger: SQLiteLedger,
) -> None:
    spawner = local_spawner(ledger)
    page = await spawner.get_options_form()
    assert "A100 (80GiB) — 1 GPU, up to 0.25 of a GPU free now" in page
    assert "T4 (15GiB) — 1 GPU, up to 1 of a GPU free now" in page
    assert re.search(r'<input type="radio" name="profile" value="gpu" checked>', page)
    assert 'name="gpu_share--unlisted-choice"' in page and "CPU only" in page
    env = submit(
        spawner, {"profile": "gpu", "gpu_type": "T4", "gpu_share": "0.25-0.5", "gpu_memory": "8GiB"}
    )
    default = json.loads(env[ENV_DEFAULT])
    assert default == {
        "gpu_request": 0.25,
        "gpu_limit": 0.5,
        "gpu_memory": 8 * GiB,
        "gpu_type": "T4",
    }
    assert json.loads(env[ENV_MAX]) == default
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["GPUSHARE_DISABLED"] == ""
    # a custom share, then CPU only on the same spawner object: nothing of the GPU is left
    env = submit(
        spawner,
        {
            "profile": "gpu",
            "gpu_type": "any",
            "gpu_share--unlisted-choice": "0.3-0.6",
            "gpu_memory": "auto",
        },
    )
    assert json.loads(env[ENV_DEFAULT])["gpu_limit"] == 0.6
    env = submit(spawner, {"profile": "cpu"})
    assert env[ENV_DEFAULT] == "" and env[ENV_MAX] == "" and env["GPUSHARE_DISABLED"] == "1"


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"gpu_share--unlisted-choice": "0.6-0.5"}, "at most gpu_limit"),
        ({"gpu_memory--unlisted-choice": "12 parsecs"}, "gpu_memory='12 parsecs'"),
        ({"gpu_share": "1-1"}, "at most 0.5 of a GPU per user"),
        ({"profile": "root"}, "profile='root' is not allowed: one of gpu, cpu"),
    ],
)
async def test_bad_values_are_refused_with_the_reason(
    ledger: SQLiteLedger, form: dict[str, str], message: str
) -> None:
    spawner = local_spawner(ledger, max_request=0.5)
    full = {
        "profile": "gpu",
        "gpu_type": "A100",
        "gpu_share": "0.25-0.5",
        "gpu_memory": "auto",
        **form,
    }
    with pytest.raises(GpuOptionError, match=re.escape(message)):
        submit(spawner, full)
    # options set without the form (JupyterHub's REST API) are checked when the server starts
    spawner.user_options = {"profile": "gpu", "gpu_share": "1-1"}
    with pytest.raises(GpuOptionError, match=re.escape("at most 0.5")):
        spawner.get_env()


async def test_inventory_down_keeps_cpu_only(tmp_path: Path) -> None:
    async def down(_spawner: Any) -> list:
        raise ConnectionError("no gpushare agent answers")

    spawner = local_spawner(SQLiteLedger(tmp_path / "x.sqlite"), inventory=down)
    page = await spawner.get_options_form()
    assert "GPU inventory unavailable (no gpushare agent answers)" in page and "CPU only" in page
