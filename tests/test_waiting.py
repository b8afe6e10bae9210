"""Waiting for a running original instead of answering 409 (``on_conflict="wait"``, waiting.py), on every store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
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
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import (
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    Store,
    StoredResponse,
    StoreUnavailable,
    idempotency_context,
)
from idempotency_mw._claim import ClaimOrWait
from idempotency_mw._waiting import Waiters
from idempotency_mw.postgres import _listener
from idempotency_mw.sqlalchemy import SQLAlchemyStore, SQLAlchemyTransaction
from idempotency_mw.store import Claim, ClaimOutcome, Transaction
from tests.conftest import client_for, tenant_of

FINGERPRINT = b"f" * 40
RESPONSE = StoredResponse(201, [], b"{}", 2)


class Original:
    """A handler that holds until told, and answers with the status it is told."""

    def __init__(self, *statuses: int) -> None:
        self.runs = 0
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.statuses = list(statuses)  # of the runs in turn; 201 after them

    async def handle(self, request: Request) -> Response:
        self.runs += 1
        run = self.runs
        context = idempotency_context(request)
        if context is not None and context.transaction is not None:
            # A handler reads or writes before it answers: its transaction's snapshot is taken here.
            if isinstance(context.transaction, SQLAlchemyTransaction):
                await context.transaction.session.execute(text("SELECT 1"))
            else:
                assert context.connection is not None
                await context.connection.execute("SELECT 1")
        self.entered.set()
        await self.go.wait()
        return JSONResponse({"run": run}, status_code=self.statuses.pop(0) if self.statuses else 201)


def waiting_app(store: Store, original: Original, **options: Any) -> Starlette:
    app = Starlette(routes=[Route("/pay", original.handle, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, on_conflict="wait", **options)
    return app


async def started(client: httpx.AsyncClient, original: Original, key: str) -> asyncio.Task[httpx.Response]:
    """The original request, held inside its handler."""
    first = asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
    await asyncio.wait_for(original.entered.wait(), 5)
    return first


async def waiting(client: httpx.AsyncClient, key: str, *, claimed_within: float = 0.2) -> asyncio.Task[httpx.Response]:
    """A duplicate of the original under ``key``, seen waiting ``claimed_within`` seconds later, not answered."""
    duplicate = asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
    await asyncio.sleep(claimed_within)
    assert not duplicate.done(), "the duplicate answered instead of waiting"
    return duplicate


async def test_a_duplicate_waits_and_gets_the_replay(store: Store, key: str) -> None:
    original = Original()
    client = client_for(waiting_app(store, original, wait=10))
    first = await started(client, original, key)
    duplicate = await waiting(client, key)
    original.go.set()
    live, replay = await first, await duplicate
    assert live.status_code == 201
    assert (replay.status_code, replay.headers["idempotent-replayed"], replay.content) == (201, "true", live.content)
    assert original.runs == 1


async def test_a_duplicate_runs_when_the_original_was_released(store: Store, key: str) -> None:
    original = Original(503)  # transient: the key is released, and the waiting duplicate runs
    client = client_for(waiting_app(store, original, wait=10))
    first = await started(client, original, key)
    duplicate = asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
    await asyncio.sleep(0.2)
    original.go.set()
    assert (await first).status_code == 503
    retried = await duplicate
    assert (retried.status_code, retried.json(), "idempotent-replayed" in retried.headers) == (201, {"run": 2}, False)
    assert original.runs == 2


async def test_a_forgotten_claim_wakes_its_waiters(store: Store, key: str) -> None:
    """An operator forgets the key of a request still running (``idempotency-mw forget``): a copy waiting for it
    claims afresh now, not at the end of its wait, and runs; the original's completion is fenced out."""
    original = Original()
    client = client_for(waiting_app(store, original, wait=30))
    first = await started(client, original, key)
    duplicate = await waiting(client, key)
    original.entered.clear()
    assert await store.forget(tenant_of(), key)
    try:
        await asyncio.wait_for(original.entered.wait(), 5)  # the copy runs, woken: its wait had 30 s left
    except TimeoutError:
        duplicate.cancel()
        raise
    finally:
        original.go.set()
    ran = await duplicate
    assert (ran.status_code, ran.json(), "idempotent-replayed" in ran.headers) == (201, {"run": 2}, False)
    await first  # its completion fenced out: what it answers is the handler's own
    assert original.runs == 2
    again = await client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
    assert (again.headers["idempotent-replayed"], again.json()) == ("true", {"run": 2})  # the copy's, not the first's


async def test_a_cancelled_waiter_stops_waiting(store: Store, key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting copy whose request is cancelled (its client left, a server timeout) stops waiting then: it claims
    the key no more when the original settles, which would take a released key for a moment from the retry that
    should have it, nor stays subscribed for the rest of its wait."""
    claims = 0
    claim = store.claim

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal claims
        claims += 1
        return await claim(*args, **kwargs)

    monkeypatch.setattr(store, "claim", counted)
    original = Original(503)  # transient: the key is released, which a waiter still there would claim
    client = client_for(waiting_app(store, original, wait=30))
    first = await started(client, original, key)
    copies = [await waiting(client, key, claimed_within=0.1) for _ in range(3)]
    for copy in copies:
        copy.cancel()
    await asyncio.gather(*copies, return_exceptions=True)
    await asyncio.sleep(0.1)
    claimed = claims
    original.go.set()
    assert (await first).status_code == 503
    await asyncio.sleep(0.3)
    assert claims == claimed  # nobody claimed again: the copies had stopped waiting
    again = await client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
    assert (again.status_code, again.json()) == (201, {"run": 2})


async def test_a_waiting_copy_stopped_as_it_claims_lets_the_claim_land_and_waits_no_more() -> None:
    """Cancelled while a claim of its is on the way (not asleep: the claim must land, ``_abandon`` releases it if
    it is ours), the copy does not go back to sleep when that claim finds the original still running."""
    waiters = Waiters()
    waiting: ClaimOrWait

    async def claim() -> Claim:
        claims.append(None)
        if len(claims) == 2:  # the check once subscribed: the request is cancelled as this claim is on its way
            waiting.stop()
        await asyncio.sleep(0)
        return Claim(ClaimOutcome.IN_PROGRESS, fence=7)

    claims: list[None] = []
    waiting = ClaimOrWait(claim, waiters.watch, within=30)
    claimed = await asyncio.wait_for(waiting.run(), 5)  # it waited for the original's settlement for 30 s before
    assert (claimed.outcome, len(claims), waiters.events) == (ClaimOutcome.IN_PROGRESS, 2, {})


async def test_after_the_bound_a_waiting_duplicate_gets_409(store: Store, key: str) -> None:
    original = Original()
    client = client_for(waiting_app(store, original, wait=0.3))
    first = await started(client, original, key)
    began = time.monotonic()
    duplicate = await client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
    waited = time.monotonic() - began
    assert duplicate.status_code == 409
    assert duplicate.json()["code"] == "idempotency_request_in_progress"
    assert 0.3 <= waited < 5
    original.go.set()
    assert (await first).status_code == 201


class BlipsAfterTheFirstAnswer(MemoryStore):
    """A store that cannot be reached for a moment, just after telling a duplicate that its key is in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = 0

    async def claim(self, *args: Any, **kwargs: Any) -> Claim:
        self.claims += 1
        if self.claims == 3:  # the original's, the duplicate's (in progress), then the duplicate's again
            raise StoreUnavailable("connection refused")
        return await super().claim(*args, **kwargs)


async def test_a_waiting_duplicate_does_not_fail_open_beside_its_original(key: str) -> None:
    """``fail_open`` runs a request whose store cannot be reached. A waiting duplicate knows better: it was told that
    its original runs, so a store failure while it waits is a 503, never a second run beside it (which it was)."""
    original = Original()
    client = client_for(waiting_app(BlipsAfterTheFirstAnswer(), original, wait=10, fail_open=True))
    first = await started(client, original, key)
    answering = client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
    try:  # a duplicate that runs the handler waits in it with the original: it would not answer
        duplicate = await asyncio.wait_for(answering, 5)
    finally:
        original.go.set()
    assert (duplicate.status_code, duplicate.json()["code"]) == (503, "idempotency_store_unavailable")
    assert (await first).status_code == 201
    assert original.runs == 1


async def test_a_different_request_with_the_key_does_not_wait(store: Store, key: str) -> None:
    original = Original()
    client = client_for(waiting_app(store, original, wait=10))
    first = await started(client, original, key)
    other = await asyncio.wait_for(client.post("/pay", json={"amount": 6}, headers={"Idempotency-Key": key}), timeout=2)
    assert other.status_code == 422
    original.go.set()
    await first


async def replayed_promptly(
    original: Original, first: asyncio.Task[httpx.Response], duplicate: asyncio.Task[httpx.Response]
) -> None:
    """The original answers; its waiting copy gets the replay within 5 s, long before its wait (30 s) would end."""
    completed = time.monotonic()
    original.go.set()
    live = await first
    replay = await asyncio.wait_for(duplicate, 10)
    assert time.monotonic() - completed < 5
    assert (replay.headers["idempotent-replayed"], replay.content) == ("true", live.content)


async def test_a_waiter_in_another_process_is_woken_by_the_database(idempotency_database_url: str, key: str) -> None:
    """Two stores stand for two processes: the original runs in one, the duplicate waits in the other, and wakes
    when the database tells of the completion (LISTEN/NOTIFY), long before its bound."""
    original = Original()
    async with PostgresStore(idempotency_database_url) as here, PostgresStore(idempotency_database_url) as there:
        first = await started(client_for(waiting_app(here, original, wait=30)), original, key)
        elsewhere = client_for(waiting_app(there, Original(), wait=30))
        duplicate = await waiting(elsewhere, key, claimed_within=0.5)  # it claimed (409 inside), and waits
        await replayed_promptly(original, first, duplicate)
        assert original.runs == 1


class SilentHop:
    """A TCP hop to the suite's PostgreSQL (through its socket on this machine) that can lose a LISTEN session's
    bytes without a word, both ways, as a NAT's or a load balancer's idle timeout does: no FIN, no RST."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.silenced = False  # the sessions that have listened so far lose everything from now on
        self._listened: list[dict[str, bool]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        self._server = await asyncio.start_server(self._hop, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()

    def silence(self) -> None:
        for session in self._listened:
            session["silent"] = True

    async def _hop(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_unix_connection(self.socket_path)
        session = {"silent": False}

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await reader.read(65536):
                    if upstream and b"LISTEN" in data:
                        self._listened.append(session)
                    if not session["silent"]:
                        writer.write(data)
                        await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False))


def local_socket(directory: str, port: str) -> str | None:
    path = f"{directory}/.s.PGSQL.{port}"
    return path if os.path.exists(path) else None


async def test_a_listening_session_lost_without_a_word_is_found_and_replaced(
    idempotency_database_url: str, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiters' LISTEN session is dropped on the way without a word: nothing ends it, and every notice after
    is lost. The listener asks it whether it is there, finds it gone within the store's timeout, wakes its waiters
    and listens again: the copy gets the replay long before its wait would have ended (30 s)."""
    monkeypatch.setattr(_listener, "PROBE_EVERY", 0.2)
    connection = await asyncpg.connect(idempotency_database_url)
    try:
        row = await connection.fetchrow(
            "SELECT split_part(current_setting('unix_socket_directories'), ',', 1), current_setting('port')"
        )
    finally:
        await connection.close()
    assert row is not None
    socket_path = local_socket(row[0].strip(), row[1])
    if socket_path is None:
        pytest.skip("the suite's PostgreSQL has no socket on this machine")
    parts = urlsplit(idempotency_database_url)
    hop = SilentHop(socket_path)
    async with hop as hop_port:
        credentials = parts.netloc.rpartition("@")[0] or "postgres"
        through_hop = f"postgresql://{credentials}@127.0.0.1:{hop_port}{parts.path}"
        async with PostgresStore(idempotency_database_url) as here, PostgresStore(through_hop, timeout=1) as there:
            for round_key in (f"{key}-before", key):
                original = Original()
                first = await started(client_for(waiting_app(here, original, wait=30)), original, round_key)
                duplicate = await waiting(client_for(waiting_app(there, Original(), wait=30)), round_key)
                if round_key == key:
                    hop.silence()  # the session that listens for the copy: from now on, it hears nothing
                await asyncio.sleep(0.5)
                await replayed_promptly(original, first, duplicate)


async def test_a_waiter_in_another_process_is_woken_by_a_forget(idempotency_database_url: str, key: str) -> None:
    """The key forgotten from one process (the command line's store, say): a copy waiting in another is told by the
    database, claims afresh and runs, long before its bound."""
    original = Original()
    async with PostgresStore(idempotency_database_url) as here, PostgresStore(idempotency_database_url) as there:
        first = await started(client_for(waiting_app(here, original, wait=30)), original, key)
        elsewhere = Original()
        duplicate = await waiting(client_for(waiting_app(there, elsewhere, wait=30)), key, claimed_within=0.5)
        async with PostgresStore(idempotency_database_url) as operator:
            assert await operator.forget(tenant_of(), key)
        try:
            await asyncio.wait_for(elsewhere.entered.wait(), 5)  # woken: its wait had 30 s left
        except TimeoutError:
            duplicate.cancel()
            raise
        finally:
            elsewhere.go.set()
            original.go.set()
        assert (await duplicate).status_code == 201
        await first
        assert (original.runs, elsewhere.runs) == (1, 1)


async def test_five_hundred_waiting_duplicates_hold_no_connection(idempotency_database_url: str, key: str) -> None:
    """A storm of duplicates that wait holds no connection while it waits: with a pool of 6, 500 of them all get the
    replay, none a 503, and the server saw no more of the store's connections than its pool (and its listener)."""
    original = Original()
    name = f"imw-waiters-{uuid.uuid4().hex[:8]}"
    separator = "&" if "?" in idempotency_database_url else "?"
    dsn = f"{idempotency_database_url}{separator}application_name={name}"
    async with PostgresStore(dsn, min_size=1, max_size=6) as store:
        client = client_for(waiting_app(store, original, wait=30))
        first = await started(client, original, key)
        duplicates = [
            asyncio.create_task(client.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
            for _ in range(500)
        ]
        await asyncio.sleep(1.0)
        admin = await asyncpg.connect(idempotency_database_url)
        try:
            connections = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
            )
        finally:
            await admin.close()
        original.go.set()
        live = await first
        answers = await asyncio.gather(*duplicates)
    assert [a.status_code for a in answers] == [201] * 500
    assert all(a.content == live.content for a in answers)
    assert original.runs == 1
    assert connections <= 6 + 1  # the store's pool, and its listener


async def test_waiters_of_one_claim_share_one_event() -> None:
    waiters = Waiters()

    async def wait() -> None:
        async with waiters.watch(42) as settled:
            await settled.wait(5)

    woken = asyncio.gather(*(wait() for _ in range(3)))
    await asyncio.sleep(0)
    assert waiters.events
    waiters.wake(7)  # another claim's settlement wakes nobody here
    await asyncio.sleep(0.05)
    assert not woken.done()
    waiters.wake(42)
    await asyncio.wait_for(woken, 1)
    assert not waiters.events


async def test_a_notification_names_the_claim_by_its_fence_alone(idempotency_database_url: str, key: str) -> None:
    """PostgreSQL checks no privilege for LISTEN: a role with no rights on the tables hears every notification. It
    hears a random number that names nothing outside the store, never a hash of the tenant and key (with a constant
    webhook tenant and guessable event ids, that told which event had settled)."""
    heard: list[str] = []
    listener = await asyncpg.connect(idempotency_database_url)
    await listener.add_listener("idempotency_mw_settled", lambda *args: heard.append(args[3]))
    try:
        async with PostgresStore(idempotency_database_url) as store:
            for settle in ("complete", "release"):
                owned = await store.claim("provider", f"{key}-{settle}", FINGERPRINT, lease=30, ttl=60)
                waiting = await store.claim("provider", f"{key}-{settle}", FINGERPRINT, lease=30, ttl=60)
                assert waiting.outcome is ClaimOutcome.IN_PROGRESS
                assert waiting.fence == owned.fence  # what the waiter waits for
                if settle == "complete":
                    assert await store.complete("provider", f"{key}-{settle}", owned.fence, RESPONSE)
                else:
                    assert await store.release("provider", f"{key}-{settle}", owned.fence)
                for _ in range(50):
                    if len(heard) == (1 if settle == "complete" else 2):
                        break
                    await asyncio.sleep(0.02)
                assert heard[-1] == f"public:{owned.fence}"
    finally:
        await listener.close()
    for payload in heard:
        assert "provider" not in payload
        assert key not in payload


async def test_the_notice_after_a_commit_finds_its_record_by_the_primary_key(
    idempotency_database_url: str, key: str
) -> None:
    """The waiters' notice runs with every transactional request's reset, after its COMMIT: it must look its record
    up by ``(tenant, key)``, never read the whole table. (Its values are written in as hex; decoded, they carried the
    collation of ``convert_from``'s encoding name, "C", which the primary key's "default" cannot serve: a sequential
    scan per request, 2.5 ms on a table of 17,000 records and growing with it.)"""
    # Written in (an app's pool, SQLAlchemy's), and as the store's own connections run it: prepared when first lent,
    # then run by name.
    store = PostgresStore(idempotency_database_url, min_size=1, max_size=1)
    async with store, store.connection() as connection, connection.transaction():
        connector: Any = store._connector  # the store's own pool
        prepared = connector.notice_statement(lent_driver(connection))
        assert prepared is not None
        plans = []
        for notice in (
            store._records.notice("tenant-é", key, 12345),
            store._records.notice("tenant-é", key, 1, prepared),
        ):
            await connection.execute("SET LOCAL enable_seqscan = off")  # what the planner can do, not likes
            plans.append("\n".join(row[0] for row in await connection.fetch("EXPLAIN " + notice.rstrip(";"))))
    for plan in plans:
        assert "idempotency_records_pkey" in plan
        assert re.search(r"Index Cond: \(\(tenant = .*\) AND \(key = .*\)\)", plan), plan


def lent_driver(connection: Any) -> Any:
    """The driver connection behind a connection the store lent."""
    return connection._connection


class SettlesAfterTheFirstClaim(PostgresStore):
    """A store whose first claim answers IN_PROGRESS and then, before the answer is read, the original settles
    elsewhere: the window between a waiter's claim and its listening, where a notification used to be missed."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.before_answer: Callable[[], Awaitable[None]] | None = None

    async def claim(
        self,
        tenant: str,
        key: str,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        matching: tuple[bytes, ...] = (),
        request: str | None = None,
        parts: bytes | None = None,
    ) -> Claim:
        claim = await super().claim(
            tenant, key, fingerprint, lease=lease, ttl=ttl, matching=matching, request=request, parts=parts
        )
        hook, self.before_answer = self.before_answer, None
        if hook is not None and claim.outcome is ClaimOutcome.IN_PROGRESS:
            await hook()
        return claim


async def test_the_first_waiter_of_a_worker_misses_no_settlement(idempotency_database_url: str, key: str) -> None:
    """The original settles after the waiter's claim found it running and before the waiter's worker listens (its
    first waiter starts the listener): the waiter subscribes, then checks, so it gets the replay at once instead of
    sleeping its whole wait."""
    original = Original()
    async with (
        PostgresStore(idempotency_database_url) as here,
        SettlesAfterTheFirstClaim(idempotency_database_url) as there,
    ):
        first = await started(client_for(waiting_app(here, original, wait=8)), original, key)

        async def settle() -> None:
            original.go.set()
            await first

        there.before_answer = settle
        began = time.monotonic()
        elsewhere = client_for(waiting_app(there, Original(), wait=8))
        replay = await elsewhere.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key})
        assert (replay.status_code, replay.headers.get("idempotent-replayed")) == (201, "true")
        assert time.monotonic() - began < 3, "the waiter slept through a settlement it missed"
    assert original.runs == 1


@pytest.mark.parametrize("pool", ["own", "app"])
async def test_waiting_never_takes_the_connection_kept_for_renewals(
    pool: str, idempotency_database_url: str, key: str
) -> None:
    """At the smallest pool the docs allow (two connections: one for claims and lent transactions, one kept for the
    work that finishes requests), a duplicate that has waited leaves the store listening, on a connection of its own
    beside the pool. A transactional handler that then holds its connection past several lease renewals still
    renews: its lease never lapses, and a retry in another worker gets 409, never a second run."""
    app_pool = None
    if pool == "app":
        app_pool = await asyncpg.create_pool(idempotency_database_url, min_size=0, max_size=2)
        store = PostgresStore(app_pool)
    else:
        store = PostgresStore(idempotency_database_url, min_size=0, max_size=2)
    runs: list[str] = []

    async def pay(request: Request) -> Response:
        body = await request.json()
        runs.append(body["step"])
        context = idempotency_context(request)
        if context is not None and context.connection is not None:
            await context.connection.execute("SELECT 1")
            await asyncio.sleep(body.get("hold", 0))
        return JSONResponse({"step": body["step"]}, status_code=201)

    def worker(on: PostgresStore) -> httpx.AsyncClient:
        app = Starlette(routes=[Route("/pay", pay, methods=["POST"]), Route("/tx", pay, methods=["POST"])])
        options: dict[str, Any] = {"on_conflict": "wait", "wait": 10, "lease": 0.9}
        options["routes"] = {"/tx": {"transactional": True}}
        app.add_middleware(IdempotencyMiddleware, store=on, **options)
        return client_for(app)

    try:
        async with store, PostgresStore(idempotency_database_url) as other_worker:
            client = worker(store)
            # A duplicate waits (plain mode): the store listens from now on.
            original = Original()
            holding = client_for(waiting_app(store, original, wait=10))
            first = await started(holding, original, key)
            duplicate = asyncio.create_task(holding.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
            await asyncio.sleep(0.3)
            original.go.set()
            assert (await first).status_code == 201
            assert (await duplicate).headers.get("idempotent-replayed") == "true"
            # A transactional handler holds its connection for three leases.
            long_key = f"{key}-long"
            running = asyncio.create_task(
                client.post("/tx", json={"step": "long", "hold": 2.7}, headers={"Idempotency-Key": long_key})
            )
            await asyncio.sleep(2.0)  # two leases later: renewed, or lapsed and taken over
            retry = await worker(other_worker).post(
                "/tx", json={"step": "long", "hold": 2.7}, headers={"Idempotency-Key": long_key}
            )
            answer = await running
    finally:
        if app_pool is not None:
            await app_pool.close()
    assert (retry.status_code, runs) == (201, ["long"]), "the lease lapsed while its handler ran, and it ran again"
    assert answer.status_code == 201
    assert retry.headers.get("idempotent-replayed") == "true"  # it waited for the original, and got its answer


async def test_a_store_closed_as_its_listener_starts_keeps_no_connection(
    idempotency_database_url: str, key: str
) -> None:
    """A wait starts the listener and the store closes before the listener has connected: the listener still ends,
    and the connection it opens goes with it, instead of listening on after the close."""
    name = f"imw-listener-{uuid.uuid4().hex[:8]}"
    separator = "&" if "?" in idempotency_database_url else "?"
    store = PostgresStore(f"{idempotency_database_url}{separator}application_name={name}", min_size=1, max_size=2)
    await store.open()

    async def wait() -> None:
        async with store.watch(7):  # the first waiter starts the listener
            await asyncio.sleep(30)

    waiting = asyncio.create_task(wait())
    await asyncio.sleep(0)
    await store.close()
    waiting.cancel()
    admin = await asyncpg.connect(idempotency_database_url)
    try:
        for _ in range(50):
            left = await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name)
            if left == 0:
                break
            await asyncio.sleep(0.1)
    finally:
        await admin.close()
    assert left == 0


@contextlib.asynccontextmanager
async def transactional_store(kind: str, url: str) -> AsyncIterator[Store]:
    store = PostgresStore(url)
    if kind == "postgres":
        async with store:
            yield store
        return
    engine = create_async_engine(make_url(url).set(drivername="postgresql+asyncpg"))
    try:
        async with SQLAlchemyStore(store, engine) as sqlalchemy_store:
            yield sqlalchemy_store
    finally:
        await engine.dispose()


@pytest.mark.parametrize("kind", ["postgres", "sqlalchemy"])
async def test_a_waiter_in_another_worker_is_woken_under_every_isolation_level(
    kind: str, isolated_url: str, key: str
) -> None:
    """A transactional original completes its record in its handler's transaction, whose snapshot under REPEATABLE
    READ or SERIALIZABLE predates the duplicate that came meanwhile: the waiters are told after the COMMIT, so the
    duplicate waiting in another worker gets its replay at once, not when its wait runs out."""
    original = Original()
    async with transactional_store(kind, isolated_url) as here, transactional_store(kind, isolated_url) as there:
        first = await started(client_for(waiting_app(here, original, wait=8, transactional=True)), original, key)
        elsewhere = client_for(waiting_app(there, Original(), wait=8, transactional=True))
        duplicate = asyncio.create_task(elsewhere.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
        await asyncio.sleep(0.5)
        assert not duplicate.done()
        settled = time.monotonic()
        original.go.set()
        live = await first
        replay = await asyncio.wait_for(duplicate, 15)
        assert time.monotonic() - settled < 3, "the waiter slept out its wait after the original committed"
    assert (live.status_code, replay.headers.get("idempotent-replayed"), replay.content) == (201, "true", live.content)
    assert original.runs == 1


class CommitsWhenTold(PostgresStore):
    """A store whose transactions hold their COMMIT until told: the window between the completion statement and the
    COMMIT, in which a duplicate counted under READ COMMITTED used to be missed."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.completed = asyncio.Event()
        self.commit = asyncio.Event()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        async with super().transaction() as transaction:
            commit = transaction.commit

            async def held() -> None:
                self.completed.set()
                await self.commit.wait()
                await commit()

            transaction.commit = held  # type: ignore[method-assign]
            yield transaction


async def test_a_duplicate_counted_between_the_completion_and_the_commit_is_woken(
    idempotency_database_url: str, key: str
) -> None:
    original = Original()
    async with CommitsWhenTold(idempotency_database_url) as here, PostgresStore(idempotency_database_url) as there:
        first = await started(client_for(waiting_app(here, original, wait=8, transactional=True)), original, key)
        original.go.set()
        await asyncio.wait_for(here.completed.wait(), 5)  # completed in its transaction, not committed yet
        elsewhere = client_for(waiting_app(there, Original(), wait=8))
        duplicate = asyncio.create_task(elsewhere.post("/pay", json={"amount": 5}, headers={"Idempotency-Key": key}))
        await asyncio.sleep(0.5)  # counted, and waiting
        settled = time.monotonic()
        here.commit.set()
        live = await first
        replay = await asyncio.wait_for(duplicate, 15)
        assert time.monotonic() - settled < 3, "the waiter slept out its wait after the original committed"
    assert (replay.headers.get("idempotent-replayed"), replay.content) == ("true", live.content)
