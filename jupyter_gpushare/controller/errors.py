"""The controller's refusals: :class:`ControllerError` ``(status, code, message, fields)``, a
:class:`~jupyter_gpushare.errors.GpushareError` like every refusal of the package.

Every refusal of the HTTP API is a GpushareError, written as JSON by the package's one
:func:`~jupyter_gpushare.errors.write_error`: ``{"error": code, "message": ..., **fields}``. The
user-server side
(:mod:`.client`) turns the same body back into an exception, so a refused share reaches the
notebook with the controller's words.
"""

from __future__ import annotations

from typing import Any

from ..errors import GpushareError
from ..ledger import AllocationNotFound, LedgerConflict
from ..share import shown_value


class ControllerError(GpushareError):
    def __init__(self, status: int, code: str, message: str, **fields: Any) -> None:
        super().__init__(message, code=code, status=status, **fields)


def unauthorized(message: str) -> ControllerError:
    return ControllerError(401, "unauthorized", message)


def forbidden(message: str) -> ControllerError:
    return ControllerError(403, "forbidden", message)


def not_found(what: str, value: str) -> ControllerError:
    return ControllerError(
        404, "not_found", f"no {what} {value!r} (or not yours)", field=what, value=value
    )


def bad_request(field: str, value: Any, allowed: str) -> ControllerError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ControllerError(
        400,
        "invalid",
        f"{field}: {shown} is not allowed; expected {allowed}",
        field=field,
        value=shown_value(value),
        allowed=allowed,
    )


def unavailable(code: str, message: str, **fields: Any) -> ControllerError:
    return ControllerError(503, code, message, **fields)


def from_exception(exc: BaseException) -> GpushareError | None:
    """The refusal a known exception answers with (None for anything else: a bug, answered 500
    without details). Every refusal of the share, placement, resize and ledger boxes is a
    :class:`GpushareError` already; an unknown allocation also says it may be another's."""
    if isinstance(exc, AllocationNotFound):
        return not_found("allocation", str(exc.args[0]) if exc.args else "")
    if isinstance(exc, LedgerConflict):
        return ControllerError(503, "ledger_busy", str(exc))
    if isinstance(exc, GpushareError):
        return exc
    return None


__all__ = [
    "ControllerError",
    "bad_request",
    "forbidden",
    "from_exception",
    "not_found",
    "unauthorized",
    "unavailable",
]
