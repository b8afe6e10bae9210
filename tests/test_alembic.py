"""The store in a service whose schema Alembic manages (docs/operations.md, "Alembic"): a real Alembic project,
run as a user runs it (``alembic upgrade``, ``check``, ``downgrade``), as the schema's owner; the app then serves
with a runtime role that may only read and write rows."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

import idempotency_mw
from idempotency_mw import PostgresStore
from idempotency_mw.postgres import migration_statements, removal_statements
from idempotency_mw.store import StoreNotGranted
from tests.apps import Probe, build_app
from tests.conftest import tenant_of, with_database
from tests.orm import sqlalchemy_url

# Where the library these tests import lives (a checkout on PYTHONPATH, or site-packages): Alembic runs in a process of
# its own, which must migrate with the same library.
LIBRARY = Path(idempotency_mw.__file__).resolve().parents[1]

ENV_PY = """
import asyncio
import os

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw.sqlalchemy import alembic_include_name
from models import metadata

FILTER = os.environ.get("WITH_FILTER", "1") == "1"  # the test turns it off once, to show what it is for


def migrate(connection):
    context.configure(
        connection=connection,
        target_metadata=metadata,
        include_name=alembic_include_name() if FILTER else None,
    )
    with context.begin_transaction():
        context.run_migrations()


async def main():
    engine = create_async_engine(context.config.get_main_option("sqlalchemy.url"))
    async with engine.connect() as connection:
        await connection.run_sync(migrate)
        await connection.commit()
    await engine.dispose()


asyncio.run(main())
"""

MODELS_PY = """
import sqlalchemy as sa

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
)
"""

# The two revisions of the docs: the store's tables, then the app's own.
STORE_REVISION = """
from alembic import op

from idempotency_mw.postgres import migration_statements, removal_statements

revision = "0001_idempotency"
down_revision = None


def upgrade():
    for statement in migration_statements():
        op.execute(statement)


def downgrade():
    for statement in removal_statements():
        op.execute(statement)
"""

ORDERS_REVISION = """
import sqlalchemy as sa
from alembic import op

revision = "0002_orders"
down_revision = "0001_idempotency"


def upgrade():
    op.create_table(
        "orders", sa.Column("id", sa.Integer, primary_key=True), sa.Column("amount", sa.Integer, nullable=False)
    )


def downgrade():
    op.drop_table("orders")
"""


@dataclass(frozen=True)
class Service:
    owner_url: str  # the schema's owner: migrations
    runtime_url: str  # the app's role: rows only
    project: Path

    def alembic(self, *argv: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(self.project / "alembic.ini"), *argv],
            cwd=self.project,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(self.project), str(LIBRARY)]), **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check:
            assert done.returncode == 0, done.stdout + done.stderr
        return done


def as_role(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}"))


def admin(url: str, *statements: str) -> None:
    async def run() -> None:
        connection = await asyncpg.connect(url)
        try:
            for statement in statements:
                await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(run())


@pytest.fixture
def service(idempotency_database_url: str, tmp_path: Path) -> Iterator[Service]:
    """A database owned by a migration role, a runtime role that holds only the grants the docs give, and an Alembic
    project with the docs' env.py and revisions."""
    suffix = uuid.uuid4().hex[:10]
    database, owner, runtime = f"imw_alembic_{suffix}", f"imw_owner_{suffix}", f"imw_runtime_{suffix}"
    admin(
        idempotency_database_url,
        f"CREATE ROLE {owner} LOGIN PASSWORD 'owner-pw'",
        f"CREATE ROLE {runtime} LOGIN PASSWORD 'runtime-pw'",
        f"CREATE DATABASE {database} OWNER {owner}",
    )
    owner_url = as_role(with_database(idempotency_database_url, database), owner, "owner-pw")
    runtime_url = as_role(with_database(idempotency_database_url, database), runtime, "runtime-pw")
    (tmp_path / "versions").mkdir()
    (tmp_path / "env.py").write_text(ENV_PY)
    (tmp_path / "models.py").write_text(MODELS_PY)
    (tmp_path / "versions" / "0001_idempotency.py").write_text(STORE_REVISION)
    (tmp_path / "versions" / "0002_orders.py").write_text(ORDERS_REVISION)
    ini = f"[alembic]\nscript_location = {tmp_path}\nsqlalchemy.url = {sqlalchemy_url(owner_url)}\n"
    (tmp_path / "alembic.ini").write_text(ini.replace("%", "%%"))
    try:
        yield Service(owner_url, runtime_url, tmp_path)
    finally:
        admin(
            idempotency_database_url,
            f"DROP DATABASE IF EXISTS {database} WITH (FORCE)",
            f"DROP ROLE IF EXISTS {runtime}",
            f"DROP ROLE IF EXISTS {owner}",
        )


def fetchval(url: str, query: str) -> object:
    async def run() -> object:
        connection = await asyncpg.connect(url)
        try:
            return await connection.fetchval(query)
        finally:
            await connection.close()

    return asyncio.run(run())


@pytest.mark.slow  # each Alembic command is a process of its own
def test_alembic_runs_the_store_migration_and_autogenerate_leaves_its_tables_alone(service: Service) -> None:
    service.alembic("upgrade", "head")
    assert fetchval(service.owner_url, "SELECT to_regclass('idempotency_responses') IS NOT NULL") is True
    # Autogenerate against the models (which do not hold the store's tables) proposes no change...
    assert "No new upgrade operations detected" in service.alembic("check").stdout
    # ...where without the filter it proposed to drop each of them.
    unfiltered = service.alembic("check", check=False, WITH_FILTER="0")
    assert unfiltered.returncode != 0
    for table in (
        "idempotency_records",
        "idempotency_responses",
        "idempotency_replays",
        "idempotency_schema_migrations",
    ):
        assert "remove_table" in unfiltered.stdout + unfiltered.stderr
        assert table in unfiltered.stdout + unfiltered.stderr
    # The store's own bookkeeping agrees: nothing pending for `idempotency-mw migrate --check`.
    check = subprocess.run(
        [sys.executable, "-m", "idempotency_mw", "--database-url", service.owner_url, "migrate", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (check.returncode, check.stdout) == (0, "up to date\n")


@pytest.mark.slow  # each Alembic command is a process of its own
def test_the_app_serves_with_a_role_that_only_reads_and_writes_rows(service: Service) -> None:
    """The runtime grants of docs/operations.md are enough for every request path (claim, completion, replay,
    release), and nothing more is given: the role cannot create or drop a table. Granted only the tables of an
    earlier version, the store refuses to open, naming what is missing and the GRANT that gives it."""
    service.alembic("upgrade", "head")
    runtime = urlsplit(service.runtime_url).netloc.split(":")[0]
    admin(
        service.owner_url,
        f"GRANT USAGE ON SCHEMA public TO {runtime}",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_records, idempotency_responses, "
        f"idempotency_recovery_points TO {runtime}",
        f"GRANT SELECT ON idempotency_replays TO {runtime}",
    )

    async def refused() -> StoreNotGranted:
        store = PostgresStore(service.runtime_url, min_size=1, max_size=2)
        with pytest.raises(StoreNotGranted) as refusal:
            await store.open()
        await store.close()  # the connection it opened to ask
        return refusal.value

    refusal = asyncio.run(refused())
    assert refusal.missing == ["idempotency_replays: INSERT, UPDATE, DELETE"]
    assert "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_replays TO <its role>" in str(refusal)
    admin(service.owner_url, f"GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_replays TO {runtime}")

    async def serve() -> None:
        async with PostgresStore(service.runtime_url, min_size=1, max_size=2) as store:
            probe = Probe()
            probe.release.set()
            app = build_app(store, probe)
            transport = httpx.ASGITransport(app=app)
            headers = {"Authorization": "Bearer sk_test_alembic", "Idempotency-Key": "order-1"}
            async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
                first = await client.post("/charge", content=b'{"amount": 5}')
                again = await client.post("/charge", content=b'{"amount": 5}')
                failed = await client.post("/status/500", headers={"Idempotency-Key": "order-2"})
            assert (first.status_code, again.status_code) == (201, 201)
            assert again.headers["idempotent-replayed"] == "true"
            assert failed.status_code == 500  # released: the record is deleted
            assert probe.calls["charge"] == 1
            tenant = tenant_of("sk_test_alembic")
            assert await store.inspect(tenant, "order-1") is not None  # the lookup reaches the records
            assert await store.inspect(tenant, "order-2") is None
            assert (await store.stats())["completed"] == 1

    asyncio.run(serve())
    with pytest.raises(asyncpg.exceptions.InsufficientPrivilegeError):
        admin(service.runtime_url, "DROP TABLE idempotency_responses")


@pytest.mark.slow  # each Alembic command is a process of its own
def test_downgrade_removes_the_store_and_its_bookkeeping(service: Service) -> None:
    service.alembic("upgrade", "head")
    service.alembic("downgrade", "base")
    tables = ("idempotency_records", "idempotency_responses", "idempotency_replays", "idempotency_schema_migrations")
    for table in (*tables, "orders"):
        assert fetchval(service.owner_url, f"SELECT to_regclass('{table}') IS NULL") is True


def test_the_statements_are_what_migrate_runs() -> None:
    """``migration_statements()`` is the store's migrations, with their bookkeeping, in the order migrate applies
    them; ``removal_statements()`` drops the responses before the records their key points at."""
    statements = migration_statements("billing")
    assert statements[0].startswith("SELECT pg_advisory_xact_lock(")
    assert statements[1] == 'CREATE SCHEMA IF NOT EXISTS "billing"'
    records = [s for s in statements if "idempotency_schema_migrations (version, name)" in s]
    assert records == [
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) VALUES (1, '0001_initial.sql')""",
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) VALUES (2, '0002_responses.sql')""",
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) VALUES (3, '0003_request_line.sql')""",
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) VALUES (4, '0004_request_parts.sql')""",
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) """
        """VALUES (5, '0005_recovery_points.sql')""",
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) VALUES (6, '0006_response_life.sql')""",
        """INSERT INTO "billing".idempotency_schema_migrations (version, name) VALUES (7, '0007_replays.sql')""",
    ]
    assert not any("--" in s or s.endswith(";") for s in statements)
    assert "CREATE SCHEMA" not in " ".join(migration_statements())  # public always exists
    assert migration_statements(applied={1, 2, 3, 4, 5, 6, 7})[-1].startswith(
        "CREATE TABLE IF NOT EXISTS"
    )  # nothing to do
    removal = removal_statements()
    assert removal.index('DROP TABLE IF EXISTS "public".idempotency_recovery_points') < removal.index(
        'DROP TABLE IF EXISTS "public".idempotency_records'
    )
    assert removal.index('DROP TABLE IF EXISTS "public".idempotency_responses') < removal.index(
        'DROP TABLE IF EXISTS "public".idempotency_records'
    )
    assert removal[-1] == 'DROP TABLE IF EXISTS "public".idempotency_schema_migrations'
