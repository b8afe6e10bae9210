"""Stored responses encrypted at rest (``idempotency_mw.encryption``): on every store kind, in both modes.

The conformance tests run once per store kind of ``tests/conftest.py`` (memory; PostgreSQL under each default
isolation level; through a transaction-pooling PgBouncer, from a DSN and on an app's pool), each with stores built
with the cipher a test asks for, on the same records: what another deploy of the app, with other keys, would see.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idempotency_mw import (
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    Store,
    header_tenant,
    idempotency_context,
)
from idempotency_mw.cli import main
from idempotency_mw.encryption import KEYS_VARIABLE, PlainResponseRefused, ResponseCipher
from idempotency_mw.sqlalchemy import SQLAlchemyStore, idempotency_session
from idempotency_mw.store import ClaimOutcome, SealedResponse, SealedResponseError, StoredResponse, UnknownKeyId
from tests.conftest import PGBOUNCER_SCHEMAS, STORES, client_for, tenant_of, with_database

ROOT = Path(__file__).resolve().parents[1]
KEYS = {name: bytes([n]) * 32 for n, name in enumerate(("2026-01", "2026-06", "2026-11"), start=1)}
FINGERPRINT = bytes(range(32))
# What an API answers: a card's last digits, a name; headers with repeated names and every byte latin-1 can carry.
BODY = b'{"id":"pi_1","card":{"last4":"4242"},"name":"Ada Lovelace","bytes":"\\u00e9"}\x00\xff\xfe'
HEADERS = [
    (b"content-type", b"application/json"),
    (b"location", b"/v1/customers/cus_ADA"),
    (b"set-cookie", b"a=1"),
    (b"set-cookie", b"b=2"),
    (b"x-odd", bytes(range(0x20, 0x7F)) + bytes(range(0xA0, 0x100))),
]
RESPONSE = StoredResponse(201, HEADERS, BODY, len(BODY))
UNSTORED = StoredResponse(200, [(b"content-disposition", b"attachment; filename=ada.csv")], None, 9_000_000)


def cipher(*key_ids: str) -> ResponseCipher:
    """A cipher with these of ``KEYS``, the first current."""
    return ResponseCipher({key_id: KEYS[key_id] for key_id in key_ids})


# -- one store kind, built with any cipher ------------------------------------------------------------------------


@dataclass
class Kind:
    """Stores of one kind of ``STORES`` on the same records, each with the cipher it is built with; and, for the
    PostgreSQL ones, a direct connection to the table they write."""

    name: str
    url: str | None  # None: memory
    direct_url: str | None
    schema: str
    bouncer: bool
    app_pool: bool
    _memory: MemoryStore | None = None
    _opened: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def store(self, with_cipher: ResponseCipher | None) -> Store:
        if self.url is None:  # one MemoryStore: a new cipher is what a restart with other keys would bring
            if self._memory is None:
                self._memory = MemoryStore()
            self._memory.cipher = with_cipher
            return self._memory
        if self.app_pool:
            pool = await asyncpg.create_pool(self.url, min_size=1, max_size=4, statement_cache_size=0)
            store = PostgresStore(pool, schema=self.schema, cipher=with_cipher)
            self._opened.append(pool.close)
        else:
            store = PostgresStore(
                self.url, schema=self.schema, prepared_statements=not self.bouncer, cipher=with_cipher, max_size=4
            )
        await store.open()
        self._opened.insert(0, lambda: store.close(grace=0))
        return store

    async def row(self, tenant: str, key: str) -> asyncpg.Record | None:
        """The raw row of ``idempotency_responses``; None for memory."""
        if self.direct_url is None:
            return None
        connection = await asyncpg.connect(self.direct_url)
        try:
            return await connection.fetchrow(
                f"SELECT * FROM {self.schema}.idempotency_responses WHERE tenant = $1 AND key = $2", tenant, key
            )
        finally:
            await connection.close()

    async def execute(self, statement: str, *args: Any) -> None:
        assert self.direct_url is not None
        connection = await asyncpg.connect(self.direct_url)
        try:
            await connection.execute(statement.replace("{schema}", self.schema), *args)
        finally:
            await connection.close()

    async def close(self) -> None:
        for close in self._opened:
            await close()


@pytest.fixture(params=list(STORES))
async def kind(request: pytest.FixtureRequest, idempotency_database_url: str) -> AsyncIterator[Kind]:
    """Each store kind of the conformance suite, built as ``tests/conftest.py``'s ``store`` fixture builds it."""
    spec = STORES[request.param]
    if spec is None:
        found = Kind(request.param, None, None, "public", False, False)
    else:
        level, bouncer, app_pool = spec
        url = direct = idempotency_database_url
        if bouncer:
            url = request.getfixturevalue("pgbouncer_url")
        if level != "read committed":
            name = urlsplit(request.getfixturevalue("isolation_urls")[level]).path.lstrip("/")
            url, direct = with_database(url, name), with_database(direct, name)
        schema = PGBOUNCER_SCHEMAS["pgbouncer-pool" if app_pool else "pgbouncer"] if bouncer else "public"
        found = Kind(request.param, url, direct, schema, bouncer, app_pool)
    try:
        yield found
    finally:
        await found.close()


async def completed(store: Store, tenant: str, key: str, response: StoredResponse = RESPONSE) -> None:
    claim = await store.claim(tenant, key, FINGERPRINT, lease=30, ttl=3600)
    assert claim.outcome is ClaimOutcome.OWNED
    assert await store.complete(tenant, key, claim.fence, response)


async def replayed(store: Store, tenant: str, key: str) -> StoredResponse:
    claim = await store.claim(tenant, key, FINGERPRINT, lease=30, ttl=3600)
    assert claim.outcome is ClaimOutcome.COMPLETED
    assert claim.response is not None
    return claim.response


def keys() -> tuple[str, str]:
    """A tenant and a key of a test's own."""
    return f"tenant-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4().hex}"


# -- conformance: every store kind --------------------------------------------------------------------------------


async def test_a_sealed_response_replays_byte_for_byte(kind: Kind) -> None:
    store = await kind.store(cipher("2026-11"))
    tenant, key = keys()
    await completed(store, tenant, key)
    assert await replayed(store, tenant, key) == RESPONSE
    record = await store.inspect(tenant, key)
    assert record is not None
    assert (record.response, record.sealed_with) == (RESPONSE, "2026-11")
    # A response not stored in full keeps its status (for the 409 that says so) and headers, sealed as well.
    await completed(store, tenant, key + "-big", UNSTORED)
    assert await replayed(store, tenant, key + "-big") == UNSTORED


async def test_nothing_of_the_response_is_readable_in_the_table(kind: Kind) -> None:
    if kind.direct_url is None:
        pytest.skip("memory has no table")
    store = await kind.store(cipher("2026-11"))
    tenant, key = keys()
    await completed(store, tenant, key)
    row = await kind.row(tenant, key)
    assert row is not None
    assert (row["status"], row["headers"], row["body"]) == (None, None, None)
    assert (row["sealed_with"], row["body_size"]) == ("2026-11", len(BODY))
    sealed = bytes(row["sealed"])
    for secret in (b"4242", b"Lovelace", b"cus_ADA", b"content-type", b"set-cookie", b"201"):
        assert secret not in sealed
    # A random nonce of its own: the same response under the same key seals differently each time.
    await completed(store, tenant, key + "-again")
    again = await kind.row(tenant, key + "-again")
    assert again is not None
    assert bytes(again["sealed"])[1:13] != sealed[1:13]


async def test_a_sealed_response_moved_to_another_record_does_not_open(kind: Kind) -> None:
    store = await kind.store(cipher("2026-11"))
    tenant, key = keys()
    await completed(store, tenant, key)
    await completed(store, tenant, key + "-other", StoredResponse(201, [], b"{}", 2))
    if kind.url is None:
        records = store._records  # type: ignore[attr-defined]
        records[(tenant, key + "-other")].response = records[(tenant, key)].response
    else:
        await kind.execute(
            "UPDATE {schema}.idempotency_responses AS s SET sealed = o.sealed, body_size = o.body_size "
            "FROM {schema}.idempotency_responses AS o "
            "WHERE s.tenant = $1 AND s.key = $2 AND o.tenant = $1 AND o.key = $3",
            tenant,
            key + "-other",
            key,
        )
    with pytest.raises(SealedResponseError, match="it was changed, or it belongs to another record"):
        await store.claim(tenant, key + "-other", FINGERPRINT, lease=30, ttl=3600)
    with pytest.raises(SealedResponseError):
        await store.inspect(tenant, key + "-other")
    assert await replayed(store, tenant, key) == RESPONSE  # the original still opens


async def test_rotation_old_keys_still_open_and_the_current_one_seals(kind: Kind) -> None:
    tenant, key = keys()
    before = await kind.store(cipher("2026-06"))
    await completed(before, tenant, key)
    after = await kind.store(cipher("2026-11", "2026-06"))  # the next deploy: a new current key, the old one kept
    assert await replayed(after, tenant, key) == RESPONSE
    await completed(after, tenant, key + "-new")
    new, old = await after.inspect(tenant, key + "-new"), await after.inspect(tenant, key)
    assert new is not None
    assert old is not None
    assert (new.sealed_with, old.sealed_with) == ("2026-11", "2026-06")
    assert await replayed(after, tenant, key + "-new") == RESPONSE


async def test_a_response_under_a_key_not_given_names_that_key(kind: Kind) -> None:
    tenant, key = keys()
    await completed(await kind.store(cipher("2026-06")), tenant, key)
    without = await kind.store(cipher("2026-11"))
    with pytest.raises(UnknownKeyId, match=r"sealed under key id '2026-06'.*has only '2026-11'") as raised:
        await without.claim(tenant, key, FINGERPRINT, lease=30, ttl=3600)
    assert raised.value.key_id == "2026-06"
    with pytest.raises(UnknownKeyId, match="'2026-06'"):
        await without.inspect(tenant, key)
    no_cipher = await kind.store(None)
    with pytest.raises(UnknownKeyId, match=r"'2026-06', and this store has no cipher"):
        await no_cipher.claim(tenant, key, FINGERPRINT, lease=30, ttl=3600)


async def test_responses_stored_plain_replay_under_a_cipher_only_while_it_allows_them(kind: Kind) -> None:
    tenant, key = keys()
    await completed(await kind.store(None), tenant, key)
    store = await kind.store(cipher("2026-11"))
    with pytest.raises(PlainResponseRefused, match="allow_plain=True"):
        await store.claim(tenant, key, FINGERPRINT, lease=30, ttl=3600)
    with pytest.raises(PlainResponseRefused):
        await store.inspect(tenant, key)
    lenient = await kind.store(ResponseCipher({"2026-11": KEYS["2026-11"]}, allow_plain=True))
    assert await replayed(lenient, tenant, key) == RESPONSE
    record = await lenient.inspect(tenant, key)
    assert record is not None
    assert (record.response, record.sealed_with) == (RESPONSE, None)


async def test_a_plain_response_put_in_place_of_a_sealed_one_is_refused(kind: Kind) -> None:
    """A role that can write the table but holds no key replaces a sealed response with a plain one of its own (an
    injected Set-Cookie, an HTML body): a store with a cipher never replays it."""
    store = await kind.store(cipher("2026-11"))
    tenant, key = keys()
    await completed(store, tenant, key)
    forged = StoredResponse(200, [(b"set-cookie", b"session=attacker"), (b"content-type", b"text/html")], b"<h1>", 4)
    if kind.url is None:
        store._records[(tenant, key)].response = forged  # type: ignore[attr-defined]
    else:
        await kind.execute(
            "UPDATE {schema}.idempotency_responses SET sealed = NULL, sealed_with = NULL, status = 200, "
            """headers = '[["set-cookie", "session=attacker"], ["content-type", "text/html"]]', body = '<h1>', """
            "body_size = 4 WHERE tenant = $1 AND key = $2",
            tenant,
            key,
        )
    with pytest.raises(PlainResponseRefused):
        await store.claim(tenant, key, FINGERPRINT, lease=30, ttl=3600)
    with pytest.raises(PlainResponseRefused):
        await store.inspect(tenant, key)


async def test_reencrypt_reseals_under_the_current_key_in_batches(kind: Kind) -> None:
    if kind.url is None:
        pytest.skip("reencrypt is the PostgreSQL store's (a MemoryStore lives no longer than its process)")
    tenant, key = keys()
    old = await kind.store(cipher("2026-06"))
    for n in range(5):
        await completed(old, tenant, f"{key}-{n}")
    await completed(await kind.store(None), tenant, f"{key}-plain")
    store = await kind.store(cipher("2026-11", "2026-06"))
    assert isinstance(store, PostgresStore)
    resealed, after, batches = 0, None, 0
    while True:
        batch = await store.reencrypt(batch_size=2, after=after)
        resealed, after, batches = resealed + batch.resealed, batch.after, batches + 1
        assert batch.unreadable == []
        if after is None:
            break
    assert resealed >= 5  # and those other tests of this kind left under 2026-06
    assert batches >= 3
    counts = await store.responses_by_key()
    assert counts.get("2026-06", 0) == 0
    assert counts.get(None, 0) >= 1  # the plain one stays plain without seal_plain
    # Idempotent: nothing left to do.
    assert (await store.reencrypt(batch_size=100)).resealed == 0
    batch = await store.reencrypt(batch_size=100_000, seal_plain=True)
    assert batch.after is None
    assert None not in await store.responses_by_key()
    # The old key can go now: every response opens under the new one alone.
    only_new = await kind.store(cipher("2026-11"))
    for name in [*(f"{key}-{n}" for n in range(5)), f"{key}-plain"]:
        assert await replayed(only_new, tenant, name) == RESPONSE
        record = await only_new.inspect(tenant, name)
        assert record is not None
        assert record.sealed_with == "2026-11"


# -- the cipher alone ---------------------------------------------------------------------------------------------


def test_keys_parse_from_base64_or_hex_the_first_current() -> None:
    raw = os.urandom(32)
    text = (
        f" 2026-11:{base64.b64encode(raw).decode()},\n2026-06:{KEYS['2026-06'].hex()} "
        f"2026-01:{base64.urlsafe_b64encode(KEYS['2026-01']).decode().rstrip('=')}"
    )
    parsed = ResponseCipher.parse(text)
    assert (parsed.current, parsed.key_ids) == ("2026-11", ("2026-11", "2026-06", "2026-01"))
    sealed = ResponseCipher({"2026-11": raw}).seal("t", "k", RESPONSE)
    assert parsed.open("t", "k", sealed) == RESPONSE
    assert ResponseCipher([("2026-06", KEYS["2026-06"].hex().upper())]).current == "2026-06"
    assert len(base64.b64decode(ResponseCipher.new_key())) == 32
    assert "2026" in repr(parsed)
    assert base64.b64encode(raw).decode() not in repr(parsed)


@pytest.mark.parametrize(
    ("keys_text", "message"),
    [
        ("", "at least one key"),
        ("2026-11:" + base64.b64encode(b"x" * 16).decode(), r"'2026-11' is 16 bytes: AES-256-GCM needs 32"),
        ("2026-11:not*base64", r"'2026-11' is neither base64 nor 64 hex digits"),
        ("a:" + KEYS["2026-01"].hex() + ",a:" + KEYS["2026-06"].hex(), "'a' is given twice"),
        ("a:" + KEYS["2026-01"].hex() + ",b:" + KEYS["2026-01"].hex(), "'a' and response key 'b' are the same key"),
        ("no colon here", "write each key as id:key"),
        ("bad/id:" + KEYS["2026-01"].hex(), "response key 'bad/id': an id is 1 to 64 characters"),
    ],
)
def test_bad_keys_are_refused_naming_the_key_id_never_the_key(keys_text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        ResponseCipher.parse(keys_text)
    for material in KEYS.values():
        assert material.hex() not in str(raised.value)


def test_the_environment_variable_is_required_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEYS_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=f"{KEYS_VARIABLE} is not set"):
        ResponseCipher.from_env()
    monkeypatch.setenv(KEYS_VARIABLE, "k1:tooshort")
    with pytest.raises(ValueError, match=f"^{KEYS_VARIABLE}: response key 'k1'"):
        ResponseCipher.from_env()
    monkeypatch.setenv("OTHER_KEYS", "k1:" + KEYS["2026-01"].hex())
    assert ResponseCipher.from_env("OTHER_KEYS").current == "k1"


def test_a_sealed_response_is_bound_to_its_record_size_key_and_format() -> None:
    sealer = cipher("2026-11", "2026-06")
    sealed = sealer.seal("tenant", "key", RESPONSE)
    assert sealed.sealed[0] == 1  # the format's version
    assert sealer.open("tenant", "key", sealed) == RESPONSE
    changed = [
        ("tenant", "key2", sealed),
        ("tenant2", "key", sealed),
        ("tenan", "tkey", sealed),  # the same bytes, cut elsewhere
        ("tenant", "key", SealedResponse(sealed.key_id, sealed.sealed, sealed.body_size + 1)),
        ("tenant", "key", SealedResponse("2026-06", sealed.sealed, sealed.body_size)),
        ("tenant", "key", SealedResponse(sealed.key_id, sealed.sealed[:-1] + b"\x00", sealed.body_size)),
    ]
    for tenant, key, tampered in changed:
        with pytest.raises(SealedResponseError):
            sealer.open(tenant, key, tampered)
    with pytest.raises(SealedResponseError, match="not in a sealed form this version reads"):
        sealer.open("tenant", "key", SealedResponse("2026-11", b"\x02" + sealed.sealed[1:], sealed.body_size))


def test_without_cryptography_the_module_names_the_extra() -> None:
    hide = (
        "import sys\n"
        "class Hidden:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cryptography' or name.startswith('cryptography.'):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Hidden())\n"
        # none of these needs it
        "import idempotency_mw, idempotency_mw._memory, idempotency_mw.postgres._store, idempotency_mw.cli\n"
        "import idempotency_mw.encryption\n"
    )
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last == (
        "ImportError: idempotency_mw.encryption needs cryptography: pip install 'idempotency-mw[encryption]'"
    ), done.stderr


# -- through the middleware: plain and transactional mode ---------------------------------------------------------


def charge_app(store: Any, *, transactional: bool = False, fail_open: bool = False) -> tuple[Starlette, list[str]]:
    runs: list[str] = []

    async def charge(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        if transactional and isinstance(store, SQLAlchemyStore):
            session = idempotency_session(request)
            await session.execute(text("SELECT 1"))
        elif transactional:
            assert context.connection is not None
            await context.connection.execute("SELECT 1")
        runs.append(context.key or "")
        return Response(BODY, status_code=201, headers={"location": "/v1/customers/cus_ADA"}, media_type="text/plain")

    app = Starlette(routes=[Route("/charges", charge, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, fail_open=fail_open)
    return app, runs


@contextlib.asynccontextmanager
async def store_of(mode: str, url: str, with_cipher: ResponseCipher | None) -> AsyncIterator[Any]:
    """A store for ``mode``: memory, postgres (plain or transactional), or SQLAlchemy (transactional)."""
    if mode == "memory":
        yield MemoryStore(cipher=with_cipher)
        return
    store = PostgresStore(url, cipher=with_cipher, max_size=4)
    if mode != "sqlalchemy":
        async with store:
            yield store
        return
    engine = create_async_engine(make_url(url).set(drivername="postgresql+asyncpg"))
    try:
        async with SQLAlchemyStore(store, engine) as sqlalchemy_store:
            yield sqlalchemy_store
    finally:
        await engine.dispose()


MODES = [("memory", False), ("postgres", False), ("postgres", True), ("sqlalchemy", True)]


@pytest.mark.parametrize(("mode", "transactional"), MODES, ids=[f"{m}-{'tx' if t else 'plain'}" for m, t in MODES])
async def test_the_middleware_replays_a_sealed_response_byte_for_byte(
    mode: str, transactional: bool, idempotency_database_url: str
) -> None:
    key = f"enc-{uuid.uuid4().hex}"
    async with store_of(mode, idempotency_database_url, cipher("2026-11")) as store:
        app, runs = charge_app(store, transactional=transactional)
        async with client_for(app) as client:
            first = await client.post("/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
            second = await client.post("/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
        assert (first.status_code, first.content, runs) == (201, BODY, [key])
        assert (second.status_code, second.headers["idempotent-replayed"]) == (201, "true")
        assert second.content == first.content
        assert [h for h in second.headers.raw if h[0] != b"idempotent-replayed"] == list(first.headers.raw)
        if mode != "memory":
            connection = await asyncpg.connect(idempotency_database_url)
            try:
                row = await connection.fetchrow(
                    "SELECT * FROM idempotency_responses WHERE tenant = $1 AND key = $2", tenant_of(), key
                )
            finally:
                await connection.close()
            assert row is not None
            assert (row["status"], row["headers"], row["body"], row["sealed_with"]) == (None, None, None, "2026-11")
            assert b"Lovelace" not in bytes(row["sealed"])
            assert b"cus_ADA" not in bytes(row["sealed"])


@pytest.mark.parametrize(("mode", "transactional"), MODES, ids=[f"{m}-{'tx' if t else 'plain'}" for m, t in MODES])
async def test_a_retry_of_a_response_under_a_missing_key_is_503_naming_the_key(
    mode: str, transactional: bool, idempotency_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The record is neither replayed nor run again: 503 with Retry-After (the store failed), and the log says
    which key id to give back."""
    key = f"enc-{uuid.uuid4().hex}"
    memory = MemoryStore(cipher=cipher("2026-06"))
    async with store_of(mode, idempotency_database_url, cipher("2026-06")) as store:
        app, runs = charge_app(memory if mode == "memory" else store, transactional=transactional)
        async with client_for(app) as client:
            assert (await client.post("/charges", json={}, headers={"Idempotency-Key": key})).status_code == 201
    memory.cipher = cipher("2026-11")
    async with store_of(mode, idempotency_database_url, cipher("2026-11")) as store:
        app, runs = charge_app(memory if mode == "memory" else store, transactional=transactional)
        with caplog.at_level(logging.ERROR, logger="idempotency_mw"):
            async with client_for(app) as client:
                retry = await client.post("/charges", json={}, headers={"Idempotency-Key": key})
    assert (retry.status_code, retry.headers.get("retry-after"), runs) == (503, "1", [])
    assert retry.json()["code"] == "idempotency_store_unavailable"
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "UnknownKeyId: the stored response is sealed under key id '2026-06'" in logged


@pytest.mark.parametrize(("mode", "transactional"), MODES, ids=[f"{m}-{'tx' if t else 'plain'}" for m, t in MODES])
async def test_a_sealed_response_downgraded_to_a_plain_one_is_never_replayed(
    mode: str, transactional: bool, idempotency_database_url: str
) -> None:
    """A role that can write the responses table but holds no key swaps a sealed response for a plain one (an
    injected Set-Cookie): the retry gets 503, never the forged answer, and nothing runs again."""
    key = f"enc-{uuid.uuid4().hex}"
    async with store_of(mode, idempotency_database_url, cipher("2026-11")) as store:
        app, runs = charge_app(store, transactional=transactional)
        async with client_for(app) as client:
            assert (await client.post("/charges", json={}, headers={"Idempotency-Key": key})).status_code == 201
            if mode == "memory":
                forged = StoredResponse(200, [(b"set-cookie", b"session=attacker")], b"<h1>", 4)
                store._records[(tenant_of(), key)].response = forged
            else:
                connection = await asyncpg.connect(idempotency_database_url)
                try:
                    await connection.execute(
                        "UPDATE idempotency_responses SET sealed = NULL, sealed_with = NULL, status = 200, "
                        """headers = '[["set-cookie", "session=attacker"]]', body = '<h1>', body_size = 4 """
                        "WHERE tenant = $1 AND key = $2",
                        tenant_of(),
                        key,
                    )
                finally:
                    await connection.close()
            retry = await client.post("/charges", json={}, headers={"Idempotency-Key": key})
    assert (retry.status_code, retry.json()["code"], runs) == (503, "idempotency_store_unavailable", [key])
    assert "set-cookie" not in retry.headers


async def test_a_response_that_does_not_open_never_fails_open() -> None:
    """``fail_open`` runs the handler unprotected when the store cannot be reached. A record that is there but does
    not open (its key was dropped) is no outage: running the handler again would repeat the operation."""
    key = f"enc-{uuid.uuid4().hex}"
    memory = MemoryStore(cipher=cipher("2026-06"))
    app, runs = charge_app(memory, fail_open=True)
    async with client_for(app) as client:
        assert (await client.post("/charges", json={}, headers={"Idempotency-Key": key})).status_code == 201
        memory.cipher = cipher("2026-11")
        retry = await client.post("/charges", json={}, headers={"Idempotency-Key": key})
    assert (retry.status_code, runs) == (503, [key])


# -- reencrypt beside live traffic, and the command line ----------------------------------------------------------


async def test_concurrent_reencrypt_runs_beside_replays_reseal_each_response_once(migrated_url: str) -> None:
    async with PostgresStore(migrated_url, cipher=cipher("2026-06")) as old:
        for n in range(60):
            await completed(old, "t", f"k{n}")
    stores = [PostgresStore(migrated_url, cipher=cipher("2026-11", "2026-06")) for _ in range(2)]
    for store in stores:
        await store.open()
    try:

        async def run(store: PostgresStore) -> int:
            total, after = 0, None
            while True:
                batch = await store.reencrypt(batch_size=7, after=after)
                total, after = total + batch.resealed, batch.after
                if after is None:
                    return total

        async def replay_all(store: PostgresStore) -> None:
            for n in range(60):
                assert await replayed(store, "t", f"k{n}") == RESPONSE

        *resealed, _ = await asyncio.gather(run(stores[0]), run(stores[1]), replay_all(stores[0]))
        leftover = (await stores[0].reencrypt(batch_size=100)).resealed  # any a run passed over while locked
        assert sum(resealed) + leftover == 60
        assert await stores[0].responses_by_key() == {"2026-11": 60}
    finally:
        for store in stores:
            await store.close()


async def test_reencrypt_leaves_a_response_that_does_not_open_and_goes_on(migrated_url: str) -> None:
    async with PostgresStore(migrated_url, cipher=cipher("2026-06")) as old:
        for name in ("a", "b", "c"):
            await completed(old, "t", name)
    connection = await asyncpg.connect(migrated_url)
    try:
        await connection.execute("UPDATE idempotency_responses SET body_size = 1 WHERE key = 'b'")
    finally:
        await connection.close()
    async with PostgresStore(migrated_url, cipher=cipher("2026-11", "2026-06")) as store:
        batch = await store.reencrypt(batch_size=10)
        assert batch.resealed == 2
        assert [(tenant, key) for tenant, key, _ in batch.unreadable] == [("t", "b")]
        assert await store.responses_by_key() == {"2026-06": 1, "2026-11": 2}


async def test_reencrypt_beside_a_completion_that_replaces_an_earlier_life_reseals_the_new_response(
    migrated_url: str,
) -> None:
    """A response of an earlier life stays when a transactional completion raced the takeover of its expired record;
    the new life's completion replaces it (``complete``'s ON CONFLICT). When that replacement commits while a
    re-sealing batch walks toward the row, the batch locks the new version: it must re-seal that one, never the
    earlier life's bytes its statement's snapshot still sees (a retry would then replay another request's answer)."""
    earlier = StoredResponse(201, [], b'{"id":"ch_1","amount":1000}', 27)
    newer = StoredResponse(201, [], b'{"id":"ch_2","amount":9900}', 27)
    connection = await asyncpg.connect(migrated_url)
    old = PostgresStore(migrated_url, cipher=cipher("2026-06"))  # an instance not given the new key yet
    await old.open()
    try:
        async with old.transaction() as transaction:  # life 1, completed in its handler's transaction ...
            first = await transaction.claim("t", "z", FINGERPRINT, lease=30, ttl=3600)
            await transaction.begin()
            assert await transaction.complete("t", "z", first.fence, earlier)
            await connection.execute(  # ... as the record expires (its handler outlived its ttl)
                "UPDATE idempotency_records SET expires_at = now() - interval '1 second', "
                "lease_expires_at = now() - interval '1 second' WHERE key = 'z'"
            )
            taken = await old.claim("t", "z", FINGERPRINT, lease=30, ttl=3600)  # a retry takes it over: life 2
            assert taken.outcome is ClaimOutcome.OWNED
            await transaction.commit()
        # Responses under the older key before it in the walk, so that the batch takes a while to reach it.
        await connection.execute(
            "INSERT INTO idempotency_records (tenant, key, fingerprint, fence, created_at, expires_at) "
            "SELECT 'a', lpad(i::text, 8, '0'), '\\x00'::bytea, i, now(), now() + interval '1 hour' "
            "FROM generate_series(1, 60000) AS i"
        )
        await connection.execute(
            "INSERT INTO idempotency_responses "
            "(tenant, key, fence, body_size, sealed, sealed_with, completed_at, life) "
            "SELECT 'a', lpad(i::text, 8, '0'), i, 0, '\\x00'::bytea, '2026-06', now(), now() "
            "FROM generate_series(1, 60000) AS i"
        )
        async with PostgresStore(migrated_url, cipher=cipher("2026-11", "2026-06")) as rotating:
            resealing = asyncio.ensure_future(rotating.reencrypt(batch_size=100_000, batch_bytes=1 << 30))
            while not await connection.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND pid <> pg_backend_pid() "
                "AND query LIKE '-- The next responses to re-seal%'"
            ):
                assert not resealing.done()
            assert await old.complete("t", "z", taken.fence, newer)  # life 2's answer, under the older key
            assert not resealing.done()  # it did not wait for the batch: the batch had not reached the row
            batch = await resealing
            assert len(batch.unreadable) == 60000
            sealed_with = await connection.fetchval("SELECT sealed_with FROM idempotency_responses WHERE key = 'z'")
            assert sealed_with == "2026-11"  # re-sealed by that batch, after the completion
            assert await replayed(rotating, "t", "z") == newer
    finally:
        await old.close()
        await connection.close()


async def test_reencrypt_reports_a_plain_row_no_store_wrote_and_seals_the_others(migrated_url: str) -> None:
    """A plain row whose headers are not a list of pairs, or whose status no response has, cannot be sealed: it is
    reported and left as it is, as a response that does not open is, and the batch goes on (it failed whole, every
    run again at the same row)."""
    async with PostgresStore(migrated_url) as plain:
        for name in ("a", "b", "c", "d"):
            await completed(plain, "t", name)
    connection = await asyncpg.connect(migrated_url)
    try:
        await connection.execute("""UPDATE idempotency_responses SET headers = '{"a": 1}' WHERE key = 'b'""")
        await connection.execute("UPDATE idempotency_responses SET status = -1 WHERE key = 'c'")
    finally:
        await connection.close()
    async with PostgresStore(migrated_url, cipher=cipher("2026-11")) as store:
        batch = await store.reencrypt(batch_size=10, seal_plain=True)
        assert batch.resealed == 2
        assert [(tenant, key) for tenant, key, _ in batch.unreadable] == [("t", "b"), ("t", "c")]
        assert all("not a response a store wrote" in why for _, _, why in batch.unreadable)
        assert await store.responses_by_key() == {None: 2, "2026-11": 2}
        assert await replayed(store, "t", "d") == RESPONSE


async def test_reencrypt_bounds_each_batch_by_bytes_as_well_as_rows(migrated_url: str) -> None:
    """A batch of large responses (8 MiB each by default) would pass PostgreSQL's 1 GB message limit at 500 rows:
    each batch stops where its responses' bytes would pass ``batch_bytes``, with one row at least, and the next
    batch goes on from there."""
    large = StoredResponse(200, [], b"x" * 1000, 1000)
    async with PostgresStore(migrated_url, cipher=cipher("2026-06")) as old:
        for n in range(5):
            await completed(old, "t", f"k{n}", large)
    async with PostgresStore(migrated_url) as plain:
        await completed(plain, "t", "k5", large)

    async def run(store: PostgresStore, batch_bytes: int) -> list[int]:
        """How many responses each batch of a run re-sealed."""
        sizes, after = [], None
        while True:
            batch = await store.reencrypt(batch_size=500, batch_bytes=batch_bytes, seal_plain=True, after=after)
            sizes.append(batch.resealed)
            if (after := batch.after) is None:
                return sizes

    async with PostgresStore(migrated_url, cipher=cipher("2026-11", "2026-06")) as store:
        assert await run(store, 2500) == [2, 2, 2]  # about 1 KB each: two fit in 2500 bytes, three do not
        assert await store.responses_by_key() == {"2026-11": 6}
        assert await run(store, 10) == [0]  # nothing left to do
    async with PostgresStore(migrated_url, cipher=cipher("2026-01", "2026-11")) as store:
        assert await run(store, 10) == [1] * 6  # each one larger than the bound: one a batch
        assert await store.responses_by_key() == {"2026-01": 6}
        assert await replayed(store, "t", "k5") == large


def test_the_command_line_reencrypts_and_inspects(
    migrated_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def seed() -> None:
        async with PostgresStore(migrated_url, cipher=cipher("2026-06")) as old:
            for n in range(3):
                await completed(old, "t", f"k{n}")
        async with PostgresStore(migrated_url) as plain:
            await completed(plain, "t", "plain")

    asyncio.run(seed())
    database = ["--database-url", migrated_url]
    monkeypatch.delenv(KEYS_VARIABLE, raising=False)
    assert main([*database, "reencrypt"]) == 2
    assert f"{KEYS_VARIABLE} is not set" in capsys.readouterr().err
    # inspect without the keys: one line naming the key id
    assert main([*database, "inspect", "t", "k0"]) == 3
    err = capsys.readouterr().err
    assert "cannot show the response of key 'k0' of tenant 't'" in err
    assert "'2026-06'" in err

    keys_text = ",".join(f"{key_id}:{KEYS[key_id].hex()}" for key_id in ("2026-11", "2026-06"))
    monkeypatch.setenv("MY_KEYS", keys_text)
    # A plain record is shown with the keys given too: showing is no place to refuse one (the app's cipher decides).
    assert main([*database, "inspect", "t", "plain", "--keys-from", "MY_KEYS"]) == 0
    assert "201" in capsys.readouterr().out
    assert main([*database, "reencrypt", "--keys-from", "MY_KEYS", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "under '2026-06': 3 responses, to re-seal" in out
    assert "plain: 1 response, left plain (--seal-plain seals them)" in out
    assert main([*database, "reencrypt", "--keys-from", "MY_KEYS", "--batch-size", "2"]) == 0
    out, err = capsys.readouterr()
    assert re.findall(r"batch \d+: re-sealed \d+", err) == ["batch 1: re-sealed 2", "batch 2: re-sealed 1"]
    assert out.splitlines() == [
        "re-sealed 3 responses under key '2026-11'",
        "plain: 1 response, left plain (--seal-plain seals them)",
        "under '2026-11' (current): 3 responses",
    ]
    assert main([*database, "reencrypt", "--keys-from", "MY_KEYS", "--seal-plain"]) == 0
    assert "re-sealed 1 response under key '2026-11'" in capsys.readouterr().out
    # Given only a newer key, with responses sealed under one it was not given: they are reported, exit 3.
    monkeypatch.setenv("NEWER_KEYS", f"2027-05:{(bytes([9]) * 32).hex()}")
    assert main([*database, "reencrypt", "--keys-from", "NEWER_KEYS"]) == 3
    out, err = capsys.readouterr()
    assert "under '2026-11': 4 responses, a key not given: they cannot be opened here" in out
    assert "left 4 responses sealed under key '2026-11' as they are: that key was not given" in err
    assert "4 responses could not be opened and were left as they are" in err
    monkeypatch.setenv(KEYS_VARIABLE, keys_text)
    assert main([*database, "inspect", "t", "k0"]) == 0
    shown = capsys.readouterr().out
    assert "sealed with  key '2026-11'" in shown
    assert "status       201" in shown
    assert b"Lovelace".hex() in shown  # the body's preview (hex: it is not all printable)


# -- the documentation's snippet ----------------------------------------------------------------------------------


def test_the_configuration_pages_snippet_runs(migrated_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encryption section's first python block, run as written with the environment it describes."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = page[page.index("## Encrypting stored responses") :]
    code = textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1))  # type: ignore[union-attr]
    monkeypatch.setenv("DATABASE_URL", migrated_url)
    monkeypatch.setenv(KEYS_VARIABLE, f"2026-11:{ResponseCipher.new_key()},2026-06:{ResponseCipher.new_key()}")
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/configuration.md", "exec"), namespace)
    store = namespace["store"]
    assert isinstance(store, PostgresStore)
    assert store.cipher is not None
    assert store.cipher.current == "2026-11"
    assert isinstance(namespace["app"], Starlette)


SWAPPED_KEY = "RjbV4CWPCd0cDfpfwCiR/9kKI2a2wL+xnO216HeGytw="


@pytest.mark.parametrize(
    "key",
    [SWAPPED_KEY, bytes(range(32)).hex(), SWAPPED_KEY.rstrip("=").replace("+", "-").replace("/", "_")],
    ids=["base64", "hex", "url-safe base64"],
)
def test_a_key_written_before_its_id_is_never_in_the_error(key: str) -> None:
    """``key:id`` instead of ``id:key``: the error names the item by its place, so the key that opens every stored
    response reaches no startup traceback or deploy log (a hex key even passes as an id)."""
    with pytest.raises(ValueError, match="the 1st response key") as raised:
        ResponseCipher.parse(f"{key}:2026-11")
    assert key not in str(raised.value)
    with pytest.raises(ValueError, match="the 2nd response key") as raised:
        ResponseCipher.parse(f"2026-10:{SWAPPED_KEY.replace('R', 'S')},{key}:2026-11")
    assert key not in str(raised.value)


def test_a_short_id_is_still_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="response key '2026-11' is 5 bytes"):
        ResponseCipher.parse("2026-11:c2hvcnQ=")


# -- fingerprint keys derived from the response keys --------------------------------------------------------------


def test_reencrypt_says_which_older_key_must_stay_for_the_fingerprints_derived_from_it(
    migrated_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no fingerprint keys and no tenant secret, fingerprints are keyed under keys derived from the response
    keys. Re-sealing moves the responses to the new key, never the fingerprints: dropping the old key then would
    turn every retry of a live request fingerprinted under it into a 422, so reencrypt says the key stays, until
    when, and exits with status 5; once those records have expired, it may go."""
    monkeypatch.delenv("IDEMPOTENCY_TENANT_SECRET", raising=False)
    monkeypatch.delenv("IDEMPOTENCY_FINGERPRINT_KEYS", raising=False)
    headers = {"x-account-id": "acct_1", "Idempotency-Key": f"enc-{uuid.uuid4().hex}"}
    runs: list[str] = []

    async def run(request: Request) -> Response:
        runs.append("ran")
        return Response(b"{}", status_code=201)

    async def charge(store: PostgresStore) -> httpx.Response:
        app = Starlette(routes=[Route("/charges", run, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, tenant=header_tenant("x-account-id"))
        async with client_for(app) as client:
            return await client.post("/charges", json={"amount": 500}, headers=headers)

    async def first() -> None:
        async with PostgresStore(migrated_url, cipher=cipher("2026-06")) as store:
            assert (await charge(store)).status_code == 201

    asyncio.run(first())
    database = ["--database-url", migrated_url]
    keys_text = ",".join(f"{key_id}:{KEYS[key_id].hex()}" for key_id in ("2026-11", "2026-06"))
    monkeypatch.setenv(KEYS_VARIABLE, keys_text)
    assert main([*database, "reencrypt"]) == 5
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[:2] == ["re-sealed 1 response under key '2026-11'", "under '2026-11' (current): 1 response"]
    assert re.fullmatch(
        r"keep key '2026-06' until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00: 1 live record has its "
        r"fingerprint under the fingerprint key derived from it \('response-key\.[0-9a-f]{12}'\)",
        lines[2],
    ), lines
    assert "key '2026-06' is still needed by the fingerprints of 1 live record" in err
    assert main([*database, "reencrypt", "--dry-run"]) == 0
    assert "keep key '2026-06' until" in capsys.readouterr().out

    async def retry() -> httpx.Response:  # with the old key kept, as reencrypt says: replayed
        async with PostgresStore(migrated_url, cipher=cipher("2026-11", "2026-06")) as store:
            return await charge(store)

    assert (asyncio.run(retry()).status_code, runs) == (201, ["ran"])

    async def expire() -> None:
        connection = await asyncpg.connect(migrated_url)
        try:
            await connection.execute("UPDATE idempotency_records SET expires_at = now() - interval '1 second'")
        finally:
            await connection.close()

    asyncio.run(expire())
    assert main([*database, "reencrypt"]) == 0
    assert "keep key" not in capsys.readouterr().out
