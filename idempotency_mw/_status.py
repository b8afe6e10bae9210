"""A key's status, for the client that sent it: whether a request it never got an answer to took effect, without
resending it (a large body, say), and until when its record lives. Only the key's own tenant can read it."""

from __future__ import annotations

import datetime
import time

import orjson
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idempotency_mw import _problems as problems
from idempotency_mw._events import Notices
from idempotency_mw._keys import AuthorizationTenant, InvalidKey, TenantResolver, parse_key, requirement, resolve_tenant
from idempotency_mw.store import RecordInfo, Store, StoreUnavailable


def key_status_route(
    store: Store,
    path: str = "/idempotency-keys/{key}",
    *,
    tenant: TenantResolver | None = None,
    problem_renderer: problems.ProblemRenderer | None = None,
) -> Route:
    """``GET path`` answers the status of ``{key}`` for the caller's tenant (``tenant``: the middleware's resolver;
    by default the same default, an HMAC of ``Authorization``): ``absent`` (never seen, released, expired, or
    another tenant's), ``in_progress``, or ``completed`` with the status it answered; with ``first_seen`` and
    ``expires``. Its refusals (a bad key, unknown credentials, the store unreachable) are the middleware's, in
    ``problem_renderer``'s envelope if given (the middleware's). ``app.routes.append(key_status_route(store))``."""
    if "{key}" not in path:
        raise ValueError(f"key_status_route needs a path with {{key}} in it, got {path!r}")
    envelope = problems.Envelope(problem_renderer, Notices())
    # Any key, a "/" in it included: a client sends it percent-encoded, and the server decodes the path before it
    # is matched, so the key may span segments.
    matched = path.replace("{key}", "{key:path}")
    return Route(
        matched, KeyStatus(store, AuthorizationTenant() if tenant is None else tenant, envelope), methods=["GET"]
    )


class KeyStatus:
    """The endpoint of :func:`key_status_route`, an ASGI app so that its refusals are the middleware's problems."""

    def __init__(self, store: Store, tenant: TenantResolver, envelope: problems.Envelope) -> None:
        self.store = store
        self.tenant = tenant
        self.envelope = envelope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            key = parse_key(str(scope["path_params"]["key"]).encode("latin-1"))
        except (InvalidKey, UnicodeEncodeError) as error:
            return await self.envelope.send(problems.key_invalid(str(error) or "not a valid key"), scope, send)
        owner = await resolve_tenant(self.tenant, scope)
        if owner is None:
            return await self.envelope.send(problems.tenant_unknown(requirement(self.tenant)), scope, send)
        try:
            record = await self.store.inspect(owner, key)
        except StoreUnavailable:
            return await self.envelope.send(problems.store_unavailable(1), scope, send)
        body = orjson.dumps(_status(key, record, time.time()))
        headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _status(key: str, record: RecordInfo | None, now: float) -> dict[str, object]:
    if record is None or record.expires_at <= now:
        return {"key": key, "state": "absent", "status": None, "first_seen": None, "expires": None}
    return {
        "key": key,
        "state": record.state,
        "status": record.response.status if record.response is not None else None,
        "first_seen": _iso(record.created_at),
        "expires": _iso(record.expires_at),
    }


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).isoformat(timespec="seconds")
