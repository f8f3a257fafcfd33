"""Lease memory that only its owner can touch (issue 12), as real Unix users (``useradd``).

- The agent's state directory is private (0700, its own, checked with ``lstat``); a directory or
  symlinks another user planted at the predictable name are neither followed, nor chmod-ed, nor
  truncated: the agent refuses them (``--state-dir``) or moves to a fresh unpredictable directory.
- No file of the agent's is group- or world-writable.
- A co-tenant (a second allocation on the same GPU, run as another uid) gets only its own share's
  memory as descriptors: the policy read-only (a writable mapping fails with ``EACCES``, and so
  does reopening it read-write), its own account, never the first share's; the first share keeps
  launching and keeps its cap.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from enforcement_support import (
    NODE,
    DaemonProc,
    GiB,
    _spawn_daemon,
    add_allocation,
    set_pid,
    spawn_tenant,
)
from support import python_for

from jupyter_gpushare.daemon import wire
from jupyter_gpushare.daemon.shm import StateDir, StateDirError
from jupyter_gpushare.ledger.sqlite import SQLiteLedger

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (useradd, other users' files)"),
]

VICTIM_TEXT = "echo 'the victim shell rc file'\n"


def unix_user(name: str) -> pwd.struct_passwd:
    """A real system user (made with ``useradd`` when missing)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=False,
            stderr=subprocess.DEVNULL,
        )
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.skip(f"could not create the user {name} (useradd)")


@pytest.fixture
def work() -> Iterator[Path]:
    """A root-owned 0755 directory in /tmp (pytest's tmp_path is 0700: other users could not
    reach a socket there)."""
    path = Path(tempfile.mkdtemp(prefix="gs-privacy-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def daemon_args(work: Path, state_dir: Path | None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jupyter_gpushare.daemon",
        "--socket",
        str(work / "daemon.sock"),
        "--ledger",
        str(work / "ledger.sqlite"),
        "--node",
        NODE,
        "--simulate-devices",
        "1xA100",
        "--quantum-ms",
        "20",
        "--window-ms",
        "1000",
        "--poll-ms",
        "100",
        *(["--state-dir", str(state_dir)] if state_dir is not None else []),
    ]


def start(work: Path, state_dir: Path | None) -> DaemonProc:
    return _spawn_daemon(
        daemon_args(work, state_dir),
        work / "daemon.sock",
        work / "ledger.sqlite",
        state_dir or work / "unused",
        work / "daemon.log",
    )


def wait_for_share(daemon: DaemonProc, allocation_id: str) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = daemon.client.status(allocation_id)
        if found.get("ok") and found["allocations"] and found["allocations"][0]["gpus"]:
            return found
        time.sleep(0.05)
    raise AssertionError(f"the agent never took up {allocation_id}: {found}")


def victim_file(work: Path) -> Path:
    victim = work / "victim-bashrc"
    victim.write_text(VICTIM_TEXT)
    victim.chmod(0o644)
    return victim


def assert_intact(victim: Path) -> None:
    st = os.lstat(victim)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644, oct(st.st_mode)
    assert victim.read_text() == VICTIM_TEXT


def plant(directory: Path, victim: Path, uuid: str, owner: pwd.struct_passwd) -> list[Path]:
    """What another user can do at a predictable name: a world-writable directory of theirs
    with symlinks to the victim's file under every name the agent uses or used."""
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    os.chown(directory, owner.pw_uid, owner.pw_gid)
    links = []
    for name in (f"{uuid}.shm", f"{uuid}.board", f"{uuid}.policy", f"{uuid}.0.account"):
        link = directory / name
        link.symlink_to(victim)
        os.lchown(link, owner.pw_uid, owner.pw_gid)
        links.append(link)
    return links


def test_planted_state_dir_is_not_used_and_nothing_is_followed(built, gpus, work, monkeypatch):
    mallory = unix_user("gs-mallory")
    victim = victim_file(work)
    socket = work / "daemon.sock"
    digest = hashlib.sha1(str(socket.resolve()).encode()).hexdigest()[:12]
    planted = Path("/dev/shm") / f"gpushare-{os.geteuid()}-{digest}"
    shutil.rmtree(planted, ignore_errors=True)
    links = plant(planted, victim, gpus[0].uuid, mallory)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    daemon = start(work, None)
    used = None
    try:
        ledger = SQLiteLedger(daemon.ledger_path)
        share = add_allocation(ledger, gpus[0], 0.5, 0.5, memory=3 * GiB)
        wait_for_share(daemon, share.id)
        used = Path(daemon.client.status()["gpus"][0]["state_dir"])
        tenant = spawn_tenant(daemon, ledger, share, gpus, ["info"], work)
        (info,) = tenant.finish()
        assert tenant.proc.returncode == 0, tenant.stderr
        assert info["total"] == 3 * GiB  # the share works from the fresh directory
    finally:
        daemon.stop()
        log = daemon.log.read_text()
    try:
        assert_intact(victim)
        st = os.lstat(planted)  # untouched: still the attacker's, still 0777, links in place
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (mallory.pw_uid, 0o777)
        for link in links:
            assert link.is_symlink() and os.readlink(link) == str(victim)
        assert used != planted and used.name.startswith(planted.name + "-"), used
        st = os.lstat(used)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o700
        assert f"refusing state directory {planted}" in log and "gs-mallory" in log, log
    finally:
        shutil.rmtree(planted, ignore_errors=True)
        if used is not None:
            shutil.rmtree(used, ignore_errors=True)


def test_a_prepared_state_dir_option_is_refused_by_name(built, gpus, work):
    mallory = unix_user("gs-mallory")
    victim = victim_file(work)
    planted = work / "state"
    plant(planted, victim, gpus[0].uuid, mallory)
    done = subprocess.run(
        daemon_args(work, planted),
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    assert done.returncode == 2, done.stderr
    assert f"refusing state directory {planted}" in done.stderr, done.stderr
    assert "gs-mallory" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert_intact(victim)
    assert stat.S_IMODE(os.lstat(planted).st_mode) == 0o777  # not chmod-ed either


def test_state_files_are_never_followed(work):
    """Even inside the agent's own directory a symlink is replaced, not followed, and a file of
    the wrong size or owner is replaced by a new one (``O_EXCL``), never truncated in place."""
    victim = victim_file(work)
    state = StateDir(work / "state")
    try:
        (work / "state" / "GPU-x.board").symlink_to(victim)
        fd, reused = state.open_file("GPU-x.board", wire.FILE_SIZE)
        os.close(fd)
        assert not reused
        st = os.lstat(work / "state" / "GPU-x.board")
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == wire.FILE_SIZE
        assert_intact(victim)
        other = work / "state" / "GPU-x.policy"
        other.write_bytes(b"x" * wire.FILE_SIZE)
        os.chown(other, 65534, 65534)  # someone else's (nobody's)
        fd, reused = state.open_file("GPU-x.policy", wire.FILE_SIZE)
        os.close(fd)
        assert not reused and os.lstat(other).st_uid == os.geteuid()
        with pytest.raises(StateDirError, match="plain file name"):
            state.open_file("../escape", wire.FILE_SIZE)
    finally:
        state.close()


def test_an_open_runtime_dir_is_not_trusted(work, monkeypatch):
    from jupyter_gpushare.daemon.server import default_state_dir

    shared = work / "runtime"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shared))
    chosen = default_state_dir(work / "daemon.sock")
    try:
        assert not chosen.is_relative_to(shared)
        assert stat.S_IMODE(os.lstat(chosen).st_mode) == 0o700
    finally:
        if chosen.is_relative_to("/dev/shm"):
            shutil.rmtree(chosen, ignore_errors=True)
    private = work / "private-runtime"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(private))
    assert default_state_dir(work / "daemon.sock").is_relative_to(private / "gpushare")


def test_no_agent_file_is_group_or_world_writable(built, gpus, work):
    state_dir = work / "state"
    daemon = start(work, state_dir)
    try:
        ledger = SQLiteLedger(daemon.ledger_path)
        share = add_allocation(ledger, gpus[0], 0.5, 0.5, memory=GiB)
        wait_for_share(daemon, share.id)
        tenant = spawn_tenant(
            daemon, ledger, share, gpus, ["mem", "2", "50", str(2**20), "1"], work
        )
        tenant.finish()
        assert tenant.proc.returncode == 0, tenant.stderr
        st = os.lstat(state_dir)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        names = sorted(p.name for p in state_dir.iterdir())
        assert {f"{gpus[0].uuid}.board", f"{gpus[0].uuid}.policy"} <= set(names), names
        assert any(n.endswith(".account") for n in names), names
        for path in state_dir.iterdir():
            st = os.lstat(path)
            assert stat.S_ISREG(st.st_mode), path
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid(), path
        assert not os.lstat(work).st_mode & 0o022
        # the socket's directory: the socket is how others connect; sim.state is the simulated
        # GPU itself (the stand-in for /dev/nvidiaN, which is 0666 too), not the agent's state
        for path in work.iterdir():
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) and path.name != "sim.state":
                assert not st.st_mode & 0o022, (path, oct(st.st_mode))
    finally:
        daemon.stop()


COTENANT = r"""
import errno, fcntl, json, mmap, os, socket, sys

sock_path, mine, theirs, state_dir = sys.argv[1:5]
VERSION, FILE_SIZE, HEADER, SLOT = (int(x) for x in sys.argv[5:9])
sys.stdin.readline()  # the test recorded our pid as the share's process


def hello(allocation):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.sendall(json.dumps({"op": "hello", "v": VERSION, "allocation": allocation,
                          "pid": os.getpid()}).encode() + b"\n")
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, got, _flags, _addr = socket.recv_fds(s, 65536, 16)
        if not chunk:
            break
        data += chunk
        fds += got
    return s, json.loads(data), fds


def errno_of(action):
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, exc.errno)
    return None


out = {}
conn, reply, fds = hello(mine)
out["reply_ok"] = reply.get("ok")
out["fds"] = len(fds)
gpu = reply["gpus"][0]
board, policy, account = (fds[gpu[k]] for k in ("board", "policy", "account"))
out["slot"] = gpu["slot"]
out["access"] = {k: fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
                 for k, fd in (("board", board), ("policy", policy), ("account", account))}
out["account_ino"] = os.fstat(account).st_ino
out["policy_map_writable"] = errno_of(
    lambda: mmap.mmap(policy, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
out["policy_reopen_rw"] = errno_of(lambda: os.open(f"/proc/self/fd/{policy}", os.O_RDWR))
view = mmap.mmap(policy, FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
base = HEADER + gpu["slot"] * SLOT
out["my_cap"] = int.from_bytes(view[base + 32:base + 40], "little")
out["my_allocation"] = view[base + 112:base + 144].rstrip(b"\0").decode()
out["state_dir_list"] = errno_of(lambda: os.listdir(state_dir))
out["state_file_open"] = errno_of(
    lambda: os.open(os.path.join(state_dir, gpu["uuid"] + ".policy"), os.O_RDWR))
_c, refused, other_fds = hello(theirs)
out["theirs"] = {"ok": refused.get("ok"), "error": refused.get("error"), "fds": len(other_fds)}
print(json.dumps(out), flush=True)
sys.stdin.readline()
"""


def test_a_cotenant_cannot_write_another_share(built, gpus, work):
    mallory = unix_user("gs-cotenant")
    state_dir = work / "state"
    daemon = start(work, state_dir)
    cotenant = None
    try:
        ledger = SQLiteLedger(daemon.ledger_path)
        first = add_allocation(ledger, gpus[0], 0.5, 0.5, memory=2 * GiB)
        second = add_allocation(ledger, gpus[0], 0.3, 0.3, memory=GiB)
        wait_for_share(daemon, first.id)
        wait_for_share(daemon, second.id)
        honest = spawn_tenant(daemon, ledger, first, gpus, ["spin", "3", "1000", "8"], work)
        cotenant = subprocess.Popen(
            [
                python_for(mallory),
                "-c",
                COTENANT,
                str(daemon.socket),
                second.id,
                first.id,
                str(state_dir),
                str(wire.VERSION),
                str(wire.FILE_SIZE),
                str(wire.HEADER_SIZE),
                str(wire.SLOT_SIZE),
            ],
            user=mallory.pw_uid,
            group=mallory.pw_gid,
            extra_groups=[],
            cwd="/",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        set_pid(ledger, second.id, cotenant.pid)
        assert cotenant.stdin is not None and cotenant.stdout is not None
        cotenant.stdin.write("go\n")
        cotenant.stdin.flush()
        line = cotenant.stdout.readline()
        assert line.startswith("{"), cotenant.stderr.read() if cotenant.stderr else line
        seen = json.loads(line)

        assert seen["reply_ok"] is True and seen["fds"] == 3
        assert seen["access"] == {"board": os.O_RDWR, "policy": os.O_RDONLY, "account": os.O_RDWR}
        assert seen["policy_map_writable"] == "EACCES"
        assert seen["policy_reopen_rw"] == "EACCES"
        assert seen["state_dir_list"] == "EACCES"
        assert seen["state_file_open"] == "EACCES"
        assert seen["my_cap"] == GiB and seen["my_allocation"] == second.id[:31]
        # the first share's descriptors never reach it: its hello for that share is refused
        assert seen["theirs"] == {"ok": False, "error": wire.E_NOT_PERMITTED, "fds": 0}
        status = daemon.client.status()
        slots = {a["id"]: a["gpus"][0]["slot"] for a in status["allocations"]}
        uuid = gpus[0].uuid
        assert seen["slot"] == slots[second.id] != slots[first.id]
        first_account = os.lstat(state_dir / f"{uuid}.{slots[first.id]}.account")
        second_account = os.lstat(state_dir / f"{uuid}.{slots[second.id]}.account")
        assert seen["account_ino"] == second_account.st_ino != first_account.st_ino

        lines = honest.finish()
        assert honest.proc.returncode == 0, honest.stderr
        assert sum(1 for x in lines if "t" in x) > 0  # it kept launching
        mine = daemon.client.status(first.id)["allocations"][0]["gpus"][0]
        assert mine["memory_cap"] == 2 * GiB
        assert daemon.client.status(first.id)["ok"]
    finally:
        if cotenant is not None:
            cotenant.kill()
            cotenant.wait(10)
        daemon.stop()


def test_installing_the_interposer_writes_through_no_prepared_name(built, work):
    """The DaemonSet's init container copies the libraries into a host directory: a symlink
    planted at the temporary name the copy used to take (``.<name>.tmp-<pid>``) is not followed."""
    from jupyter_gpushare.daemon.install_lib import install

    victim = victim_file(work)
    target = work / "lib"
    target.mkdir()
    (target / f".libgpushare.so.tmp-{os.getpid()}").symlink_to(victim)
    written = install(target)
    assert target / "libgpushare.so" in written
    assert_intact(victim)
    for path in written:
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644, path
    assert not [p for p in target.rglob("*.tmp") if p.is_file()]


def test_a_reused_slot_gets_a_new_account(tmp_path):
    """A slot given to a new allocation gets a new account file: what a former holder's process
    still maps is the old one, so it cannot give back (or take) its successor's memory. An agent
    restart reuses the accounts of active slots (memory already reserved is kept)."""
    import mmap

    from jupyter_gpushare.daemon.shm import GpuShm

    state = StateDir(tmp_path / "state")
    shm = GpuShm(state, "GPU-test", 20_000_000, 1_000_000_000)
    try:
        first = shm.claim("a-first", 0.5, 0.5, GiB, set())
        assert first is not None
        old_fd = os.dup(shm.account_fd(first))
        old = mmap.mmap(old_fd, wire.ACCOUNT_SIZE, mmap.MAP_SHARED)
        old_view = wire.Slot.from_buffer(old)
        old_view.mem_used = 123
        assert shm.account(first).mem_used == 123
        for i in range(wire.SLOTS - 1):  # every other slot taken
            assert shm.claim(f"a-other-{i}", 0.01, 0.01, GiB, set()) is not None
        shm.release(first)
        again = shm.claim("a-second", 0.25, 0.25, GiB // 2, set())
        assert again == first  # the only released slot is reused ...
        assert os.fstat(shm.account_fd(again)).st_ino != os.fstat(old_fd).st_ino
        assert shm.account(again).mem_used == 0  # ... with a fresh account
        old_view.mem_used = 2**40  # the former holder's mapping writes on
        assert shm.account(again).mem_used == 0
        shm.account(again).mem_used = 4096
        assert shm.policy[again].allocation == b"a-second"
        assert shm.policy[again].mem_cap == GiB // 2
        del old_view
        old.close()
        os.close(old_fd)
    finally:
        shm.close()
    restarted = GpuShm(state, "GPU-test", 20_000_000, 1_000_000_000)
    try:
        assert restarted.reused and restarted.slot_of("a-second") == again
        assert restarted.account(again).mem_used == 4096
        assert restarted.board[again].lease_until_ns == 0
    finally:
        restarted.close()
        state.close()


def test_a_stopped_agent_keeps_live_shares_memory_and_leaves_nothing_else(built, gpus, work):
    from enforcement_support import remove_allocation, restart_daemon

    state_dir = work / "state"
    daemon = start(work, state_dir)
    try:
        ledger = SQLiteLedger(daemon.ledger_path)
        share = add_allocation(ledger, gpus[0], 0.5, 0.5, memory=GiB)
        wait_for_share(daemon, share.id)
        daemon.stop()  # SIGTERM with a live share: its memory account stays for the next agent
        assert f"{gpus[0].uuid}.board" in os.listdir(state_dir)
        daemon = restart_daemon(daemon)
        wait_for_share(daemon, share.id)
        remove_allocation(ledger, share.id)
        deadline = time.monotonic() + 20
        while daemon.client.status()["allocations"] and time.monotonic() < deadline:
            time.sleep(0.05)
        daemon.stop()  # nothing left to keep: the files and the directory go
        assert not state_dir.exists(), os.listdir(state_dir)
    finally:
        daemon.stop()
