"""The controller's one error model: :class:`ControllerError` ``(status, code, message, fields)``.

Every refusal of the HTTP API is one of these, written as JSON by one function
(:func:`error_body`): ``{"error": code, "message": ..., **fields}``. The user-server side
(:mod:`.client`) turns the same body back into an exception, so a refused share reaches the
notebook with the controller's words.
"""

from __future__ import annotations

from typing import Any

from ..ledger import AllocationNotFound, LedgerConflict, LedgerUnavailable
from ..placement import PlacementRefused
from ..resize import BelowUse, UsageUnknown
from ..share import ShareError


class ControllerError(Exception):
    def __init__(self, status: int, code: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.fields = fields

    def to_json(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.fields}


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
        allowed=allowed,
    )


def unavailable(code: str, message: str, **fields: Any) -> ControllerError:
    return ControllerError(503, code, message, **fields)


def from_exception(exc: BaseException) -> ControllerError | None:
    """The error a known exception of the share, placement and ledger boxes maps to (None for
    anything else: a bug, answered 500 without details)."""
    if isinstance(exc, ControllerError):
        return exc
    if isinstance(exc, ShareError):
        body = exc.to_json()
        return ControllerError(
            400, str(body.pop("error", "invalid_share")), str(body.pop("message", exc)), **body
        )
    if isinstance(exc, (PlacementRefused, BelowUse, UsageUnknown)):
        body = exc.to_json()
        status = 503 if isinstance(exc, UsageUnknown) else 409
        return ControllerError(status, str(body.pop("error")), str(body.pop("message")), **body)
    if isinstance(exc, AllocationNotFound):
        return not_found("allocation", str(exc.args[0]) if exc.args else "")
    if isinstance(exc, LedgerUnavailable):
        body = exc.to_json()
        return ControllerError(
            503, str(body.pop("error", "ledger_unavailable")), str(body.pop("message", exc)), **body
        )
    if isinstance(exc, LedgerConflict):
        return ControllerError(503, "ledger_busy", str(exc))
    return None


__all__ = [
    "ControllerError",
    "bad_request",
    "error_body",
    "forbidden",
    "from_exception",
    "not_found",
    "unauthorized",
    "unavailable",
]


def error_body(exc: ControllerError) -> dict[str, Any]:
    return exc.to_json()
