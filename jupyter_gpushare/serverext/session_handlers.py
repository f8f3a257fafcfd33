"""``POST /api/sessions`` answers a refused share with its own status and reason.

jupyter_server's session handler turns every failed kernel start into ``HTTPError(500, str(e))``
(its ``except Exception`` clause), so a notebook opened with a share that does not fit answered
500, logged as a server fault, and JupyterLab showed "Error Starting Kernel" with the exception's
text. A refusal is the user's answer, not a fault: this subclass keeps jupyter_server's ``post``
unchanged and only rewrites the error it raises when its cause is a
:class:`~jupyter_gpushare.provisioner.ShareRefused` - 400 for an invalid share, 409 when nothing
fits, with the same JSON body (``error``, ``message``) as ``POST /api/kernels``. Any other failure
stays jupyter_server's 500. The extension registers it on jupyter_server's own URL; tornado
matches extension rules before the server's core ones.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

from jupyter_server.services.sessions.handlers import SessionRootHandler
from jupyter_server.utils import url_path_join

from ..provisioner import ShareRefused


def refusal_behind(error: BaseException | None) -> ShareRefused | None:
    """The :class:`ShareRefused` that ``error`` wraps (its cause or context chain), if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ShareRefused):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class GpuShareSessionRootHandler(SessionRootHandler):
    """jupyter_server's ``/api/sessions`` with refused shares answered as 400/409."""

    def log_exception(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if refusal_behind(value) is None:
            super().log_exception(typ, value, tb)
        # a refusal was logged once already, as one line (provisioner.RefusalLoggedOnce)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc_info = kwargs.get("exc_info")
        refused = refusal_behind(exc_info[1] if exc_info else None)
        if refused is None:
            super().write_error(status_code, **kwargs)
            return
        self.set_status(refused.status_code, reason=refused.reason)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(refused.body))


def session_handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, r"/api/sessions/?"), GpuShareSessionRootHandler)]
