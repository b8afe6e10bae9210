"""Fixtures shared by the suite. The PostgreSQL fixtures come from the package's own pytest plugin
(``idempotency_mw.testing``): a real server, started by the suite unless ``DATABASE_URL`` is set."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest
from starlette.types import ASGIApp

from faults.pgbouncer import PgBouncer
from idempotency_mw import AuthorizationTenant, MemoryStore, PostgresStore, Store

# The package's pytest plugin (idempotency_mw.testing: the PostgreSQL fixtures), loaded here rather than from its
# entry point (pyproject.toml blocks that), so that it imports the library after pytest-cov has started measuring.
pytest_plugins = ["idempotency_mw.testing"]

# The default tenant resolver's secret, set before any app is built; child processes (fault workers) inherit it.
TEST_TENANT_SECRET = "test-tenant-secret-0123456789abcdef0123456789abcdef"
os.environ["IDEMPOTENCY_TENANT_SECRET"] = TEST_TENANT_SECRET


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """A test marked no_cover runs with no tracer at all, under pytest-xdist too.

    pytest-cov (7.1) starts two coverages in an xdist worker: one as the plugin loads, as in a single process, and
    the worker's own at session start, on top of it. Its no_cover marker pauses the worker's, which resumes the
    first: the test's lines go uncounted, but every Python call still pays the tracer. This wrapper runs inside
    pytest-cov's, after its pause, and takes away whatever tracer is left until the test's call is over."""
    if item.get_closest_marker("no_cover") is None:
        return (yield)
    tracer, new_threads = sys.gettrace(), threading.gettrace()
    sys.settrace(None)
    threading.settrace(None)
    try:
        return (yield)
    finally:
        sys.settrace(tracer)
        threading.settrace(new_threads)


def with_database(url: str, name: str) -> str:
    """The same server and credentials, another database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@pytest.fixture
async def fresh_url(idempotency_database_url: str) -> AsyncIterator[str]:
    """A database of its own, created empty on the suite's server (nothing migrated, no schema), dropped afterwards:
    for tests that need a database nobody else touches."""
    name = f"imw_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield with_database(idempotency_database_url, name)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.fixture
async def migrated_url(fresh_url: str) -> str:
    """A database of its own with the store's tables in schema public."""
    store = PostgresStore(fresh_url, min_size=0, max_size=1)
    await store.migrate()
    await store.close()
    return fresh_url


# The stores behind PgBouncer keep their records in schemas of their own: some conformance tests use fixed keys, and
# the direct store's records (schema public, same database) would answer them.
PGBOUNCER_SCHEMAS = {"pgbouncer": "through_pgbouncer", "pgbouncer-pool": "through_pgbouncer_pool"}


@pytest.fixture(scope="session")
def pgbouncer_url(idempotency_database_url: str) -> Iterator[str]:
    """The suite's PostgreSQL behind a PgBouncer in transaction pooling mode. PgBouncer is found on the system, never
    installed from here (``./dev test`` installs it as root); a machine without it fails the tests that need it,
    with the command to run. The store's schemas for the conformance tests are migrated through it."""
    with PgBouncer(idempotency_database_url, pool_mode="transaction") as bouncer:
        # Its own event loop in a thread: the store fixture asks for this one from inside a running loop.
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            thread.submit(asyncio.run, _migrate_through(bouncer.dsn)).result()
        yield bouncer.dsn


async def _migrate_through(url: str) -> None:
    for schema in PGBOUNCER_SCHEMAS.values():
        store = PostgresStore(url, min_size=0, max_size=1, schema=schema, prepared_statements=False)
        try:
            await store.migrate()
        finally:
            await store.close()


ISOLATION_LEVELS = ("read committed", "repeatable read", "serializable")


@pytest.fixture(scope="session")
def isolation_urls(idempotency_database_url: str) -> Iterator[dict[str, str]]:
    """A migrated database for each default isolation level (``ALTER DATABASE ... SET
    default_transaction_isolation``), for the session: what a store meets on a database, or for a role, whose
    default is not PostgreSQL's READ COMMITTED."""
    names = {level: f"imw_iso_{level.replace(' ', '_')}_{uuid.uuid4().hex[:6]}" for level in ISOLATION_LEVELS}
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        thread.submit(asyncio.run, _create_isolated(idempotency_database_url, names)).result()
        try:
            yield {level: with_database(idempotency_database_url, name) for level, name in names.items()}
        finally:
            thread.submit(asyncio.run, _drop(idempotency_database_url, list(names.values()))).result()


async def _create_isolated(url: str, names: dict[str, str]) -> None:
    admin = await asyncpg.connect(url)
    try:
        for level, name in names.items():
            await admin.execute(f'CREATE DATABASE "{name}"')
            await admin.execute(f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = '{level}'")
    finally:
        await admin.close()
    for level, name in names.items():
        for schema in ("public", *PGBOUNCER_SCHEMAS.values()):
            store = PostgresStore(with_database(url, name), min_size=0, max_size=1, schema=schema)
            try:
                await store.migrate()
            finally:
                await store.close()
        connection = await asyncpg.connect(with_database(url, name))
        try:
            assert await connection.fetchval("SHOW transaction_isolation") == level
        finally:
            await connection.close()


async def _drop(url: str, names: list[str]) -> None:
    admin = await asyncpg.connect(url)
    try:
        for name in names:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(params=ISOLATION_LEVELS)
def isolated_url(request: pytest.FixtureRequest, isolation_urls: dict[str, str]) -> str:
    """A migrated database whose default isolation level is each of PostgreSQL's three, in turn."""
    level: str = request.param
    return isolation_urls[level]


async def _role(url: str, name: str) -> str:
    """A superuser role ``name``, made once for the server (concurrent makers are fine)."""
    connection = await asyncpg.connect(url)
    try:
        if not await connection.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", name):
            with contextlib.suppress(asyncpg.DuplicateObjectError):  # another test made it meanwhile
                await connection.execute(f"CREATE ROLE {name} SUPERUSER")
    finally:
        await connection.close()
    return name


@pytest.fixture
async def db(idempotency_database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of the test's own to the database, beside the store's: to look at and set up what the store
    reads and writes."""
    connection = await asyncpg.connect(idempotency_database_url)
    yield connection
    await connection.close()


@pytest.fixture
async def opened_store(idempotency_database_url: str) -> AsyncIterator[PostgresStore]:
    """An opened PostgresStore of up to four connections, closed without a grace period."""
    async with opened(PostgresStore(idempotency_database_url, min_size=1, max_size=4)) as store:
        yield store


@pytest.fixture
async def leak_role(idempotency_database_url: str) -> str:
    """A role a handler switches to on the connection it was lent (row-level security), and leaves behind."""
    return await _role(idempotency_database_url, "imw_leak_role")


@pytest.fixture
async def app_role(idempotency_database_url: str) -> str:
    """A role an app's pool switches to as it connects (SET ROLE in asyncpg's ``init``, a SQLAlchemy ``connect``
    event), like a least-privilege role for the app; a superuser here, so that the store's statements run under it
    as well."""
    return await _role(idempotency_database_url, "imw_app_role")


STORES = {
    # name: (isolation level of the database's sessions, through PgBouncer, on the app's own asyncpg pool)
    "memory": None,
    "postgres": ("read committed", False, False),
    "postgres, repeatable read": ("repeatable read", False, False),
    "postgres, serializable": ("serializable", False, False),
    "pgbouncer": ("read committed", True, False),
    "pgbouncer-pool": ("read committed", True, True),
    "pgbouncer, serializable": ("serializable", True, False),
    "pgbouncer-pool, repeatable read": ("repeatable read", True, True),
}


@pytest.fixture(params=list(STORES))
async def store(request: pytest.FixtureRequest, idempotency_database_url: str) -> AsyncIterator[Store]:
    """Every conformance test runs once per store: in memory; on PostgreSQL; and on PostgreSQL behind a
    transaction-pooling PgBouncer, with a store built from a DSN and with one on the app's own asyncpg pool. The
    PostgreSQL ones also run on databases whose default isolation level is REPEATABLE READ or SERIALIZABLE."""
    kind = STORES[request.param]
    if kind is None:
        yield MemoryStore()
        return
    level, bouncer, app_pool = kind
    url = idempotency_database_url
    if bouncer:
        url = request.getfixturevalue("pgbouncer_url")
    if level != "read committed":
        isolated = request.getfixturevalue("isolation_urls")[level]
        url = with_database(url, urlsplit(isolated).path.lstrip("/"))
    if not bouncer:
        async with opened(PostgresStore(url)) as pg:
            yield pg
        return
    schema = PGBOUNCER_SCHEMAS["pgbouncer-pool" if app_pool else "pgbouncer"]
    if not app_pool:
        async with opened(PostgresStore(url, prepared_statements=False, schema=schema)) as pg:
            yield pg
        return
    pool = await asyncpg.create_pool(url, min_size=1, max_size=10, statement_cache_size=0)
    try:
        async with opened(PostgresStore(pool, schema=schema)) as pg:
            yield pg
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def opened(store: PostgresStore) -> AsyncIterator[PostgresStore]:
    """A store for one test, closed without the shutdown grace: tests leave claims in progress on purpose, and
    nothing is coming to settle them (the grace itself is tested in tests/test_postgres.py and
    tests/scenarios/test_shutdown.py)."""
    await store.open()
    try:
        yield store
    finally:
        await store.close(grace=0)


@pytest.fixture(params=["memory", "postgres", "postgres, transactional"])
async def store_and_mode(
    request: pytest.FixtureRequest, idempotency_database_url: str
) -> AsyncIterator[tuple[Store, bool]]:
    """A store and whether routes are transactional: in memory, and on PostgreSQL in plain and in transactional mode
    (the three places a feature of the request's path must hold, short of every store of ``store``)."""
    if request.param == "memory":
        yield MemoryStore(), False
        return
    async with opened(PostgresStore(idempotency_database_url, max_size=40)) as pg:
        yield pg, request.param.endswith("transactional")


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


def client_for(app: ASGIApp, *, token: str = "sk_test_alice") -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://test",
        headers={"Authorization": f"Bearer {token}"},
    )


def http_scope(
    path: str,
    key: str | None,
    *,
    spec_version: str = "2.3",
    extensions: dict[str, Any] | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> dict[str, Any]:
    """A POST (keyed unless ``key`` is None) as uvicorn 0.54 builds it, for tests that call the ASGI app directly
    (``spec_version`` 2.3: Starlette's StreamingResponse then listens for ``http.disconnect`` while it streams).
    ``headers``: the request's headers besides the key; by default a JSON content type."""
    headers = list(headers) if headers is not None else [(b"content-type", b"application/json")]
    if key is not None:
        headers.insert(0, (b"idempotency-key", key.encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
        "extensions": extensions or {},
    }
