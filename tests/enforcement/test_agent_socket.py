"""The node agent's socket under hostile local users (issue 12): bounded memory per client,
connection caps, idle timeouts, the descriptor reserve, ``status`` showing only the caller's own
shares, and the ledger-failure log that does not flood. Clients are real Unix users
(``agent_abuse_support.py``); the tight latency figure is in benchmarks/agent_abuse.py."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import replace

import psutil
import pytest
from agent_abuse_support import (
    FLOOD,
    GARBAGE,
    HELLO_FLOOD,
    HOLD,
    HONEST,
    IDLE,
    STATUS,
    finish,
    percentile,
    raise_own_fd_limit,
    read_json,
    record,
    run_as,
    shared_dir,
    start_agent,
    unix_user,
)
from enforcement_support import add_allocation, shares, spawn_tenant

from jupyter_gpushare.daemon.admission import Admins, Admission, Peer, read_peer
from jupyter_gpushare.daemon.ratelog import RateLimitedLog
from jupyter_gpushare.ledger.sqlite import SQLiteLedger

MB = 2**20


class _Sampler(threading.Thread):
    """The agent's peak RSS and descriptor count while it runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.rss = 0
        self.fds = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.rss = max(self.rss, self.process.memory_info().rss)
                self.fds = max(self.fds, self.process.num_fds())
            except psutil.Error:
                return
            time.sleep(0.05)

    def stop(self) -> None:
        self.done.set()
        self.join(5)


def test_abuse_leaves_the_agent_small_and_an_honest_kernel_served(built, gpus):
    """A ping flood that never reads (1M asked), 5,000 idle connections of another user, garbage
    frames, all at once, while an honest kernel of a third user says hello and keeps asking for
    its own status, and an interposed tenant keeps launching at its 0.5 share."""
    raise_own_fd_limit()
    honest_user, idle_user, rough_user = (
        unix_user(n) for n in ("gsagent-a", "gsagent-b", "gsagent-c")
    )
    directory = shared_dir()
    agent = start_agent(directory)
    sampler = _Sampler(agent.proc.pid)
    try:
        ledger = SQLiteLedger(agent.ledger_path)
        base_fds = psutil.Process(agent.proc.pid).num_fds()
        sampler.start()
        honest = run_as(honest_user, HONEST, str(agent.socket), "6")
        mine = record(
            ledger,
            gpus[0],
            pid=honest.pid,
            uid=honest_user.pw_uid,
            user=honest_user.pw_name,
            kernel_id="k-honest",
        )
        share = add_allocation(ledger, gpus[0], 0.5, 0.5)
        agent.client.refresh()

        idle = run_as(idle_user, IDLE, str(agent.socket), "5000")
        opened = read_json(idle)
        flood = run_as(rough_user, FLOOD, str(agent.socket), "1000000")
        flooded = read_json(flood)
        garbage = run_as(rough_user, GARBAGE, str(agent.socket))
        tenant = spawn_tenant(agent, ledger, share, gpus, ["spin", "5", "1000", "8"], directory)
        assert honest.stdin is not None
        honest.stdin.write(mine.id + "\n")
        honest.stdin.flush()
        served = read_json(honest)
        tenant.finish()
        idle_left = finish(idle)
        junk = finish(garbage)
        finish_flood = flood
        assert finish_flood.stdin is not None
        finish_flood.stdin.close()
        flood.wait(30)
    finally:
        sampler.stop()
        agent.stop()
    log = agent.log.read_text()

    # the flood: the agent stopped reading long before 1M requests (memory bounded per client)
    assert flooded.get("sent_requests", 0) < 1_000_000, flooded
    # 5,000 idle connections of one uid: at most 256 kept (the per-uid cap), the rest closed
    assert opened["connected"] + opened["failed"] == 5000, opened
    assert idle_left["still_open"] <= 256, idle_left
    # garbage: answered at most 16 times in a row, then the connection is closed
    assert junk["connections"] >= 1 and junk["unclosed"] == 0, junk
    assert junk["max_answers"] <= 16, junk
    # the agent stayed small, and its descriptors bounded
    assert sampler.rss < 100 * MB, f"agent RSS {sampler.rss / MB:.0f} MB\n{log[-3000:]}"
    assert sampler.fds <= base_fds + 256 + 64, (sampler.fds, base_fds)
    # the honest kernel was served all along (tight figures: benchmarks/agent_abuse.py)
    assert served["hello"] and served["n_errors"] == 0, served
    assert len(served["status_ms"]) >= 50, len(served["status_ms"])
    p99 = percentile(served["status_ms"] + served["ping_ms"], 0.99)
    assert p99 <= 50, f"honest round trip p99 {p99:.1f} ms"
    # and the tenant kept its share (the agent's lease loop was not starved)
    t0 = tenant.lines[0]["start"] + int(1.5e9)
    (got,) = shares([tenant], t0, t0 + int(3e9))
    assert 0.4 <= got <= 0.56, got
    assert "Traceback" not in log, log[-3000:]
    assert log.count("refused a connection") <= 3, log[-3000:]
    shutil.rmtree(directory, ignore_errors=True)


def test_status_shows_each_user_only_their_own_shares(built, gpus):
    """User B's ``status`` has none of A's allocation id, kernel id or PID; B sees its shares by
    uid, by user name (records without a uid) and by process; root and the admin group see
    all; B cannot ask for A's allocation by id."""
    user_a, user_b = unix_user("gsagent-a"), unix_user("gsagent-b")
    admin = unix_user("gsagent-d", groups=("gsagentadm",))
    directory = shared_dir()
    agent = start_agent(directory, "--admin-group", "gsagentadm")
    try:
        ledger = SQLiteLedger(agent.ledger_path)
        ledger.put_gpus_sync(gpus[0].node, gpus)  # for the kernel's ``gpus`` op
        ask_a = run_as(user_a, STATUS, str(agent.socket))
        ask_b = run_as(user_b, STATUS, str(agent.socket))
        ask_b_for_a = run_as(user_b, STATUS, str(agent.socket))
        ask_b_gpus = run_as(user_b, STATUS, str(agent.socket))
        ask_admin = run_as(admin, STATUS, str(agent.socket))
        a = record(
            ledger,
            gpus[0],
            pid=ask_a.pid,
            uid=user_a.pw_uid,
            user=user_a.pw_name,
            kernel_id="k-of-user-a",
        )
        b_uid = record(ledger, gpus[0], pid=None, uid=user_b.pw_uid, user=user_a.pw_name)
        b_name = record(ledger, gpus[0], pid=None, user=user_b.pw_name)
        b_process = record(ledger, gpus[0], pid=ask_b.pid, user="somebody-else")
        agent.client.refresh()
        everything = {a.id, b_uid.id, b_name.id, b_process.id}

        def ask(proc, allocation=""):
            assert proc.stdin is not None
            proc.stdin.write(allocation + "\n")
            proc.stdin.flush()
            reply = read_json(proc)
            proc.wait(30)
            return reply

        seen_b = ask(ask_b)
        seen_a = ask(ask_a)
        b_for_a = ask(ask_b_for_a, a.id)
        b_gpus = ask(ask_b_gpus, '{"op": "gpus"}')
        seen_admin = ask(ask_admin)
        seen_root = agent.client.status()
    finally:
        agent.stop()
        shutil.rmtree(directory, ignore_errors=True)

    ids = lambda reply: {x["id"] for x in reply["allocations"]}  # noqa: E731
    assert ids(seen_b) == {b_uid.id, b_name.id, b_process.id}, seen_b
    text = str(seen_b)
    assert a.id not in text and "k-of-user-a" not in text and str(ask_a.pid) not in text
    [gpu] = seen_b["gpus"]  # the GPU's totals are shown, the others' shares are not named
    assert gpu["shares"] == 4 and abs(gpu["reserved_request"] - 0.8) < 1e-6, gpu
    assert set(gpu["allocations"]) == ids(seen_b) and gpu["holder"] in (None, *ids(seen_b))
    assert ids(seen_a) == {a.id}, seen_a
    assert b_for_a["ok"] is False and b_for_a["error"] == "unknown_allocation", b_for_a
    assert a.id not in str({k: v for k, v in b_for_a.items() if k != "message"})
    assert ids(seen_root) == everything and ids(seen_admin) == everything, seen_admin
    [row] = b_gpus["gpus"]  # the kernel's `gpus` op: free capacity, only its own ids
    assert row["shares"] == 4 and abs(row["free_request"] - 0.2) < 1e-6, row
    # (another process of B's: b_process is the first one's, by its PID)
    assert set(row["allocations"]) == {b_uid.id, b_name.id} and a.id not in str(b_gpus), b_gpus


def test_idle_connections_time_out_but_share_holders_stay(built, gpus):
    user_a, user_b = unix_user("gsagent-a"), unix_user("gsagent-b")
    directory = shared_dir()
    agent = start_agent(directory, "--idle-timeout", "1")
    try:
        ledger = SQLiteLedger(agent.ledger_path)
        holder = run_as(user_a, HOLD, str(agent.socket), "3")
        mine = record(ledger, gpus[0], pid=holder.pid, uid=user_a.pw_uid)
        agent.client.refresh()
        idle = run_as(user_b, IDLE, str(agent.socket), "3")
        assert read_json(idle)["connected"] == 3
        assert holder.stdin is not None
        holder.stdin.write(mine.id + "\n")
        holder.stdin.flush()
        held = read_json(holder)
        left = finish(idle)
    finally:
        agent.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert left["still_open"] == 0, left  # sent nothing for 1 s: closed
    assert held == {"hello": True, "pinged": True, "kept_served": True, "other_closed": True}


def test_descriptors_are_kept_for_share_holders(built, gpus):
    """With 400 descriptors and 150 of them reserved, a user without a share cannot take the
    last 150 (though under its per-uid cap); a user holding a share and root still connect."""
    raise_own_fd_limit()
    user_a, user_b = unix_user("gsagent-a"), unix_user("gsagent-b")
    directory = shared_dir()
    agent = start_agent(
        directory, "--fd-reserve", "150", "--max-connections-per-uid", "1000", nofile=400
    )
    try:
        ledger = SQLiteLedger(agent.ledger_path)
        honest = run_as(user_a, HONEST, str(agent.socket), "1")
        mine = record(ledger, gpus[0], pid=honest.pid, uid=user_a.pw_uid)
        agent.client.refresh()
        idle = run_as(user_b, IDLE, str(agent.socket), "600")
        read_json(idle)
        assert honest.stdin is not None
        honest.stdin.write(mine.id + "\n")
        honest.stdin.flush()
        served = read_json(honest)
        root_ok = agent.client.alive()
        fds = psutil.Process(agent.proc.pid).num_fds()
        left = finish(idle)
    finally:
        agent.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert 0 < left["still_open"] <= 400 - 150, left
    assert fds <= 400 - 150 + 8, fds
    assert served["hello"] and served["n_errors"] == 0 and served["status_ms"], served
    assert root_ok


def test_a_broken_ledger_is_logged_once_a_minute_not_every_poll(built, tmp_path):
    agent = start_agent(tmp_path)  # polls the ledger every 100 ms
    try:
        broken = tmp_path / "ledger.sqlite.away"
        agent.ledger_path.rename(broken)
        agent.ledger_path.write_bytes(b"not a database " * 512)
        # the agent's cache is read again within its 5 s TTL; from then on every poll fails
        deadline = time.monotonic() + 20
        while "reading the ledger failed" not in agent.log.read_text():
            assert time.monotonic() < deadline, agent.log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(3)  # ~30 more failed reads, none of them logged
        during = agent.log.read_text()
        agent.ledger_path.unlink()
        broken.rename(agent.ledger_path)
        deadline = time.monotonic() + 10
        while "working again" not in agent.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        after = agent.log.read_text()
    finally:
        agent.stop()
    failures = [line for line in during.splitlines() if "reading the ledger failed" in line]
    assert len(failures) == 1, during[-3000:]
    assert "database" in failures[0]  # the reason is in the line
    assert "Traceback" not in during
    assert "reading the ledger failed: working again" in after, after[-2000:]


def test_rate_limited_log_counts_what_it_did_not_write(caplog):
    now = [0.0]
    log = RateLimitedLog(
        logging.getLogger("test.ratelog"),
        "reading the ledger failed",
        every=60.0,
        clock=lambda: now[0],
    )
    with caplog.at_level(logging.INFO, logger="test.ratelog"):
        for _ in range(4 * 60 * 4):  # four minutes of failures every 250 ms
            log.failed("database is locked", ValueError("x"))
            now[0] += 0.25
        log.ok()
        log.ok()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + 3 + 1, lines
    assert lines[0] == "reading the ledger failed: database is locked"
    assert "240 times in the last 60 s" in lines[1], lines
    assert lines[-1] == "reading the ledger failed: working again"
    assert not any(r.exc_info for r in caplog.records)


def test_admission_caps_per_uid_and_pod_and_keeps_the_reserve():
    opened = [20]
    admission = Admission(
        per_uid=2, per_pod=1, reserve=10, fd_limit=lambda: 1000, open_fds=lambda: opened[0]
    )
    user = Peer(pid=10, uid=1234, gid=1234, pod=None, admin=False)
    root = Peer(pid=11, uid=0, gid=0, pod=None, admin=True)
    in_pod = Peer(
        pid=12, uid=1234, gid=1234, pod="0f0e0d0c-0b0a-0908-0706-050403020100", admin=False
    )
    other_pod = replace(in_pod, pod="10101010-2020-3030-4040-505050505050")
    never = lambda: False  # noqa: E731
    assert admission.admit(user, never) is None and admission.admit(user, never) is None
    refusal = admission.admit(user, never)
    assert refusal is not None and "uid 1234 already has 2 connections" in refusal
    assert all(admission.admit(root, never) is None for _ in range(5))  # uid 0: not capped
    assert admission.admit(in_pod, never) is None  # a pod is counted as itself, not its uid
    assert admission.admit(in_pod, never) is not None
    assert admission.admit(other_pod, never) is None
    admission.left(user)
    assert admission.admit(user, never) is None
    assert admission.refused == 2

    near_full = [995]
    tight = Admission(
        per_uid=100, per_pod=100, reserve=10, fd_limit=lambda: 1000, open_fds=lambda: near_full[0]
    )
    refusal = tight.admit(user, never)
    assert refusal is not None and "short of file descriptors" in refusal
    assert tight.admit(user, lambda: True) is None  # holds a share here
    assert tight.admit(root, never) is None
    near_full[0] = 500
    assert tight.admit(user, never) is None


def test_read_peer_takes_the_identity_from_the_kernel():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = read_peer(a, Admins())
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert peer.start == pytest.approx(psutil.Process().create_time(), abs=0.02)
    assert peer.admin is (os.getuid() == 0 or os.getuid() == os.geteuid())
    assert peer.counted_as == f"uid {os.getuid()}"


def test_admin_group_members_are_admins():
    member = unix_user("gsagent-d", groups=("gsagentadm",))
    stranger = unix_user("gsagent-b")
    admins = Admins("gsagentadm")
    assert admins.admits(member.pw_uid, member.pw_gid)
    assert not admins.admits(stranger.pw_uid, stranger.pw_gid)
    assert admins.admits(0, 0)


def test_a_hello_flood_neither_floods_the_log_nor_delays_an_honest_hello(built, gpus):
    """64 connections of another user keep saying hello for allocations that are not theirs
    (each refusal re-reads the ledger first); an honest kernel whose allocation the agent has
    not read yet (it polls once a minute here) still gets its hello answered at once, and the
    refusals are summarized in the log, not written one by one."""
    honest_user, rough_user = unix_user("gsagent-a"), unix_user("gsagent-c")
    directory = shared_dir()
    agent = start_agent(directory, "--poll-ms", "60000")
    try:
        ledger = SQLiteLedger(agent.ledger_path)
        flood = run_as(rough_user, HELLO_FLOOD, str(agent.socket), "64")
        time.sleep(2)
        honest = run_as(honest_user, HONEST, str(agent.socket), "1")
        mine = record(ledger, gpus[0], pid=honest.pid, uid=honest_user.pw_uid)
        assert honest.stdin is not None
        honest.stdin.write(mine.id + "\n")  # not refreshed: its hello makes the agent read
        honest.stdin.flush()
        served = read_json(honest)
        time.sleep(1)
        flooded = finish(flood)
    finally:
        agent.stop()
    log = agent.log.read_text()
    shutil.rmtree(directory, ignore_errors=True)
    assert flooded["answered"] >= 100, flooded
    assert served["hello"] is True and served["n_errors"] == 0, served
    assert served["hello_ms"] < 1000, served["hello_ms"]
    assert log.count("refused a process") <= 2, log[-3000:]


def test_whose_shares_a_caller_sees(tmp_path):
    """``Daemon.caller_shares`` on plain records: a kernel pod's record only to a process in that
    pod; a record's uid wins over its user name; a process sees its own record and its parent's
    (not one whose PID was reused: another start time)."""
    from jupyter_gpushare.daemon.server import Daemon, DaemonSettings
    from jupyter_gpushare.ledger import Allocation
    from jupyter_gpushare.share import ShareSpec

    daemon = Daemon(None, DaemonSettings(socket_path=tmp_path / "s.sock", node="n"))  # type: ignore[arg-type]
    spec = ShareSpec(gpu_request=0.1, gpu_limit=0.1, gpu_memory=2**30, gpu_type="A100")
    me = psutil.Process()
    parent = me.parent()
    assert parent is not None

    def rec(**fields):
        return Allocation(
            id=Allocation.new_id(), node="n", gpus=("GPU-x",), spec=spec, memory=2**30, **fields
        )

    pod_uid = "0f0e0d0c-0b0a-0908-0706-050403020100"
    pod_record = rec(extra={"k8s_pod": "k", "k8s_pod_uid": pod_uid, "uid": 1234})
    by_uid = rec(extra={"uid": 1234}, user="root")
    by_name = rec(user="gsagent-named")
    mine = rec(pid=me.pid, pid_start=me.create_time())
    parents = rec(pid=parent.pid, pid_start=parent.create_time())
    reused = rec(pid=parent.pid, pid_start=parent.create_time() - 100)
    started = me.create_time()
    local = Peer(pid=me.pid, uid=1234, gid=1234, pod=None, admin=False, start=started)
    in_pod = Peer(pid=me.pid, uid=1234, gid=1234, pod=pod_uid, admin=False, start=started)
    admin = Peer(pid=me.pid, uid=0, gid=0, pod=None, admin=True, start=started)
    # a connection whose process is gone (another process on its PID): no record by process
    seen = daemon.caller_shares(replace(local, start=started - 100))
    assert not seen(mine) and not seen(parents)
    seen = daemon.caller_shares(replace(local, start=None))
    assert not seen(mine) and not seen(parents)
    # a record naming a PID without its start time is nobody's by process
    assert not daemon.caller_shares(local)(rec(pid=me.pid))

    seen = daemon.caller_shares(local)
    assert [seen(a) for a in (pod_record, by_uid, by_name, mine, parents, reused)] == [
        False,
        True,
        False,
        True,
        True,
        False,
    ]
    seen = daemon.caller_shares(in_pod)
    assert [seen(a) for a in (pod_record, by_uid, mine)] == [True, False, False]
    named = unix_user("gsagent-named")
    seen = daemon.caller_shares(replace(local, uid=named.pw_uid, pid=1))
    assert seen(by_name) and not seen(by_uid)
    seen = daemon.caller_shares(admin)
    assert all(seen(a) for a in (pod_record, by_uid, by_name, reused))


def test_a_line_without_end_is_cut_off_at_max_line(daemon):
    from jupyter_gpushare.daemon import wire

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(daemon.socket))
        s.sendall(b"x\n")
        assert b"bad_request" in s.recv(65536)
        try:
            s.sendall(b"{" * (wire.MAX_LINE + 4096))
            closed = s.recv(65536) == b""
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        assert closed
    assert daemon.client.alive()
