"""CurveZMQ transport encryption (jupyter_client >= 8.10): the gpushare kernelspecs declare
``metadata.supported_encryption: ["curve"]``, so a server with
``KernelManager.transport_encryption = "required"`` starts them encrypted (without the
declaration it refuses them), and a client without the keys gets no answer."""

from __future__ import annotations

import json
import queue
from pathlib import Path
from typing import Any

import pytest
import zmq
from jupyter_client.blocking import BlockingKernelClient
from support import add_kernelspec

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")


def test_gpushare_kernels_run_encrypted_when_required(
    jupyter_server: Any, gpushare_env: dict[str, str]
) -> None:
    server = jupyter_server("1xA100", "--KernelManager.transport_encryption=required")
    for name in ("gpushare-python", "gpushare-python-half"):
        started = server.post(
            "/gpushare/api/kernels" if name == "gpushare-python" else "/api/kernels", {"name": name}
        )
        assert started.status_code == 201, (name, started.text, server.log())
        kernel_id = started.json()["id"]
        path = Path(gpushare_env["JUPYTER_RUNTIME_DIR"]) / f"kernel-{kernel_id}.json"
        info = json.loads(path.read_text())
        assert info.get("curve_publickey") and info.get("curve_secretkey"), info.keys()

        client = server.client(kernel_id)  # with the keys: works
        assert client.execute("print(6 * 7)").strip() == "42"
        client.close()

        # without them the kernel's sockets do not answer (the handshake fails)
        plain = BlockingKernelClient()
        plain.load_connection_info({k: v for k, v in info.items() if not k.startswith("curve")})
        plain.start_channels(hb=False)
        try:
            plain.kernel_info()
            with pytest.raises(queue.Empty):
                plain.get_shell_msg(timeout=3)
        finally:
            plain.stop_channels()
        assert server.delete(f"/api/kernels/{kernel_id}").status_code == 204
    assert server.allocations() == []


def test_without_the_declaration_required_encryption_refuses_the_kernel(
    jupyter_server: Any, gpushare_env: dict[str, str]
) -> None:
    """What the declaration is for: the same kernelspec without it is refused."""
    add_kernelspec(gpushare_env, "undeclared", {"gpu_request": 0.25})
    server = jupyter_server("1xA100", "--KernelManager.transport_encryption=required")
    refused = server.post("/api/kernels", {"name": "undeclared"})
    assert refused.status_code == 500 and "supported_encryption" in server.log()
    assert server.allocations() == []
