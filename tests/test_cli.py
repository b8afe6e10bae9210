"""The ``idempotency-mw`` command line, run in-process (``main([...])``) against a real PostgreSQL.

Each test gets its own schema (``--schema``), so ``gc`` and ``stats``, which see the whole table, give exact
numbers whatever the rest of the suite left behind.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import idempotency_mw
from idempotency_mw import PostgresStore, StoredResponse, StoreUnavailable
from idempotency_mw._cli_arguments import moment
from idempotency_mw.cli import EXIT_NOT_FOUND, EXIT_OUTPUT_CLOSED, build_parser, main
from idempotency_mw.postgres import migration_statements
from idempotency_mw.postgres._connector import address_of, naming_address
from tests.apps import Probe, build_app
from tests.conftest import client_for, tenant_of, with_database

T = TypeVar("T")
TENANT = "a" * 64
FINGERPRINT = bytes(range(32))


@dataclass(frozen=True)
class Database:
    """A test's own store: the suite's database, in a schema no other test uses."""

    url: str
    schema: str

    @property
    def options(self) -> list[str]:
        return ["--database-url", self.url, "--schema", self.schema]


def on_db(db: Database, work: Callable[[PostgresStore], Awaitable[T]]) -> T:
    async def run() -> T:
        store = PostgresStore(db.url, min_size=1, max_size=1, schema=db.schema)  # not opened: work may migrate
        try:
            return await work(store)
        finally:
            await store.close(grace=0)  # seeds leave claims in progress on purpose

    return asyncio.run(run())


def sql(url: str, statement: str, *args: Any, fetch: bool = False) -> str:
    """Run one statement; return its status, or with ``fetch`` its one value."""

    async def run() -> str:
        connection = await asyncpg.connect(url)
        try:
            if fetch:
                return str(await connection.fetchval(statement, *args))
            return str(await connection.execute(statement, *args))
        finally:
            await connection.close()

    return asyncio.run(run())


@pytest.fixture
def empty_db(idempotency_database_url: str) -> Iterator[Database]:
    """A schema that does not exist yet (``migrate`` creates it; dropped afterwards)."""
    schema = f"imw_cli_{uuid.uuid4().hex[:12]}"
    try:
        yield Database(idempotency_database_url, schema)
    finally:
        sql(idempotency_database_url, f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def db(empty_db: Database) -> Database:
    """A migrated, empty store of our own."""
    on_db(empty_db, lambda store: store.migrate())
    return empty_db


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


async def completed(store: PostgresStore, tenant: str, key: str, body: bytes, *, retries: int = 0) -> None:
    """A completed record; ``retries`` claims arrive while it runs (409s, counted), then one replay (not counted)."""
    claim = await store.claim(tenant, key, FINGERPRINT, lease=60, ttl=3600)
    for _ in range(retries):
        await store.claim(tenant, key, FINGERPRINT, lease=60, ttl=3600)
    headers = [(b"content-type", b"application/json"), (b"set-cookie", b"a=1"), (b"set-cookie", b"b=2")]
    assert await store.complete(tenant, key, claim.fence, StoredResponse(201, headers, body, len(body)))
    await store.claim(tenant, key, FINGERPRINT, lease=60, ttl=3600)


# -- migrate ----------------------------------------------------------------------------------------------------


def test_migrate_creates_the_schema_then_is_up_to_date(capsys: pytest.CaptureFixture[str], empty_db: Database) -> None:
    applied = (
        "applied 0001_initial.sql\napplied 0002_responses.sql\napplied 0003_request_line.sql\n"
        "applied 0004_request_parts.sql\n"
        "applied 0005_recovery_points.sql\napplied 0006_response_life.sql\napplied 0007_replays.sql\n"
    )
    assert cli(capsys, *empty_db.options, "migrate") == (0, applied, "")
    assert cli(capsys, *empty_db.options, "migrate") == (0, "up to date\n", "")
    tables = sql(
        empty_db.url,
        "SELECT count(*) FROM pg_tables WHERE schemaname = $1 "
        "AND tablename IN ('idempotency_records', 'idempotency_responses', 'idempotency_schema_migrations')",
        empty_db.schema,
        fetch=True,
    )
    assert tables == "3"


def test_unmigrated_schema_says_run_migrate_with_that_schema(
    capsys: pytest.CaptureFixture[str], empty_db: Database
) -> None:
    for command in (["stats"], ["inspect", TENANT, "k"], ["forget", TENANT, "k"], ["gc"], ["gc", "--dry-run"]):
        code, out, err = cli(capsys, *empty_db.options, *command)
        assert (code, out) == (3, "")
        assert err == (
            f'idempotency-mw: the idempotency tables are missing from schema "{empty_db.schema}" of this database: '
            f"run `idempotency-mw --schema {empty_db.schema} migrate` first\n"
        )


def test_unmigrated_database_says_run_migrate(
    capsys: pytest.CaptureFixture[str], idempotency_database_url: str
) -> None:
    name = f"imw_cli_{uuid.uuid4().hex[:12]}"
    sql(idempotency_database_url, f"CREATE DATABASE {name}")
    try:
        code, out, err = cli(capsys, "--database-url", with_database(idempotency_database_url, name), "stats")
    finally:
        sql(idempotency_database_url, f"DROP DATABASE {name} WITH (FORCE)")
    assert (code, out) == (3, "")
    assert err == (
        'idempotency-mw: the idempotency tables are missing from schema "public" of this database: '
        "run `idempotency-mw migrate` first\n"
    )


def test_migrate_check_exits_4_and_names_what_is_pending(
    capsys: pytest.CaptureFixture[str], empty_db: Database
) -> None:
    """A CI gate or an init container asks without changing anything: the schema is not even created."""
    pending = (
        "pending: 0001_initial.sql, 0002_responses.sql, 0003_request_line.sql, 0004_request_parts.sql, "
        "0005_recovery_points.sql, 0006_response_life.sql, 0007_replays.sql\n"
    )
    assert cli(capsys, *empty_db.options, "migrate", "--check") == (4, pending, "")
    assert sql(empty_db.url, "SELECT to_regnamespace($1) IS NULL", empty_db.schema, fetch=True) == "True"
    cli(capsys, *empty_db.options, "migrate")
    assert cli(capsys, *empty_db.options, "migrate", "--check") == (0, "up to date\n", "")


def test_migrate_sql_prints_what_migrate_would_run(capsys: pytest.CaptureFixture[str], empty_db: Database) -> None:
    """For review, or for a migration tool of the app's: the script, run as it is, leaves the schema as migrate
    would, bookkeeping included."""
    code, script, _ = cli(capsys, *empty_db.options, "migrate", "--sql")
    assert code == 0
    lines = script.splitlines()
    assert lines[0].startswith(f"-- idempotency_mw {idempotency_mw.__version__}: what migrate would run on schema")
    assert (lines[1], lines[-1]) == ("BEGIN;", "COMMIT;")
    assert sql(empty_db.url, "SELECT to_regnamespace($1) IS NULL", empty_db.schema, fetch=True) == "True"
    sql(empty_db.url, script)  # one simple-protocol script, as psql would run it
    assert cli(capsys, *empty_db.options, "migrate", "--check") == (0, "up to date\n", "")
    assert cli(capsys, *empty_db.options, "migrate", "--sql") == (
        0,
        f'-- schema "{empty_db.schema}" is up to date: nothing to run\n',
        "",
    )


def test_tables_another_tool_created_are_stamped_not_recreated(
    capsys: pytest.CaptureFixture[str], empty_db: Database
) -> None:
    """Tables made from a copy of the DDL, without the bookkeeping: migrate said "relation ... already exists" and
    nothing more. It names --stamp, which records the migrations without running them."""
    code, _, err = cli(capsys, *empty_db.options, "migrate", "--stamp")
    assert code == 3
    assert "has no idempotency tables of this version to record (none, or older ones): run migrate instead" in err
    by_hand = [s for s in migration_statements(empty_db.schema) if "idempotency_schema_migrations" not in s]
    sql(empty_db.url, ";\n".join(by_hand))
    code, _, err = cli(capsys, *empty_db.options, "migrate")
    assert code == 3
    assert "already exists: the tables exist, but schema" in err
    assert f"record them with `idempotency-mw --schema {empty_db.schema} migrate --stamp`" in err
    stamped = (
        "recorded 0001_initial.sql as applied\nrecorded 0002_responses.sql as applied\n"
        "recorded 0003_request_line.sql as applied\nrecorded 0004_request_parts.sql as applied\n"
        "recorded 0005_recovery_points.sql as applied\nrecorded 0006_response_life.sql as applied\n"
        "recorded 0007_replays.sql as applied\n"
    )
    assert cli(capsys, *empty_db.options, "migrate", "--stamp") == (0, stamped, "")
    assert cli(capsys, *empty_db.options, "migrate") == (0, "up to date\n", "")


def test_migrate_without_the_create_privilege_names_it(
    capsys: pytest.CaptureFixture[str], idempotency_database_url: str, empty_db: Database
) -> None:
    role = f"imw_dml_{uuid.uuid4().hex[:10]}"
    sql(idempotency_database_url, f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    try:
        parts = urlsplit(idempotency_database_url)
        url = urlunsplit(parts._replace(netloc=f"{role}:pw@{parts.netloc.rsplit('@', 1)[-1]}"))
        code, out, err = cli(capsys, "--database-url", url, "--schema", empty_db.schema, "migrate")
    finally:
        sql(idempotency_database_url, f"DROP ROLE {role}")
    assert (code, out) == (3, "")
    assert "permission denied for database" in err
    assert f"needs the CREATE privilege on schema {empty_db.schema}" in err
    assert "run it as the schema's owner" in err


@pytest.mark.parametrize("schema", ["Billing", "a-b", "pg_idempotency"])
def test_a_bad_schema_name_is_a_usage_error(capsys: pytest.CaptureFixture[str], schema: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--database-url", "postgresql://localhost/db", "--schema", schema, "migrate"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --schema: idempotency store schema" in err
    assert repr(schema) in err


# -- inspect and forget ---------------------------------------------------------------------------------------


def test_what_an_app_stored_reaches_the_terminal_as_text_never_as_control(
    capsys: pytest.CaptureFixture[str], db: Database
) -> None:
    """A tenant from a resolver of the app's, a response header: an escape sequence in them (a title set, the screen
    cleared, colours) is printed as its escape, not sent to the operator's terminal to act on."""
    tenant, header = "acct\x1b]0;PWNED\x07\x1b[2J", b"a\x1b[31mRED"

    async def work(store: PostgresStore) -> None:
        claim = await store.claim(tenant, "k1", FINGERPRINT, lease=60, ttl=3600, request="POST /x\x1b[31m")
        assert await store.complete(tenant, "k1", claim.fence, StoredResponse(201, [(b"x-echo", header)], b"{}", 2))

    on_db(db, work)
    for command in (["inspect", tenant, "k1"], ["list", tenant]):
        code, out, _ = cli(capsys, *db.options, *command)
        assert code == 0
        assert not {"\x1b", "\x07"} & set(out)
        assert "acct\\x1b]0;PWNED\\x07\\x1b[2J" in out


def test_inspect_shows_a_completed_record(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    on_db(db, lambda store: completed(store, TENANT, "order-1", b'{"id": "ch_1",\n"amount": 10}', retries=2))
    info = on_db(db, lambda store: store.inspect(TENANT, "order-1"))
    assert info is not None
    code, out, err = cli(capsys, *db.options, "inspect", TENANT, "order-1")
    assert (code, err) == (0, "")

    def iso(epoch: float) -> str:
        return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat(timespec="milliseconds")

    assert out.splitlines() == [
        f"tenant       {TENANT}",
        "key          order-1",
        "request      -",  # claimed by the store itself, not through the middleware
        "state        completed",
        f"fence        {info.fence}",
        "attempts     2",
        f"replays      1 (last {iso(info.last_replayed_at or 0)})",  # completed() replays once
        f"created      {iso(info.created_at)}",
        f"expires      {iso(info.expires_at)}",
        "lease until  -",
        f"fingerprint  {FINGERPRINT.hex()} (unkeyed: written before fingerprints were keyed)",
        "status       201",
        "headers      content-type: application/json",
        "             set-cookie: a=1",
        "             set-cookie: b=2",
        "body size    28 bytes",
        'body (text)  {"id": "ch_1",\\n"amount": 10}',
    ]


def test_inspect_shows_the_request_and_its_replays(
    capsys: pytest.CaptureFixture[str], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Was the second charge a replay?" from the record: its method and route, and how often it was replayed
    (written in batches, so a replay still writes nothing itself)."""

    async def serve() -> None:
        async with PostgresStore(db.url, min_size=1, max_size=2, schema=db.schema) as store:
            client = client_for(build_app(store, Probe()), token="sk_test_dora")
            for _ in range(3):
                await client.post("/charge", content=b'{"amount": 10}', headers={"Idempotency-Key": "pay-r"})
            await store.count_replays()  # what the store does every few seconds, and as it closes

    asyncio.run(serve())
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_dora")
    code, out, _ = cli(capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "pay-r")
    assert code == 0
    lines = dict(line.split(None, 1) for line in out.splitlines() if line[:1] != " ")
    assert lines["request"] == "POST /charge"
    assert lines["replays"].startswith("2 (last 20")
    code, out, _ = cli(
        capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "pay-r", "--json"
    )
    shown = json.loads(out)
    assert (shown["request"], shown["replays"], shown["attempts"]) == ("POST /charge", 2, 0)


def test_inspect_shows_that_request_parts_are_stored_and_nothing_of_them(
    capsys: pytest.CaptureFixture[str], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A route that explains a mismatch stores the request's parts, keyed digests: inspect says they are there, how
    many body fields, under which key; never a digest."""

    async def serve() -> None:
        async with PostgresStore(db.url, min_size=1, max_size=2, schema=db.schema) as store:
            app = build_app(store, Probe(), explain_mismatch=True, fingerprint_keys="2026-11:" + "k" * 32)
            body = {"amount": 10, "currency": "eur"}
            await client_for(app, token="sk_test_erin").post("/charge", json=body, headers={"Idempotency-Key": "p"})

    asyncio.run(serve())
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_erin")
    code, out, _ = cli(capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "p")
    assert code == 0
    (shown,) = [line for line in out.splitlines() if line.startswith("request parts")]
    assert shown == "request parts  83 bytes: method, path, query, body (2 fields), under key '2026-11'"
    code, out, _ = cli(capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "p", "--json")
    parts = {"key": "2026-11", "fields": 2, "body_compared": "fields", "bytes": 83}
    assert json.loads(out)["request_parts"] == parts


def test_inspect_json(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    on_db(db, lambda store: completed(store, TENANT, "k-json", b"\x00\x01binary" * 40))
    code, out, _ = cli(capsys, *db.options, "inspect", TENANT, "k-json", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["tenant"] == TENANT
    assert shown["key"] == "k-json"
    assert shown["state"] == "completed"
    assert shown["expired"] is False
    assert shown["attempts"] == 0
    assert shown["lease_expires_at"] is None
    created = datetime.datetime.fromisoformat(shown["created_at"])
    expires = datetime.datetime.fromisoformat(shown["expires_at"])
    assert created.tzinfo is not None
    assert expires - created == datetime.timedelta(hours=1)
    assert (shown["fingerprint"], shown["fingerprint_key"]) == (FINGERPRINT.hex(), None)
    response = shown["response"]
    assert response["status"] == 201
    assert response["headers"] == [["content-type", "application/json"], ["set-cookie", "a=1"], ["set-cookie", "b=2"]]
    assert response["body_size"] == 320
    assert response["body_stored"] is True
    assert response["body_preview_encoding"] == "hex"
    assert response["body_preview"] == ((b"\x00\x01binary" * 40)[:200]).hex()


def test_inspect_in_progress_record_shows_its_lease(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    on_db(db, lambda store: store.claim(TENANT, "running", FINGERPRINT, lease=30, ttl=3600))
    code, out, _ = cli(capsys, *db.options, "inspect", TENANT, "running", "--json")
    shown = json.loads(out)
    assert (code, shown["state"], shown["response"]) == (0, "in_progress", None)
    lease = datetime.datetime.fromisoformat(shown["lease_expires_at"])
    assert lease - datetime.datetime.fromisoformat(shown["created_at"]) == datetime.timedelta(seconds=30)


def test_inspect_by_authorization_finds_what_the_middleware_stored(
    capsys: pytest.CaptureFixture[str], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant the default resolver stored is found from the Authorization header the client sent."""

    async def post_twice() -> None:
        async with PostgresStore(db.url, min_size=1, max_size=2, schema=db.schema) as store:
            client = client_for(build_app(store, Probe()), token="sk_test_alice")
            for _ in range(2):
                await client.post("/charge", content=b'{"amount": 10}', headers={"Idempotency-Key": "pay-1"})

    asyncio.run(post_twice())
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_alice")
    code, out, _ = cli(
        capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "pay-1", "--json"
    )
    shown = json.loads(out)
    assert code == 0
    assert shown["tenant"] == tenant_of("sk_test_alice")
    assert (shown["attempts"], shown["response"]["status"]) == (0, 201)  # the second request was a replay
    assert shown["response"]["body_preview"] == '{"charge":1,"echo":"{\\"amount\\": 10}"}'
    # On standard input, as another client library spells it: the same tenant.
    monkeypatch.setattr("sys.stdin", io.StringIO(" bearer  sk_test_alice\n"))
    code, out, _ = cli(capsys, *db.options, "inspect", "--authorization-from", "-", "pay-1", "--json")
    assert (code, json.loads(out or "{}").get("tenant")) == (0, tenant_of("sk_test_alice"))
    # The wrong credential is another tenant: no record.
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_bob")
    code, out, err = cli(capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "pay-1")
    assert (code, out) == (1, "")
    assert "no record for key 'pay-1'" in err
    assert "IDEMPOTENCY_TENANT_SECRET" in err  # the one thing that can differ from the servers'


@pytest.mark.parametrize("command", ["inspect", "forget"])
def test_a_clients_credential_on_the_command_line_is_refused(
    capsys: pytest.CaptureFixture[str], db: Database, command: str
) -> None:
    """ps and the shell's history would show it, as they would response keys, which are refused there too."""
    code, out, err = cli(capsys, *db.options, command, "--authorization", "Bearer sk_live_AbC", "pay-1")
    assert (code, out) == (2, "")
    assert "--authorization-from" in err
    assert "sk_live_AbC" not in err


def test_authorization_without_the_tenant_secret_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IDEMPOTENCY_TENANT_SECRET")
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_alice")
    code, out, err = cli(capsys, *db.options, "forget", "--authorization-from", "CLIENT_AUTHORIZATION", "k")
    assert (code, out) == (2, "")
    assert err == (
        "idempotency-mw: --authorization-from needs the secret the servers' default tenant resolver uses: "
        "set IDEMPOTENCY_TENANT_SECRET to the same value (or give TENANT as stored)\n"
    )
    monkeypatch.setenv("IDEMPOTENCY_TENANT_SECRET", "too-short")
    code, _, err = cli(capsys, *db.options, "inspect", "--authorization-from", "CLIENT_AUTHORIZATION", "k")
    assert code == 2
    assert "IDEMPOTENCY_TENANT_SECRET is 9 characters long; it must be at least 32" in err


def test_unknown_key_is_exit_1_with_a_hint(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    code, out, err = cli(capsys, *db.options, "inspect", "Bearer sk_live_x", "nope")
    assert (code, out) == (1, "")
    assert err == (
        "idempotency-mw: no record for key 'nope' of tenant 'Bearer sk_live_x' (TENANT must be exactly what the "
        "app's tenant resolver returned; with the default resolver, give the client's header with "
        "--authorization-from instead)\n"
    )
    code, out, err = cli(capsys, *db.options, "inspect", tenant_of(), "nope", "--json")
    assert (code, out) == (1, "")
    assert "--authorization" not in err  # a tenant the default resolver made: the hint has nothing to add


@pytest.fixture
def reader(db: Database) -> Iterator[list[str]]:
    """The options of a support desk's or a monitoring job's role on ``db``: SELECT on the store's tables (and USAGE
    on the schema), nothing more."""
    role = f"desk_{uuid.uuid4().hex[:8]}"
    sql(db.url, f"CREATE ROLE {role} LOGIN PASSWORD 'desk-pw'")
    try:
        sql(db.url, f'GRANT USAGE ON SCHEMA "{db.schema}" TO {role}')
        sql(db.url, f'GRANT SELECT ON ALL TABLES IN SCHEMA "{db.schema}" TO {role}')
        parts = urlsplit(db.url)
        desk = urlunsplit(parts._replace(netloc=f"{role}:desk-pw@{parts.netloc.rsplit('@', 1)[-1]}"))
        yield ["--database-url", desk, "--schema", db.schema]
    finally:
        sql(db.url, f"DROP OWNED BY {role}")
        sql(db.url, f"DROP ROLE {role}")


def test_a_role_that_only_reads_inspects_lists_and_counts_but_is_told_what_forget_needs(
    capsys: pytest.CaptureFixture[str], db: Database, reader: list[str]
) -> None:
    """A support desk's role, granted SELECT on the store's tables and nothing more: the store refuses to open for
    it (StoreNotGranted), yet inspect, list and stats only read, and run; forget, which deletes, says what it lacks."""
    on_db(db, lambda store: completed(store, "", "desk-key", b"ok"))
    assert cli(capsys, *reader, "inspect", "", "desk-key")[0] == 0
    assert cli(capsys, *reader, "stats")[0] == 0
    assert cli(capsys, *reader, "list", "", "--since", "1h")[0] == 0
    code, out, err = cli(capsys, *reader, "forget", "", "desk-key")
    assert (code, out) == (3, "")
    assert "lacks privileges" in err
    assert "idempotency_records: INSERT, UPDATE, DELETE" in err
    assert on_db(db, lambda store: store.inspect("", "desk-key")) is not None


def test_a_role_that_only_reads_runs_every_command_that_only_reads(
    capsys: pytest.CaptureFixture[str], db: Database, reader: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A monitoring job's role, SELECT only: stalled, gc --dry-run, reencrypt --dry-run and migrate --check only read,
    and run with it (stalled and gc --dry-run were refused for the privileges to write that they never use); gc and
    reencrypt, which write, stop before any change and name the privileges they lack."""
    from idempotency_mw.encryption import ResponseCipher

    seed_table(db)
    table = f'"{db.schema}".idempotency_records'
    sql(
        db.url,
        f'INSERT INTO "{db.schema}".idempotency_recovery_points (tenant, key, life, step, position, done, result, '
        f"fence, committed_at) SELECT tenant, key, created_at, 'charge', 1, true, '{{}}', fence, now() FROM {table} "
        "WHERE key = 'stalled'",
    )
    monkeypatch.setenv("READER_KEYS", f"2026-12:{ResponseCipher.new_key()}")
    code, out, err = cli(capsys, *reader, "stalled", "--lapsed-for", "0", "--json")
    assert (code, err) == (0, "")
    assert [(each["key"], each["last_step"]) for each in json.loads(out)] == [("stalled", "charge")]
    assert cli(capsys, *reader, "gc", "--dry-run") == (0, "25 expired records would be deleted (dry run)\n", "")
    code, out, err = cli(capsys, *reader, "reencrypt", "--dry-run", "--keys-from", "READER_KEYS")
    assert (code, err) == (0, "")
    assert "27 responses" in out
    assert cli(capsys, *reader, "migrate", "--check") == (0, "up to date\n", "")
    for writes in (["gc"], ["reencrypt", "--keys-from", "READER_KEYS"]):
        code, out, err = cli(capsys, *reader, *writes)
        assert (code, out) == (3, "")
        assert "lacks privileges" in err
        assert "idempotency_records: INSERT, UPDATE, DELETE" in err
    assert on_db(db, lambda store: store.count_expired()) == 25  # gc deleted nothing


def test_forget_deletes_then_reports_absence(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    on_db(db, lambda store: completed(store, "", "anon-key", b"ok"))
    assert cli(capsys, *db.options, "forget", "", "anon-key") == (
        0,
        "forgot key 'anon-key' of tenant ''\n",
        "",
    )
    assert on_db(db, lambda store: store.inspect("", "anon-key")) is None
    code, _, err = cli(capsys, *db.options, "forget", "", "anon-key")
    assert code == 1
    assert "no record for key 'anon-key' of tenant ''" in err


@pytest.mark.parametrize(
    "argv",
    [["inspect", TENANT], ["forget"], ["inspect", "--authorization-from", "HOME", TENANT, "k"]],
    ids=["no-key", "nothing", "both-tenant-and-authorization"],
)
def test_record_arguments_are_checked(capsys: pytest.CaptureFixture[str], db: Database, argv: list[str]) -> None:
    code, out, err = cli(capsys, *db.options, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("idempotency-mw: ")
    assert err.count("\n") == 1


NOT_UTF8 = os.fsdecode(b"k\xff")  # bytes that are not UTF-8, as Python gives them in sys.argv (surrogateescape)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["inspect", TENANT, NOT_UTF8], "KEY"),
        (["forget", NOT_UTF8, "k"], "TENANT"),
        (["inspect", "--authorization-from", "CLIENT_AUTHORIZATION", NOT_UTF8], "KEY"),
    ],
    ids=["inspect-key", "forget-tenant", "key-after-authorization"],
)
def test_a_record_argument_that_is_not_utf8_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
    db: Database,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    named: str,
) -> None:
    """A key pasted from a file in another encoding: asyncpg cannot send it, and it was reported as a database error
    (exit 3). It is bad input, exit 2, naming the argument and the bytes given, before any connection."""
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_alice")
    assert cli(capsys, *db.options, *argv) == (
        2,
        "",
        f"idempotency-mw: {named} must be UTF-8 text, got the bytes b'k\\xff'\n",
    )


def test_a_listed_tenant_that_is_not_utf8_is_a_usage_error(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*db.options, "list", NOT_UTF8])
    assert exit_info.value.code == 2
    assert "argument TENANT: must be UTF-8 text, got the bytes b'k\\xff'" in capsys.readouterr().err


# -- list: the support desk ----------------------------------------------------------------------------------


def served(db: Database, token: str, *keys: str) -> None:
    """Requests through the middleware, as a customer with this API key sends them."""

    async def post() -> None:
        async with PostgresStore(db.url, min_size=1, max_size=2, schema=db.schema) as store:
            client = client_for(build_app(store, Probe()), token=token)
            for key in keys:
                await client.post("/charge", content=b'{"amount": 10}', headers={"Idempotency-Key": key})

    asyncio.run(post())


def test_list_finds_a_customer_by_the_tag_in_a_log_line(
    capsys: pytest.CaptureFixture[str], db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Support staff hold a log line (tenant tag, key hash) and a rough time, never the customer's live key: the tag
    leads to the customer's records of that window, each with the key hash the log showed."""
    with caplog.at_level("DEBUG", logger="idempotency_mw"):
        served(db, "sk_live_alice", "pay-1", "pay-2")
    served(db, "sk_live_bob", "pay-1")
    line = next(r for r in caplog.records if vars(r).get("idempotency_outcome") == "executed")
    tag, key_hash = vars(line)["idempotency_tenant_tag"], vars(line)["idempotency_key_hash"]
    sql(  # claimed 3 days ago: its response is of that life (migrations/0006)
        db.url,
        f"WITH moved AS (UPDATE {db.schema}.idempotency_responses SET life = now() - interval '3 days' "
        f"WHERE key = 'pay-2') "
        f"UPDATE {db.schema}.idempotency_records SET created_at = now() - interval '3 days' WHERE key = 'pay-2'",
    )
    code, out, err = cli(capsys, *db.options, "list", "--tag", tag, "--since", "2h", "--json")
    assert (code, err) == (0, "")
    (listed,) = json.loads(out)
    assert (listed["tenant"], listed["tag"]) == (tenant_of("sk_live_alice"), tag)
    (record,) = listed["records"]  # pay-2 was first claimed before the window
    assert (record["key"], record["key_hash"], record["state"], record["status"]) == (
        "pay-1",
        key_hash,
        "completed",
        201,
    )
    code, out, _ = cli(capsys, *db.options, "list", "--tag", tag, "--since", "7d")
    assert code == 0
    head, columns, first, second = out.splitlines()
    assert head.startswith(f"tenant {tenant_of('sk_live_alice')}: 2 records first claimed between ")
    assert columns.split() == ["created", "key", "key", "hash", "request", "state", "status", "attempts", "replays"]
    pay_2 = hashlib.sha256(b"pay-2").hexdigest()[:12]
    assert first.split()[1:] == ["pay-2", pay_2, "POST", "/charge", "completed", "201", "0", "0"]
    assert second.split()[1:3] == ["pay-1", key_hash]


def test_list_by_tenant_or_by_the_clients_header(
    capsys: pytest.CaptureFixture[str], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    served(db, "sk_test_carol", "order-1")
    by_tenant = cli(capsys, *db.options, "list", tenant_of("sk_test_carol"), "--json")
    monkeypatch.setenv("CLIENT_AUTHORIZATION", "Bearer sk_test_carol")
    by_header = cli(capsys, *db.options, "list", "--authorization-from", "CLIENT_AUTHORIZATION", "--json")
    assert by_tenant == by_header
    assert [r["key"] for r in json.loads(by_tenant[1])[0]["records"]] == ["order-1"]
    code, out, _ = cli(capsys, *db.options, "list", "nobody")
    assert code == 1  # nothing in the window
    assert out.startswith("tenant nobody: 0 records first claimed between")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["list"], "give one of TENANT, --tag or --authorization-from"),
        (["list", "t", "--tag", "0123abcd"], "give one of TENANT, --tag or --authorization-from"),
        (["list", "--authorization", "Bearer sk_live_x"], "a client's credential is not taken on the command line"),
        (["list", "t", "--since", "1h", "--until", "2h"], "--until must be later than --since"),
    ],
)
def test_list_arguments_are_checked(
    capsys: pytest.CaptureFixture[str], db: Database, argv: list[str], message: str
) -> None:
    code, out, err = cli(capsys, *db.options, *argv)
    assert (code, out) == (2, "")
    assert message in err


@pytest.mark.parametrize(("value", "message"), [("--tag=xyz", "8 hex digits"), ("--since=yesterday", "ISO 8601")])
def test_list_values_are_checked(capsys: pytest.CaptureFixture[str], value: str, message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["list", "t", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_tag_nobody_has_says_what_to_check(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    code, out, err = cli(capsys, *db.options, "list", "--tag", "00000000")
    assert (code, out) == (1, "")
    assert "no tenant tagged 00000000 has records first claimed between" in err
    assert "IDEMPOTENCY_TENANT_SECRET is the servers' secret" in err


def test_moments_are_iso_times_or_ages() -> None:
    assert moment("2026-11-28T06:00:00Z") == datetime.datetime(2026, 11, 28, 6, tzinfo=datetime.UTC).timestamp()
    assert moment("2026-11-28T06:00:00") == moment("2026-11-28T06:00:00+00:00")  # no zone: UTC
    assert abs(moment("2h") - (time.time() - 7200)) < 5
    assert abs(moment("1.5d") - (time.time() - 1.5 * 86400)) < 5


# -- stats and gc ---------------------------------------------------------------------------------------------


def seed_table(db: Database) -> None:
    """2 completed (one retried 3 times), 2 live in progress (one past its lease, one an hour old), 25 expired."""

    async def work(store: PostgresStore) -> None:
        await completed(store, TENANT, "done-1", b"1", retries=3)
        await completed(store, TENANT, "done-2", b"2")
        await store.claim(TENANT, "running", FINGERPRINT, lease=60, ttl=7200)
        await store.claim(TENANT, "stalled", FINGERPRINT, lease=60, ttl=7200)
        for i in range(25):
            await completed(store, "b" * 64, f"old-{i}", b"x")

    on_db(db, work)
    table = f"{db.schema}.idempotency_records"
    sql(db.url, f"UPDATE {table} SET lease_expires_at = now() - interval '1 second' WHERE key = 'stalled'")
    sql(db.url, f"UPDATE {table} SET created_at = now() - interval '1 hour' WHERE key = 'running'")
    sql(db.url, f"UPDATE {table} SET expires_at = now() - interval '1 minute' WHERE key LIKE 'old-%'")


def test_stats(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    seed_table(db)
    code, out, _ = cli(capsys, *db.options, "stats", "--json")
    stats = json.loads(out)
    oldest = stats.pop("oldest_in_progress_seconds")
    assert code == 0
    assert stats == {"in_progress": 2, "completed": 2, "expired": 25, "past_lease": 1, "attempts": 3, "stalled": 0}
    assert 3600 <= oldest < 3660
    code, out, _ = cli(capsys, *db.options, "stats")
    assert out == (
        "in progress             2\n"
        "completed               2\n"
        "expired (awaiting gc)   25\n"
        "past their lease        1\n"
        "oldest in progress      1h 00m\n"
        "attempts (all records)  3\n"
        "stalled at a step       0\n"
    )


def test_stats_of_an_empty_table(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    code, out, _ = cli(capsys, *db.options, "stats")
    assert code == 0
    assert "oldest in progress      -\n" in out


def test_gc_dry_run_then_batches(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    seed_table(db)
    args = [*db.options, "gc", "--batch-size", "10"]
    assert cli(capsys, *args, "--dry-run") == (0, "25 expired records would be deleted (dry run)\n", "")
    assert cli(capsys, *args, "--dry-run", "--max-batches", "2")[1] == "20 expired records would be deleted (dry run)\n"
    assert on_db(db, lambda store: store.count_expired()) == 25  # a dry run deletes nothing

    assert cli(capsys, *args, "--max-batches", "2") == (
        0,
        "deleted 20 expired records\n",
        "batch 1: deleted 10 (10 so far)\nbatch 2: deleted 10 (20 so far)\n",
    )
    assert cli(capsys, *args) == (0, "deleted 5 expired records\n", "batch 1: deleted 5 (5 so far)\n")
    assert cli(capsys, *args) == (0, "deleted 0 expired records\n", "batch 1: deleted 0 (0 so far)\n")
    stats = on_db(db, lambda store: store.stats())
    assert (stats["expired"], stats["completed"], stats["in_progress"]) == (0, 2, 2)  # live records untouched


def test_gc_stops_after_a_short_batch(capsys: pytest.CaptureFixture[str], db: Database) -> None:
    seed_table(db)
    code, out, err = cli(capsys, *db.options, "gc", "--batch-size", "25")
    assert (code, out) == (0, "deleted 25 expired records\n")
    assert err.splitlines() == ["batch 1: deleted 25 (25 so far)", "batch 2: deleted 0 (25 so far)"]


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_gc_rejects_bad_batch_sizes(capsys: pytest.CaptureFixture[str], db: Database, value: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*db.options, "gc", "--batch-size", value])
    assert exit_info.value.code == 2
    assert "--batch-size" in capsys.readouterr().err


# -- connection errors ----------------------------------------------------------------------------------------


def test_no_database_url(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    assert cli(capsys, "stats") == (2, "", "idempotency-mw: no database: pass --database-url or set DATABASE_URL\n")


def test_database_url_from_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Database
) -> None:
    monkeypatch.setenv("DATABASE_URL", db.url)
    assert cli(capsys, "--schema", db.schema, "migrate") == (0, "up to date\n", "")


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("notadsn", "invalid database URL: not a PostgreSQL URL (no scheme)"),
        ("mysql://localhost/db", "invalid database URL: not a PostgreSQL URL (scheme 'mysql')"),
        ("postgresql://u@127.0.0.1:port/db", "invalid database URL: invalid literal for int()"),
        ("postgresql://u@[::1/db", "invalid database URL: Invalid IPv6 URL"),
        ("postgresql://u@127.0.0.1:99999/db", "invalid database URL: connect(): port must be 0-65535"),
    ],
)
def test_bad_database_url(capsys: pytest.CaptureFixture[str], dsn: str, message: str) -> None:
    code, out, err = cli(capsys, "--database-url", dsn, "stats")
    assert (code, out) == (3, "")
    assert err.startswith(f"idempotency-mw: {message}")
    assert err.count("\n") == 1


@pytest.mark.parametrize("scheme", ["postgresql+asyncpg", "postgres+psycopg2"])
def test_the_sqlalchemy_spelling_of_the_url_is_accepted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Database, scheme: str
) -> None:
    """One DATABASE_URL for the app's engine and for this command: asyncpg refused SQLAlchemy's spelling."""
    url = scheme + db.url[db.url.index("://") :]
    assert cli(capsys, "--database-url", url, "--schema", db.schema, "migrate") == (0, "up to date\n", "")
    monkeypatch.setenv("DATABASE_URL", url)
    assert cli(capsys, "--schema", db.schema, "stats", "--json")[0] == 0


def test_connection_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, out, err = cli(capsys, "--database-url", f"postgresql://u@127.0.0.1:{port}/db", "stats")
    assert (code, out) == (3, "")
    assert err == f"idempotency-mw: cannot reach the database: Connect call failed ('127.0.0.1', {port})\n"


def test_a_missing_unix_socket_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """asyncpg said only "No such file or directory": which file, the operator had to guess."""
    url = f"postgresql://app:s3cret@/db?host={tmp_path}&port=6543"
    code, out, err = cli(capsys, "--database-url", url, "stats")
    assert (code, out) == (3, "")
    assert err == (
        "idempotency-mw: cannot reach the database: No such file or directory "
        f"(connecting to {tmp_path}/.s.PGSQL.6543)\n"
    )


async def test_the_stores_unreachable_error_names_the_address_and_never_the_password(tmp_path: Path) -> None:
    store = PostgresStore(f"postgresql://app:s3cret@/db?host={tmp_path}", min_size=1, max_size=1, timeout=2)
    with pytest.raises(StoreUnavailable) as raised:
        await store.open()
    await store.close()
    assert f"(connecting to {tmp_path}/.s.PGSQL.5432)" in str(raised.value)
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("postgresql://u:p@db.internal:6432/app", "db.internal:6432"),
        ("postgresql://u@[::1]/app", "[::1]:5432"),
        ("postgresql://u@/app?host=/run/postgresql", "/run/postgresql/.s.PGSQL.5432"),
        ("postgresql:///app", "the default local socket or localhost:5432"),
    ],
)
def test_addresses_as_errors_name_them(url: str, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGHOST", raising=False)
    monkeypatch.delenv("PGPORT", raising=False)
    assert address_of(url) == where
    refused = naming_address(ConnectionRefusedError(111, "Connection refused"), url)
    assert refused.strerror == f"Connection refused (connecting to {where})"  # an IPv6 host too
    assert isinstance(refused, ConnectionRefusedError)
    named = OSError(111, f"Connect call failed ('{where.rsplit(':', 1)[0].strip('[]')}', 5432)")
    assert naming_address(named, url) is named  # it names its address already


def test_server_that_never_answers_times_out(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        port = silent.getsockname()[1]
        code, out, err = cli(
            capsys, "--timeout", "0.3", "--database-url", f"postgresql://u@127.0.0.1:{port}/db", "stats"
        )
    assert (code, out) == (3, "")
    assert err == "idempotency-mw: the database did not answer within 0.3s (is it up? see --timeout)\n"


def test_unknown_database(capsys: pytest.CaptureFixture[str], idempotency_database_url: str) -> None:
    parts = urlsplit(idempotency_database_url)
    missing = urlunsplit(parts._replace(path="/no_such_database_here"))
    code, _, err = cli(capsys, "--database-url", missing, "stats")
    assert code == 3
    assert (
        err == 'idempotency-mw: the database refused the connection: database "no_such_database_here" does not exist\n'
    )


# -- global options, before or after the command ------------------------------------------------------------

# Each command with arguments that make it succeed (or, for a key that is not there, exit 1) on a migrated store.
COMMAND_LINES = {
    "migrate": ["migrate"],
    "gc": ["gc", "--dry-run"],
    "inspect": ["inspect", TENANT, "no-such-key"],
    "forget": ["forget", TENANT, "no-such-key"],
    "stats": ["stats", "--json"],
}


@pytest.mark.parametrize("command", sorted(COMMAND_LINES))
@pytest.mark.parametrize("where", ["before", "after"])
def test_global_options_before_or_after_the_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Database, command: str, where: str
) -> None:
    """Users type ``idempotency-mw migrate --database-url …`` (the guide did) as often as the other order."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    options = [*db.options, "--timeout", "7"]
    line = COMMAND_LINES[command]
    argv = [*options, *line] if where == "before" else [*line, *options]
    args = build_parser().parse_args(argv)
    assert (args.database_url, args.timeout, args.schema) == (db.url, 7.0, db.schema)
    code, _, err = cli(capsys, *argv)
    assert code == (EXIT_NOT_FOUND if command in ("inspect", "forget") else 0), err


def test_global_option_defaults_and_precedence() -> None:
    args = build_parser().parse_args(["stats"])
    assert (args.database_url, args.timeout, args.schema) == (None, None, None)  # not given: see below
    args = build_parser().parse_args(["--schema", "billing", "stats"])
    assert args.schema == "billing"  # not reset by the command's own copy of the option
    args = build_parser().parse_args(["--timeout", "2", "gc", "--timeout", "3"])
    assert args.timeout == 3.0  # the later one wins, as with any repeated option


def test_schema_and_timeout_come_from_the_environment_the_app_reads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Database
) -> None:
    """IDEMPOTENCY_SCHEMA and IDEMPOTENCY_STORE_TIMEOUT set the app's store and this command alike; an option given
    on the command line wins, and a bad value is a usage error naming the variable."""
    monkeypatch.setenv("IDEMPOTENCY_SCHEMA", db.schema)
    monkeypatch.setenv("IDEMPOTENCY_STORE_TIMEOUT", "2.5")
    assert cli(capsys, "--database-url", db.url, "migrate") == (0, "up to date\n", "")
    store = PostgresStore(db.url)
    assert (store.schema, store.timeout) == (db.schema, 2.5)
    assert PostgresStore(db.url, schema="public", timeout=1).schema == "public"
    code, _, err = cli(capsys, "--database-url", db.url, "--schema", "public", "--timeout", "9", "migrate", "--check")
    assert code in (0, 4)  # the suite's public schema, whatever state it is in: the option won
    monkeypatch.setenv("IDEMPOTENCY_STORE_TIMEOUT", "soon")
    code, _, err = cli(capsys, "--database-url", db.url, "stats")
    assert (code, err) == (
        2,
        "idempotency-mw: IDEMPOTENCY_STORE_TIMEOUT='soon': expected a positive number of seconds\n",
    )
    monkeypatch.setenv("IDEMPOTENCY_STORE_TIMEOUT", "1")
    monkeypatch.setenv("IDEMPOTENCY_SCHEMA", "Billing")
    code, _, err = cli(capsys, "--database-url", db.url, "stats")
    assert code == 2
    assert "plain lower-case identifier" in err


@pytest.mark.parametrize(
    "arguments",
    [
        ["gc", "--pause", "nan"],  # passed every comparison, then slept for ever after the first batch
        ["stats", "--timeout", "nan"],
        ["stalled", "--lapsed-for", "inf"],
        ["list", "t", "--since", "800000d"],  # a time the listing cannot show (before the year 1)
        ["list", "t", "--until", "9999-12-31T23:59:59-14:00"],  # after the year 9999, in UTC
    ],
)
def test_a_value_no_command_can_use_is_a_usage_error(capsys: pytest.CaptureFixture[str], arguments: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_a_bad_global_option_after_the_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["stats", "--timeout", "0"])
    assert exit_info.value.code == 2
    assert "argument --timeout: must be positive, got 0" in capsys.readouterr().err


# -- the commands ---------------------------------------------------------------------------------------------


def test_help_lists_the_operators_commands_only(capsys: pytest.CaptureFixture[str]) -> None:
    """The payments demo lives in examples/ (``./dev demo``), not in the installed command line."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("migrate", "gc", "inspect", "forget", "list", "stats", "reencrypt"):
        assert f"    {command} " in out
    assert "demo" not in out
    with pytest.raises(SystemExit) as exit_info:
        main(["demo"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """What a support ticket asks first; the same version as the package's."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"idempotency-mw {idempotency_mw.__version__}\n"


class ClosedPipe(io.StringIO):
    """Standard output whose reader went away, as under ``idempotency-mw stats | head -0``."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_is_not_a_database_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, db: Database
) -> None:
    """``stats | head`` printed "cannot reach the database: Broken pipe" and exited 3, as for an outage."""
    on_db(db, lambda store: completed(store, TENANT, "piped", b"{}"))
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    for argv in (["stats"], ["stats", "--json"], ["inspect", TENANT, "piped"], ["gc", "--dry-run"]):
        assert main([*db.options, *argv]) == EXIT_OUTPUT_CLOSED == 141
        assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_closed_pipe_ends_the_process_quietly(db: Database) -> None:
    """The same through a real pipe whose reader closed before the command wrote, as a shell runs ``| head -0``:
    no message, no warning at exit (Python's flush of the closed stdout), status 141 as for SIGPIPE."""
    command = [sys.executable, "-m", "idempotency_mw", *db.options, "stats"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        process.stdout.close()
        err = process.stderr.read()
        assert (process.wait(timeout=60), err) == (141, b"")


# -- the entry points -------------------------------------------------------------------------------------------

REPOSITORY = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {
    "idempotency-mw": [str(Path(sys.executable).parent / "idempotency-mw")],
    "python -m idempotency_mw.cli": [sys.executable, "-m", "idempotency_mw.cli"],
    "python -m idempotency_mw": [sys.executable, "-m", "idempotency_mw"],
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_runs_the_command_line(entry: str, empty_db: Database) -> None:
    """``python -m idempotency_mw.cli migrate`` exited 0 having done nothing (the module had no ``__main__``
    guard), and ``python -m idempotency_mw`` did not exist."""
    command = ENTRY_POINTS[entry]
    done = subprocess.run([*command, *empty_db.options, "migrate"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("applied 0001_initial.sql\n")
    refused = subprocess.run([*command, "frobnicate"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "invalid choice: 'frobnicate'" in refused.stderr


def test_every_entry_point_the_docs_name_is_tested() -> None:
    """The package's ``python -m`` commands that the README and the docs show are the ones run above (the command
    line) and in tests/test_devdb.py (``idempotency_mw.devdb``)."""
    pages = [REPOSITORY / "README.md", *(REPOSITORY / "docs").glob("*.md")]
    named = {match for page in pages for match in re.findall(r"python -m (idempotency_mw[\w.]*)", page.read_text())}
    tested = {" ".join(command[1:]).removeprefix("-m ") for command in ENTRY_POINTS.values() if len(command) > 1}
    assert named <= tested | {"idempotency_mw.devdb"}


# -- the installed script ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_installed_console_script(db: Database) -> None:
    script = Path(sys.executable).parent / "idempotency-mw"
    on_db(db, lambda store: completed(store, TENANT, "via-script", b"{}"))
    result = subprocess.run([str(script), *db.options, "stats", "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["completed"] == 1
    result = subprocess.run(
        [str(script), *db.options, "inspect", TENANT, "nope"], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"idempotency-mw: no record for key 'nope' of tenant '{TENANT}' (TENANT must be")
