"""Who is calling: a JupyterHub user, resolved from the Hub API token their server holds.

The trust boundary of the controller. A user's Jupyter server sends the token JupyterHub gave it
(``JUPYTERHUB_API_TOKEN``) as ``Authorization: token …``; :class:`HubAuth` asks the Hub who that
is (``GET {hub}/hub/api/user``, the endpoint every Hub service uses) and caches the answer for a
short TTL in a bounded LRU, so a Hub that is briefly away does not stop running kernels and a
flood of bad tokens cannot grow memory. At most ``max_requests`` Hub requests run at once and
``max_waiting`` distinct tokens wait (then 503); one request per token, shielded, so a caller who
hangs up does not cancel it for the others waiting on it. Everything behind this module takes a
:class:`HubUser` that was already checked.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from .errors import ControllerError, unauthorized, unavailable


@dataclass(frozen=True)
class HubUser:
    """A JupyterHub user as the Hub's user model describes it."""

    name: str
    admin: bool = False
    groups: tuple[str, ...] = field(default_factory=tuple)


def token_from_header(header: str | None) -> str:
    """The token of an ``Authorization: token …`` (or ``Bearer …``) header; 401 otherwise."""
    if not header:
        raise unauthorized(
            "no Authorization header: send the server's JupyterHub API token "
            "as 'Authorization: token <JUPYTERHUB_API_TOKEN>'"
        )
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() not in ("token", "bearer") or not token.strip():
        raise unauthorized("Authorization must be 'token <JupyterHub API token>'")
    return token.strip()


class HubAuth:
    """Resolve Hub API tokens to users (``GET /hub/api/user``), with a bounded TTL cache."""

    def __init__(
        self,
        hub_url: str,
        ttl: float = 30.0,
        max_entries: int = 4096,
        timeout: float = 5.0,
        max_requests: int = 8,
        max_waiting: int = 256,
    ) -> None:
        self.hub_url = hub_url.rstrip("/")
        self.max_waiting = max_waiting
        self._asking = asyncio.Semaphore(max_requests)
        self.ttl = ttl
        self.max_entries = max_entries
        self.timeout = timeout
        # sha256(token) -> (expires, user or None for a token the Hub refused)
        self._cache: OrderedDict[str, tuple[float, HubUser | None]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[HubUser | None]] = {}
        self.hub_requests = 0

    async def user(self, token: str) -> HubUser:
        """The user holding ``token``; 401 for a token the Hub does not know, 503 when the
        Hub cannot be asked."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(key)
            found = cached[1]
        else:
            pending = self._inflight.get(key)
            if pending is None:  # one Hub request per token at a time
                if len(self._inflight) >= self.max_waiting:
                    raise unavailable(
                        "busy", "too many Hub token checks under way; try again in a moment"
                    )
                pending = asyncio.ensure_future(self._bounded_ask(token))
                self._inflight[key] = pending
                pending.add_done_callback(lambda done: self._settled(key, done))
            # shielded: a caller who hangs up does not cancel the check the others wait on
            found = await asyncio.shield(pending)
        if found is None:
            raise unauthorized("the JupyterHub API token was refused by the Hub")
        return found

    async def _bounded_ask(self, token: str) -> HubUser | None:
        async with self._asking:  # at most max_requests Hub requests at once
            return await self._ask(token)

    def _settled(self, key: str, done: asyncio.Future[HubUser | None]) -> None:
        if self._inflight.get(key) is done:
            del self._inflight[key]
        if not done.cancelled() and done.exception() is None:
            self._remember(key, done.result())

    def _remember(self, key: str, user: HubUser | None) -> None:
        # refusals are kept briefly too, so a bad token cannot make us hammer the Hub
        ttl = self.ttl if user is not None else min(self.ttl, 5.0)
        self._cache[key] = (time.monotonic() + ttl, user)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)

    async def _ask(self, token: str) -> HubUser | None:
        self.hub_requests += 1
        request = HTTPRequest(
            f"{self.hub_url}/hub/api/user",
            headers={"Authorization": f"token {token}"},
            request_timeout=self.timeout,
            connect_timeout=self.timeout,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as exc:
            if exc.code in (401, 403, 404):
                return None
            raise unavailable(
                "hub_unavailable", f"JupyterHub at {self.hub_url} answered {exc.code}"
            ) from None
        except (OSError, asyncio.TimeoutError) as exc:
            raise unavailable(
                "hub_unavailable", f"JupyterHub at {self.hub_url} cannot be reached: {exc}"
            ) from None
        return parse_user_model(response.body)


def parse_user_model(body: bytes) -> HubUser | None:
    """The Hub's user model (``name``, ``admin``, ``groups``); a service token (``kind``
    'service') or anything without a name is no user."""
    try:
        model = json.loads(body)
    except ValueError:
        return None
    if not isinstance(model, dict) or model.get("kind", "user") != "user":
        return None
    name = model.get("name")
    if not isinstance(name, str) or not name:
        return None
    groups = model.get("groups") or []
    return HubUser(
        name=name,
        admin=model.get("admin") is True,
        groups=tuple(g for g in groups if isinstance(g, str)),
    )


__all__ = ["ControllerError", "HubAuth", "HubUser", "parse_user_model", "token_from_header"]
