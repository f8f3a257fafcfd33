"""The environment of a process the server starts on this machine (daemon/env.local_kernel_env,
used by the local kernel backend and ``gpushare run``): the one builder's variables plus the
server's settings, and the ``--simulate`` text of an inventory (inventory.simulate_text)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from jupyter_gpushare.config import GpuShare
from jupyter_gpushare.daemon.env import interposer_path, kernel_env, local_kernel_env
from jupyter_gpushare.inventory import simulate_text, simulated_gpus
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.share import ShareSpec


def _allocation(gpus, node: str = "n1") -> Allocation:  # type: ignore[no-untyped-def]
    return Allocation(
        id="a-0123456789abcdef",
        node=node,
        gpus=(gpus[1].uuid,),
        spec=ShareSpec(gpu_request=0.25, gpu_limit=0.5),
        memory=1 << 30,
    )


@pytest.mark.parametrize("enforce", [True, False])
def test_local_kernel_env_is_kernel_env_plus_the_servers_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enforce: bool
) -> None:
    monkeypatch.delenv("GPUSHARE_SIM_STATE", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/x.so")
    here = simulated_gpus("2xA100", node="n1")
    inventory = [*here, *simulated_gpus("1xT4", node="n2")]
    allocation = _allocation(here)
    settings = GpuShare(
        socket_path=str(tmp_path / "run" / "daemon.sock"),
        ledger_path=str(tmp_path / "ledger.sqlite"),
        enforce=enforce,
    )
    env = local_kernel_env(allocation, inventory, settings)
    expected = kernel_env(allocation, tmp_path / "run" / "daemon.sock", here)
    expected["GPUSHARE_LEDGER"] = str(tmp_path / "ledger.sqlite")
    preloads = enforce and interposer_path().exists()  # enforcing(): on, and the library built
    if not preloads:
        expected.pop("LD_PRELOAD")
    assert env == expected
    assert env["CUDA_VISIBLE_DEVICES"] == here[1].uuid
    assert ("LD_PRELOAD" in env) == preloads
    state_dir = Path(env["GPUSHARE_SIM_STATE"]).parent
    assert state_dir == tmp_path / "run"  # the simulator's state beside the socket, made here
    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700


def test_simulate_text_reads_back_as_the_same_gpus() -> None:
    gpus = simulated_gpus("2xA100,1xT4,1xA100", node="n1")
    assert simulate_text(gpus) == "2xA100,1xT4,1xA100"
    assert simulated_gpus(simulate_text(reversed(gpus)), node="n1") == gpus
    assert simulate_text([]) == ""
