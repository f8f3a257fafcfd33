"""``jupyter_gpushare.panel()`` in real kernels: live updates over the widget comms while another
cell runs, values equal to the daemon's status, the Release button, and a daemon that goes away
and comes back."""

from __future__ import annotations

import json
from pathlib import Path

from nbkit import (
    ALLOCATE,
    MIB,
    allocations_of,
    click,
    daemon_allocation,
    fields,
    gpu_memory_used,
    run_collecting,
    start_kernel,
    widget_updates,
)
from support import stop_daemons, wait_for

from jupyter_gpushare.share import format_bytes

SHOW = "import jupyter_gpushare, json\np = jupyter_gpushare.panel()\np"
IDS = (
    "print(json.dumps({n: getattr(p, n).model_id for n in ('title', 'info', 'plot', "
    "'message', 'release_button', 'confirm_button')} | {'confirm': p.confirm.layout.model_id}))"
)


def _show_panel(client):
    reply, opened = run_collecting(client.client, SHOW)
    assert reply["content"]["status"] == "ok"
    ids = json.loads(client.execute(IDS).strip().splitlines()[-1])
    return ids, opened


def _latest(messages, comm_id, trait="value"):
    """The last value of a widget trait seen in comm_open / update messages."""
    value = None
    for m in messages:
        if m["msg_type"] in ("comm_open", "comm_msg") and m["content"]["comm_id"] == comm_id:
            state = m["content"]["data"].get("state") or {}
            if trait in state:
                value = state[trait]
    return value


def test_panel_updates_while_a_cell_runs_and_matches_the_daemon(jupyter_server):
    server = jupyter_server("1xA100")
    kernel, alloc = start_kernel(server, {"gpu_request": 0.25, "gpu_limit": 0.5})
    client = server.client(kernel["id"])
    assert "alloc 0" in client.execute(ALLOCATE)
    ids, opened = _show_panel(client)

    reply, seen = run_collecting(client.client, "import time; time.sleep(3)")
    assert reply["content"]["status"] == "ok"
    during = [m for m in seen if m["during"]]
    updates = widget_updates(during, {ids["message"], ids["info"], ids["plot"]})
    assert len(updates) >= 2, [m["msg_type"] for m in seen]
    stamps = {u["value"] for u in updates if "value" in u and "updated" in u["value"]}
    assert len(stamps) >= 2  # distinct seconds: the thread kept going while the cell slept

    everything = opened + seen
    shown = fields(_latest(everything, ids["info"]))
    truth = daemon_allocation(server, alloc["id"])
    assert shown["gpu_uuid"] == alloc["gpus"][0] == truth["gpus"][0]["gpu"]
    assert shown["gpu_type"].startswith("A100")
    assert (shown["request"], shown["limit"]) == ("25 %", "50 %")  # one unit: percent
    assert (truth["request"], truth["limit"]) == (0.25, 0.5)
    assert shown["memory_cap"] == format_bytes(truth["memory_cap"]) == "20GiB"
    assert shown["memory_used"] == format_bytes(truth["memory_used"]) == "256MiB"
    waits = truth["lease_waits"]
    assert shown["lease_waits"] == f"{waits} time{'' if waits == 1 else 's'}"
    assert shown["kernels"] == "1 share on this GPU"
    assert shown["achieved_share"].endswith(" %")
    info = _latest(everything, ids["info"])
    assert "leases" not in info and "share(s)" not in info
    assert "simulated GPU" in _latest(everything, ids["title"])
    plot = _latest(everything, ids["plot"])
    assert "<svg" in plot and 'data-series="share"' in plot and 'data-series="memory"' in plot
    # axes with a scale, and a legend naming the dashed request and limit lines
    for label in (">0 %<", ">50 %<", ">100 %<", ">now<"):
        assert label in plot, label
    legend = plot.split('class="gpushare-legend"')[1]
    for name in ("achieved share", "memory used / cap", "request", "limit"):
        assert name in legend
    assert "stroke-dasharray" in plot.split('data-series="request"')[1].split("/>")[0]
    # theme colours only: JupyterLab's CSS variables, no fixed background
    assert "#fafafa" not in plot and "var(--jp-brand-color1" in plot
    assert "active" in fields(_latest(everything, ids["message"]))["state"]
    client.close()


def test_release_button_returns_the_share_and_the_kernel_lives_on(jupyter_server):
    server = jupyter_server("1xA100")
    kernel, alloc = start_kernel(server)
    uuid = alloc["gpus"][0]
    client = server.client(kernel["id"])
    assert "alloc 0" in client.execute(ALLOCATE)
    wait_for(lambda: (gpu_memory_used(server, uuid) or 0) >= 256 * MIB, timeout=10)
    ids, _ = _show_panel(client)

    click(client.client, ids["release_button"])  # asks for confirmation first
    _, seen = run_collecting(client.client, "print(p.confirm.layout.display)")
    assert _latest(seen, ids["confirm"], "display") == "flex"
    # the question above its buttons (a column), not beside them in one wrapping row
    layout = json.loads(
        client.execute(
            "print(json.dumps([type(p.confirm).__name__, p.confirm.children[0] is p.confirm_text,"
            " [type(c).__name__ for c in p.confirm.children[1].children]]))"
        )
    )
    assert layout == ["VBox", True, ["Button", "Button"]]
    assert allocations_of(server, kernel["id"]) == [alloc]  # nothing released yet

    click(client.client, ids["confirm_button"])
    _, seen = run_collecting(client.client, "print(p.last_status['state'])")
    assert [m["content"]["text"].strip() for m in seen if m["msg_type"] == "stream"] == ["released"]
    # the ledger, the daemon and the simulator's memory all show it gone
    assert allocations_of(server, kernel["id"]) == []
    assert daemon_allocation(server, alloc["id"]) is None
    wait_for(lambda: gpu_memory_used(server, uuid) == 0, timeout=10)
    message = _latest(seen, ids["message"])
    assert "Released 25–50 % of an A100" in message and "256MiB of GPU memory freed" in message
    assert message.count("freed") == 1 and "`" not in message, message
    assert "Restart the kernel to get a new share" in message
    assert "<code>%gpushare request</code>" in message
    # the Release button is gone, not left disabled
    button_layout = json.loads(
        client.execute("print(json.dumps(p.release_button.layout.model_id))")
    )
    assert _latest(seen, button_layout, "display") == "none"
    assert client.execute("1+1").strip() == "2"
    client.close()


def test_panel_says_when_the_daemon_is_gone_and_recovers(jupyter_server):
    from jupyter_gpushare.daemon.supervisor import ensure_daemon, stop
    from jupyter_gpushare.inventory import local_node_name, simulated_gpus

    server = jupyter_server("1xA100", "--AgentSupervision.interval=0")  # it stays gone
    kernel, alloc = start_kernel(server)
    client = server.client(kernel["id"])
    ids, _ = _show_panel(client)
    socket = server.env["GPUSHARE_SOCKET"]
    stop_daemons(socket)
    wait_for(lambda: "unreachable" in client.execute("print(p.last_status['state'])"), 10)
    _, seen = run_collecting(client.client, "import time; time.sleep(1.5)")
    text = _latest(seen, ids["message"])
    assert "daemon is unreachable" in text and "retrying" in text
    assert "1" == client.execute("print(1)").strip()

    node = local_node_name()
    proc = ensure_daemon(
        Path(socket), Path(server.env["GPUSHARE_LEDGER"]), simulated_gpus("1xA100", node), node
    )
    try:
        wait_for(lambda: "active" in client.execute("print(p.last_status['state'])"), 15)
        assert fields(client.execute("print(p.info.value)"))["gpu_uuid"] == alloc["gpus"][0]
    finally:
        client.close()
        stop(proc)


def test_panel_without_a_share_says_so_and_keeps_checking(monkeypatch):
    """Outside a gpushare kernel (no share): a clear message, Release disabled, and the thread
    keeps checking until the panel is closed."""
    import time

    from jupyter_gpushare.notebook.panel import GpuPanel

    for name in ("GPUSHARE_ALLOCATION_ID", "GPUSHARE_SOCKET", "GPUSHARE_SIMULATED"):
        monkeypatch.delenv(name, raising=False)
    panel = GpuPanel(interval=0.05).start()
    try:
        wait_for(lambda: panel.updates >= 4, timeout=10, interval=0.05)
        assert fields(panel.message.value)["state"] == "none"
        assert "holds no GPU share" in panel.message.value
        assert panel.release_button.disabled and panel.info.value == ""
        assert panel.release_button.layout.display == "none"  # nothing to release: no button
    finally:
        panel.close()
    time.sleep(0.2)
    after = panel.updates
    time.sleep(0.3)
    assert panel.updates == after  # closing stopped the thread
