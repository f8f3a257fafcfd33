"""GET /gpushare/api/dashboard and /gpushare/api/starts (serverext/dashboard_handlers.py), on a
real jupyter_server with two identities.

The server knows two tokens: one for ``ada``, whom its Authorizer allows ``read`` on
``gpushare_admin``, and one for ``uma``, who may use gpushare but is no admin. The machine's
ledger holds two users' shares: a kernel of this server's Unix user, started over REST, and a
``gpushare run`` of another Unix user (uid 4242, recorded as the node agent records one: a live
process, its command line). ada sees both whole; uma sees the server user's kernel whole and the
other user's share as capacity only - no id, user, command, kernel or live use anywhere in the
answer - and cannot widen that with query arguments or another user's name.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from support import wait_for

from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation
from jupyter_gpushare.ledger.sqlite import SQLiteLedger
from jupyter_gpushare.share import ShareSpec

IDENTITIES = textwrap.dedent('''
    from jupyter_server.auth import Authorizer, User
    from jupyter_server.auth.identity import IdentityProvider

    TOKENS = {"tok-ada": "ada", "tok-uma": "uma"}

    class TwoTokens(IdentityProvider):
        """ada and uma by their tokens (header, or ?token= for a browser, which then keeps the
        login cookie); the test helper's own token as before."""

        def get_user(self, handler):
            given = handler.request.headers.get("Authorization", "").removeprefix("token ")
            given = given or handler.get_argument("token", "")
            if given in TOKENS:
                user = User(username=TOKENS[given])
                handler._token_authenticated = True  # as jupyter_server's own token (no XSRF)
                self.set_login_cookie(handler, user)
                return user
            return super().get_user(handler)

    class AdaIsAdmin(Authorizer):
        def is_authorized(self, handler, user, action, resource):
            if resource == "gpushare_admin":
                return user.username == "ada"
            return True
''')

OTHER_UID = 4242
COMMAND = ["python", "train.py", "--epochs", "3"]


@pytest.fixture
def other_users_run(gpushare_env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"])  # the other user's holder: a live process
    yield proc
    proc.kill()
    proc.wait()


def _record_other_users_share(env: dict[str, str], proc: subprocess.Popen[bytes]) -> str:
    """Record a share of Unix user 4242 as the node agent records a ``gpushare run`` (the
    holder's pid and start time, its uid and command line) in the machine's ledger."""

    async def record() -> str:
        ledger = SQLiteLedger(env["GPUSHARE_LEDGER"])
        try:
            (gpu,) = [g for g in await ledger.gpus() if g.type == "A100"]
            assert isinstance(gpu, Gpu)
            start = psutil.Process(proc.pid).create_time()
            a = Allocation(
                id=Allocation.new_id(),
                node=gpu.node,
                gpus=(gpu.uuid,),
                spec=ShareSpec.from_mapping({"gpu_request": 0.25, "gpu_limit": 0.5}),
                memory=gpu.memory // 4,
                owner="run",
                state="active",
                pid=proc.pid,
                pid_start=start,
                server_pid=proc.pid,
                user="gs-bob",
                extra={"uid": OTHER_UID, "command": COMMAND, "server_start": start},
            )
            snap = await ledger.snapshot()
            version = snap.versions.get(gpu.node, 0)
            assert await ledger.compare_and_swap(gpu.node, version, [*snap.on_node(gpu.node), a])
            return a.id
        finally:
            await ledger.close()

    return asyncio.run(record())


def _as(server: Any, token: str, path: str) -> requests.Response:
    return requests.get(server.url + path, headers={"Authorization": f"token {token}"}, timeout=30)


def test_admin_sees_every_share_a_user_their_own(
    jupyter_server: Any,
    gpushare_env: dict[str, str],
    tmp_path: Path,
    other_users_run: subprocess.Popen[bytes],
) -> None:
    (tmp_path / "twoids.py").write_text(IDENTITIES)
    gpushare_env["PYTHONPATH"] = f"{tmp_path}:{gpushare_env.get('PYTHONPATH', '')}"
    server = jupyter_server(
        "1xA100",
        "--ServerApp.identity_provider_class=twoids.TwoTokens",
        "--ServerApp.authorizer_class=twoids.AdaIsAdmin",
    )
    started = server.post(
        "/gpushare/api/kernels",
        {"name": "gpushare-python", "path": "work/train.ipynb", "share": {"gpu_request": 0.5}},
    )
    assert started.status_code == 201, started.text
    kernel = started.json()
    mine = kernel["allocation"]["id"]
    session = server.post(
        "/api/sessions",
        {"path": "work/train.ipynb", "type": "notebook", "kernel": {"id": kernel["id"]}},
    )
    assert session.status_code == 201, session.text
    other = _record_other_users_share(gpushare_env, other_users_run)

    def both_listed(token: str) -> dict[str, Any] | None:
        body = _as(server, token, "/gpushare/api/dashboard").json()
        shares = [s for g in body["gpus"] for s in g["shares"]]
        return body if len(shares) == 2 else None

    # the admin: both shares, whole, with whose they are
    ada = wait_for(lambda: both_listed("tok-ada"), timeout=30)
    assert ada["admin"] is True
    (gpu,) = ada["gpus"]
    assert gpu["type"] == "A100" and gpu["reserved_request"] == 0.75
    assert gpu["free_request"] == 0.25
    by_id = {s["id"]: s for s in gpu["shares"]}
    assert set(by_id) == {mine, other}
    assert by_id[other]["user"] == "gs-bob"
    assert by_id[other]["command"] == " ".join(COMMAND)
    assert by_id[other]["owner"] == "run" and by_id[other]["mine"] is False
    assert by_id[mine]["mine"] is True
    assert by_id[mine]["path"] == "work/train.ipynb"
    assert by_id[mine]["kernel_id"] == kernel["id"]
    assert (by_id[mine]["request"], by_id[mine]["limit"]) == (0.5, 0.5)

    # live use of the server's kernel arrives from the node daemon
    def metered() -> dict[str, Any] | None:
        body = _as(server, "tok-ada", "/gpushare/api/dashboard").json()
        found = [s for g in body["gpus"] for s in g["shares"] if s.get("id") == mine]
        return found[0] if found and found[0]["metered"] else None

    live = wait_for(metered, timeout=30)
    assert 0 <= live["achieved_share"] <= 1 and live["memory_used"] is not None

    # the server keeps the last two minutes, sampled as usage is read (status bar, dashboard)
    def with_history() -> dict[str, Any] | None:
        server.get("/gpushare/api/usage")  # the status bar's poll samples too
        body = _as(server, "tok-ada", "/gpushare/api/dashboard").json()
        return body if len(body["history"]["shares"].get(mine, [])) >= 3 else None

    history = wait_for(with_history, timeout=30, interval=1.1)["history"]
    assert history["window_s"] == 120
    times = [t for t, _v in history["shares"][mine]]
    assert times == sorted(times) and times[-1] - times[0] <= 120
    assert all(0 <= v <= 1 for _t, v in history["shares"][mine])
    assert len(history["gpus"][gpu["uuid"]]) >= 3

    # a user: the server user's kernel whole, the other user's share as capacity only
    uma = wait_for(lambda: both_listed("tok-uma"), timeout=30)
    assert uma["admin"] is False
    (gpu,) = uma["gpus"]
    assert gpu["free_request"] == 0.25 and gpu["reserved_request"] == 0.75
    whole = [s for s in gpu["shares"] if s["mine"]]
    hidden = [s for s in gpu["shares"] if not s["mine"]]
    assert [s["id"] for s in whole] == [mine] and whole[0]["path"] == "work/train.ipynb"
    assert hidden == [
        {
            "mine": False,
            "request": 0.25,
            "limit": 0.5,
            "memory_cap": hidden[0]["memory_cap"],
            "gpu_count": 1,
            "state": "active",
        }
    ]
    assert set(uma["history"]["shares"]) == {mine}  # the other user's use is not in it
    text = json.dumps(uma)
    for secret in (other, "gs-bob", "train.py", str(OTHER_UID), str(other_users_run.pid)):
        assert secret not in text, secret
    # query arguments, a user name or a forged header widen nothing
    for path in (
        "/gpushare/api/dashboard?admin=1",
        "/gpushare/api/dashboard?user=gs-bob&all=true",
    ):
        assert "gs-bob" not in _as(server, "tok-uma", path).text
    forged = requests.get(
        server.url + "/gpushare/api/dashboard",
        headers={"Authorization": "token tok-uma", "X-Forwarded-User": "ada"},
        timeout=30,
    )
    assert forged.json()["admin"] is False

    # no token: no dashboard
    anonymous = requests.get(server.url + "/gpushare/api/dashboard", timeout=30)
    assert anonymous.status_code in (401, 403)
    assert "gs-bob" not in anonymous.text

    # the kernel's start was reported phase by phase and ended ready
    starts = _as(server, "tok-uma", "/gpushare/api/starts").json()["starts"]
    (start,) = [s for s in starts if s["kernel_id"] == kernel["id"]]
    assert start["phase"] == "ready" and start["ended"] is True
    assert start["kernel_name"] == "gpushare-python"


def test_dashboard_needs_gpushare_read(jupyter_server: Any, gpushare_env: dict[str, str]) -> None:
    """The endpoint is under the same Authorizer resource as the rest (read on gpushare)."""
    deny = "from jupyter_server.auth import Authorizer\n" + textwrap.dedent("""
        class NoGpushare(Authorizer):
            def is_authorized(self, handler, user, action, resource):
                return resource != "gpushare"
    """)
    folder = Path(gpushare_env["JUPYTER_CONFIG_DIR"]).parent / "deny"
    folder.mkdir()
    (folder / "denyauth.py").write_text(deny)
    gpushare_env["PYTHONPATH"] = f"{folder}:{gpushare_env.get('PYTHONPATH', '')}"
    server = jupyter_server("1xA100", "--ServerApp.authorizer_class=denyauth.NoGpushare")
    for path in ("/gpushare/api/dashboard", "/gpushare/api/starts"):
        assert server.get(path).status_code == 403, path


def test_start_phases_are_reported_in_order() -> None:
    """The board (pure): phases in order, a restart starts over, ended starts expire."""
    from jupyter_gpushare.progress import KEEP_S, StartBoard, pod_phase

    board = StartBoard()
    board.report("k1", "placing", "placing", kernel_name="gpushare-python", now=100.0)
    board.report("k1", "scheduling", "0/3 nodes are available: 3 Insufficient gpu.", now=101.0)
    (s,) = board.starts(now=102.0)
    assert (s.phase, s.kernel_name, s.since) == ("scheduling", "gpushare-python", 100.0)
    assert "Insufficient" in s.message and not s.ended
    board.report("k1", "ready", now=110.0)
    assert board.starts(now=110.0 + KEEP_S - 1)[0].ended
    assert board.starts(now=110.0 + KEEP_S + 1) == []
    with pytest.raises(ValueError, match="unknown start phase"):
        board.report("k1", "teleporting")

    assert pod_phase(None) is None
    unscheduled = {
        "spec": {},
        "status": {
            "conditions": [
                {"type": "PodScheduled", "status": "False", "message": "0/2 nodes are available"}
            ]
        },
    }
    assert pod_phase(unscheduled) == ("scheduling", "0/2 nodes are available")
    pulling = {
        "spec": {"nodeName": "gpu-1"},
        "status": {
            "containerStatuses": [
                {"state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
            ]
        },
    }
    assert pod_phase(pulling) == ("pulling", "ErrImagePull: not found")
    running = {
        "spec": {"nodeName": "gpu-1"},
        "status": {"containerStatuses": [{"state": {"running": {}}}]},
    }
    assert pod_phase(running) == ("starting", "running on gpu-1")
