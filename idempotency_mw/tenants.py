"""Tenant resolvers: who owns a key.

Keys are unique per tenant, so two customers who both send ``Idempotency-Key: 1`` never meet. A resolver maps the
ASGI scope to a tenant string (an account id, an API-key id, a JWT subject), or to None when it cannot tell whose
request this is: the middleware then refuses the keyed request rather than let it share a namespace with strangers.
It may be sync or async.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Scope

from idempotency_mw.keys import InvalidKey, MissingKey, key_from_headers
from idempotency_mw.store import Store, StoreUnavailable

TenantResolver = Callable[[Scope], "str | Awaitable[str | None] | None"]


class TenantFromApp:
    """A tenant the app tells the middleware itself, from inside the request, once its own authentication has
    answered. With one as ``tenant=``, the middleware reads and checks the key and the body, then leaves the claim of
    each keyed request to :func:`idempotency_mw.claim`, which the app calls with the tenant it resolved (an account,
    an API key's owner); :class:`idempotency_mw.fastapi.TenantDependency` does so as a FastAPI dependency. The app's
    own answers (its 401) come before any of the middleware's.

    The middleware never calls it with a scope. :meth:`check` may refuse, at startup, an app whose covered routes
    would run without telling their tenant.
    """

    requirement = "the credentials this API authenticates requests with"  # what a client without a tenant lacks

    def check(self, app: Any, covered: Callable[[Any, str, frozenset[str] | None], bool]) -> None:
        """Raise ValueError naming the covered routes of ``app`` that would not claim (``covered(endpoint, path,
        methods)`` tells whether the middleware covers a route); nothing to check by default."""


SECRET_VARIABLE = "IDEMPOTENCY_TENANT_SECRET"
# The records of a route that names its own tenant (``tenant=`` on a route: a provider's webhooks) are stored under
# this prefix and that tenant, so that no tenant of the middleware's resolver meets them; a resolver that returns a
# tenant with this prefix is refused.
ROUTE_TENANTS = "route:"
MIN_SECRET_LENGTH = 32
GENERATE_SECRET = 'python -c "import secrets; print(secrets.token_hex(32))"'
PREFIX = "hmac-sha256:"

# credentials = auth-scheme [ 1*SP ( token68 / #auth-param ) ] (RFC 9110 §11.4), after the OWS around the value.
_CREDENTIALS = re.compile(rb"([^ \t]+)[ \t]*(.*)", re.DOTALL)


class AuthorizationTenant:
    """The default resolver: an HMAC-SHA256 of the ``Authorization`` header, keyed by a server-side secret.

    A plain hash of a Basic credential is a password verifier that a dictionary inverts; under a secret it is not,
    and the same secret on every instance gives the same tenant everywhere, across restarts. The secret is
    ``secret``, or else the ``IDEMPOTENCY_TENANT_SECRET`` environment variable: at least 32 characters.

    What HTTP leaves open is normalised first (the scheme's case, the whitespace around and after it), so
    ``Bearer x`` and ``bearer  x`` are one tenant; the credentials themselves are compared as sent. A request
    without the header, with an empty one, or with several has no tenant (None), unless ``anonymous`` names the
    namespace that requests without credentials share.
    """

    requirement = "exactly one Authorization header"  # what a client without a tenant lacks

    def __init__(self, secret: str | bytes | None = None, *, anonymous: str | None = None) -> None:
        self._keyed = hmac.new(_secret_bytes(secret), digestmod=hashlib.sha256)  # copied for each request
        self.anonymous = _anonymous(anonymous)

    def derive(self, label: bytes) -> list[bytes]:
        """The HMAC-SHA256 of ``label`` under the secret, for a key derived from it (the fingerprint keys of
        ``fingerprint.FingerprintKeys.derived``): a list, one per secret, the current one first."""
        keyed = self._keyed.copy()
        keyed.update(label)
        return [keyed.digest()]

    def __call__(self, scope: Scope) -> str | None:
        values = _values(scope, b"authorization")
        if len(values) > 1:
            return None  # which one is the caller? Not for us to guess
        credentials = _canonical(values[0]) if values else None
        if credentials is None:
            return self.anonymous
        keyed = self._keyed.copy()
        keyed.update(credentials)
        return PREFIX + keyed.hexdigest()


def header_tenant(header: str, *, anonymous: str | None = None) -> TenantResolver:
    """A resolver that takes the tenant from a request header set by a trusted proxy (say ``x-account-id``).

    A request without the header has no tenant (None) unless ``anonymous`` names a shared one; a repeated header
    never has one.
    """
    if not isinstance(header, str) or not header.strip():
        raise ValueError(f"header_tenant needs a header name, got {header!r}")
    wanted = header.strip().lower().encode("latin-1")
    shared = _anonymous(anonymous)

    def resolve(scope: Scope) -> str | None:
        values = _values(scope, wanted)
        if len(values) > 1:
            return None  # which one is the caller? Not for us to guess
        value = values[0].strip(b" \t") if values else b""
        return value.decode("latin-1") if value else shared  # an empty header names nobody

    resolve.requirement = f"exactly one {header.strip()} header"  # type: ignore[attr-defined]
    return resolve


def legacy_sha256_fallback(store: Store, tenant: TenantResolver | None = None) -> TenantResolver:
    """For one ``ttl`` after upgrading from the unsalted SHA-256 default: then remove it.

    A keyed request whose record was written before the upgrade (under ``sha256(Authorization)``, as the old
    default stored it) keeps that tenant, so its retry still finds its record; every other request gets ``tenant``
    (by default ``AuthorizationTenant()``), so no new SHA-256 value is written. It costs one extra store read per
    keyed request. Once every record written before the upgrade has expired, it finds nothing: switch to
    ``tenant`` alone.
    """
    new = AuthorizationTenant() if tenant is None else tenant

    async def resolve(scope: Scope) -> str | None:
        values = _values(scope, b"authorization")
        if len(values) == 1:
            try:
                key = key_from_headers(scope["headers"])
            except (MissingKey, InvalidKey):
                key = None
            if key is not None:
                legacy = hashlib.sha256(values[0]).hexdigest()
                try:
                    record = await store.inspect(legacy, key)
                except StoreUnavailable:
                    record = None  # the claim will meet the same outage and answer 503
                if record is not None and record.expires_at > time.time():
                    return legacy
        resolved = new(scope)
        return await resolved if inspect.isawaitable(resolved) else resolved

    return resolve


def _canonical(value: bytes) -> bytes | None:
    """``scheme credentials`` with the scheme lower-cased and one space between; None for an empty value.

    A value without a space is bare credentials (``Authorization: sk_live_AbC``, as some APIs take it), not a
    scheme: it is compared as sent, since credentials are case-sensitive."""
    match = _CREDENTIALS.fullmatch(value.strip(b" \t"))
    if match is None:
        return None
    scheme, credentials = match.groups()
    return scheme.lower() + b" " + credentials if credentials else scheme


def _values(scope: Scope, name: bytes) -> list[bytes]:
    return [bytes(value) for key, value in scope["headers"] if key == name]


def _secret_bytes(secret: str | bytes | None) -> bytes:
    source = "the tenant secret"
    if secret is None:
        secret = os.environ.get(SECRET_VARIABLE) or None
        source = SECRET_VARIABLE
        if secret is None:
            raise ValueError(
                f"the default tenant resolver needs a secret, the same on every instance: set the environment "
                f"variable {SECRET_VARIABLE} to a random value of at least {MIN_SECRET_LENGTH} characters "
                f"(generate one with: {GENERATE_SECRET}), or pass tenant=AuthorizationTenant(secret), or pass "
                f"tenant= a resolver of your own that returns the account that owns the request"
            )
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"the tenant secret must be str or bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_LENGTH:
        raise ValueError(
            f"{source} is {len(secret)} characters long; it must be at least {MIN_SECRET_LENGTH} "
            f"(generate one with: {GENERATE_SECRET})"
        )
    return secret


def _anonymous(anonymous: str | None) -> str | None:
    if anonymous is not None and not isinstance(anonymous, str):
        raise TypeError(f"anonymous must be a tenant string or None, not {type(anonymous).__name__}")
    return anonymous


def requirement(resolver: object) -> str | None:
    """What a client must send for ``resolver`` to find its tenant, for the 400 that tells it (None: unknown)."""
    found = getattr(resolver, "requirement", None)
    return found if isinstance(found, str) else None


async def resolve_tenant(resolver: TenantResolver, scope: Scope) -> str | None:
    """The tenant ``resolver`` tells for a request, awaited if it is awaitable, and checked: a ``str`` or None."""
    tenant = resolver(scope)
    if isinstance(tenant, str) or tenant is None:
        return tenant
    if inspect.isawaitable(tenant):
        tenant = await tenant
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"the tenant resolver must return a str or None, not {type(tenant).__name__}")
    return tenant


def unknown_tenant_advice(resolver: object) -> str:
    """For the operator, once: why keyed requests get 400 idempotency_tenant_unknown, in the words of ``resolver``."""
    needs = requirement(resolver)
    if isinstance(resolver, AuthorizationTenant):
        advice = (
            "If your clients authenticate otherwise (an API-key header, cookies, a gateway), pass tenant= a resolver "
            "that returns their account; to let requests without credentials share one namespace, pass "
            'tenant=AuthorizationTenant(anonymous="public").'
        )
    else:
        advice = "It gave None for a keyed request: it is the app's to say whose request this is."
    why = f"it needs {needs}" if needs else "it gave no tenant"
    return (
        "idempotency: a request with an Idempotency-Key got 400 idempotency_tenant_unknown because the tenant "
        f"resolver {resolver!r} could not tell whose key it is ({why}). {advice} Logged once per middleware."
    )
