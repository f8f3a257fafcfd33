"""What an unauthenticated caller can make the controller do with ``PUT /api/usage/<node>``
(issue 16): the node daemons' TokenReviews are bounded. Garbage costs no review, distinct
JWT-shaped tokens cost at most ``max_reviews`` reviews in flight (and at most ``max_waiting``
waiting, then 503), refusals are remembered apart from accepted tokens, and a caller who hangs
up does not cancel the review others wait on. The API server's side (audiences, a real
TokenReview) is tested in test_controller_cache.py against the real kube-apiserver.

The API server is played here by :meth:`NodeAuth._token_review` (the one call that asks it), so
the bounds are counted exactly; nothing else is replaced.

Where it runs: no cluster: the controller's TokenReview bounds against a fake reviewer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import pytest

from jupyter_gpushare.controller.auth import HubAuth, HubUser
from jupyter_gpushare.controller.errors import ControllerError
from jupyter_gpushare.controller.usage import AUDIENCE, NodeAuth, jwt_claims, precheck

NAMESPACE = "gpushare"
DAEMON = f"system:serviceaccount:{NAMESPACE}:gpushare-daemon"


def part(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def jwt(n: int, audience: str = AUDIENCE, exp: float | None = None) -> str:
    """A JWT-shaped token (unsigned: the signature part is noise) claiming ``audience``."""
    claims = {"aud": [audience], "sub": f"caller-{n}", "exp": exp or time.time() + 600}
    return f"{part({'alg': 'RS256', 'kid': 'k'})}.{part(claims)}.c2lnbmF0dXJl{n}"


class Reviewed(NodeAuth):
    """NodeAuth whose API server knows ``good`` (the daemon's token); each review takes
    ``delay`` seconds, or until ``gate`` is set."""

    def __init__(self, good: set[str] = frozenset(), delay: float = 0.0, **kw: Any) -> None:
        super().__init__(kube=None, namespace=NAMESPACE, **kw)  # type: ignore[arg-type]
        self.good = set(good)
        self.delay = delay
        self.gate: asyncio.Event | None = None
        self.audiences = [AUDIENCE]

    async def _token_review(self, token: str) -> dict[str, Any]:
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(self.delay)
        if token not in self.good:
            return {"authenticated": False, "error": "invalid bearer token"}
        return {
            "authenticated": True,
            "audiences": self.audiences,
            "user": {"username": DAEMON},
        }


async def outcome(auth: NodeAuth, token: str) -> int:
    try:
        await auth.check(token, "n1")
    except ControllerError as exc:
        return exc.status
    return 200


async def test_garbage_costs_no_review() -> None:
    """2,000 distinct tokens that are no JWT, or claim another audience, or have expired, at
    once: all 401, and not one TokenReview."""
    auth = Reviewed()
    garbage = [f"garbage-{n}" for n in range(1000)]
    garbage += [f"a.b.c{n}" for n in range(300)]  # three parts, no JSON header
    garbage += [jwt(n, audience="https://kubernetes.default.svc") for n in range(400)]
    garbage += [jwt(n, exp=time.time() - 60) for n in range(300)]
    assert len(set(garbage)) == 2000
    results = await asyncio.gather(*(outcome(auth, t) for t in garbage))
    assert set(results) == {401}
    assert auth.reviews == 0
    why = precheck(jwt(1, audience="https://kubernetes.default.svc"), AUDIENCE, time.time())
    assert why is not None and AUDIENCE in why and "kubernetes.default.svc" in why
    assert jwt_claims("x" * 20000) is None and jwt_claims(jwt(3)) is not None


async def test_distinct_jwts_are_reviewed_at_most_max_reviews_at_once() -> None:
    """200 distinct JWT-shaped invalid tokens at once: each reviewed once, never more than the
    semaphore's width in flight; asked again, they are refused from the negative cache."""
    auth = Reviewed(delay=0.02, max_reviews=8)
    tokens = [jwt(n) for n in range(200)]
    results = await asyncio.gather(*(outcome(auth, t) for t in tokens))
    assert set(results) == {401}
    assert auth.reviews == 200
    assert 1 <= auth.most_in_flight <= 8, auth.most_in_flight
    results = await asyncio.gather(*(outcome(auth, t) for t in tokens))
    assert set(results) == {401} and auth.reviews == 200  # remembered


async def test_waiting_reviews_are_bounded_then_503() -> None:
    auth = Reviewed(max_reviews=2, max_waiting=5)
    auth.gate = asyncio.Event()
    first = [asyncio.ensure_future(outcome(auth, jwt(n))) for n in range(5)]
    await asyncio.sleep(0.05)
    assert await outcome(auth, jwt(99)) == 503  # a sixth distinct token: try again later
    auth.gate.set()
    assert await asyncio.gather(*first) == [401] * 5
    assert await outcome(auth, jwt(100)) == 401  # room again


async def test_a_cancelled_waiter_does_not_cancel_the_review_for_others() -> None:
    daemon = jwt(7)
    auth = Reviewed(good={daemon})
    auth.gate = asyncio.Event()
    first = asyncio.ensure_future(auth.check(daemon, "n1"))
    second = asyncio.ensure_future(auth.check(daemon, "n1"))
    await asyncio.sleep(0.05)
    first.cancel()  # the first report's connection is gone
    with pytest.raises(asyncio.CancelledError):
        await first
    auth.gate.set()
    await asyncio.wait_for(second, 5)  # accepted: the shared review went on
    assert auth.reviews == 1
    await auth.check(daemon, "n1")  # and its verdict is cached
    assert auth.reviews == 1


async def test_refusals_cannot_evict_the_daemons_verdicts() -> None:
    daemon = jwt(0)
    auth = Reviewed(good={daemon}, max_refused=16)
    await auth.check(daemon, "n1")
    results = await asyncio.gather(*(outcome(auth, jwt(n)) for n in range(1, 201)))
    assert set(results) == {401} and auth.reviews == 201
    await auth.check(daemon, "n1")
    assert auth.reviews == 201  # still cached
    assert len(auth._refused) == 16  # the negative cache stays small


async def test_a_review_that_does_not_confirm_the_audience_is_refused() -> None:
    """An API server that authenticates the token but not for the controller's audience (one
    that ignores spec.audiences, or names others): 401 naming the audience."""
    daemon = jwt(5)
    auth = Reviewed(good={daemon})
    auth.audiences = ["https://kubernetes.default.svc"]
    with pytest.raises(ControllerError) as refused:
        await auth.check(daemon, "n1")
    assert refused.value.status == 401 and AUDIENCE in str(refused.value)


class Hub(HubAuth):
    """HubAuth whose Hub knows ``alice-token``; each request waits for ``gate``."""

    def __init__(self, **kw: Any) -> None:
        super().__init__("http://hub.invalid", **kw)
        self.gate = asyncio.Event()
        self.asked = 0
        self.in_flight = 0
        self.most_in_flight = 0

    async def _ask(self, token: str) -> HubUser | None:
        self.asked += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
        finally:
            self.in_flight -= 1
        return HubUser("alice") if token == "alice-token" else None


async def test_hub_tokens_bounded_and_shared_checks_shielded() -> None:
    """The same bounds for Hub API tokens (users' servers): a cancelled caller does not cancel
    the Hub request others wait on; distinct bad tokens are asked at most ``max_requests`` at
    a time, at most ``max_waiting`` wait, then 503."""
    hub = Hub(max_requests=4, max_waiting=50)
    first = asyncio.ensure_future(hub.user("alice-token"))
    second = asyncio.ensure_future(hub.user("alice-token"))
    await asyncio.sleep(0.05)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    bad = [asyncio.ensure_future(hub.user(f"bad-{n}")) for n in range(49)]
    await asyncio.sleep(0.05)
    with pytest.raises(ControllerError) as busy:
        await hub.user("one-too-many")
    assert busy.value.status == 503
    assert hub.most_in_flight == 4
    hub.gate.set()
    assert (await asyncio.wait_for(second, 5)).name == "alice"
    results = await asyncio.gather(*bad, return_exceptions=True)
    assert all(isinstance(r, ControllerError) and r.status == 401 for r in results)
    assert hub.asked == 50 and hub.most_in_flight == 4
    await hub.user("alice-token")  # cached
    assert hub.asked == 50
