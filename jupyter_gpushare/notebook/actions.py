"""What a kernel can do about its own GPU share, in plain Python (DEVELOPING.md, box 9).

``status()``, ``gpus()``, ``release()`` and ``request(...)`` are what the panel's Release button
and the ``%gpushare`` magics call, and what scripts use (``jupyter_gpushare.status()``). They
talk to the node daemon on ``GPUSHARE_SOCKET`` — the daemon holds the ledger and checks that the
calling process is the one holding the share — so Kubernetes kernels go the same way as local
ones (given a node daemon that follows the Kubernetes ledger and recognises pod processes). With
enforcement off (no daemon, no interposer) a local kernel releases its allocation in the ledger
itself.

Releasing (the semantics, also in the README, "Releasing the GPU"): the share leaves the ledger
and the daemon, so placement can hand it to someone else at once; the interposer frees every byte
of GPU memory this process holds (its CUDA contexts included) before :func:`release` returns; the
kernel process and its CPU state (variables, imports) live on. From then on every CUDA launch,
allocation or new context of this process fails with ``CUDA_ERROR_NOT_PERMITTED`` and the message
:data:`RELEASED_MESSAGE`. A process cannot get a CUDA context back, so using a GPU again takes a
kernel restart; :func:`request` can reserve the new share first, and the restart uses it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from typing import Any

from ..daemon import client as daemon_client
from ..daemon.client import DaemonClient
from ..errors import GpushareError
from ..share import ShareError, ShareSpec, format_bytes, format_share, format_share_range

#: what a kernel can do once its share is released (said after what was released and freed)
AFTER_RELEASE = (
    "This kernel keeps running but cannot use a GPU again. Restart the kernel to get a new "
    "share (%gpushare request reserves one first)."
)
RELEASED_MESSAGE = "The GPU share of this kernel was released and its GPU memory freed. " + (
    AFTER_RELEASE
)


# A refused or impossible action is a GpushareError (the package's one error model,
# jupyter_gpushare.errors): ``str()`` is the message for the user, ``code`` what went wrong,
# ``to_json()`` the same body the server answers with.


class NoShare(GpushareError):
    """This kernel holds no GPU share (never had one, or released it)."""

    code = "no_share"
    status = 409


class DaemonUnreachable(GpushareError, daemon_client.DaemonUnreachable):
    """No gpushare daemon answers on the kernel's socket (the client's error, as the notebook
    side says it)."""

    code = "daemon"
    status = 503


class _KernelState:
    """What this process knows beyond its environment: a release and a reserved next share.
    (One per process; a plain class, not a dataclass, whose generated methods cost start time.)"""

    __slots__ = ("inventory", "lock", "memory_freed", "released", "reserved", "seen_active")

    def __init__(self) -> None:
        self.released: dict[str, Any] | None = None
        self.reserved: dict[str, Any] | None = None
        self.memory_freed: int | None = None
        self.seen_active = False  # the daemon reported this process's share at least once
        self.inventory: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()


_state = _KernelState()


def allocation_id() -> str | None:
    """The share this process holds now, or None (none given, or released)."""
    if _state.released is not None:
        return None
    return os.environ.get("GPUSHARE_ALLOCATION_ID") or None


def released() -> dict[str, Any] | None:
    """The share this process released (Allocation JSON), or None."""
    return _state.released


def note_released_by_daemon() -> dict[str, Any]:
    """The node daemon said this kernel's share is gone after it knew it (idle reclaim released
    it): record the release as one from outside, so that :func:`request` reserves a new share for
    the restart. Returns :func:`status`."""
    _state.seen_active = True
    return status()


def _client(timeout: float = 5.0) -> DaemonClient:
    path = os.environ.get("GPUSHARE_SOCKET")
    if not path:
        raise NoShare(
            "This kernel was not started with a GPU share (GPUSHARE_SOCKET is not "
            "set): pick a 'GPU share' kernel."
        )
    return DaemonClient(path, timeout=timeout)


def _ask(call: Any, *args: Any) -> dict[str, Any]:
    try:
        return call(*args)
    except OSError as exc:  # DaemonUnreachable too
        raise DaemonUnreachable(f"The gpushare daemon is unreachable: {exc}") from exc


def _refused(reply: dict[str, Any]) -> GpushareError:
    message = str(reply.get("message") or reply.get("error") or "refused")
    if reply.get("suggestions"):
        message += " (" + "; ".join(map(str, reply["suggestions"])) + ")"
    detail = {k: v for k, v in reply.items() if k not in ("ok", "error", "message")}
    return GpushareError(message, code=str(reply.get("error") or "error"), **detail)


# -- reading -----------------------------------------------------------------------------------


def gpus() -> list[dict[str, Any]]:
    """Every GPU the ledger knows (this node's, or the cluster's) with its free capacity:
    ``uuid``, ``node``, ``type``, ``name``, ``memory``, ``free_request``, ``free_memory``,
    ``allocations``, ``simulated``."""
    reply = _ask(_client().gpus)
    if not reply.get("ok"):
        raise _refused(reply)
    rows = list(reply.get("gpus") or [])
    with _state.lock:
        _state.inventory = {r["uuid"]: r for r in rows}
    return rows


def _gpu_facts(uuid: str) -> dict[str, Any]:
    """Static facts of a GPU (name, type, memory), asked once."""
    if uuid not in _state.inventory:
        try:
            gpus()
        except GpushareError:
            return {}
    return _state.inventory.get(uuid, {})


def status() -> dict[str, Any]:
    """This kernel's share and its GPU, now.

    ``state`` is ``active`` (``allocation``: request, limit, achieved share over the daemon's
    window, memory used and cap, lease waits; ``gpu``: the GPU's facts, NVML readings and how
    many shares it holds), ``released``, ``none`` (no share given), ``unreachable`` (no daemon
    answers; ``message`` says why) or ``unenforced`` (no daemon and no interposer: enforcement
    is off, the share is bookkeeping only). Never raises for these states: the panel shows them."""
    simulated = os.environ.get("GPUSHARE_SIMULATED") == "1"
    base: dict[str, Any] = {
        "simulated": simulated,
        "allocation": None,
        "gpu": None,
        "reserved": _state.reserved,
        "memory_freed": _state.memory_freed,
    }
    if _state.released is not None:
        return {
            **base,
            "state": "released",
            "released": _state.released,
            "message": RELEASED_MESSAGE,
        }
    current = allocation_id()
    if current is None or not os.environ.get("GPUSHARE_SOCKET"):
        return {
            **base,
            "state": "none",
            "message": "This kernel holds no GPU share: it was not started with one.",
        }
    try:
        reply = _client(timeout=2.0).status(current)
        if reply.get("error") == "unknown_allocation":  # the daemon may not have polled yet
            _client(timeout=2.0).refresh()
            reply = _client(timeout=2.0).status(current)
    except OSError as exc:  # DaemonUnreachable too
        if not _interposed():
            return {
                **base,
                "state": "unenforced",
                "allocation_id": current,
                "message": f"This kernel holds the share {current}, but shares are not "
                "enforced here (no gpushare daemon), so there is no live usage.",
            }
        return {
            **base,
            "state": "unreachable",
            "allocation_id": current,
            "message": f"The gpushare daemon is unreachable ({exc}); retrying.",
        }
    gone = reply.get("error") == "unknown_allocation"
    freed = _free_process_memory() if gone else None
    if gone and ((freed is not None and freed >= 0) or _state.seen_active):
        # released from outside (REST, an admin): the interposer saw its slot released (and
        # freed the memory), or the daemon knew the share before
        freed = None if freed is None else max(freed, 0)
        with _state.lock:
            _state.released = {"id": current}
            _state.memory_freed = freed
        return {
            **base,
            "state": "released",
            "released": _state.released,
            "memory_freed": freed,
            "message": "It was released from outside this kernel. " + RELEASED_MESSAGE,
        }
    if not reply.get("ok"):
        return {
            **base,
            "state": "unreachable",
            "allocation_id": current,
            "message": f"The daemon refused the status of {current}: {reply.get('message')}",
        }
    _state.seen_active = True
    allocation = reply["allocations"][0]
    uuid = allocation["gpus"][0]["gpu"] if allocation.get("gpus") else None
    gpu: dict[str, Any] | None = None
    for entry in reply.get("gpus") or []:
        if entry.get("uuid") == uuid:
            kernels = entry.get("shares", len(entry.get("allocations") or []))  # others unnamed
            gpu = {**_gpu_facts(uuid), **entry, "kernels": kernels}
    return {
        **base,
        "state": "active",
        "allocation_id": current,
        "allocation": allocation,
        "gpu": gpu,
        "daemon": reply.get("daemon"),
        "message": "",
    }


# -- changing ------------------------------------------------------------------------------------


def _free_process_memory() -> int | None:
    """Asks the interposer (preloaded into this process) to free the process's GPU memory now;
    the bytes it freed, -1 when its slots are not released, None without an interposer."""
    try:
        fn = ctypes.CDLL(None).gpushare_release_memory
    except AttributeError:
        return None
    fn.restype = ctypes.c_longlong
    return int(fn())  # -1: the interposer does not see the share released


def release() -> dict[str, Any]:
    """Give this kernel's GPU share back (see the module's doc for exactly what happens).
    Returns ``{"released": Allocation JSON, "memory_freed": bytes, "message": …}``; raises
    :class:`NoShare` when there is nothing to release."""
    current = allocation_id()
    if current is None:
        if _state.released is not None:
            raise NoShare(
                "This kernel's GPU share was already released. " + RELEASED_MESSAGE, code="released"
            )
        raise NoShare("This kernel holds no GPU share.")
    try:
        reply = _ask(_client().release, current)
    except DaemonUnreachable:
        reply = _release_without_daemon(current)  # enforcement off: bookkeeping only
    if not reply.get("ok"):
        raise _refused(reply)
    freed = _free_process_memory()
    freed = None if freed is None else max(freed, 0)  # -1: this process never used the GPU
    with _state.lock:
        _state.released = reply["released"]
        _state.memory_freed = freed
    gone = f"{format_bytes(freed)} of GPU memory freed." if freed else "Its GPU memory is freed."
    return {
        "released": reply["released"],
        "memory_freed": freed,
        "message": f"Released {describe(reply['released'])}. {gone} {AFTER_RELEASE}",
    }


def _release_without_daemon(current: str) -> dict[str, Any]:
    """With enforcement off there is no daemon: a local kernel releases its own allocation in the
    ledger directly (``GPUSHARE_LEDGER``). With the interposer loaded the daemon is needed (it
    frees the memory and tells the interposer), so that case stays an error."""
    path = os.environ.get("GPUSHARE_LEDGER")
    if not path or _interposed():
        raise DaemonUnreachable(
            "The gpushare daemon is unreachable, so the share cannot be released now; try again "
            "in a moment, or shut the kernel down to give the GPU back."
        )
    from ..ledger.sqlite import SQLiteLedger

    async def run() -> dict[str, Any]:
        ledger = SQLiteLedger(path)
        try:
            found = (await ledger.snapshot()).find(current)
            if found is None:
                return {
                    "ok": False,
                    "error": "unknown_allocation",
                    "message": f"no allocation {current!r} in the ledger",
                }
            if found.pid != os.getpid():
                return {
                    "ok": False,
                    "error": "not_permitted",
                    "message": f"allocation {current} is held by process {found.pid}",
                }
            released = await ledger.release(current)
            return {"ok": True, "released": (released or found).to_json()}
        finally:
            await ledger.close()

    box: dict[str, Any] = {}

    def work() -> None:  # own thread: the kernel's main thread runs an event loop
        try:
            box["reply"] = asyncio.run(run())
        except Exception as exc:  # the ledger is unreadable: say so
            box["reply"] = {"ok": False, "error": "ledger", "message": f"the ledger {path}: {exc}"}

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    return dict(box["reply"])


def _interposed() -> bool:
    """Whether libgpushare.so is loaded in this process (enforcement on)."""
    return hasattr(ctypes.CDLL(None), "gpushare_release_memory")


def _share_args(gpu_request: Any, gpu_limit: Any, gpu_memory: Any, gpu_type: Any) -> dict[str, Any]:
    given = {
        "gpu_request": gpu_request,
        "gpu_limit": gpu_limit,
        "gpu_memory": gpu_memory,
        "gpu_type": gpu_type,
    }
    return {k: v for k, v in given.items() if v is not None}


def request(
    gpu_request: float | str | None = None,
    gpu_limit: float | str | None = None,
    gpu_memory: int | str | None = None,
    gpu_type: str | None = None,
) -> dict[str, Any]:
    """Change this kernel's share live, or reserve a new one after a release.

    While the kernel holds a share: request, limit and memory change at once on the same GPU
    when placement allows it there (else :class:`GpushareError` with the reason; nothing
    changes); another GPU type needs a new share (release, then request). Only what is given
    changes, with two rules: a request above the current limit is refused unless a limit is
    given too (the limit is a promise of "at most", not raised behind the user's back), and
    an "auto" memory cap (request × the GPU's memory, what a share without ``gpu_memory``
    gets) follows a new request (kept where the kernel already uses more). After a release: a
    new share is reserved on this node for this kernel; this process cannot use it (its CUDA
    context is gone), a kernel restart does. Returns ``{"allocation", "live", "message"}``."""
    share = _share_args(gpu_request, gpu_limit, gpu_memory, gpu_type)
    current = allocation_id()
    if current is not None:
        if not share:
            raise GpushareError(
                "Nothing to change: give --gpu-request, --gpu-limit or --gpu-memory.",
                code="invalid_share",
                status=400,
            )
        if gpu_type is not None:
            raise GpushareError(
                "A live change keeps the GPU: another GPU type needs a new "
                "share (release this one, then request).",
                code="invalid_share",
                status=400,
            )
        share, auto_memory = _live_change(current, share)
        reply = _ask(_client().resize, current, share)
        kept = ""
        if not reply.get("ok") and auto_memory and reply.get("error") == "below_use":
            share.pop("gpu_memory")  # the kernel uses more than the auto cap would be: keep it
            reply = _ask(_client().resize, current, share)
            kept = " The memory cap stays: the kernel uses more than request × GPU memory."
        if not reply.get("ok"):
            raise _refused(reply)
        return {
            "allocation": reply["allocation"],
            "live": True,
            "message": f"This kernel now holds {describe(reply['allocation'])} "
            f"(changed live).{kept}",
        }
    if _state.released is None:
        raise NoShare(
            "This kernel holds no GPU share and released none: it was not started "
            "with one; pick a 'GPU share' kernel."
        )
    if _state.reserved is not None:
        raise GpushareError(
            f"A new share is already reserved ({describe(_state.reserved)}): "
            "restart the kernel to use it.",
            code="reserved",
            status=409,
        )
    reply = _ask(_client().reserve, share)
    if not reply.get("ok"):
        raise _refused(reply)
    with _state.lock:
        _state.reserved = reply["allocation"]
    return {
        "allocation": reply["allocation"],
        "live": False,
        "message": f"Reserved {describe(reply['allocation'])} for this kernel. This process "
        "released its GPU and cannot create a CUDA context again: restart the "
        "kernel (Kernel > Restart Kernel) to use the new share; the restart keeps "
        "it.",
    }


def _live_change(current: str, share: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The resize to ask the daemon for: ``share`` checked against the share held now, with the
    limit pinned (a request above it is refused here) and an auto memory cap following the
    request. Returns the change and whether the memory in it is that auto cap."""
    # a bad value is a ShareError (code invalid_share, naming the field), a GpushareError too
    asked = ShareSpec.from_mapping(share, defaults=ShareSpec(gpu_request=0.01, gpu_limit=1.0))
    if "gpu_request" not in share:
        return share, False
    held = status()
    allocation = held.get("allocation")
    if held.get("state") != "active" or not allocation:
        return share, False  # the daemon answers the resize with the reason
    request, limit = float(allocation["request"]), float(allocation["limit"])
    change = dict(share)
    if "gpu_limit" not in share:
        if asked.gpu_request > limit + 1e-9:
            raise GpushareError(
                f"gpu_request {asked.gpu_request:g} is above this kernel's limit "
                f"{limit:g} (the most it may use), and a request cannot exceed its limit: "
                f"give the limit too, e.g. --gpu-request {asked.gpu_request:g} --gpu-limit "
                f"{asked.gpu_request:g} (gpu_limit= in Python)",
                code="invalid_share",
                status=400,
                field="gpu_request",
                value=asked.gpu_request,
                allowed=f"at most the limit {limit:g}, or a new limit with it",
                limit=limit,
            )
        change["gpu_limit"] = limit  # unchanged: never lifted with the request
    total = int((held.get("gpu") or {}).get("memory") or 0)
    cap = int(allocation.get("memory_cap") or 0)
    auto = (
        "gpu_memory" not in share
        and total > 0
        and asked.gpu_request != request
        and abs(cap - int(total * request)) <= 1
    )
    if auto:
        change["gpu_memory"] = int(total * asked.gpu_request)
    return change, auto


def wait_cause(allocation: dict[str, Any], shares: int) -> str:
    """Why a share waited for its turn on the GPU, in words: its own limit (alone on the GPU, it
    waits only when it would go beyond its limit), other shares' turns (limit 100 %), or either."""
    value = float(allocation.get("limit") or allocation.get("gpu_limit") or 1.0)
    limit = format_share(value)
    if shares <= 1:
        return f"its own limit ({limit}): no other share on this GPU"
    if value >= 1.0:
        return f"other shares' turns ({shares - 1} other share{'' if shares == 2 else 's'})"
    return f"its own limit ({limit}) or other shares' turns"


def refused_calls() -> int | None:
    """How many GPU calls the interposer preloaded into this process refused (a released or
    refused share: ``CUDA_ERROR_NOT_PERMITTED``), None without an interposer."""
    try:
        fn = ctypes.CDLL(None).gpushare_refused_calls
    except AttributeError:
        return None
    fn.restype = ctypes.c_ulonglong
    return int(fn())


def describe(allocation: dict[str, Any]) -> str:
    """``25–50 % of an A100 (a-…, 20GiB, GPU-…)`` for an Allocation JSON."""
    if "gpu_request" not in allocation:
        return f"the share {allocation.get('id')}"
    kind = allocation.get("gpu_type") or "GPU"
    part = format_share_range(float(allocation["gpu_request"]), float(allocation["gpu_limit"]))
    article = "an" if kind[:1].upper() in "AEFHILMNORSX" else "a"
    gpus = ",".join(allocation.get("gpus") or [])
    return (
        f"{part} of {article} {kind} ({allocation.get('id')}, "
        f"{format_bytes(int(allocation.get('gpu_memory') or 0))}, {gpus})"
    )


__all__ = [
    "AFTER_RELEASE",
    "RELEASED_MESSAGE",
    "DaemonUnreachable",
    "GpushareError",
    "NoShare",
    "ShareError",
    "allocation_id",
    "describe",
    "gpus",
    "note_released_by_daemon",
    "refused_calls",
    "release",
    "released",
    "request",
    "status",
    "wait_cause",
]
