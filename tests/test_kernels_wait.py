"""``"wait"`` in ``POST /gpushare/api/kernels`` (issue 27: the Lab picker's "Wait in line"): a
start's own wait in the queue, checked at the edge against ``GpuShare.start_wait_max``.

The waiting itself (a system agent's queue, the kernel started by itself after a release) is
tests/lab/test_queue_wait.py and tests/test_queue_agent.py; here, a server with a ledger of its
own (no queue): every bad ``wait`` is a 400 that names the field, the value and what is allowed,
and a good one on a full GPU is refused at once (nothing to wait in), never a 500.
"""

from __future__ import annotations

from typing import Any

#: JSON texts of ``wait`` that are not seconds from 0 to the bound (120 here)
BAD = [
    "-1",
    '"60"',
    "true",
    "null0",
    "[5]",
    '{"s": 5}',
    "121",
    "1e400",
    "NaN",
    "-Infinity",
    "9" * 5000,
]


def test_a_bad_wait_is_refused_by_name(jupyter_server: Any) -> None:
    server = jupyter_server("1xA100", "--GpuShare.start_wait_max=120")
    for text in BAD:
        body = '{"name": "gpushare-python", "wait": ' + text + "}"
        reply = server.request("POST", "/gpushare/api/kernels", data=body)
        assert reply.status_code == 400, (text, reply.text)
        error = reply.json()
        if text == "null0":  # not JSON at all
            assert error["error"] == "bad_json", error
            continue
        assert error["field"] == "wait" and error["error"] == "invalid_request", error
        assert "from 0 to 120" in error["allowed"], error
        assert "GpuShare.start_wait_max" in error["allowed"], error
    assert server.get("/api/kernels").json() == []


def test_a_wait_on_a_server_that_lets_none_wait_and_one_without_a_queue(
    jupyter_server: Any,
) -> None:
    server = jupyter_server("1xA100", "--GpuShare.start_wait_max=0")
    reply = server.request(
        "POST", "/gpushare/api/kernels", json={"name": "gpushare-python", "wait": 30}
    )
    assert reply.status_code == 400, reply.text
    assert "lets no start wait" in reply.json()["allowed"]
    queue = server.get("/gpushare/api/queue").json()
    assert queue["enabled"] is False and queue["max_wait"] == 0
    # a ledger of the server's own has no queue: a start that does not fit is refused at once
    other = jupyter_server("1xA100", "--GpuShare.start_wait_max=60")
    big = {"gpu_request": 1, "gpu_limit": 1}
    held = other.request("POST", "/gpushare/api/kernels", json={"name": "gpushare-python"})
    assert held.status_code == 201, held.text
    refused = other.request(
        "POST",
        "/gpushare/api/kernels",
        json={"name": "gpushare-python", "share": big, "wait": 60},
    )
    assert refused.status_code == 409 and refused.json()["error"] == "no_fit", refused.text
    assert refused.elapsed.total_seconds() < 10
