"""A simulated day on a full machine: the agent's queue next to refusal-and-retry clients.

Two system agents (``jupyter gpushare daemon --system --simulate NxA100``), side by side in one
run so that the machine's load hits both, each serving the same day of the same users (real Unix
users ``gsq0`` … made with ``useradd``; run as root). The day is time-compressed (``--hour-s``
real seconds per simulated hour; all figures below are in simulated minutes unless they end in
``_real_s``). Each user opens notebook sessions at random through the day (a busy middle of the
day): a share of 0.25 (half of them), 0.5 or 1.0 of an A100, held for a log-normal time; a third
of the sessions go idle after their work, get an idle-reclaim warning (``extra.reclaim_warning``,
as the server's idle reclaim writes it) and are released at its deadline.

- **queue**: a start that does not fit waits in the agent's queue
  (``AgentLedger.reserve_waiting``, what ``run --wait`` and the provisioner's ``queue_wait`` use).
- **retry**: a start that does not fit is refused; the client tries again every
  ``--retry-min`` minutes (± a third), as a user would.

Both give up after ``--give-up-min``. Reported per variant: wait p50/p95 (a start that gave up
counts its whole wait), gave up, fairness (Jain's index over users' mean wait per unit of share
asked), GPU allocation (time-average of the requests held over the machine's compute, over the
busy part of the day), starts lost (asked, neither started nor given up) or doubled (one entry,
two shares); for the queue also the ETA's honesty (starts that began inside the first range they
were shown, of those shown one; target >= 90 %), its width (the median of the first range's high
end over the wait that followed) and the release -> start latency (the agent's,
from the ledger write that woke its queue to the start, real seconds; target p99 <= 1 s).

Run (root): ``python benchmarks/fair_queue.py`` (~2 min; ``--hours``, ``--hour-s``, ``--users``,
``--gpus``, ``--seed``). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import pwd
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# imported before the users' processes are forked (they may not read this Python's files)
from jupyter_gpushare.ledger.agent import AgentLedger
from jupyter_gpushare.placement import PlacementRefused, Policy, allocate
from jupyter_gpushare.share import ShareSpec

NODE = "gs-queue-bench"


@dataclass(frozen=True)
class Session:
    user: int
    arrive_h: float
    request: float
    hold_min: float
    idle: bool


def day(users: int, hours: float, gpus: int, seed: int) -> list[Session]:
    """The sessions of one day: per user a Poisson stream whose rate follows the working day
    (low in the first and last hours, ~1.6x the mean around midday); users 0 and 1 open twice
    as many sessions as the others. Demand around midday is ~1.3x the machine."""
    rng = random.Random(seed)
    mean_size = 0.5 * 0.25 + 0.3 * 0.5 + 0.2 * 1.0
    mean_hold_h = 0.75
    total_rate = 0.85 * gpus / (mean_size * mean_hold_h)  # sessions per hour, all users
    weights = [2.0 if u < 2 else 1.0 for u in range(users)]
    out = []
    for u in range(users):
        rate = total_rate * weights[u] / sum(weights)
        t = 0.0
        while True:
            t += rng.expovariate(rate * 1.6)  # thinning: accept by the hour's shape
            if t >= hours:
                break
            shape = 0.35 + 1.25 * math.sin(math.pi * t / hours) ** 2
            if rng.random() > shape / 1.6:
                continue
            size = rng.choices([0.25, 0.5, 1.0], [0.5, 0.3, 0.2])[0]
            hold = min(240.0, rng.lognormvariate(math.log(35), 0.6))
            out.append(Session(u, t, size, hold, rng.random() < 1 / 3))
    return sorted(out, key=lambda s: s.arrive_h)


# -- the users' side (forked children, each as its Unix user) -------------------------------------


async def run_user(
    path: str, sessions: list[Session], mode: str, t0: float, args: dict[str, Any]
) -> list[dict[str, Any]]:
    hour_s = args["hour_s"]
    minute_s = hour_s / 60
    ledger = AgentLedger(path)
    gpus = await ledger.gpus()
    me = os.getpid()
    rng = random.Random(args["seed"] * 1000 + os.getuid())

    async def one(s: Session) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, t0 + s.arrive_h * hour_s - time.time()))
        asked = time.time()
        spec = ShareSpec(s.request, s.request)
        give_up = args["give_up_min"] * minute_s
        made = None
        tries = 0
        seen: list[dict[str, Any]] = []
        if mode == "queue":
            try:
                made = await ledger.reserve_waiting(
                    spec, Policy(), give_up, seen.append, owner="run", server_pid=me
                )
            except PlacementRefused:
                made = None
        else:
            while True:
                tries += 1
                try:
                    made = await allocate(ledger, spec, gpus, None, owner="run", server_pid=me)
                    break
                except PlacementRefused:
                    pause = args["retry_min"] * minute_s * rng.uniform(2 / 3, 4 / 3)
                    if time.time() + pause - asked > give_up:
                        break
                    await asyncio.sleep(pause)
        began = time.time()
        out: dict[str, Any] = {
            "user": s.user,
            "request": s.request,
            "asked": asked,
            "began": began,
            "wait_min": (began - asked) / minute_s,
            "started": made is not None,
            "tries": tries,
            "queued": bool(seen),
            "allocation": made.id if made else None,
            "entry": made.extra.get("queue_entry") if made else None,
        }
        shown = next((v["eta"] for v in seen if (v.get("eta") or {}).get("hi_s") is not None), None)
        if shown is not None and made is not None:  # the first range this user was shown
            at = began - float(shown["computed_at"])
            lo, hi = float(shown["lo_s"] or 0.0), float(shown["hi_s"])
            slack = args["eta_slack_min"] * minute_s
            out["eta"] = "early" if at < lo - slack else "late" if at > hi + slack else "inside"
            out["eta_range_min"] = [round(lo / minute_s, 1), round(hi / minute_s, 1)]
            out["eta_at_min"] = round(at / minute_s, 1)
        if made is None:
            return out
        hold = s.hold_min * minute_s
        if s.idle:  # works for half its time, then idle: warned, released at the deadline
            await asyncio.sleep(hold / 2)
            now = time.time()
            warning = {
                "warned_at": now,
                "release_at": now + args["grace_min"] * minute_s,
                "idle_s": 0,
                "message": "idle",
            }

            def warn(a: Any, _others: Any) -> Any:
                return replace(a, extra={**a.extra, "reclaim_warning": warning})

            await ledger.update(made.id, warn)
            await asyncio.sleep(args["grace_min"] * minute_s)
        else:
            await asyncio.sleep(hold)
        await ledger.release(made.id)
        out["released"] = time.time()
        return out

    return list(await asyncio.gather(*(one(s) for s in sessions)))


def user_process(
    user: pwd.struct_passwd,
    path: str,
    sessions: list[Session],
    mode: str,
    t0: float,
    args: dict[str, Any],
    send: Any,
) -> None:
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)
    os.environ["HOME"] = user.pw_dir
    try:
        send.send(("ok", asyncio.run(run_user(path, sessions, mode, t0, args))))
    except BaseException as exc:
        send.send(("error", f"{type(exc).__name__}: {exc}"))


# -- the machine's side (root) --------------------------------------------------------------------


def unix_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "-M", "--shell", "/bin/sh", name], check=True)
        return pwd.getpwnam(name)


def ask(path: str, message: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 22)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data)
    assert isinstance(reply, dict)
    return reply


class Agent:
    def __init__(self, gpus: int, hold_s: float, eta_window_s: float) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gs-queue-bench-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.socket = str(self.dir / "daemon.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_gpushare.daemon",
                "--system",
                "--socket",
                self.socket,
                "--ledger",
                str(self.dir / "state" / "ledger.sqlite"),
                "--node",
                NODE,
                "--simulate",
                f"{gpus}xA100",
                "--state-dir",
                str(self.dir / "shm"),
                "--queue-max-per-user",
                "100",
                "--queue-hold",
                str(hold_s),
                "--queue-eta-window",
                str(eta_window_s),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "agent.log", "wb"),
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if ask(self.socket, {"op": "ping"}).get("ok"):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the agent did not start: {self.dir / 'agent.log'}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(20)
        shutil.rmtree(self.dir, ignore_errors=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def jain(values: list[float]) -> float:
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=8.0, help="simulated hours in the day")
    parser.add_argument("--hour-s", type=float, default=9.0, help="real seconds per hour")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--retry-min", type=float, default=3.0)
    parser.add_argument("--give-up-min", type=float, default=120.0)
    parser.add_argument("--grace-min", type=float, default=10.0)
    parser.add_argument("--hold-min", type=float, default=60.0, help="the queue's --queue-hold")
    parser.add_argument(
        "--eta-window-min", type=float, default=60.0, help="the queue's --queue-eta-window"
    )
    parser.add_argument(
        "--eta-slack-min",
        type=float,
        default=0.5,
        help="a start this close to the range shown counts as inside it",
    )
    parser.add_argument("--dump", help="write every start's record (JSON) to this file")
    opts = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the users are real Unix users (useradd)")
    sessions = day(opts.users, opts.hours, opts.gpus, opts.seed)
    users = [unix_user(f"gsq{u}") for u in range(opts.users)]
    minute_s = opts.hour_s / 60
    args = {
        "hour_s": opts.hour_s,
        "retry_min": opts.retry_min,
        "give_up_min": opts.give_up_min,
        "grace_min": opts.grace_min,
        "seed": opts.seed,
        "eta_slack_min": opts.eta_slack_min,
    }
    agents = {
        mode: Agent(opts.gpus, opts.hold_min * minute_s, opts.eta_window_min * minute_s)
        for mode in ("queue", "retry")
    }
    print(
        f"{len(sessions)} sessions of {opts.users} users on {opts.gpus} simulated A100s, "
        f"{opts.hours:g} h at {opts.hour_s:g} s per hour; load1 {os.getloadavg()[0]:.2f}",
        file=sys.stderr,
    )
    held: dict[str, list[tuple[float, float]]] = {m: [] for m in agents}
    stop = threading.Event()

    def sample() -> None:  # requests held over time, per variant
        while not stop.is_set():
            for mode, agent in agents.items():
                try:
                    snap = ask(agent.socket, {"op": "ledger.snapshot"})
                    total = sum(a["gpu_request"] * a["gpu_count"] for a in snap["allocations"])
                    held[mode].append((time.time(), total))
                except (OSError, ValueError):
                    pass
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    ctx = multiprocessing.get_context("fork")
    t0 = time.time() + 2.0
    procs = []
    for mode, agent in agents.items():
        for u, user in enumerate(users):
            receive, send = ctx.Pipe(duplex=False)
            mine = [s for s in sessions if s.user == u]
            p = ctx.Process(
                target=user_process, args=(user, agent.socket, mine, mode, t0, args, send)
            )
            p.start()
            send.close()
            procs.append((mode, p, receive))
    sampler.start()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in agents}
    failures = []
    limit = opts.hours * opts.hour_s + (240 + opts.give_up_min + opts.grace_min) * minute_s + 60
    for mode, p, receive in procs:
        if receive.poll(limit):
            status, payload = receive.recv()
            if status == "ok":
                results[mode].extend(payload)
            else:
                failures.append(f"{mode}: {payload}")
        else:
            failures.append(f"{mode}: a user's process gave no result")
        p.join(10)
    stop.set()
    sampler.join(5)
    queue_figures = ask(agents["queue"].socket, {"op": "ledger.queue"})["metrics"]
    left = {m: ask(a.socket, {"op": "ledger.snapshot"})["allocations"] for m, a in agents.items()}
    for agent in agents.values():
        agent.stop()

    busy_from, busy_to = t0 + 0.15 * opts.hours * opts.hour_s, t0 + 0.85 * opts.hours * opts.hour_s
    out: dict[str, Any] = {"sessions": len(sessions), "users": opts.users, "gpus": opts.gpus}
    rows = []
    for mode, done in results.items():
        waits = [r["wait_min"] for r in done]
        per_user: dict[int, list[float]] = {}
        for r in done:
            per_user.setdefault(r["user"], []).append(r["wait_min"] / r["request"])
        fairness = jain([statistics.mean(v) for v in per_user.values()])
        samples = [v for t, v in held[mode] if busy_from <= t <= busy_to]
        allocation = statistics.mean(samples) / opts.gpus if samples else float("nan")
        entries = [r["entry"] for r in done if r["entry"]]
        row = {
            "wait_p50_min": round(percentile(waits, 0.5), 1),
            "wait_p95_min": round(percentile(waits, 0.95), 1),
            "gave_up": sum(not r["started"] for r in done),
            "jain": round(fairness, 3),
            "gpu_allocated": round(allocation, 3),
            "lost": len(sessions) - len(done),
            "doubled": len(entries) - len(set(entries)),
            "left_in_ledger": len(left[mode]),
        }
        if mode == "queue":
            judged = [r["eta"] for r in done if "eta" in r]
            row["eta_inside"] = round(judged.count("inside") / len(judged), 3) if judged else None
            row["eta_shown"] = len(judged)
            row["eta_early"] = judged.count("early")
            row["eta_late"] = judged.count("late")
            row["no_eta_shown"] = sum(1 for r in done if r["queued"] and "eta" not in r)
            # how wide the ranges are: the high end over the wait it turned out to be (a wait
            # under the slack counts as the slack)
            widths = [
                r["eta_range_min"][1] / max(r["eta_at_min"], opts.eta_slack_min)
                for r in done
                if "eta" in r
            ]
            row["eta_hi_over_wait_p50"] = round(statistics.median(widths), 2) if widths else None
            row["agent_eta_inside"] = queue_figures["eta_inside"]
            row["agent_eta_shown"] = queue_figures["eta_shown"]
            row["queued"] = sum(r["queued"] for r in done)
            reactions = queue_figures["reactions_s"]
            row["release_to_start_p99_real_s"] = round(percentile(reactions, 0.99), 3)
        else:
            row["tries"] = sum(r["tries"] for r in done)
        out[mode] = row
        rows.append((mode, row))
    for mode, row in rows:
        print(f"{mode:6s} " + "  ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr)
    if failures:
        out["failures"] = failures
        print("failures:", failures, file=sys.stderr)
    out["load1_after"] = round(os.getloadavg()[0], 2)
    if opts.dump:
        Path(opts.dump).write_text(json.dumps(results))
    print(json.dumps(out))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
