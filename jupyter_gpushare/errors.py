"""One error model: :class:`GpushareError` (code, HTTP status, message; field, value and allowed
where the error is about input) and one :func:`write_error` that answers it as JSON.

Every refusal a user or client can see subclasses it (a bad share, nothing fits, a memory cap
below use, usage not known, an unavailable or contended ledger, an unknown allocation, no GPU, the
agent's or the controller's refusal, a share released while its kernel started), so the server
extension and the controller answer each with the same function and the same shape::

    {"error": code, "message": "...", "field": ..., "value": ..., "allowed": ..., **fields}

(``field``/``value``/``allowed`` only for input errors; ``fields`` carry what a client needs
beyond that, e.g. ``suggestions`` of ``no_fit``, ``memory_used`` of ``below_use``). Clients read
that shape: ``tests/test_rest_*.py``, the lab extension's ``api.ts``. A leaf module: it imports
nothing of the package, so every box may raise these.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tornado.web import RequestHandler

_UNSET: Any = object()


class GpushareError(Exception):
    """A refusal with a code (``error`` in JSON), an HTTP status and a message for people.

    Subclasses set ``code`` and ``status`` as class attributes (an instance may override them);
    an input error also names ``field``, the ``value`` given and what is ``allowed``."""

    code: str = "error"
    status: int = 500
    field: str | None = None
    value: Any = None
    allowed: str | None = None

    def __init__(
        self,
        message: str = "",
        *,
        code: str | None = None,
        status: int | None = None,
        field: str | None = None,
        value: Any = _UNSET,
        allowed: str | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if field is not None:
            self.field = field
        if value is not _UNSET:
            self.value = value
        if allowed is not None:
            self.allowed = allowed
        self.fields: dict[str, Any] = dict(fields)

    def json_value(self) -> Any:
        """``value`` as JSON carries it (as given when JSON can, else its text)."""
        try:
            json.dumps(self.value)
            return self.value
        except (TypeError, ValueError):
            return repr(self.value)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code, "message": str(self.message or self)}
        if self.field is not None:
            body["field"] = self.field
            body["value"] = self.json_value()
            body["allowed"] = self.allowed
        body.update(self.fields)
        return body


def write_error(handler: RequestHandler, error: GpushareError) -> None:
    """Answer ``error`` on ``handler`` (any tornado handler: the server extension's REST API,
    the controller's): its status and its JSON body."""
    handler.set_status(error.status)
    handler.set_header("Content-Type", "application/json")
    handler.finish(json.dumps(error.to_json(), default=str))


__all__ = ["GpushareError", "write_error"]
