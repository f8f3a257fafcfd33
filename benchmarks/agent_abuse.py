"""The node agent under abusive clients (issue 12): an honest kernel's round trips to the agent
(a status of its own allocation on a new connection, as the panel does, and a ping on its hello'd
connection) alone, then while other users flood it with pings they never read (1M asked), hold
5,000 idle connections and send garbage frames. Prints both, the ratio, the agent's peak memory
and descriptors, and one JSON line at the end.

Targets (issue 12): agent memory < 100 MB, honest p99 <= 10 ms under abuse. Run as root (it
creates the users gsagent-a/b/c with useradd):

    python3 benchmarks/agent_abuse.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "enforcement"))
sys.path.insert(0, str(HERE.parent))  # this checkout's package and libraries

import psutil  # noqa: E402
from agent_abuse_support import (  # noqa: E402
    FLOOD,
    GARBAGE,
    HONEST,
    IDLE,
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
from enforcement_support import NODE  # noqa: E402

from jupyter_gpushare.inventory import simulated_gpus  # noqa: E402
from jupyter_gpushare.ledger.sqlite import SQLiteLedger  # noqa: E402

MB = 2**20


def _peak(pid: int, stop: threading.Event, out: dict[str, int]) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        try:
            out["rss"] = max(out.get("rss", 0), process.memory_info().rss)
            out["fds"] = max(out.get("fds", 0), process.num_fds())
        except psutil.Error:
            return
        time.sleep(0.05)


def _honest_run(agent: Any, ledger: SQLiteLedger, user: Any, seconds: float) -> dict[str, Any]:
    gpu = simulated_gpus("1xA100", NODE)[0]
    honest = run_as(user, HONEST, str(agent.socket), str(seconds))
    mine = record(ledger, gpu, pid=honest.pid, uid=user.pw_uid, user=user.pw_name)
    agent.client.refresh()
    assert honest.stdin is not None
    honest.stdin.write(mine.id + "\n")
    honest.stdin.flush()
    result = read_json(honest, timeout=seconds + 60)
    honest.wait(30)
    both = result["status_ms"] + result["ping_ms"]
    return {
        "round_trips": len(both),
        "errors": result["n_errors"],
        "status_p50_ms": round(percentile(result["status_ms"], 0.5), 3),
        "status_p99_ms": round(percentile(result["status_ms"], 0.99), 3),
        "ping_p50_ms": round(percentile(result["ping_ms"], 0.5), 3),
        "ping_p99_ms": round(percentile(result["ping_ms"], 0.99), 3),
        "p99_ms": round(percentile(both, 0.99), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="honest round trips per run")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the abusers are real users (useradd)", file=sys.stderr)
        return 2
    raise_own_fd_limit()
    honest_user, idle_user, rough_user = (
        unix_user(n) for n in ("gsagent-a", "gsagent-b", "gsagent-c")
    )
    directory = shared_dir()
    agent = start_agent(directory)
    figures: dict[str, Any] = {"load1_start": round(os.getloadavg()[0], 2)}
    peak: dict[str, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_peak, args=(agent.proc.pid, stop, peak), daemon=True)
    try:
        ledger = SQLiteLedger(agent.ledger_path)
        figures["agent_rss_idle_mb"] = round(
            psutil.Process(agent.proc.pid).memory_info().rss / MB, 1
        )
        baseline = _honest_run(agent, ledger, honest_user, args.seconds)
        sampler.start()
        idle = run_as(idle_user, IDLE, str(agent.socket), "5000")
        opened = read_json(idle)
        flood = run_as(rough_user, FLOOD, str(agent.socket), "1000000")
        flooded = read_json(flood)
        garbage = run_as(rough_user, GARBAGE, str(agent.socket))
        abused = _honest_run(agent, ledger, honest_user, args.seconds)
        still_open = finish(idle)["still_open"]
        junk = finish(garbage)
        assert flood.stdin is not None
        flood.stdin.close()
        flood.wait(30)
    finally:
        stop.set()
        agent.stop()
        shutil.rmtree(directory, ignore_errors=True)
    figures.update(
        {
            "baseline": baseline,
            "abused": abused,
            "p99_ratio": round(abused["p99_ms"] / max(baseline["p99_ms"], 1e-3), 2),
            "agent_rss_peak_mb": round(peak.get("rss", 0) / MB, 1),
            "agent_fds_peak": peak.get("fds", 0),
            "flood_requests_taken": flooded.get("sent_requests"),
            "idle_connected": opened["connected"],
            "idle_kept_open": still_open,
            "garbage_connections": junk["connections"],
            "garbage_max_answers": junk["max_answers"],
            "load1_end": round(os.getloadavg()[0], 2),
        }
    )
    for name, run in (("unabused", baseline), ("abused", abused)):
        print(
            f"{name:>9}: {run['round_trips']} round trips, {run['errors']} errors; "
            f"status p50 {run['status_p50_ms']} ms p99 {run['status_p99_ms']} ms; "
            f"ping p50 {run['ping_p50_ms']} ms p99 {run['ping_p99_ms']} ms"
        )
    print(
        f"honest p99 abused/unabused: {figures['p99_ratio']} "
        f"(abused p99 {abused['p99_ms']} ms; target <= 10 ms)"
    )
    print(
        f"agent: peak RSS {figures['agent_rss_peak_mb']} MB (idle "
        f"{figures['agent_rss_idle_mb']} MB; target < 100 MB), peak descriptors "
        f"{figures['agent_fds_peak']}"
    )
    print(
        f"abusers: the flood got {flooded.get('sent_requests')} of 1,000,000 pings in before "
        f"the agent stopped reading; {opened['connected']} idle connections opened, "
        f"{still_open} kept; {junk['connections']} garbage connections, closed after at most "
        f"{junk['max_answers']} answers"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
