"""Hostile bodies for ``POST /gpushare/api/kernels`` and ``PATCH /gpushare/api/allocations/{id}``.

One real jupyter_server (simulated A100) for the module, one kernel holding 0.25 of it. Whatever
the body: never a 500; every 4xx is JSON with ``field``/``value``/``allowed`` (or a ``message``
for a body that is not a request at all); nothing is reserved or started by a refused request.
POST bodies whose share is valid get a name that is not a gpushare kernelspec, so no kernel is
started (the share grammar itself is covered by tests/test_share.py).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import JupyterServer, isolated_env, stop_daemons

from jupyter_gpushare.share import SHARE_FIELDS, ShareError, ShareSpec


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterServer]:
    tmp = tmp_path_factory.mktemp("fuzz")
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    env = isolated_env(tmp, short)
    srv = JupyterServer(env, "1xA100").start()
    digits = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # so that the client can write 5,000-digit numbers
    try:
        yield srv
    finally:
        sys.set_int_max_str_digits(digits)
        srv.stop()
        stop_daemons(env["GPUSHARE_SOCKET"])
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def held(server: JupyterServer) -> dict[str, Any]:
    """The one kernel (and allocation) the module's server holds."""
    started = server.post(
        "/gpushare/api/kernels", {"name": "gpushare-python", "share": {"gpu_request": 0.25}}
    )
    assert started.status_code == 201, started.text
    return dict(started.json())


def send(server: JupyterServer, method: str, path: str, body: Any) -> requests.Response:
    """``body`` as JSON (NaN, Infinity and 5,000-digit numbers included), or raw bytes."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"token {server.token}", "Content-Type": "application/json"}
    return requests.request(method, server.url + path, data=raw, headers=headers, timeout=60)


def check_refusal(response: Any) -> dict[str, Any]:
    """A 4xx with a JSON body that says what was wrong."""
    assert response.status_code < 500, (response.status_code, response.text[:2000])
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    body = response.json()
    assert isinstance(body, dict), body
    if "field" in body:
        assert {"field", "value", "allowed", "message"} <= set(body), body
        assert len(json.dumps(body["value"])) <= 200, body  # cut short, never the whole value
    else:
        assert body.get("message"), body
    assert len(response.text) < 4000
    return dict(body)


def unchanged(server: JupyterServer, held: dict[str, Any]) -> None:
    allocations = server.allocations()
    assert [a["id"] for a in allocations] == [held["allocation"]["id"]]
    kernels = server.get("/api/kernels").json()
    assert [k["id"] for k in kernels] == [held["id"]]


# -- named cases: every one was a 500 or a meaningless acceptance ----------------------------

HUGE = [
    10**400,
    10**5000,
    -(10**400),
    "9" * 400,
    "9" * 5000,
    "9" * 400 + "GiB",
    "9" * 5000 + "GiB",
    1e308 * 10,
    -math.inf,
    math.nan,
]
TINY = [1e-320, "1e-320", 0.005, "0.0000001", 0.333]
FOREIGN = ["٠٫٥", "٠.٥", "０.５", "١٠GiB", "१०GiB", "1_0"]
WRONG_TYPES = [True, False, None, [], {}, [0.5], {"a": 1}]


@pytest.mark.parametrize("field", ["gpu_request", "gpu_limit", "gpu_memory", "gpu_count"])
def test_named_share_values_are_refused_by_field(server, held, field):
    for value in HUGE + TINY + FOREIGN + WRONG_TYPES:
        if value is None or value == [] or value == {}:
            continue  # "absent": the default applies
        share = {field: value}
        if field == "gpu_count":
            share.update(gpu_request=1, gpu_limit=1)
        response = send(
            server, "POST", "/gpushare/api/kernels", {"name": "gpushare-python", "share": share}
        )
        body = check_refusal(response)
        assert response.status_code == 400, (value, body)
        assert body["field"] == field, (value, body)
        if value in TINY and field in ("gpu_request", "gpu_limit"):
            assert "0.01" in body["allowed"]
        if value in TINY and field == "gpu_memory":
            assert "1MiB" in body["allowed"]
        patch = send(
            server, "PATCH", f"/gpushare/api/allocations/{held['allocation']['id']}", {field: value}
        )
        patched = check_refusal(patch)
        assert patch.status_code == 400 and patched["field"] == field, (value, patched)
    unchanged(server, held)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (b'{"share": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001, "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "must be a JSON object, not an array"),
        (b'"x"', "must be a JSON object, not a string"),
        (b"null", "must be a JSON object, not null"),
        (b"17", "must be a JSON object, not a number"),
    ],
)
def test_bodies_that_are_not_a_request(server, held, raw, words):
    for method, path in (
        ("POST", "/gpushare/api/kernels"),
        ("PATCH", f"/gpushare/api/allocations/{held['allocation']['id']}"),
    ):
        body = check_refusal(send(server, method, path, raw))
        assert body["error"] == "bad_json" and words in body["message"], body
    unchanged(server, held)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"", "name"),
        ({}, "name"),
        ({"share": {"gpu_request": 0.25}}, "name"),
        ({"name": "python3"}, "name"),
        ({"name": "no-such-kernel"}, "name"),
        ({"name": ["gpushare-python"]}, "name"),
        ({"name": "gpushare-python", "path": 7}, "path"),
        ({"name": "gpushare-python", "share": [0.25]}, "share"),
        ({"name": "gpushare-python", "share": "0.25"}, "share"),
        ({"name": "gpushare-python", "shares": {}}, "shares"),
        ({"name": "gpushare-python", "x" * 10_000: 1}, "x" * 79 + "…"),
        ({"name": "gpushare-python", "share": {"y" * 10_000: 1}}, "y" * 79 + "…"),
        ({"name": "gpushare-python", "share": {"": 1}}, '""'),
        (
            {"name": "gpushare-python", "share": {"gpu_request": 0.5, "gpu_limit": 0.25}},
            "gpu_request",
        ),
        ({"name": "gpushare-python", "share": {"gpu_type": "H100"}}, "gpu_type"),
        ({"name": "gpushare-python", "share": {"gpu_memory": "100GiB"}}, "gpu_memory"),
    ],
)
def test_post_refusals_name_the_field(server, held, body, field):
    response = send(server, "POST", "/gpushare/api/kernels", body)
    refused = check_refusal(response)
    assert response.status_code == 400 and refused["field"] == field, refused
    if field == "name":
        assert "gpushare-python" in refused["allowed"]
    unchanged(server, held)


# -- property: any body --------------------------------------------------------------------

JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.integers(min_value=10**300, max_value=10**320)
    | st.text(max_size=12)
    | st.text(st.characters(categories=["Nd"]), min_size=1, max_size=6)
    | st.builds(
        lambda d, u: d + u,
        st.text("0123456789.", min_size=1, max_size=420),
        st.sampled_from(["", "GiB", "Mi", "KiB", "b", "T", " parsecs"]),
    )
)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
SHARE_VALUE = {
    "gpu_request": JSON_LEAF,
    "gpu_limit": JSON_LEAF,
    "gpu_memory": JSON_LEAF,
    "gpu_count": JSON_LEAF,
    "gpu_type": JSON_LEAF | st.sampled_from(["A100", "T4", "any"]),
    "gpu_labels": JSON,
}
SHARE = st.fixed_dictionaries({}, optional={**SHARE_VALUE, "gpu_bogus": JSON}) | JSON


def _locally_valid(share: Any) -> bool:
    if share is None:
        return True  # absent: the default share
    try:
        ShareSpec.from_mapping(share)
    except ShareError:
        return False
    return True


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(["gpushare-python", "python3", None, 3, "x" * 300]) | JSON,
    share=SHARE,
    extra=st.dictionaries(st.sampled_from(["path", "kernel", "env"]), JSON, max_size=1),
)
def test_any_post_body_is_refused_cleanly(server, held, name, share, extra):
    body: dict[str, Any] = {"share": share, **extra}
    if name is not None:
        body["name"] = name
    if name == "gpushare-python" and _locally_valid(share):
        body["name"] = "python3"  # a valid share would start a kernel: not this test's subject
    response = send(server, "POST", "/gpushare/api/kernels", body)
    if response.status_code == 201:  # a share valid here though not locally: give it back
        send(server, "DELETE", f"/api/kernels/{response.json()['id']}", b"")
        pytest.fail(f"started a kernel for {body!r}")
    check_refusal(response)
    unchanged(server, held)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    change=st.fixed_dictionaries(
        {}, optional={k: SHARE_VALUE[k] for k in ("gpu_request", "gpu_limit", "gpu_memory")}
    )
    | st.dictionaries(st.sampled_from((*SHARE_FIELDS, "owner", "id")), JSON, max_size=3)
    | JSON
)
def test_any_patch_body_is_answered_cleanly(server, held, change):
    allocation = held["allocation"]["id"]
    response = send(server, "PATCH", f"/gpushare/api/allocations/{allocation}", change)
    if response.status_code == 200:  # a valid live change: it took effect, nothing else did
        after = response.json()
        assert after["id"] == allocation
        assert 0 < after["gpu_request"] <= after["gpu_limit"] <= 1
        assert after["gpu_memory"] >= 2**20
    else:
        check_refusal(response)
    unchanged(server, held)
