"""End to end on one machine: a real jupyter_server, real ipykernel kernels, the local backend."""

from __future__ import annotations

import json
import os
import signal

from support import add_kernelspec, wait_for


def _alloc_of(server, kernel_id):
    return [a for a in server.allocations() if a["kernel_id"] == kernel_id]


def test_kernel_sees_its_gpu_and_allocation(jupyter_server):
    server = jupyter_server("1xA100")
    kernel = server.start_kernel("gpushare-python")
    [alloc] = _alloc_of(server, kernel["id"])
    assert (alloc["gpu_request"], alloc["gpu_limit"], alloc["gpu_type"]) == (0.25, 0.5, "A100")
    assert alloc["state"] == "active" and alloc["pid"]
    client = server.client(kernel["id"])
    env = json.loads(
        client.execute(
            "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
            "['GPUSHARE_ALLOCATION_ID', 'GPUSHARE_SOCKET', 'CUDA_VISIBLE_DEVICES', "
            "'GPUSHARE_SIMULATED']}))"
        )
    )
    client.close()
    assert env["GPUSHARE_ALLOCATION_ID"] == alloc["id"]
    assert env["CUDA_VISIBLE_DEVICES"] == alloc["gpus"][0]
    assert env["GPUSHARE_SOCKET"] == server.env["GPUSHARE_SOCKET"]
    assert env["GPUSHARE_SIMULATED"] == "1"
    gpus = server.get("/gpushare/api/gpus").json()
    assert gpus["simulated"] is True
    [gpu] = gpus["gpus"]
    assert gpu["uuid"] == alloc["gpus"][0] and gpu["free_request"] == 0.75
    assert gpu["allocations"] == [alloc["id"]]

    assert server.delete(f"/api/kernels/{kernel['id']}").status_code == 204
    assert _alloc_of(server, kernel["id"]) == []


def test_two_halves_fit_and_a_third_is_refused_with_the_reason(jupyter_server):
    server = jupyter_server("1xA100")
    share = {"gpu_request": 0.5, "gpu_limit": 0.5, "gpu_type": "A100"}
    first = server.post("/gpushare/api/kernels", {"name": "gpushare-python", "share": share})
    second = server.post("/gpushare/api/kernels", {"name": "gpushare-python", "share": share})
    assert first.status_code == 201, first.text
    assert second.status_code == 201, second.text
    assert first.json()["allocation"]["gpu_request"] == 0.5
    third = server.post("/gpushare/api/kernels", {"name": "gpushare-python", "share": share})
    assert third.status_code == 409, third.text
    assert third.json()["error"] == "no_fit"
    assert "no A100 has 0.5 free" in third.json()["message"]
    assert len(server.allocations()) == 2  # the refusal reserved nothing
    assert len(server.get("/api/kernels").json()) == 2


def test_bad_specs_get_400_naming_the_field(jupyter_server):
    server = jupyter_server("1xA100")
    cases = {
        "gpu_request": ({"gpu_request": 0.7, "gpu_limit": 0.5}, "at most gpu_limit"),
        "gpu_limit": ({"gpu_limit": 1.5}, "(0, 1]"),
        "gpu_memory": ({"gpu_memory": "100GiB"}, "at most 80GiB"),
        "gpu_type": ({"gpu_type": "T4"}, "one of A100"),
    }
    for field, (share, allowed) in cases.items():
        response = server.post("/gpushare/api/kernels", {"name": "gpushare-python", "share": share})
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["error"] == "invalid_share" and body["field"] == field, body
        assert allowed in body["allowed"], body
        assert field in body["message"]
    nan = server.request(
        "POST",
        "/gpushare/api/kernels",
        data='{"name": "gpushare-python", "share": {"gpu_request": NaN}}',
    )
    assert nan.status_code == 400 and nan.json()["field"] == "gpu_request"
    assert server.allocations() == []
    assert server.get("/api/kernels").json() == []


def test_misspelled_kernelspec_key_is_refused_by_name(jupyter_server, gpushare_env):
    add_kernelspec(gpushare_env, "typo", {"gpu_requets": 0.25})
    server = jupyter_server("1xA100")
    response = server.post("/api/kernels", {"name": "typo"})
    assert response.status_code == 400, response.text
    assert "gpu_requets" in response.json()["message"]
    assert "known keys are" in response.json()["message"]
    ours = server.post("/gpushare/api/kernels", {"name": "typo"})
    assert ours.status_code == 400 and ours.json()["field"].endswith("gpu_requets")
    assert server.allocations() == []


def test_released_after_kill_9_of_the_kernel_process(jupyter_server):
    server = jupyter_server("1xA100")
    kernel = server.start_kernel("gpushare-python")
    [alloc] = _alloc_of(server, kernel["id"])
    os.kill(alloc["pid"], signal.SIGKILL)
    # The dead process's allocation goes; the restarter brings the kernel back with a new one.
    wait_for(lambda: all(a["id"] != alloc["id"] for a in server.allocations()), timeout=30)
    [again] = wait_for(lambda: [a for a in _alloc_of(server, kernel["id"]) if a["pid"]], 30)
    assert again["pid"] != alloc["pid"] and again["state"] == "active"
    server.delete(f"/api/kernels/{kernel['id']}")
    assert server.allocations() == []


def test_restart_keeps_the_share(jupyter_server):
    server = jupyter_server("1xA100")
    kernel = server.start_kernel("gpushare-python")
    [before] = _alloc_of(server, kernel["id"])
    assert server.post(f"/api/kernels/{kernel['id']}/restart").status_code == 200
    [after] = wait_for(lambda: [a for a in _alloc_of(server, kernel["id"]) if a["pid"]], 30)
    assert after["id"] == before["id"] and after["gpus"] == before["gpus"]
    assert after["pid"] != before["pid"]


def test_released_after_server_death(jupyter_server, gpushare_env):
    server = jupyter_server("1xA100")
    kernel = server.start_kernel("gpushare-python")
    [alloc] = _alloc_of(server, kernel["id"])
    server.kill9()
    second = jupyter_server("1xA100")
    wait_for(lambda: second.allocations() == [], timeout=30)
    # the orphaned kernel process is gone too
    wait_for(lambda: not _alive(alloc["pid"]), timeout=30)


def test_release_over_rest(jupyter_server):
    server = jupyter_server("1xA100")
    kernel = server.start_kernel("gpushare-python")
    [alloc] = _alloc_of(server, kernel["id"])
    assert server.get(f"/gpushare/api/allocations/{alloc['id']}").json()["id"] == alloc["id"]
    assert server.delete(f"/gpushare/api/allocations/{alloc['id']}").status_code == 204
    assert server.delete(f"/gpushare/api/allocations/{alloc['id']}").status_code == 404
    assert server.allocations() == []
    client = server.client(kernel["id"])
    assert client.execute("print(1 + 1)").strip() == "2"  # the kernel lives on
    assert int(client.execute("import os; print(os.getpid())")) == alloc["pid"]  # not restarted
    client.close()
    assert server.get(f"/api/kernels/{kernel['id']}").json()["execution_state"] != "starting"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_status_names_the_notebook_and_the_server_logs_each_refusal_once(
    jupyter_server, gpushare_env
):
    """A kernel started for a notebook (jupyter_server's sessions) records the notebook's path
    on its share, and ``jupyter gpushare status`` shows it; a refused start (REST, a session)
    is logged by the server once, on one line, without a traceback."""
    import subprocess
    import sys

    server = jupyter_server("1xA100")
    (server.root / "work").mkdir()
    session = server.post(
        "/api/sessions",
        {
            "path": "work/analysis.ipynb",
            "name": "analysis.ipynb",
            "type": "notebook",
            "kernel": {"name": "gpushare-python"},
        },
    )
    assert session.status_code == 201, session.text
    [alloc] = _alloc_of(server, session.json()["kernel"]["id"])
    notebook = str(server.root / "work" / "analysis.ipynb")
    assert alloc["extra"]["notebook"] == notebook
    table = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare", "status"],
        env={**gpushare_env, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    [row] = [line for line in table.stdout.splitlines() if alloc["id"] in line]
    assert notebook in row and "25 %" in row and "50 %" in row, table.stdout

    # the kernelspecs' logos reach JupyterLab's launcher and kernel picker
    specs = server.get("/api/kernelspecs").json()["kernelspecs"]
    for name in ("gpushare-python", "gpushare-python-half", "gpushare-python-whole"):
        assert {"logo-32x32", "logo-64x64", "logo-svg"} <= set(specs[name]["resources"])
    logo = server.get(specs["gpushare-python"]["resources"]["logo-64x64"])
    assert logo.status_code == 200 and logo.content.startswith(b"\x89PNG")

    too_big = {"gpu_request": 1.0, "gpu_limit": 1.0}
    refused = server.post("/gpushare/api/kernels", {"name": "gpushare-python", "share": too_big})
    assert refused.status_code == 409, refused.text
    whole = server.post(
        "/api/sessions",
        {
            "path": "whole.ipynb",
            "name": "whole.ipynb",
            "type": "notebook",
            "kernel": {"name": "gpushare-python-whole"},
        },
    )
    # jupyter_server's own session handler answered 500 for this; a refusal is the user's answer
    assert whole.status_code == 409, whole.text
    assert whole.json()["error"] == "no_fit" and "1 free" in whole.json()["message"], whole.text

    def logged() -> list[str]:
        return [line for line in server.log().splitlines() if "kernel start refused" in line]

    lines = wait_for(lambda: len(logged()) >= 2 and logged(), timeout=10)
    log = server.log()
    assert len(lines) == 2, log  # one line per refusal (jupyter_client logged each twice)
    assert all("no GPU has 1 free" in line for line in lines), lines
    assert "Traceback" not in log and "ShareRefused" not in log, log
