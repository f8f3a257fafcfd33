"""One error model (jupyter_gpushare.errors): every refusal is a GpushareError with a code, an
HTTP status and one JSON shape, written by one write_error."""

from __future__ import annotations

import json

import pytest
import tornado.testing
import tornado.web

from jupyter_gpushare.controller.errors import ControllerError, bad_request, from_exception
from jupyter_gpushare.errors import GpushareError, write_error
from jupyter_gpushare.hub import GpuOptionError
from jupyter_gpushare.inventory import NoGpuError
from jupyter_gpushare.ledger import AllocationNotFound, LedgerConflict, LedgerUnavailable
from jupyter_gpushare.ledger.agent import AgentRefused
from jupyter_gpushare.notebook.actions import DaemonUnreachable, NoShare
from jupyter_gpushare.placement import PlacementRefused
from jupyter_gpushare.resize import BelowUse, UsageUnknown
from jupyter_gpushare.share import ShareError

REFUSALS = [
    (ShareError("gpu_request", "2", "a number in (0, 1]"), 400, "invalid_share"),
    (PlacementRefused("no A100 has 0.5 free", ["0.25 of an A100"]), 409, "no_fit"),
    (BelowUse(1 << 30, 2 << 30), 409, "below_use"),
    (UsageUnknown("node-1", 12.0), 503, "usage_unknown"),
    (LedgerUnavailable("/x/ledger.sqlite", "disk full"), 503, "ledger_unavailable"),
    (LedgerConflict("kept losing"), 503, "busy"),
    (AllocationNotFound("a-0123"), 404, "not_found"),
    (AgentRefused("not_permitted", "another user's share"), 403, "not_permitted"),
    (AgentRefused("no_fit", "over capacity"), 409, "no_fit"),
    (NoGpuError("no NVIDIA GPU here"), 409, "no_gpu"),
    (ControllerError(401, "unauthorized", "no token"), 401, "unauthorized"),
    (GpuOptionError("GPU share refused: no GPUs"), 400, "invalid_share"),
    (NoShare("This kernel holds no GPU share."), 409, "no_share"),
    (DaemonUnreachable("The gpushare daemon is unreachable: gone"), 503, "daemon"),
]


@pytest.mark.parametrize(("error", "status", "code"), REFUSALS, ids=lambda v: str(v)[:20])
def test_every_refusal_is_one_model(error: GpushareError, status: int, code: str) -> None:
    assert isinstance(error, GpushareError)
    assert (error.status, error.code) == (status, code)
    body = error.to_json()
    assert body["error"] == code and body["message"] == str(error.message or error)
    json.dumps(body)  # JSON as it is


def test_input_errors_name_field_value_and_allowed() -> None:
    body = ShareError("gpu_limit", 1.5, "a number in (0, 1]").to_json()
    assert (body["field"], body["value"], body["allowed"]) == (
        "gpu_limit",
        1.5,
        "a number in (0, 1]",
    )
    below = BelowUse(1 << 30, 3 << 30).to_json()
    assert below["field"] == "gpu_memory" and below["value"] == 1 << 30
    assert below["memory_used"] == 3 << 30 and "3GiB" in below["allowed"]
    # hostile input is repeated cut short, never whole
    huge = bad_request("kernel_id", "x" * 100_000, "up to 64 characters").to_json()
    assert len(json.dumps(huge)) < 1000 and huge["field"] == "kernel_id"
    # a value JSON cannot carry is shown as its text
    assert GpushareError("odd", field="f", value={1, 2}, allowed="a list").to_json()["value"] == (
        "{1, 2}"
    )
    assert "field" not in GpushareError("plain").to_json()


def test_the_controller_answers_package_refusals_as_they_are() -> None:
    refused = PlacementRefused("nothing fits")
    assert from_exception(refused) is refused
    unknown = from_exception(AllocationNotFound("a-1"))
    assert (
        unknown is not None and unknown.status == 404 and unknown.to_json()["field"] == "allocation"
    )
    assert from_exception(ValueError("a bug")) is None


class _Refusing(tornado.web.RequestHandler):
    def get(self, which: str) -> None:
        write_error(self, REFUSALS[int(which)][0])


class TestWriteError(tornado.testing.AsyncHTTPTestCase):
    def get_app(self) -> tornado.web.Application:
        return tornado.web.Application([(r"/(\d+)", _Refusing)])

    def test_status_and_body_over_http(self) -> None:
        for i, (error, status, code) in enumerate(REFUSALS):
            response = self.fetch(f"/{i}", raise_error=False)
            assert response.code == status, (i, response.code)
            assert response.headers["Content-Type"] == "application/json"
            assert json.loads(response.body) == json.loads(json.dumps(error.to_json()))
            assert json.loads(response.body)["error"] == code
