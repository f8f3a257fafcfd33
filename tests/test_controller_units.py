"""The controller's pure pieces (box 12): bounds per Hub user and group, the Hub's user model,
the checks of what a user's server sends, and the one error model. The controller itself runs
on the real control plane in tests/k8s/test_controller.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from jupyter_gpushare.controller.auth import HubUser, parse_user_model, token_from_header
from jupyter_gpushare.controller.bounds import Bounds, Quotas, parse_bounds
from jupyter_gpushare.controller.errors import ControllerError, from_exception
from jupyter_gpushare.controller.kernels import (
    check_command,
    check_connection,
    check_env,
    check_kernel_id,
)
from jupyter_gpushare.controller.servers import check_server_id
from jupyter_gpushare.ledger import AllocationNotFound, LedgerUnavailable
from jupyter_gpushare.placement import PlacementRefused
from jupyter_gpushare.share import ShareError, ShareSpec


def test_bounds_tightest_of_user_and_groups_else_default() -> None:
    bounds = Bounds(
        parse_bounds({"alice": {"gpu_request": 0.5, "gpu_limit": 1.0}}, "user_bounds"),
        parse_bounds(
            {
                "students": {"gpu_request": 0.25, "gpu_limit": 0.5},
                "big": {"gpu_request": 1.0, "gpu_limit": 1.0, "gpu_memory": "8GiB"},
            },
            "group_bounds",
        ),
        ShareSpec(gpu_request=0.1, gpu_limit=0.2),
    )
    both = bounds.of(HubUser("alice", groups=("students", "big")))
    assert both is not None and (both.gpu_request, both.gpu_limit) == (0.25, 0.5)
    assert both.gpu_memory == 8 * 2**30
    only_default = bounds.of(HubUser("dave"))
    assert only_default is not None and only_default.gpu_limit == 0.2
    assert bounds.of(HubUser("root", admin=True)) is None  # admins: no default bound
    assert bounds.of(HubUser("root", admin=True, groups=("students",))) is not None


@pytest.mark.parametrize(
    "mapping, field",
    [
        ({"bob": 0.5}, "user_bounds['bob']"),
        ({"bob": {"gpu_reqest": 0.5}}, "user_bounds['bob'].gpu_reqest"),
        ({"bob": {"gpu_request": 2}}, "gpu_request"),
    ],
)
def test_bad_bound_config_names_the_setting(mapping: dict, field: str) -> None:
    with pytest.raises(ShareError) as caught:
        parse_bounds(mapping, "user_bounds")
    assert caught.value.field == field


def test_hub_user_model() -> None:
    model = {"kind": "user", "name": "bob", "admin": False, "groups": ["students", 3]}
    assert parse_user_model(json.dumps(model).encode()) == HubUser("bob", False, ("students",))
    assert parse_user_model(json.dumps({**model, "admin": "yes"}).encode()).admin is False
    assert parse_user_model(json.dumps({"kind": "service", "name": "x"}).encode()) is None
    assert parse_user_model(b"[]") is None and parse_user_model(b"not json") is None
    assert token_from_header("token abc") == "abc" == token_from_header("Bearer abc")
    for header in (None, "", "Basic abc", "token "):
        with pytest.raises(ControllerError) as caught:
            token_from_header(header)
        assert caught.value.status == 401


def test_what_a_server_sends_is_checked_by_name() -> None:
    connection = {
        "shell_port": 1,
        "iopub_port": 2,
        "stdin_port": 3,
        "control_port": 4,
        "hb_port": 5,
        "key": "k",
    }
    assert check_connection(connection)["ip"] == "0.0.0.0"  # the pod's interfaces, always
    assert check_env(
        {"A": "1", "LD_PRELOAD": "/evil.so", "GPUSHARE_SOCKET": "/x", "PATH": "/tmp"}
    ) == {"A": "1"}
    assert check_command(["python", "-c", "1"]) == ["python", "-c", "1"]
    cases = [
        (check_connection, {**connection, "hb_port": True}, "connection.hb_port"),
        (check_connection, {**connection, "key": 5}, "connection.key"),
        (check_env, {"A=B": "1"}, "env"),
        (check_env, ["A"], "env"),
        (check_command, [], "command"),
        (check_command, ["a", 1], "command"),
        (check_kernel_id, "a/b", "kernel_id"),
        (check_kernel_id, "x" * 65, "kernel_id"),
        (check_server_id, "-x", "server_id"),
    ]
    for check, value, field in cases:
        with pytest.raises(ControllerError) as caught:
            check(value)
        assert caught.value.status == 400 and caught.value.to_json()["field"] == field
        assert field in caught.value.message


def test_one_error_model() -> None:
    cases = [
        (ShareError("gpu_request", 2, "at most 1"), 400, "invalid_share"),
        (PlacementRefused("no A100 has 0.5 free"), 409, "no_fit"),
        (AllocationNotFound("abc"), 404, "not_found"),
        (LedgerUnavailable("GpuLedger", "etcd is away"), 503, "ledger_unavailable"),
    ]
    for exc, status, code in cases:
        mapped = from_exception(exc)
        assert mapped is not None and (mapped.status, mapped.code) == (status, code)
        assert mapped.to_json()["message"]
    assert from_exception(RuntimeError("bug")) is None  # answered 500 without details


def test_quotas_smallest_of_user_and_groups_else_default() -> None:
    quotas = Quotas({"alice": 2.0}, {"students": 0.5, "staff": 4}, 1.0)
    assert quotas.of(HubUser("alice", groups=("staff",))) == 2.0
    assert quotas.of(HubUser("bob", groups=("students", "staff"))) == 0.5
    assert quotas.of(HubUser("dave")) == 1.0
    assert quotas.of(HubUser("root", admin=True)) is None
    for bad in (0, -1, True, "1"):
        with pytest.raises(ShareError) as caught:
            Quotas({}, {"g": bad}, None)
        assert caught.value.field == "group_quotas['g']"


def _unschedulable_pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "gpushare-kernel-a1", "namespace": "gpushare"},
        "spec": {},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient cpu.",
                }
            ],
        },
    }


def test_kernel_status_names_the_pods_start_phase_in_the_clusters_words() -> None:
    from jupyter_gpushare.controller.kernels import KernelService

    service = KernelService.__new__(KernelService)
    service.watcher = SimpleNamespace(get=lambda name: _unschedulable_pod())  # type: ignore[assignment]
    allocation = SimpleNamespace(id="a-1", extra={"k8s_pod": "gpushare-kernel-a1"})
    status = service.kernel_status(allocation)  # type: ignore[arg-type]
    assert status["start_phase"] == "scheduling", status
    assert "Insufficient cpu" in status["start_message"], status
    assert status["exit_code"] is None


async def test_a_start_through_the_controller_shows_the_pods_phases_while_it_waits() -> None:
    """The thin client's start waits for ``POST /api/kernels`` (answered once the pod runs) and
    meanwhile shows the pod's phases, read from ``GET /api/kernels/{allocation}``, on the
    server's start board - the board the Lab picker and status bar poll."""
    from jupyter_gpushare.controller.backend import ControllerKernelBackend
    from jupyter_gpushare.progress import board

    answers = [
        RuntimeError("controller busy"),  # a failed read is skipped, the start goes on
        {"start_phase": "scheduling", "start_message": "0/3 nodes are available"},
        {"start_phase": "scheduling", "start_message": "0/3 nodes are available"},
        {"start_phase": "pulling", "start_message": "ContainerCreating"},
        {"start_phase": "bogus", "start_message": "not a phase"},
    ]
    posted = asyncio.get_running_loop().create_future()

    class Client:
        async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
            if method == "POST":
                return await posted
            assert (method, path, kw.get("retry")) == ("GET", "/api/kernels/a-1", False)
            answer = answers.pop(0) if answers else {"start_phase": "starting"}
            if not answers:
                posted.done() or posted.set_result({"pod": "gpushare-kernel-a1"})
            if isinstance(answer, Exception):
                raise answer
            return answer

    class Settings:
        pass

    settings = Settings()
    backend = ControllerKernelBackend.__new__(ControllerKernelBackend)
    backend.allocation = SimpleNamespace(id="a-1")  # type: ignore[assignment]
    backend.provisioner = SimpleNamespace(settings=settings, kernel_id="k-1")
    backend.start_poll_interval = 0.01
    remote = SimpleNamespace(client=Client())
    post = asyncio.ensure_future(remote.client.request("POST", "/api/kernels", {}))
    answer = await backend._while_starting(remote, post)  # type: ignore[arg-type]
    assert answer == {"pod": "gpushare-kernel-a1"}
    [start] = board(settings).starts()
    assert [(phase, message) for phase, message, _ in start.steps] == [
        ("scheduling", "0/3 nodes are available"),
        ("pulling", "ContainerCreating"),
    ], start

    # a start whose server gives up (its task cancelled) does not leave the POST running
    never = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(backend._while_starting(remote, never))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert never.cancelled()
