"""System mode: one node agent owns a shared machine's ledger (issue 12).

Real Unix users (``useradd``; CI runs as root) against one ``jupyter gpushare daemon --system``
on a simulated A100, its socket and ledger in a root-owned 0755 directory. Each user's code runs
in a forked process that has switched to that user's uid and groups (``setuid``), so the agent
knows it only by its peer credentials, exactly as it knows a user's Jupyter server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread  # noqa: F401 - loaded before the fork (see as_user)
import json
import multiprocessing
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpushare import bound as bounds
from jupyter_gpushare import cli as gpushare_cli
from jupyter_gpushare import paths
from jupyter_gpushare.daemon import ledger_ops
from jupyter_gpushare.daemon.client import DaemonClient
from jupyter_gpushare.inventory import Gpu
from jupyter_gpushare.ledger import Allocation, LedgerUnavailable
from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.ledger.reconcile import process_start_time
from jupyter_gpushare.placement import PlacementRefused, Policy, allocate
from jupyter_gpushare.resize import resized
from jupyter_gpushare.share import ShareError, ShareSpec

NODE = "gs-h3"
GiB = 2**30
ALICE, BOB = "gsh3alice", "gsh3bob"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, setuid)")


# -- real users and the agent ----------------------------------------------------------------


def unix_user(name: str) -> pwd.struct_passwd:
    """A real user (``useradd -m`` when missing)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "-m", "--shell", "/bin/sh", name], check=False, stderr=subprocess.DEVNULL
        )
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.skip(f"could not create the user {name} (useradd)")


class Agent:
    def __init__(
        self, directory: Path, *extra: str, system: bool = True, simulate: str = "1xA100"
    ) -> None:
        self.dir = directory
        self.socket = directory / "daemon.sock"
        self.ledger = directory / "state" / "ledger.sqlite"
        args = [
            sys.executable,
            "-m",
            "jupyter_gpushare.daemon",
            "--socket",
            str(self.socket),
            "--ledger",
            str(self.ledger),
            "--node",
            NODE,
            "--simulate",
            simulate,
            "--state-dir",
            str(directory / "shm"),
            "--poll-ms",
            "100",
            *extra,
        ]
        if system:
            args.append("--system")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
        self.log = directory / "daemon.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=out, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while not DaemonClient(self.socket, timeout=1).alive():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the agent did not start: {self.log.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def agent_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="gs-h3-", dir="/tmp"))
    path.chmod(0o755)  # root-owned, others may enter (the socket), nobody else may write
    return path


@pytest.fixture
def agent() -> Iterator[Callable[..., Agent]]:
    made: list[Agent] = []

    def start(*extra: str, system: bool = True, simulate: str = "1xA100") -> Agent:
        found = Agent(agent_dir(), *extra, system=system, simulate=simulate)
        made.append(found)
        return found

    yield start
    for a in made:
        a.stop()
        shutil.rmtree(a.dir, ignore_errors=True)


@pytest.fixture
def holder() -> Iterator[Callable[[pwd.struct_passwd], int]]:
    """A long-lived process of a user (``sleep``): holds that user's test shares."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(user: pwd.struct_passwd) -> int:
        proc = subprocess.Popen(
            ["sleep", "600"], user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd="/"
        )
        procs.append(proc)
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)


def as_user(
    user: pwd.struct_passwd, work: Callable[..., Any], *args: Any, start: Any = None, **kwargs: Any
) -> Any:
    """Run ``work(*args)`` (a function or coroutine function) in a forked process as ``user``;
    returns
    ``("ok", result)`` or ``("error", type name, message, agent error code)``. ``start``: a
    multiprocessing Event the child waits for before it begins (to start several at once).
    The child runs the code this process already loaded (this Python's own files may not be
    readable by the user: a pyenv under /root), so modules it needs are imported up here."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        os.setgroups(os.getgrouplist(user.pw_name, user.pw_gid))
        os.setgid(user.pw_gid)
        os.setuid(user.pw_uid)
        os.environ["HOME"] = user.pw_dir
        os.environ["USER"] = user.pw_name
        if start is not None:
            start.wait(30)
        try:
            done = work(*args, **kwargs)
            send.send(("ok", asyncio.run(done) if asyncio.iscoroutine(done) else done))
        except BaseException as exc:
            send.send(("error", type(exc).__name__, str(exc), getattr(exc, "error", None)))

    proc = ctx.Process(target=child)
    proc.start()
    send.close()
    proc.result = receive  # type: ignore[attr-defined]
    return proc


def result_of(proc: Any, timeout: float = 60) -> Any:
    assert proc.result.poll(timeout), "the user's process gave no result"
    out = proc.result.recv()
    proc.join(10)
    return out


def run_as(user: pwd.struct_passwd, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return result_of(as_user(user, work, *args, **kwargs))


# -- what the users' processes do (module level: they run in forked children) ----------------


async def place(
    socket: str, request: float, bound: dict[str, Any] | None = None, holder: int | None = None
) -> dict:
    """Place a share through the agent; ``holder``: the process that holds it (default this
    one: the agent releases the share once it is gone)."""
    hub = bounds.from_json(bound) if bound else None
    ledger = AgentLedger(socket, hub)
    inventory = await ledger.gpus()
    spec = ShareSpec(request, request)
    if hub is not None:  # as the provisioner does (hub.apply_user_bound): memory from the bound
        spec = bounds.narrowed(spec, hub) if request <= hub.gpu_request else spec
    try:
        a = await allocate(
            ledger, spec, inventory, None, owner="run", server_pid=holder or os.getpid()
        )
    except PlacementRefused as exc:
        return {"refused": exc.message}
    return {"allocation": a.to_json()}


async def record_kernel(
    socket: str,
    pid: int,
    server_pid: int | None = None,
    pid_start: float | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A kernel share of 0.1 naming ``pid`` as its process and ``server_pid`` as its server, as
    a user's own code may write it (no start times unless given); ``fields``: more of the
    record (``user``, ``extra``), as an admin may write them."""
    ledger = AgentLedger(socket)
    made = await allocate(
        ledger,
        ShareSpec(0.1, 0.1, gpu_memory=GiB),
        await ledger.gpus(),
        None,
        owner="kernel",
        state="active",
        pid=pid,
        pid_start=pid_start,
        server_pid=server_pid,
        **fields,
    )
    return made.to_json()


async def snapshot(socket: str) -> list[dict[str, Any]]:
    return [a.to_json() for a in (await AgentLedger(socket).snapshot()).allocations]


async def release(socket: str, allocation_id: str) -> Any:
    released = await AgentLedger(socket).release(allocation_id)
    return released.to_json() if released else None


async def resize_share(socket: str, allocation_id: str, change: dict[str, Any]) -> dict:
    """A PATCH-like resize: the REST handler's read-modify-CAS through the agent."""
    ledger = AgentLedger(socket)
    gpus = await ledger.gpus()
    after = await ledger.update(
        allocation_id, lambda cur, others: resized(cur, others, gpus, change, None)
    )
    return after.to_json()


async def cas_replacing(socket: str, allocation_id: str, **changes: Any) -> bool:
    """A hand-made compare-and-swap that changes fields of one record (an attack, mostly)."""
    ledger = AgentLedger(socket)
    snap = await ledger.snapshot()
    found = snap.find(allocation_id)
    assert found is not None
    rest = [a for a in snap.on_node(found.node) if a.id != allocation_id]
    return await ledger.compare_and_swap(
        found.node, snap.versions[found.node], [*rest, replace(found, **changes)]
    )


async def put_gpus(socket: str) -> None:
    await AgentLedger(socket).put_gpus(NODE, [Gpu(NODE, "GPU-fake", 0, "fake", "A100", 10**15)])


async def touch_files(paths_to_try: list[str]) -> dict[str, str]:
    """Try to open each path for reading and for writing; what happened to each."""
    out = {}
    for path in paths_to_try:
        for mode, flags in (("r", os.O_RDONLY), ("w", os.O_WRONLY)):
            try:
                os.close(os.open(path, flags | os.O_NOFOLLOW))
                out[f"{mode}:{path}"] = "opened"
            except OSError as exc:
                out[f"{mode}:{path}"] = type(exc).__name__
    return out


async def status(socket: str) -> dict[str, Any]:
    return await asyncio.to_thread(DaemonClient(socket).status)


def find_system(socket: str) -> bool:
    os.environ["GPUSHARE_SOCKET"] = socket
    found = paths.find_agent(fresh=True)
    return found.system and str(found.socket) == socket


def kernel_op(socket: str, op: str, *args: Any) -> dict[str, Any]:
    """A kernel's own op (``release``, ``resize``) on the agent's socket, from this process."""
    return getattr(DaemonClient(socket), op)(*args)


async def kernel_resize(socket: str, allocation_id: str, share: dict[str, Any]) -> dict:
    """A kernel's own resize op: this process becomes the allocation's process first."""
    ledger = AgentLedger(socket)
    pid = os.getpid()
    start = process_start_time(pid)
    await ledger.update(
        allocation_id, lambda a, _o: replace(a, pid=pid, pid_start=start, state="active")
    )
    return await asyncio.to_thread(DaemonClient(socket).resize, allocation_id, share)


# -- the tests ------------------------------------------------------------------------------


def test_two_users_one_gpu_one_is_placed_other_refused_and_cannot_touch_it(agent, holder) -> None:
    alice, bob = unix_user(ALICE), unix_user(BOB)
    a = agent()
    socket = str(a.socket)
    start = multiprocessing.get_context("fork").Event()
    procs = [as_user(u, place, socket, 0.75, None, holder(u), start=start) for u in (alice, bob)]
    time.sleep(0.3)
    start.set()  # both ask 0.75 of the one A100 at the same instant
    outcomes = [result_of(p) for p in procs]
    assert all(o[0] == "ok" for o in outcomes), outcomes
    placed = [o[1]["allocation"] for o in outcomes if "allocation" in o[1]]
    refused = [o[1]["refused"] for o in outcomes if "refused" in o[1]]
    assert len(placed) == 1 and len(refused) == 1, outcomes
    assert "0.25" in refused[0]  # the reason names what is free
    winner = placed[0]
    owner, other = (alice, bob) if outcomes[0][1].get("allocation") else (bob, alice)
    assert winner["user"] == owner.pw_name and winner["extra"]["uid"] == owner.pw_uid

    # the other user sees the share only as capacity
    seen = run_as(other, snapshot, socket)
    assert seen[0] == "ok"
    (theirs,) = [s for s in seen[1] if s["id"] == winner["id"]]
    assert theirs["gpu_request"] == 0.75 and theirs["gpus"] == winner["gpus"]
    assert theirs["user"] == "" and theirs["pid"] is None and theirs["kernel_id"] is None
    assert theirs["server_pid"] is None and theirs["extra"] == {"redacted": True}
    # ... and cannot release it, resize it, or rewrite it
    for work, args in (
        (release, (winner["id"],)),
        (resize_share, (winner["id"], {"gpu_request": 0.1, "gpu_limit": 0.1})),
        (cas_replacing, (winner["id"],)),
    ):
        kwargs = {"memory": 1} if work is cas_replacing else {}
        outcome = run_as(other, work, socket, *args, **kwargs)
        assert outcome[:2] == ("error", "AgentRefused") and outcome[3] == "not_permitted", (
            work.__name__,
            outcome,
        )
    # ... nor through a kernel's own ops (the agent checks the caller's process)
    for op, args in (
        ("release", (winner["id"],)),
        ("resize", (winner["id"], {"gpu_request": 0.1, "gpu_limit": 0.1})),
    ):
        reply = run_as(other, kernel_op, socket, op, *args)
        assert reply[0] == "ok" and reply[1]["error"] == "not_permitted", (op, reply)
    # nor publish GPUs
    outcome = run_as(other, put_gpus, socket)
    assert outcome[3] == "not_permitted", outcome
    # the agent's status shows the other user none of its details
    shown = run_as(other, status, socket)
    assert shown[0] == "ok", shown
    shown = shown[1]
    assert winner["id"] not in json.dumps(shown.get("allocations", []))
    # no file of the agent can be opened by the other user, let alone written
    files = [str(a.ledger), f"{a.ledger}-wal", f"{a.ledger}-shm", f"{a.socket}.lock", str(a.log)]
    opened = run_as(other, touch_files, [f for f in files if os.path.exists(f)])[1]
    assert not any(v == "opened" and k.startswith("w:") for k, v in opened.items()), opened
    for f in (str(a.ledger), f"{a.socket}.lock"):
        assert opened[f"r:{f}"] == "PermissionError", opened
    assert oct(os.stat(a.ledger.parent).st_mode & 0o777) == "0o700"
    assert os.stat(a.ledger).st_mode & 0o077 == 0
    # root sees everything; the owner releases its own share
    root_view = asyncio.run(snapshot(socket))
    (full,) = [s for s in root_view if s["id"] == winner["id"]]
    assert full["user"] == owner.pw_name and full["extra"]["uid"] == owner.pw_uid
    assert run_as(owner, release, socket, winner["id"])[0] == "ok"
    assert asyncio.run(snapshot(socket)) == []


def test_per_user_bound_is_recorded_and_holds_on_every_path(agent, holder) -> None:
    alice = unix_user(ALICE)
    holding = holder(alice)
    a = agent("--max-share", '{"gpu_request": 0.5, "gpu_limit": 0.5}')
    socket = str(a.socket)
    hub_bound = {"gpu_request": 0.25, "gpu_limit": 0.25, "gpu_memory": 10 * GiB}
    over = run_as(alice, place, socket, 0.5, hub_bound)
    assert over[:2] == ("error", "ShareError") and "gpu_request" in over[2], over
    made = run_as(alice, place, socket, 0.25, hub_bound, holding)[1]["allocation"]
    assert made["extra"]["bound"]["gpu_limit"] == 0.25
    assert made["extra"]["bound"]["gpu_memory"] == 10 * GiB
    # PATCH-like: read-modify-CAS through the agent
    grown = run_as(alice, resize_share, socket, made["id"], {"gpu_request": 1.0, "gpu_limit": 1.0})
    assert grown[:2] == ("error", "ShareError") and "at most 0.25" in grown[2], grown
    more_memory = run_as(alice, resize_share, socket, made["id"], {"gpu_memory": "20GiB"})
    assert more_memory[:2] == ("error", "ShareError") and "gpu_memory" in more_memory[2]
    # lifting the recorded bound itself is not the holder's to do
    lifted = run_as(alice, cas_replacing, socket, made["id"], extra={"uid": alice.pw_uid})
    assert lifted[3] == "not_permitted", lifted
    # within the bound is fine; the agent's own --max-share bounds a user without a Hub bound
    smaller = run_as(alice, resize_share, socket, made["id"], {"gpu_memory": "5GiB"})
    assert smaller[0] == "ok" and smaller[1]["gpu_memory"] == 5 * GiB, smaller
    assert run_as(alice, place, socket, 0.75, None, holding)[:2] == ("error", "ShareError")
    # the kernel's own resize op (this process becomes the share's process: last, as
    # the agent releases the share once that process is gone)
    by_kernel = run_as(
        alice, kernel_resize, socket, made["id"], {"gpu_request": 1.0, "gpu_limit": 1.0}
    )
    assert by_kernel[0] == "ok" and by_kernel[1]["ok"] is False, by_kernel
    assert by_kernel[1]["field"] == "gpu_request" and "0.25" in by_kernel[1]["allowed"]


def test_the_agent_releases_a_share_whose_holder_is_gone(agent) -> None:
    """No share outlives its holder: the system agent reconciles for every user (a user's own
    server could release only its own), and a user's record without a holder is refused."""
    from support import wait_for

    alice = unix_user(ALICE)
    a = agent()
    holding = subprocess.Popen(
        ["sleep", "600"], user=alice.pw_uid, group=alice.pw_gid, extra_groups=[], cwd="/"
    )
    made = run_as(alice, place, str(a.socket), 0.5, None, holding.pid)[1]["allocation"]
    assert [s["id"] for s in asyncio.run(snapshot(str(a.socket)))] == [made["id"]]
    holding.kill()
    holding.wait(10)
    wait_for(lambda: asyncio.run(snapshot(str(a.socket))) == [], timeout=30)


def test_reserve_uses_the_deployments_policy_and_aliases(agent, tmp_path: Path) -> None:
    """A kernel's ``reserve`` after a release is placed with the deployment's policy (here a
    cordoned GPU that binpack would otherwise pick: it is the fuller one) and type aliases."""
    from jupyter_gpushare.inventory import simulated_gpus

    first, second = (replace(g, type="BIG") for g in simulated_gpus("2xA100", NODE))
    config = tmp_path / "jupyter_server_config.json"
    config.write_text(
        json.dumps(
            {
                "GpuShare": {"type_aliases": {"BIG": ["A100"]}},
                "GpusharePlacement": {"cordoned_gpus": [first.uuid]},
            }
        )
    )
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"GpuShare": {"type_aliases": {"BIG": ["A100"]}}}))

    def held(pid: int | None, request: float) -> Allocation:
        return Allocation(
            id=Allocation.new_id(),
            node=NODE,
            gpus=(first.uuid,),
            spec=ShareSpec(request, request, gpu_memory=GiB, gpu_type="BIG"),
            memory=GiB,
            state="active",
            pid=pid,
            pid_start=process_start_time(pid) if pid else None,
        )

    def reserve_after_release(config_file: Path) -> dict[str, Any]:
        a = agent("--config", str(config_file), system=False, simulate="2xA100")
        ledger = AgentLedger(a.socket)
        mine, neighbour = held(os.getpid(), 0.5), held(None, 0.25)

        async def hold() -> None:
            await ledger.put_gpus(NODE, [first, second])  # a per-user agent's server publishes
            snap = await ledger.snapshot()  # both on the first GPU (placed before a cordon)
            assert await ledger.compare_and_swap(
                NODE, snap.versions.get(NODE, 0), [mine, neighbour]
            )

        asyncio.run(hold())
        client = DaemonClient(a.socket)
        assert client.release(mine.id)["ok"]
        reply = client.reserve({"gpu_type": "big", "gpu_request": 0.5, "gpu_limit": 0.5})
        assert reply["ok"], reply
        return reply["allocation"]

    cordoned = reserve_after_release(config)
    assert cordoned["gpus"] == [second.uuid]  # not the cordoned (fuller) one
    assert cordoned["gpu_type"] == "BIG"  # the configured alias's spelling
    # without the cordon binpack puts it next to the neighbour: the policy decided above
    assert reserve_after_release(plain)["gpus"] == [first.uuid]


def test_eight_agents_started_at_once_leave_one(tmp_path: Path) -> None:
    directory = agent_dir()
    socket = directory / "daemon.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    args = [
        sys.executable,
        "-m",
        "jupyter_gpushare.daemon",
        "--socket",
        str(socket),
        "--ledger",
        str(directory / "ledger.sqlite"),
        "--node",
        NODE,
        "--simulate",
        "1xA100",
        "--state-dir",
        str(directory / "shm"),
    ]
    procs = [
        subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        deadline = time.monotonic() + 60
        while sum(p.poll() is None for p in procs) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in procs if p.poll() is None]
        assert len(alive) == 1, [p.returncode for p in procs]
        assert all(p.returncode == 0 for p in procs if p not in alive)
        assert DaemonClient(socket).ping()["pid"] == alive[0].pid
        said = procs[0].stdout.read() if procs[0] not in alive else procs[1].stdout.read()
        assert f"another agent (pid {alive[0].pid}) already serves {socket}" in said
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(10)
        shutil.rmtree(directory, ignore_errors=True)


def test_only_the_gpu_group_may_use_the_agent(agent, holder) -> None:
    """``--group G``: the socket is 0660 root:G; a user outside G cannot even connect, and the
    agent itself refuses one that got a descriptor some other way; a group bound applies."""
    import grp

    if subprocess.run(["groupadd", "-f", "gsh3gpu"], stderr=subprocess.DEVNULL).returncode:
        pytest.skip("groupadd failed")
    alice, bob = unix_user(ALICE), unix_user(BOB)
    subprocess.run(["usermod", "-aG", "gsh3gpu", ALICE], check=True)
    subprocess.run(
        ["gpasswd", "-d", BOB, "gsh3gpu"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    a = agent(
        "--group", "gsh3gpu", "--group-max-share", 'gsh3gpu={"gpu_request": 0.5, "gpu_limit": 0.5}'
    )
    st = os.stat(a.socket)
    assert st.st_mode & 0o777 == 0o660 and st.st_gid == grp.getgrnam("gsh3gpu").gr_gid
    outcome = run_as(bob, snapshot, str(a.socket))
    assert outcome[:2] == ("error", "LedgerUnavailable") and "Permission denied" in outcome[2]
    # ... and is not sent to a private agent of their own beside it (which would double-book)
    assert run_as(bob, find_system, str(a.socket)) == ("ok", True)
    assert run_as(alice, snapshot, str(a.socket)) == ("ok", [])
    over = run_as(alice, place, str(a.socket), 0.75, None, holder(alice))  # the group's bound
    assert over[:2] == ("error", "ShareError") and "at most 0.5" in over[2], over
    made = run_as(alice, place, str(a.socket), 0.5, None, holder(alice))[1]["allocation"]
    assert made["extra"]["bound"]["gpu_limit"] == 0.5


def test_an_unusable_ledger_file_is_reported_as_unavailable(agent) -> None:
    """The agent's own file broken (here: overwritten): callers get LedgerUnavailable with
    SQLite's reason (REST: 503 ledger_unavailable), not an internal error."""
    a = agent()
    ledger = AgentLedger(a.socket)
    gpus = asyncio.run(ledger.gpus())
    for extra in ("-wal", "-shm"):
        Path(f"{a.ledger}{extra}").unlink(missing_ok=True)
    a.ledger.write_bytes(b"this is not a database" * 100)
    with pytest.raises(LedgerUnavailable, match="not a database"):
        asyncio.run(allocate(ledger, ShareSpec(0.25, 0.25), gpus, None))


def test_lock_refuses_a_directory_others_may_write(tmp_path: Path) -> None:
    from jupyter_gpushare.daemon.lock import UnsafeDirectory, take

    shared = Path(tempfile.mkdtemp(prefix="gs-h3-", dir="/tmp"))
    try:
        shared.chmod(0o1777)
        with pytest.raises(UnsafeDirectory, match="writable by other users"):
            take(shared / "daemon.sock")
        shared.chmod(0o755)
        (shared / "daemon.sock.lock").symlink_to(tmp_path / "victim")
        with pytest.raises(OSError):  # O_NOFOLLOW: a planted symlink is never followed
            take(shared / "daemon.sock")
        assert not (tmp_path / "victim").exists()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_discovery_finds_the_system_agent_first(agent, monkeypatch) -> None:
    a = agent()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(a.socket))
    found = paths.find_agent(fresh=True)
    assert found.system and found.socket == a.socket
    from jupyter_gpushare.config import GpuShare

    settings = GpuShare(socket_path=str(a.socket), node_name=NODE)
    assert isinstance(settings.local_ledger(), AgentLedger)
    gpus = asyncio.run(settings.local_gpus())  # the agent's inventory, not this process's
    assert [g.type for g in gpus] == ["A100"] and gpus[0].node == NODE
    # the Hub's form on this machine reads the agent's inventory (jupyter_gpushare.hub_local)
    from jupyter_gpushare.hub_local import LocalGpuForm

    page = asyncio.run(LocalGpuForm().options_form(None))
    assert "A100 (80GiB) — 1 GPU, up to 1 of a GPU free now" in page
    b = agent(system=False)
    monkeypatch.setenv("GPUSHARE_SOCKET", str(b.socket))
    assert not paths.find_agent(fresh=True).system
    assert not isinstance(GpuShare(socket_path=str(b.socket)).local_ledger(), AgentLedger)


def gpushare_run(socket: str, *argv: str) -> dict[str, Any]:
    """``jupyter gpushare run`` as this user, against the agent named by GPUSHARE_SOCKET."""
    os.environ.update(GPUSHARE_SOCKET=socket, GPUSHARE_NODE_NAME=NODE)
    from jupyter_gpushare.config import GpuShare

    GpuShare.clear_instance()  # a fresh command: no settings an earlier test left in this process
    code = gpushare_cli.main(["run", *argv])
    return {"code": code, "left": asyncio.run(snapshot(socket))}


def test_gpushare_run_as_a_user_goes_through_the_system_agent(agent) -> None:
    """Discovery, placement, the child's pid recorded by the agent, release and the exit code:
    no per-user agent is started and nothing is left in the ledger."""
    alice = unix_user(ALICE)
    a = agent()
    theirs = Path(tempfile.mkdtemp(prefix="gs-h3-run-", dir="/tmp"))
    os.chown(theirs, alice.pw_uid, alice.pw_gid)  # the user's command writes what it saw here
    seen = theirs / "seen"
    script = (
        f"echo $GPUSHARE_ALLOCATION_ID $GPUSHARE_SOCKET > {seen}; "
        f"test -S $GPUSHARE_SOCKET && exit 7"
    )
    outcome = run_as(
        alice, gpushare_run, str(a.socket), "--gpu-request", "0.5", "--", "/bin/sh", "-c", script
    )
    assert outcome[0] == "ok", outcome
    assert outcome[1] == {"code": 7, "left": []}
    allocation_id, socket = seen.read_text().split()
    assert allocation_id.startswith("a-") and socket == str(a.socket)
    shutil.rmtree(theirs)
    agents = [
        p
        for p in psutil.process_iter(["uids", "cmdline"])
        if p.info["uids"]
        and p.info["uids"].real == alice.pw_uid
        and "jupyter_gpushare.daemon" in " ".join(p.info["cmdline"] or [])
    ]
    assert agents == []  # no per-user agent was started


def test_a_jupyter_server_places_its_kernels_through_the_system_agent(
    gpushare_env: dict[str, str], jupyter_server: Any
) -> None:
    """A real jupyter_server finds the system agent on its socket, starts no agent of its own,
    and its kernels' shares are placed, resized and released in the agent's ledger (the
    server's own SQLite file is never made)."""
    from support import wait_for

    from jupyter_gpushare.inventory import local_node_name

    socket = Path(gpushare_env["GPUSHARE_SOCKET"])
    state = socket.parent / "agent-state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    agent_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare.daemon",
            "--system",
            "--socket",
            str(socket),
            "--ledger",
            str(state / "ledger.sqlite"),
            "--simulate",
            "1xA100",
            "--state-dir",
            str(socket.parent / "agent-shm"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        wait_for(lambda: DaemonClient(socket, timeout=1).alive(), timeout=30)
        server = jupyter_server("1xA100")
        kernel = server.start_kernel("gpushare-python")
        [mine] = [a for a in server.allocations() if a["kernel_id"] == kernel["id"]]
        held = asyncio.run(AgentLedger(socket).snapshot()).find(mine["id"])
        assert held is not None and held.node == local_node_name() and held.pid == mine["pid"]
        assert held.extra["uid"] == os.getuid()
        changed = server.request(
            "PATCH", f"/gpushare/api/allocations/{mine['id']}", json={"gpu_limit": 0.75}
        )
        assert changed.status_code == 200, changed.text
        after = asyncio.run(AgentLedger(socket).snapshot()).find(mine["id"])
        assert after is not None and after.limit == 0.75
        assert server.delete(f"/api/kernels/{kernel['id']}").status_code == 204
        wait_for(lambda: asyncio.run(AgentLedger(socket).snapshot()).allocations == ())
        assert not Path(gpushare_env["GPUSHARE_LEDGER"]).exists()
        agents = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "jupyter_gpushare.daemon" in (p.info["cmdline"] or [])
            and str(socket) in (p.info["cmdline"] or [])
        ]
        assert [p.pid for p in agents] == [agent_proc.pid]  # the server started none
    finally:
        agent_proc.send_signal(signal.SIGTERM)
        agent_proc.wait(10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--system", "--kubernetes-namespace", "x"], "--system serves a machine's own SQLite"),
        (["--system", "--max-share", '{"gpu_request": 2}'], "--max-share: gpu_request=2 is not"),
        (["--system", "--max-share", "half"], "--max-share 'half': not JSON share keys"),
        (["--system", "--group-max-share", "nosuchgroup={}"], "nosuchgroup: no such group"),
        (["--system", "--group-max-share", "0.5"], "GROUP=JSON"),
        (["--group", "users"], "--group needs --system"),
    ],
)
def test_bad_system_options_are_refused_by_name(argv: list[str], message: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jupyter_gpushare.daemon",
            *argv,
            "--socket",
            "/nonexistent/gs-h3/daemon.sock",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_systemd_unit_starts_the_system_agent_as_documented() -> None:
    from jupyter_gpushare.daemon import cli as daemon_cli

    unit = (
        Path(__file__).resolve().parents[1]
        / "deploy"
        / "systemd"
        / "jupyter-gpushare-agent.service"
    ).read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    command = settings["ExecStart"].split()
    assert command[0].endswith("jupyter-gpushare") and command[1] == "daemon"
    import argparse

    parser = argparse.ArgumentParser()
    daemon_cli.add_arguments(parser)
    args = parser.parse_args(command[2:])
    assert args.system and daemon_cli.serve_path(args) == paths.SYSTEM_SOCKET
    assert daemon_cli.ledger_file(args) == paths.SYSTEM_LEDGER
    assert settings["RuntimeDirectory"] == paths.SYSTEM_SOCKET.parent.name
    assert settings["RuntimeDirectoryMode"] == "0755"  # what the agent demands of it
    assert settings["StateDirectory"] == paths.SYSTEM_LEDGER.parent.name
    assert settings["StateDirectoryMode"] == "0700"
    for flag in ("--group", "--admin-group", "--max-share"):  # named in the unit's comments
        assert flag in unit and parser.parse_args(["--system", flag, "x"]) is not None


def test_while_the_system_agent_restarts_nobody_starts_a_private_one(agent, monkeypatch) -> None:
    """Discovery of the well-known system socket (pointed at a test agent here): answered, then
    dead with its socket left (kill -9, before systemd restarts it): still the system agent,
    so callers wait for it; gone (service stopped, socket removed): the per-user agent."""
    a = agent()
    monkeypatch.delenv("GPUSHARE_SOCKET", raising=False)
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", a.socket)
    assert paths.find_agent(fresh=True) == paths.AgentAddress(a.socket, True)
    a.proc.kill()
    a.proc.wait(10)
    assert a.socket.exists()
    assert paths.find_agent(fresh=True) == paths.AgentAddress(a.socket, True)
    a.socket.unlink()
    assert not paths.find_agent(fresh=True).system


# -- the authorization rules, pure --------------------------------------------------------


GPU = Gpu(NODE, "GPU-1", 0, "NVIDIA A100", "A100", 80 * GiB)


def record(uid: int, request: float = 0.25, **extra: Any) -> Allocation:
    return Allocation(
        id=Allocation.new_id(),
        node=NODE,
        gpus=(GPU.uuid,),
        spec=ShareSpec(request, request, gpu_memory=GiB),
        memory=GiB,
        server_pid=os.getpid(),
        user=f"u{uid}",
        extra={"uid": uid, **extra},
    )


def test_authorize_rules() -> None:
    me, other = os.getuid(), os.getuid() + 1  # two users; this process is me's
    alice = ledger_ops.Caller(me, "alice", False, frozenset())
    root = ledger_ops.Caller(0, "root", True, frozenset())
    hers, his = record(me), record(other)
    current = [hers, his]

    def go(
        who: ledger_ops.Caller, proposed: list[Allocation], bound: ShareSpec | None = None
    ) -> list[Allocation]:
        return ledger_ops.authorize(current, proposed, who, NODE, [GPU], bound, True)

    redacted = ledger_ops.redact(his)
    assert go(alice, [hers, redacted]) == [hers, his]  # the stored record is kept
    with pytest.raises(ledger_ops.NotPermitted):
        go(alice, [hers])  # removing his
    with pytest.raises(ledger_ops.NotPermitted):
        go(alice, [hers, replace(redacted, gpus=("GPU-2",))])
    with pytest.raises(ledger_ops.NotPermitted):
        go(alice, [replace(hers, extra={"uid": other}), redacted])  # giving hers away
    added = replace(record(other, 0.25), user="mallory")  # claims to be his
    out = go(alice, [hers, redacted, added])
    assert out[-1].extra["uid"] == me and out[-1].user == "alice"
    with pytest.raises(ledger_ops.OverCapacity):
        go(alice, [hers, redacted, record(me, 0.75)])
    for bad in (-1.0, float("nan"), 0.001):  # would fool the capacity sums, or is no share
        sneaky = Allocation.from_json({**record(me).to_json(), "gpu_request": bad})
        with pytest.raises(ShareError, match="gpu_request"):
            go(alice, [hers, redacted, sneaky, record(me, 1.0)])
    with pytest.raises(ShareError, match="gpu_request"):
        go(alice, [hers, redacted, record(me, 0.5)], ShareSpec(0.25, 0.25))
    assert go(root, [hers]) == [hers]  # an admin may release anyone's
    with pytest.raises(ledger_ops.NotPermitted, match="needs its holder"):  # never released
        go(alice, [hers, redacted, replace(record(me), server_pid=None)])
    kept = ledger_ops.authorize(
        current,
        [replace(hers, state="active"), redacted],
        alice,
        NODE,
        [GPU],
        None,
        True,
        Policy(cordoned_gpus=frozenset({GPU.uuid})),
    )
    assert len(kept) == 2  # shares placed before a cordon stay and may change; new ones may not
    with pytest.raises(ledger_ops.NotPermitted, match="cordoned"):
        ledger_ops.authorize(
            [],
            [record(me)],
            alice,
            NODE,
            [GPU],
            None,
            True,
            Policy(cordoned_gpus=frozenset({GPU.uuid})),
        )
    with pytest.raises(ledger_ops.NotPermitted, match="excluded"):
        ledger_ops.authorize(
            [], [record(me)], alice, NODE, [GPU], None, True, Policy(exclude_types=("a100",))
        )
    bounded = record(me)
    bounded = replace(bounded, extra=bounds.record(bounded.extra, ShareSpec(0.25, 0.25)))
    with pytest.raises(ShareError):
        ledger_ops.authorize(
            [bounded],
            [replace(bounded, spec=ShareSpec(0.5, 0.5, GiB))],
            alice,
            NODE,
            [GPU],
            None,
            True,
        )


def test_who_may_use_the_agent_and_which_bound_applies() -> None:
    class FakeDaemon:  # ledger_ops keeps its Access per daemon object
        pass

    daemon: Any = FakeDaemon()
    group_bound, agent_bound = ShareSpec(0.5, 0.5), ShareSpec(0.75, 1.0, gpu_memory=40 * GiB)
    ledger_ops.configure(
        daemon,
        ledger_ops.Access(
            system=True, user_gid=4242, max_share=agent_bound, group_bounds={4242: group_bound}
        ),
    )
    member = ledger_ops.Caller(1001, "alice", False, frozenset({4242}))
    outsider = ledger_ops.Caller(1002, "bob", False, frozenset({100}))
    root = ledger_ops.Caller(0, "root", True, frozenset())
    assert ledger_ops.may_use(daemon, member) is None
    assert ledger_ops.may_use(daemon, root) is None
    refusal = ledger_ops.may_use(daemon, outsider)
    assert refusal is not None and refusal["error"] == "not_permitted"
    assert "bob is not in group" in refusal["message"]
    hub = ShareSpec(0.25, 1.0)
    applied = ledger_ops.bound_for(daemon, member, hub)
    assert applied is not None
    assert (applied.gpu_request, applied.gpu_limit, applied.gpu_memory) == (0.25, 0.5, 40 * GiB)
    alone = ledger_ops.bound_for(daemon, root, None)
    assert alone is not None and (alone.gpu_request, alone.gpu_limit) == (0.75, 1.0)
    # a per-user agent serves its own user only
    ledger_ops.configure(daemon, ledger_ops.Access(system=False))
    assert ledger_ops.may_use(daemon, member) is not None


def test_a_kept_record_is_the_stored_one() -> None:
    his = record(1002)
    (kept,) = ledger_ops._parse_allocations([{"id": his.id, "keep": True}], [his])
    assert kept is his
    with pytest.raises(ShareError, match=r"allocations\[0\]\.id"):
        ledger_ops._parse_allocations([{"id": "a-nothere", "keep": True}], [his])
    with pytest.raises(ShareError, match="each allocation id once"):
        ledger_ops._parse_allocations([his.to_json(), his.to_json()], [his])
    with pytest.raises(ShareError, match=r"allocations\[0\]"):
        ledger_ops._parse_allocations([{"id": "a-1", "gpu_request": "lots"}], [])


def test_tightest_bound() -> None:
    hub = ShareSpec(0.5, 1.0, gpu_memory=40 * GiB)
    admin = ShareSpec(0.75, 0.75)
    both = bounds.tightest([hub, admin, None])
    assert both is not None
    assert (both.gpu_request, both.gpu_limit, both.gpu_memory) == (0.5, 0.75, 40 * GiB)
    assert bounds.tightest([None]) is None
    with pytest.raises(ShareError, match="gpu_type"):
        bounds.tightest([ShareSpec(gpu_type="A100"), ShareSpec(gpu_type="T4")])
