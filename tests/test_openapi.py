"""The REST API's OpenAPI 3 description (``docs/reference/openapi.yaml``) against the server.

- Every route and method the server extension registers under ``/gpushare/api/`` is in the
  description, and the description names no route the server does not have: a new handler fails
  here until its route is described.
- A real jupyter_server with gpushare on a simulated GPU answers every operation with a success
  and with an error, and each response (status, headers, body) is validated against the
  description with openapi-core.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse
from support import REPO
from tornado import web
from traitlets.config import LoggingConfigurable

SPEC = REPO / "docs" / "reference" / "openapi.yaml"
PREFIX = "/gpushare/api/"
METHODS = ("get", "post", "put", "patch", "delete")


class _RecordingServer(LoggingConfigurable):
    """Stands in for a ServerApp while the extension loads: records the handlers it adds and
    starts nothing (the start task is scheduled on ``io_loop``, which never runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.routes: list[tuple[str, type]] = []
        recorder = self

        class WebApp:
            settings: dict[str, Any] = {"base_url": "/"}

            def add_handlers(self, _host: str, handlers: list[tuple[str, type]]) -> None:
                recorder.routes.extend((pattern, cls) for pattern, cls, *_ in handlers)

        class Loop:
            def call_later(self, *_args: Any) -> object:
                return object()

        self.web_app = WebApp()
        self.io_loop = Loop()

    async def cleanup_kernels(self) -> None:
        return None


#: a path parameter in a handler's pattern: ``(?P<name>...)`` or an unnamed ``(...)``
_GROUP = re.compile(r"\((?:\?P<(\w+)>)?[^()]*\)")


def _parameter(match: re.Match[str]) -> str:
    return "{" + (match.group(1) or "") + "}"


def _takes(method: Any, arguments: int) -> bool:
    """Whether a handler method can answer a route whose pattern has ``arguments`` groups."""
    try:
        inspect.signature(method).bind(None, *(["x"] * arguments))
    except TypeError:
        return False
    return True


def _same_shape(path: str) -> str:
    """A path with its parameters' names left out (the document names them, a pattern may not)."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def registered_routes() -> dict[str, set[str]]:
    """``/gpushare/api/...`` path template -> the HTTP methods its handler answers. A handler
    method that cannot take its route's arguments fails here: tornado would call it with them
    anyway, and the request would end in a 500."""
    from jupyter_gpushare.serverext import _load_jupyter_server_extension

    server = _RecordingServer()
    _load_jupyter_server_extension(server)
    routes: dict[str, set[str]] = {}
    for pattern, cls in server.routes:
        template = _GROUP.sub(_parameter, pattern).rstrip("$").removesuffix("/?")
        if not template.startswith(PREFIX):
            continue  # /api/sessions: jupyter_server's own route, answered by ours
        arguments = len(_GROUP.findall(pattern))  # tornado passes each group to the method
        methods = {m for m in METHODS if getattr(cls, m) is not getattr(web.RequestHandler, m)}
        wrong = {m for m in methods if not _takes(getattr(cls, m), arguments)}
        assert not wrong, f"{cls.__name__} serves {pattern} but {sorted(wrong)} cannot take it"
        routes.setdefault(template, set()).update(methods)
    return routes


def described_routes() -> dict[str, set[str]]:
    import yaml

    paths = yaml.safe_load(SPEC.read_text())["paths"]
    return {path: {m for m in item if m in METHODS} for path, item in paths.items()}


def test_every_route_of_the_server_is_described_and_nothing_else(
    gpushare_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in gpushare_env.items():  # the settings the extension makes stay in tmp
        monkeypatch.setenv(name, value)
    registered = {_same_shape(p): m for p, m in registered_routes().items()}
    described = {_same_shape(p): m for p, m in described_routes().items()}
    assert registered, "the extension registered no /gpushare/api/ route"
    missing = {
        f"{m.upper()} {p}" for p, ms in registered.items() for m in ms - described.get(p, set())
    }
    stale = {
        f"{m.upper()} {p}" for p, ms in described.items() for m in ms - registered.get(p, set())
    }
    assert not missing, f"describe these in {SPEC.relative_to(REPO)}: {sorted(missing)}"
    assert not stale, f"{SPEC.relative_to(REPO)} describes routes the server lacks: {sorted(stale)}"


#: operations whose success a server with its own ledger cannot give, and why
SUCCESS_NEEDS = {
    ("/gpushare/api/queue/{entry}", "delete"): "a queue: a system agent's or the controller's",
}


class Checked:
    """Sends requests to a server and validates each answer against the description."""

    def __init__(self, server: Any, openapi: OpenAPI) -> None:
        self.server = server
        self.openapi = openapi
        self.seen: dict[tuple[str, str], set[int]] = {}

    def __call__(
        self,
        method: str,
        path: str,
        template: str,
        status: int,
        body: Any = None,
        data: bytes | None = None,
        token: bool = True,
    ) -> requests.Response:
        headers = {"Authorization": f"token {self.server.token}"} if token else {}
        response = requests.request(
            method,
            self.server.url + path,
            headers=headers,
            json=body,
            data=data,
            timeout=self.server.timeout,
        )
        assert response.status_code == status, (method, path, response.status_code, response.text)
        self.openapi.validate_response(
            RequestsOpenAPIRequest(response.request), RequestsOpenAPIResponse(response)
        )
        self.seen.setdefault((template, method.lower()), set()).add(response.status_code)
        return response


@pytest.fixture
def pool_config(gpushare_env: dict[str, str]) -> None:
    """One warm pool of one kernel, so that ``/pools`` answers with a pool in it."""
    config = Path(gpushare_env["JUPYTER_CONFIG_DIR"])
    config.mkdir(parents=True, exist_ok=True)
    pool = {
        "name": "small",
        "kernelspec": "gpushare-python",
        "share": {"gpu_request": 0.25, "gpu_limit": 0.5},
        "size": 1,
    }
    (config / "jupyter_server_config.json").write_text(json.dumps({"GpuShare": {"pools": [pool]}}))


def test_real_responses_match_the_description(jupyter_server: Any, pool_config: None) -> None:
    openapi = OpenAPI.from_file_path(str(SPEC))  # also validates the document itself
    server = jupyter_server(
        "1xA100", "--ServerApp.kernel_manager_class=jupyter_gpushare.pools.PoolKernelManager"
    )
    check = Checked(server, openapi)
    one = "/gpushare/api/allocations/{allocation_id}"
    kernels = "/gpushare/api/kernels"

    # a kernel with a chosen share, and the refusals of a start
    started = check(
        "POST", kernels, kernels, 201, {"name": "gpushare-python", "share": {"gpu_request": 0.3}}
    ).json()
    allocation = started["allocation"]["id"]
    invalid = {"name": "gpushare-python", "share": {"gpu_request": 2}}
    assert check("POST", kernels, kernels, 400, invalid).json()["field"] == "gpu_request"
    assert check("POST", kernels, kernels, 400, {"name": "nope"}).json()["field"] == "name"
    assert check("POST", kernels, kernels, 400, data=b"[1").json()["error"] == "bad_json"
    too_big = {"name": "gpushare-python", "share": {"gpu_request": 0.9, "gpu_limit": 1}}
    refused = check("POST", kernels, kernels, 409, too_big).json()
    assert refused["error"] == "no_fit" and refused["suggestions"], refused

    # every GET, once the warm pool's kernel runs (the dashboard and usage then have shares)
    def pool_ready() -> bool:
        return (
            check("GET", "/gpushare/api/pools", "/gpushare/api/pools", 200).json()["pools"][0][
                "ready"
            ]
            == 1
        )

    from support import wait_for

    wait_for(pool_ready, timeout=60, interval=0.5)
    for path in described_routes():
        if "get" in described_routes()[path] and "{" not in path:
            check("GET", path, path, 200)
            check("GET", path, path, 403, token=False)

    # one allocation: read, resize, refusals, release
    path = f"/gpushare/api/allocations/{allocation}"
    assert check("GET", path, one, 200).json()["id"] == allocation
    resized = check("PATCH", path, one, 200, {"gpu_limit": 0.7}).json()
    assert resized["gpu_limit"] == 0.7
    check("PATCH", path, one, 400, {})
    assert check("PATCH", path, one, 400, {"gpu_limit": "x"}).json()["field"] == "gpu_limit"
    assert check("PATCH", path, one, 409, {"gpu_request": 0.9, "gpu_limit": 1}).json()["error"] == (
        "no_fit"
    )
    check("PATCH", path, one, 403, {"gpu_limit": 0.6}, token=False)
    check("DELETE", path, one, 403, token=False)
    check("DELETE", path, one, 204)
    for method in ("GET", "PATCH", "DELETE"):
        body = {"gpu_limit": 0.6} if method == "PATCH" else None
        assert check(method, path, one, 404, body).json()["error"] == "not_found"
    check("POST", kernels, kernels, 403, {"name": "gpushare-python"}, token=False)

    # the queue: a server's own ledger has none (a system agent's or the controller's has)
    queue, entry = "/gpushare/api/queue", "/gpushare/api/queue/{entry}"
    assert check("GET", queue, queue, 200).json()["enabled"] is False
    missing = f"{queue}/q-0123456789abcdef"
    assert check("DELETE", missing, entry, 404).json()["error"] == "no_queue"
    check("DELETE", missing, entry, 403, token=False)

    # every described operation answered with a success and with an error
    for template, methods in described_routes().items():
        for method in methods:
            statuses = check.seen.get((template, method), set())
            if (template, method) not in SUCCESS_NEEDS:
                assert any(s < 300 for s in statuses), f"no success of {method} {template}"
            assert any(s >= 400 for s in statuses), f"no error of {method} {template}"
