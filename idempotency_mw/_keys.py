"""The name of a request's record: its key, and the tenant that owns it.

The key is the ``Idempotency-Key`` header, another header a route names, or a route's function of the body (a
webhook's event id). The IETF draft makes the header an RFC 8941/9651 structured-field *String* (``"8e03978e-…"``);
Stripe and most clients send a bare token (``8e03978e-…``). Both are accepted and name the same key. Anything else
is refused with a reason, never repaired: a key we rewrote silently could collide with another client's key.

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
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import Scope

from idempotency_mw._wire import KEY_HEADER, MAX_KEY_LENGTH
from idempotency_mw.store import Store, StoreUnavailable

HEADER = KEY_HEADER.lower().encode("ascii")  # as ASGI servers pass header names


class InvalidKey(ValueError):
    """The header is present but is not a valid key; the message says why."""


class MissingKey(LookupError):
    """The request carries no ``Idempotency-Key`` header."""


class KeyFunctionFailed(InvalidKey):
    """A route's ``key_from`` function raised on this request's body (a JSON array where it expects an object): the
    request has no valid key, and its caller, who may be anyone, gets 400. The function's error is the cause."""


class RequestHeaders:
    """The headers the middleware reads of a request: the values of its key's header (``Idempotency-Key``, or the one
    a route names), of ``Authorization`` (the default tenant resolver's), and the first ``Content-Type`` and
    ``Content-Length``. ASGI servers pass names lower-cased. When no name comes twice (the common case), a dictionary
    of the list picks them out; a repeated name (two keys must be refused) takes a pass over the list."""

    __slots__ = ("authorization", "content_length", "content_type", "key")

    def __init__(self, headers: list[tuple[bytes, bytes]], key_header: bytes = HEADER) -> None:
        by_name = dict(headers)
        if len(by_name) == len(headers):  # no name twice, the common case: a look-up each, no loop
            key, authorization = by_name.get(key_header), by_name.get(b"authorization")
            self.key = [] if key is None else [key]
            self.authorization = [] if authorization is None else [authorization]
            self.content_type = bytes(by_name.get(b"content-type", b""))
            self.content_length = bytes(by_name.get(b"content-length", b""))
            return
        self.key = [value for name, value in headers if name == key_header]
        self.authorization = [value for name, value in headers if name == b"authorization"]
        self.content_type = bytes(next((v for n, v in headers if n == b"content-type"), b""))
        self.content_length = bytes(next((v for n, v in headers if n == b"content-length"), b""))


def key_from_headers(headers: list[tuple[bytes, bytes]], header: bytes = HEADER) -> str:
    """Return the key carried by raw ASGI ``headers`` (in ``Idempotency-Key``, or another lower-cased ``header``).

    Raises :class:`MissingKey` when there is none and :class:`InvalidKey` when the header is repeated or malformed.
    """
    return key_from_values([value for name, value in headers if name == header], header)


def key_from_values(values: list[bytes], header: bytes = HEADER) -> str:
    """The key of the values a request's key header came with: :class:`MissingKey` for none, :class:`InvalidKey`
    for several (which one is the client's?) or a malformed one."""
    if not values:
        raise MissingKey()
    if len(values) > 1:
        raise InvalidKey(f"the {header.decode('latin-1')} header must appear exactly once")
    return parse_key(values[0])


def key_from_body(key_from: Callable[[Any], Any], body: Any) -> str:
    """What a route's function finds in the request body as the app reads it (a webhook's event id): the key; None
    means none (:class:`MissingKey`), and a function that raises means a body without one (:class:`KeyFunctionFailed`,
    so its caller, who may be anyone, gets 400 rather than a traceback)."""
    try:
        key = key_from(body)
    except Exception as error:
        raise KeyFunctionFailed(
            f"this route takes its idempotency key from the request body, and none could be read from this one "
            f"(a JSON {type(body).__name__})"
        ) from error
    if key is None:
        raise MissingKey()
    return key_from_payload(key)


def parse_key(raw: bytes) -> str:
    """Parse one header value: an sf-string (``"abc"``) or a bare token (``abc``)."""
    value = raw.strip(b" \t")
    if not value:
        raise InvalidKey("the Idempotency-Key header is empty")
    key = _parse_sf_string(value) if value[:1] == b'"' else _parse_token(value)
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidKey(f"an idempotency key is 1 to {MAX_KEY_LENGTH} characters long, this one has {len(key)}")
    return key


# Visible ASCII except the comma: every byte a bare key may hold (the loop below only runs to say what is wrong).
_BARE_TOKEN = re.compile(rb"[\x21-\x2b\x2d-\x7e]+")


def key_from_payload(value: object) -> str:
    """A key a route takes from the request body (a webhook's event id): a string of 1 to 255 visible ASCII
    characters, taken as it is (no quoting applies to it)."""
    if not isinstance(value, str):
        raise InvalidKey(f"the key taken from the body must be a string, not {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise InvalidKey(f"an idempotency key is 1 to {MAX_KEY_LENGTH} characters long, this one has {len(value)}")
    if not value.isascii() or not value.isprintable() or " " in value:
        raise InvalidKey("an idempotency key must be visible ASCII, without spaces or control characters")
    return value


def _parse_token(value: bytes) -> str:
    if _BARE_TOKEN.fullmatch(value):
        return value.decode("ascii")
    for byte in value:
        if byte > 0x7E:
            raise InvalidKey("an idempotency key must be ASCII")
        if byte < 0x21:
            raise InvalidKey("an idempotency key must not contain spaces or control characters")
        if byte == 0x2C:  # ","
            # A comma is how proxies join repeated fields: "a,b" may be two keys merged into one.
            raise InvalidKey("a bare idempotency key must not contain a comma (quote it as an sf-string)")
    return value.decode("ascii")


def _parse_sf_string(value: bytes) -> str:
    """RFC 9651 §4.2.5: DQUOTE *(unescaped / "\\" ( DQUOTE / "\\" )) DQUOTE, and nothing after it."""
    out = bytearray()
    index, end = 1, len(value)
    while index < end:
        byte = value[index]
        if byte == 0x5C:  # backslash
            index += 1
            if index >= end or value[index] not in (0x22, 0x5C):
                raise InvalidKey('bad escape in quoted idempotency key: only \\" and \\\\ are allowed')
            out.append(value[index])
        elif byte == 0x22:  # closing quote
            if index != end - 1:
                raise InvalidKey("unexpected characters after the quoted idempotency key")
            key = out.decode("ascii")
            if " " in key:
                raise InvalidKey("an idempotency key must not contain spaces")
            return key
        elif byte > 0x7E:
            raise InvalidKey("an idempotency key must be ASCII")
        elif byte < 0x20:
            raise InvalidKey("an idempotency key must not contain control characters")
        else:
            out.append(byte)
        index += 1
    raise InvalidKey("the quoted idempotency key has no closing quote")


def uuid7_time(key: str) -> float | None:
    """The creation time (Unix seconds) a UUIDv7 key carries in its first 48 bits, or None for other keys."""
    if len(key) != 36 or key[14] != "7":
        return None
    try:
        value = uuid.UUID(key)
    except ValueError:
        return None
    if value.version != 7 or value.variant != uuid.RFC_4122:
        return None
    return (value.int >> 80) / 1000


def outlived(key: str, ttl: float) -> bool:
    """Whether a UUIDv7 key was born more than ``ttl`` seconds ago: a record of it may have expired already."""
    born = uuid7_time(key)
    return born is not None and time.time() - born > ttl


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
OTHER_SECRETS_VARIABLE = "IDEMPOTENCY_TENANT_OTHER_SECRETS"  # a rotation in progress: the secret(s) besides it
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

    ``others`` (else, with the secret from the environment, ``IDEMPOTENCY_TENANT_OTHER_SECRETS``, comma-separated)
    are the secrets of a rotation in progress, the next one or the previous one: new records are claimed under
    ``secret``, and a fresh claim also looks for a live record under each of the others (:meth:`alternates`), so a
    retry across the rotation finds its record (docs/guide.md, "Rotating the tenant secret").
    """

    requirement = "exactly one Authorization header"  # what a client without a tenant lacks

    def __init__(
        self,
        secret: str | bytes | None = None,
        *,
        anonymous: str | None = None,
        others: Sequence[str | bytes] | None = None,
    ) -> None:
        self._keyed, self._others = _keyed_secrets(secret, others, b"")
        self.anonymous = _anonymous(anonymous)

    def derive(self, label: bytes) -> list[bytes]:
        """The HMAC-SHA256 of ``label`` under each secret, for a key derived from them (the fingerprint keys of
        ``fingerprint.FingerprintKeys.derived``): a list, one per secret, the current one first."""
        derived = []
        for secret in (self._keyed, *self._others):
            keyed = secret.copy()
            keyed.update(label)
            derived.append(keyed.digest())
        return derived

    def alternates(self, values: list[bytes]) -> tuple[str, ...]:
        """The tenants of the same request under the other secrets of a rotation in progress (none without one)."""
        if not self._others or len(values) != 1:
            return ()
        credentials = _canonical(values[0])
        if credentials is None:
            return ()  # the anonymous namespace does not depend on the secret
        return tuple(_tenant(secret, credentials) for secret in self._others)

    def __call__(self, scope: Scope) -> str | None:
        return self.of(_values(scope, b"authorization"))

    def of(self, values: list[bytes]) -> str | None:
        """The tenant of a request whose ``Authorization`` header came with ``values`` (what the middleware picked
        out of the request's headers already)."""
        if len(values) > 1:
            return None  # which one is the caller? Not for us to guess
        credentials = _canonical(values[0]) if values else None
        if credentials is None:
            return self.anonymous
        keyed = self._keyed.copy()  # _tenant, written out: every keyed request comes here (6 opcodes for the call)
        keyed.update(credentials)
        return PREFIX + keyed.hexdigest()


class CookieTenant:
    """A resolver for apps that authenticate browsers by a session cookie: an HMAC-SHA256 of the cookie's value
    (an opaque session id), keyed like :class:`AuthorizationTenant` (``secret``, else ``IDEMPOTENCY_TENANT_SECRET``),
    so the table never holds a live session id.

    A request without the cookie is not the middleware's to scope: it passes through untouched, as a request without
    a key does (a browser may add an ``Idempotency-Key`` to every form it posts, a login form included, and the app
    answers those as it would without the middleware); a route that ``required`` keys still refuses it (400).
    ``anonymous`` names a namespace such requests share instead (their keys then meet one another's).

    ``others`` (else, with the secret from the environment, ``IDEMPOTENCY_TENANT_OTHER_SECRETS``) are the secrets of
    a rotation in progress, as for :class:`AuthorizationTenant`: a fresh claim also looks for the request's record
    under each of them (:meth:`alternates`)."""

    requirement = "the session cookie"

    def __init__(
        self,
        name: str,
        secret: str | bytes | None = None,
        *,
        anonymous: str | None = None,
        others: Sequence[str | bytes] | None = None,
    ) -> None:
        if not isinstance(name, str) or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
            raise ValueError(f"CookieTenant needs a cookie name, got {name!r}")
        self.name = name
        self.requirement = f"the {name} cookie"
        self._keyed, self._others = _keyed_secrets(secret, others, b"cookie:")
        self.anonymous = _anonymous(anonymous)
        self.passes_unscoped = self.anonymous is None

    def __call__(self, scope: Scope) -> str | None:
        value = _cookie(scope, self.name)
        if not value:
            return self.anonymous
        return _tenant(self._keyed, value.encode("latin-1"))

    def alternates(self, scope: Scope) -> tuple[str, ...]:
        """The tenants of the same request under the other secrets of a rotation in progress (none without one)."""
        value = _cookie(scope, self.name) if self._others else None
        if not value:
            return ()  # the anonymous namespace does not depend on the secret
        return tuple(_tenant(secret, value.encode("latin-1")) for secret in self._others)


def shared_namespace(resolver: object) -> str | None:
    """The tenant ``resolver`` gives every request it cannot tell apart (``anonymous=``), whose callers then share one
    namespace of keys; None when it gives none (every tenant is one caller's, as far as the middleware can tell). A
    resolver of the app's own that shares a tenant among callers says so the same way: an ``anonymous`` attribute."""
    shared = getattr(resolver, "anonymous", None)
    return shared if isinstance(shared, str) else None


def passes_unscoped(resolver: object) -> bool:
    """Whether a keyed request that ``resolver`` finds no tenant for passes through untouched (:class:`CookieTenant`)
    rather than being refused with 400."""
    return getattr(resolver, "passes_unscoped", False) is True


def _cookie(scope: Scope, name: str) -> str | None:
    """The value of cookie ``name`` as the app reads it (Starlette's ``request.cookies``: a repeated name's last
    pair, unquoted): the session the app acts for, whatever else a browser sends along (a cookie tossed from a
    sibling domain)."""
    return HTTPConnection(scope).cookies.get(name)


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
    resolve.anonymous = shared  # type: ignore[attr-defined]  # shared_namespace reads it
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

    resolve.anonymous = shared_namespace(new)  # type: ignore[attr-defined]  # the legacy tenants are per credential
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


def _keyed_secrets(
    secret: str | bytes | None, others: Sequence[str | bytes] | None, label: bytes
) -> tuple[hmac.HMAC, list[hmac.HMAC]]:
    """A resolver's HMACs, begun with ``label`` and copied for each request: under the current secret, and under
    each other secret of a rotation (``others``; else, with the secret from the environment, the environment's)."""
    current = _secret_bytes(secret)
    if others is None and secret is not None:
        others = ()  # the environment's other secrets go with the environment's secret
    keyed = hmac.new(current, label, hashlib.sha256)
    return keyed, [hmac.new(other, label, hashlib.sha256) for other in _other_secrets(others, current)]


def _tenant(keyed: hmac.HMAC, value: bytes) -> str:
    """The tenant of ``value`` (credentials, a session id) under the secret ``keyed`` was begun with."""
    tenant = keyed.copy()
    tenant.update(value)
    return PREFIX + tenant.hexdigest()


def _other_secrets(others: Sequence[str | bytes] | None, current: bytes) -> list[bytes]:
    """The other secrets of a rotation: given, or from the environment; each as long as a secret must be, and none
    the current one (a rotation from a secret to itself is a mistake worth saying)."""
    source = "a secret of others="
    if others is None:
        others = [part.strip() for part in os.environ.get(OTHER_SECRETS_VARIABLE, "").split(",") if part.strip()]
        source = f"a secret of {OTHER_SECRETS_VARIABLE}"
    if isinstance(others, str | bytes):
        raise TypeError("others must be a sequence of secrets, not one secret")
    found = [_secret_bytes(other, source=source) for other in others]
    if current in found:
        raise ValueError(f"{source} is the current tenant secret: give the other secret of the rotation")
    return found


def _secret_bytes(secret: str | bytes | None, *, source: str = "the tenant secret") -> bytes:
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
