"""Tenant resolvers: who owns a key.

Keys are unique per tenant, so two customers who both send ``Idempotency-Key: 1`` never meet. A resolver maps the
ASGI scope to a tenant string (an account id, an API-key id, a JWT subject). It may be sync or async.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable

from starlette.types import Scope

TenantResolver = Callable[[Scope], "str | Awaitable[str]"]

ANONYMOUS = ""


def authorization_tenant(scope: Scope) -> str:
    """The default: a SHA-256 of the ``Authorization`` header, so the secret itself is never stored.

    Requests without the header share the anonymous tenant ``""``; apps that accept anonymous writes should
    supply their own resolver.
    """
    for name, value in scope["headers"]:
        if name == b"authorization":
            return hashlib.sha256(value).hexdigest()
    return ANONYMOUS


def header_tenant(header: str) -> TenantResolver:
    """A resolver that takes the tenant from a request header set by a trusted proxy (say ``x-account-id``)."""
    wanted = header.lower().encode("latin-1")

    def resolve(scope: Scope) -> str:
        for name, value in scope["headers"]:
            if name == wanted:
                return str(value.decode("latin-1"))
        return ANONYMOUS

    return resolve
