"""Fixtures shared by the suite. The PostgreSQL fixtures come from the package's own pytest plugin
(``idempotency_mw.testing``): a real server, started by the suite unless ``DATABASE_URL`` is set."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from idempotency_mw import AuthorizationTenant, MemoryStore, PostgresStore, Store

# The default tenant resolver's secret, set before any app is built; child processes (fault workers) inherit it.
TEST_TENANT_SECRET = "test-tenant-secret-0123456789abcdef0123456789abcdef"
os.environ["IDEMPOTENCY_TENANT_SECRET"] = TEST_TENANT_SECRET


@pytest.fixture(params=["memory", "postgres"])
async def store(request: pytest.FixtureRequest, idempotency_database_url: str) -> AsyncIterator[Store]:
    """Every conformance test runs once per store."""
    if request.param == "memory":
        yield MemoryStore()
    else:
        async with PostgresStore(idempotency_database_url) as pg:
            yield pg


@pytest.fixture
async def pg_store(idempotency_store: PostgresStore) -> PostgresStore:
    return idempotency_store


@pytest.fixture
def key() -> str:
    return str(uuid.uuid4())


def tenant_of(token: str = "sk_test_alice") -> str:
    """The tenant the default resolver derives from ``Authorization: Bearer <token>`` (the header of client_for)."""
    tenant = AuthorizationTenant()({"headers": [(b"authorization", f"Bearer {token}".encode())]})
    assert tenant is not None
    return tenant


def client_for(app: object, *, token: str = "sk_test_alice") -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://test",  # type: ignore[arg-type]
        headers={"Authorization": f"Bearer {token}"},
    )
