"""Binding a warm kernel to the user's session before its first use.

A warm kernel was started in the server's root directory with the server's environment. A cold
start would have given it the session's working directory and environment (``JPY_SESSION_NAME``
and whatever the session manager adds), so the claim sets exactly those in the running kernel
with one silent execute request (no output, no history entry, no execution count) and waits for
its reply: the user's first cell already runs in the right place.

What the share put into the environment (``GPUSHARE_*``, the device visibility variables, the
interposer preload and the simulator's library path) is never overwritten.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from queue import Empty
from typing import Any

#: Variables the kernel's share set at launch; a session's environment does not replace them.
SHARE_VARIABLES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
    }
)
BIND_TIMEOUT_S = 10.0


def session_changes(
    launch_env: Mapping[str, str] | None, session_env: Mapping[str, str]
) -> dict[str, str]:
    """The variables of ``session_env`` that differ from what the warm kernel was started with,
    leaving the share's own variables alone."""
    launch_env = launch_env or {}
    return {
        k: str(v)
        for k, v in session_env.items()
        if launch_env.get(k) != v and k not in SHARE_VARIABLES and not k.startswith("GPUSHARE_")
    }


def bind_code(cwd: str, env: Mapping[str, str], session_name: str | None) -> str:
    """Python run silently in the kernel: working directory, environment, ``__session__``."""
    lines = [
        "import os as __gpushare_os",
        # a remote kernel (a pod) may not have the server's directory: then it stays put
        f"if __gpushare_os.path.isdir({cwd!r}): __gpushare_os.chdir({cwd!r})",
        f"__gpushare_os.environ.update({dict(env)!r})",
    ]
    if session_name:
        lines.append(f"get_ipython().user_ns['__session__'] = {session_name!r}")
    lines.append("del __gpushare_os")
    return "\n".join(lines)


async def bind_session(
    client: Any, km: Any, cwd: str, session_env: Mapping[str, str], session_name: str | None
) -> dict[str, str]:
    """Run :func:`bind_code` in the warm kernel through ``client`` (connected, ready); returns
    the variables it set. Raises when the kernel does not answer ``ok`` in time."""
    launch = getattr(km, "_launch_args", None) or {}
    changes = session_changes(launch.get("env"), session_env)
    msg_id = client.execute(
        bind_code(cwd, changes, session_name), silent=True, store_history=False, allow_stdin=False
    )
    deadline = time.monotonic() + BIND_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the warm kernel did not answer within {BIND_TIMEOUT_S:g} s")
        try:
            reply = await client.get_shell_msg(timeout=left)
        except Empty:
            continue
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            break
    content = reply["content"]
    if content.get("status") != "ok":
        raise RuntimeError(
            f"binding the session failed: {content.get('ename')}: {content.get('evalue')}"
        )
    await _until_idle(client, msg_id, deadline)
    return changes


async def _until_idle(client: Any, msg_id: str, deadline: float) -> None:
    """Wait for the kernel's ``idle`` status after the binding (it follows the reply on iopub):
    the user's first look at the kernel must not catch the binding's ``busy``."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await client.get_iopub_msg(timeout=left)
        except Empty:
            return
        if (
            msg.get("msg_type") == "status"
            and msg.get("parent_header", {}).get("msg_id") == msg_id
            and msg.get("content", {}).get("execution_state") == "idle"
        ):
            return
