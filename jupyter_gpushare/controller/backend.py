"""The ``kubernetes`` backend in controller mode: a thin client of the cluster controller.

Chosen by :class:`jupyter_gpushare.backends.kubernetes.KubernetesBackend` when
``c.KubernetesBackendConfig.controller_url`` is set. The server keeps what is its own — the
kernel's ports and key (its kernel manager's session), the command with the pod's paths, the
environment it forwards — and asks the controller for everything that needs the cluster:

- ``pre_launch``: the provisioner has placed the share through :class:`.client.ControllerLedger`
  (``POST /api/allocations``); here only the command is rewritten for the pod;
- ``launch_kernel``: ``POST /api/kernels`` with the connection info; the controller creates the
  Secret and the pod, waits for it to run and answers with the pod's IP; meanwhile the pod's
  start phase (``GET /api/kernels/{allocation}``) goes to this server's start board for the UI;
- ``poll``/``wait``: ``GET /api/kernels/{allocation}`` (the controller's pod watch), at most
  every ``poll_interval`` seconds;
- ``kill``/``terminate``/``cleanup``: ``DELETE /api/kernels/{allocation}`` (the share stays for a
  restart; the provisioner releases it with ``DELETE /api/allocations/{id}``).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

from jupyter_client.connect import KernelConnectionInfo

from ..inventory import Gpu
from ..k8s.backend import KernelPodFailed, KubernetesKernelBackend
from ..ledger import Allocation, Ledger
from ..progress import PHASES
from ..progress import report as report_phase
from .client import ControllerContext, ControllerRefused, controller_context


class ControllerKernelBackend(KubernetesKernelBackend):
    name = "kubernetes"
    poll_interval = 2.0
    #: how often a start waiting for its pod reads the pod's phase from the controller
    start_poll_interval = 1.0

    def __init__(self, provisioner: Any) -> None:
        super().__init__(provisioner)
        self._remote: ControllerContext | None = None
        self._launch_id: str | None = None
        self._status: tuple[float, dict[str, Any]] | None = None

    async def remote(self) -> ControllerContext:
        if self._remote is None:
            self._remote = await controller_context(self.config)
        return self._remote

    async def ledger(self) -> Ledger:
        return (await self.remote()).ledger

    async def inventory(self) -> Sequence[Gpu]:
        return await (await self.remote()).ledger.gpus()

    async def pre_launch(self, allocation: Allocation, **kwargs: Any) -> dict[str, Any]:
        km = self.provisioner.parent
        if km is None:
            raise RuntimeError("the gpushare provisioner has no kernel manager (parent)")
        self.allocation = allocation
        self.failure = None
        self._launched = False
        self._deleting = False
        self._status = None
        self._launch_id = uuid.uuid4().hex[:10]
        self._connection = self._connection_info(km)
        settings = self.provisioner.settings
        given = list(kwargs.pop("extra_arguments", []))
        extra = given + [a for a in settings.extra_kernel_args if a not in given]
        kwargs["cmd"] = self._pod_command(km.format_kernel_cmd(extra_arguments=extra), km)
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        remote = await self.remote()
        assert self.allocation is not None and self._connection is not None
        body = {
            "allocation_id": self.allocation.id,
            "launch_id": self._launch_id,
            "kernel_id": str(self.provisioner.kernel_id),
            "command": list(cmd),
            "env": self._forwarded_env(kwargs.get("env")),
            "connection": self._connection,
        }
        try:
            answer = await self._while_starting(
                remote, asyncio.ensure_future(remote.client.request("POST", "/api/kernels", body))
            )
        except ControllerRefused as exc:
            if exc.body.get("error") == "kernel_pod_failed":
                self.failure = str(exc)
                raise KernelPodFailed(str(exc)) from None
            raise
        self.pod_name = answer["pod"]
        self.allocation = Allocation.from_json(answer["allocation"])
        self._launched = True
        info = dict(self._connection)
        info["ip"] = answer["connection"]["ip"]
        info["key"] = str(info["key"]).encode()
        self.log.info(
            "gpushare: kernel %s runs in pod %s on %s (through the controller)",
            self.provisioner.kernel_id,
            self.pod_name,
            self.allocation.node,
        )
        return info  # type: ignore[return-value]

    async def _while_starting(self, remote: ControllerContext, post: asyncio.Future[Any]) -> Any:
        """The answer to ``POST /api/kernels``, which comes once the pod runs. Meanwhile the pod's
        start phase (scheduling, image pulling, in the cluster's words) is read from
        ``GET /api/kernels/{allocation}`` every ``start_poll_interval`` seconds and shown on this
        server's start board, as the direct mode shows it from its own pod watch."""
        assert self.allocation is not None
        shown: tuple[str, str] | None = None
        try:
            while True:
                done, _ = await asyncio.wait({post}, timeout=self.start_poll_interval)
                if done:
                    return post.result()
                try:
                    status = await remote.client.request(
                        "GET", f"/api/kernels/{self.allocation.id}", retry=False
                    )
                except Exception:  # the start's own answer says what went wrong
                    continue
                phase = status.get("start_phase") if isinstance(status, dict) else None
                if phase in PHASES and (phase, str(status.get("start_message") or "")) != shown:
                    shown = (phase, str(status.get("start_message") or ""))
                    report_phase(self.provisioner.settings, self.provisioner.kernel_id, *shown)
        finally:
            if not post.done():
                post.cancel()

    async def _kernel_status(self, fresh: bool = False) -> dict[str, Any] | None:
        if self.allocation is None:
            return None
        now = time.monotonic()
        if not fresh and self._status is not None and now - self._status[0] < self.poll_interval:
            return self._status[1]
        remote = await self.remote()
        try:
            status = await remote.client.request(
                "GET", f"/api/kernels/{self.allocation.id}", retry=False
            )
        except ControllerRefused:
            return self._status[1] if self._status else None  # away: the kernel keeps running
        except Exception:
            status = {"exit_code": -9, "failure": "its share was released"}
        self._status = (now, status)
        return status

    async def poll(self) -> int | None:
        if not self._launched:
            return None
        status = await self._kernel_status()
        if status is None:
            return None
        code = status.get("exit_code")
        if code is None and status.get("deleting"):
            code = -9
        if code is not None and self.failure is None and not self._deleting:
            self.failure = status.get("failure") or f"pod {self.pod_name} ended (exit {code})"
            self.log.warning(
                "gpushare: kernel %s ended: %s", self.provisioner.kernel_id, self.failure
            )
        return code if code is None else int(code)

    async def wait(self) -> int | None:
        while self._launched:
            code = await self.poll()
            if code is not None:
                return code
            await asyncio.sleep(self.poll_interval)
        return None

    async def send_signal(self, signum: int) -> None:
        if signum == 0:
            return
        if signum == signal.SIGINT:
            self._interrupt()
        elif signum in (signal.SIGTERM, signal.SIGKILL):
            await self._stop_pod(0 if signum == signal.SIGKILL else 1)
        else:
            self.log.warning("gpushare: signal %s cannot be sent to a kernel pod", signum)

    async def kill(self, restart: bool = False) -> None:
        await self._stop_pod(1)

    async def terminate(self, restart: bool = False) -> None:
        await self._stop_pod(1)

    async def _stop_pod(self, grace: int) -> None:
        self._deleting = True
        if self.allocation is None or self.pod_name is None:
            return
        remote = await self.remote()
        status = await remote.client.request(
            "DELETE", f"/api/kernels/{self.allocation.id}?grace={grace}"
        )
        self._status = (time.monotonic(), status)

    async def cleanup(self, restart: bool = False) -> None:
        if self._launched and self.allocation is not None:
            try:
                await self._stop_pod(1)
            except Exception as exc:  # released meanwhile: nothing left to stop
                self.log.debug(
                    "gpushare: cleanup of kernel %s: %s", self.provisioner.kernel_id, exc
                )
        self._launched = False
        self._deleting = False
        if not restart:
            self._connection = None


__all__ = ["ControllerKernelBackend"]
