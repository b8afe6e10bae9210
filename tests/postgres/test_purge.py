"""The purge, and every statement that deletes a record or writes a response, without the foreign keys to the
records (migrations/0006, contract/0008): on the schema as this release's migrate leaves it (the foreign keys still
there, for the previous release running beside it) and as the contract step leaves it (the shape the statements are
written for). Each race is played in its order by hand: a transaction held open on one connection while the other
statement runs on another."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from idempotency_mw import PostgresStore, StoredResponse
from idempotency_mw.postgres._lending import PostgresTransaction
from idempotency_mw.postgres._sql import contract_statements
from idempotency_mw.store import ClaimOutcome
from tests.conftest import opened
from tests.postgres.test_store import fetch, wait_for_lock_wait

FINGERPRINT = bytes(range(32))
OTHER = bytes(range(1, 33))
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id": 1}', 9)
LATER = StoredResponse(202, [(b"content-type", b"application/json")], b'{"id": 2}', 9)


@pytest.fixture(params=["expanded", "contracted"])
async def shaped_url(request: pytest.FixtureRequest, migrated_url: str) -> str:
    """A migrated database of its own: as migrate leaves it, or with the contract step applied too."""
    if request.param == "contracted":
        connection = await asyncpg.connect(migrated_url)
        try:
            for statement in contract_statements():
                await connection.execute(statement)
            assert await connection.fetchval("SELECT count(*) FROM pg_constraint WHERE contype = 'f'") == 0
        finally:
            await connection.close()
    return migrated_url


@pytest.fixture(params=["read committed", "repeatable read", "serializable"])
async def isolation(request: pytest.FixtureRequest, shaped_url: str) -> str:
    """The isolation level of the handlers' transactions: the database's default, which a lent transaction takes."""
    level: str = request.param
    name = (await fetch(shaped_url, "SELECT current_database()"))[0][0]
    await fetch(shaped_url, f"ALTER DATABASE \"{name}\" SET default_transaction_isolation = '{level}'")
    return level


@pytest.fixture
async def store(shaped_url: str) -> AsyncIterator[PostgresStore]:
    async with opened(PostgresStore(shaped_url, min_size=1, max_size=3)) as store:  # some tests stop a race halfway
        yield store


@pytest.fixture
async def admin(shaped_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(shaped_url)
    try:
        yield connection
    finally:
        await connection.close()


async def rows(admin: asyncpg.Connection, table: str, key: str) -> int:
    return int(await admin.fetchval(f"SELECT count(*) FROM idempotency_{table} WHERE key = $1", key))


async def expire(admin: asyncpg.Connection, key: str) -> None:
    """Past its ttl and its lease: a handler stuck beyond both (a renewal keeps the record alive otherwise)."""
    await admin.execute(
        "UPDATE idempotency_records SET expires_at = now() - interval '1 s', lease_expires_at = now() - interval '1 s' "
        "WHERE key = $1",
        key,
    )


async def test_the_purge_passes_over_a_record_whose_completion_is_in_flight(
    store: PostgresStore, admin: asyncpg.Connection
) -> None:
    """A completion in a handler's transaction holds its record: the purge leaves it (SKIP LOCKED) and never waits;
    once it committed, the next purge takes the record and its response together, and nothing is left over."""
    async with store.transaction() as transaction:
        claim = await transaction.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
        await expire(admin, "k")
        await transaction.begin()
        assert await transaction.complete("t", "k", claim.fence, RESPONSE)
        assert await asyncio.wait_for(store.purge_expired(), 10) == 0
        await transaction.commit()
    assert (await rows(admin, "records", "k"), await rows(admin, "responses", "k")) == (1, 1)
    assert await store.purge_expired() == 1
    assert (await rows(admin, "records", "k"), await rows(admin, "responses", "k")) == (0, 0)


async def test_a_completion_after_the_purge_leaves_no_response(
    isolation: str, store: PostgresStore, admin: asyncpg.Connection
) -> None:
    """The purge deleted the record first: the completion finds it gone (READ COMMITTED: fenced out) or fails its
    transaction (REPEATABLE READ, SERIALIZABLE: its snapshot still has the record), and no response is left without
    a record, for a claim of the key afresh to find."""
    async with store.transaction() as transaction:
        assert isinstance(transaction, PostgresTransaction)
        claim = await transaction.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
        await transaction.begin()
        assert await transaction.connection.fetchval("SELECT count(*) FROM idempotency_records") == 1  # a snapshot
        await expire(admin, "k")
        assert await store.purge_expired() == 1
        if isolation == "read committed":
            assert not await transaction.complete("t", "k", claim.fence, RESPONSE)
            await transaction.commit()
        else:
            with pytest.raises(asyncpg.SerializationError):
                await transaction.complete("t", "k", claim.fence, RESPONSE)
            await transaction.rollback()
    assert await rows(admin, "responses", "k") == 0
    fresh = await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
    assert fresh.outcome is ClaimOutcome.OWNED


async def test_a_completion_racing_a_takeover_never_answers_for_the_new_life(
    isolation: str, store: PostgresStore, admin: asyncpg.Connection
) -> None:
    """The record expired under a stuck handler and a new request took the key over (a new life) while the stuck
    handler's transaction was still open. Its completion is fenced out (READ COMMITTED), or lands as a response of
    the earlier life (REPEATABLE READ, SERIALIZABLE: its snapshot predates the takeover): never read for the new
    life, replaced by the new life's completion, purged with the record."""
    async with store.transaction() as transaction:
        assert isinstance(transaction, PostgresTransaction)
        stuck = await transaction.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
        await transaction.begin()
        assert await transaction.connection.fetchval("SELECT count(*) FROM idempotency_records") == 1  # a snapshot
        await expire(admin, "k")
        taken = await store.claim("t", "k", OTHER, lease=30, ttl=60)
        assert taken.outcome is ClaimOutcome.OWNED
        landed = await transaction.complete("t", "k", stuck.fence, RESPONSE)
        assert landed == (isolation != "read committed")
        await transaction.commit()
    assert (await store.claim("t", "k", OTHER, lease=30, ttl=60)).outcome is ClaimOutcome.IN_PROGRESS
    record = await store.inspect("t", "k")
    assert record is not None
    assert (record.state, record.response) == ("in_progress", None)
    assert await store.complete("t", "k", taken.fence, LATER)
    replay = await store.claim("t", "k", OTHER, lease=30, ttl=60)
    assert (replay.outcome, replay.response) == (ClaimOutcome.COMPLETED, LATER)
    await expire(admin, "k")
    assert await store.purge_expired() == 1
    assert (await rows(admin, "records", "k"), await rows(admin, "responses", "k")) == (0, 0)


async def test_a_release_waits_for_a_completion_in_flight_and_keeps_it(
    store: PostgresStore, admin: asyncpg.Connection
) -> None:
    """A release that meets the record held by a completion still in its transaction (a COMMIT whose answer was
    lost, say) waits for it; the completion committed, the record stays completed, and the release says so."""
    async with store.transaction() as transaction:
        claim = await transaction.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
        await transaction.begin()
        assert await transaction.complete("t", "k", claim.fence, RESPONSE)
        releasing = asyncio.create_task(store.release("t", "k", claim.fence))
        await wait_for_lock_wait(admin)
        await transaction.commit()
    assert not await releasing
    replay = await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
    assert (replay.outcome, replay.response) == (ClaimOutcome.COMPLETED, RESPONSE)


async def test_a_release_after_a_rolled_back_completion_frees_the_key(
    store: PostgresStore, admin: asyncpg.Connection
) -> None:
    async with store.transaction() as transaction:
        claim = await transaction.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
        await transaction.begin()
        assert await transaction.complete("t", "k", claim.fence, RESPONSE)
        releasing = asyncio.create_task(store.release("t", "k", claim.fence))
        await wait_for_lock_wait(admin)
        await transaction.rollback()
    assert await releasing
    assert (await rows(admin, "records", "k"), await rows(admin, "responses", "k")) == (0, 0)


async def test_the_purge_takes_the_responses_and_points_of_every_life_and_nothing_live(
    store: PostgresStore, admin: asyncpg.Connection
) -> None:
    """Expired: a completed and replayed record, one holding a response of an earlier life (left by a completion that
    raced a takeover), one stopped at a recovery point. Live: a completed and replayed record. The purge removes the
    three with all their rows, and leaves the live one whole."""
    for key in ("done", "stale", "stepped", "live"):
        claim = await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)
        if key != "stepped":
            assert await store.complete("t", key, claim.fence, RESPONSE)
    for key in ("done", "live"):
        assert (await store.claim("t", key, FINGERPRINT, lease=30, ttl=60)).outcome is ClaimOutcome.COMPLETED
    await store.count_replays()
    await admin.execute("UPDATE idempotency_responses SET life = life - interval '1 hour' WHERE key = 'stale'")
    await admin.execute(
        "INSERT INTO idempotency_recovery_points (tenant, key, life, step, position, done, result, fence, "
        "committed_at) SELECT tenant, key, created_at, 'charge', 0, true, '{}', fence, now() "
        "FROM idempotency_records WHERE key = 'stepped'"
    )
    assert (await store.claim("t", "stale", FINGERPRINT, lease=30, ttl=60)).outcome is ClaimOutcome.IN_PROGRESS
    for key in ("done", "stale", "stepped"):
        await expire(admin, key)
    assert await store.purge_expired(batch_size=10) == 3
    assert await store.purge_expired(batch_size=10) == 0
    left = await admin.fetch(
        "SELECT 'record' AS kind, key FROM idempotency_records UNION ALL "
        "SELECT 'response', key FROM idempotency_responses UNION ALL "
        "SELECT 'point', key FROM idempotency_recovery_points UNION ALL "
        "SELECT 'replays', key FROM idempotency_replays ORDER BY 1"
    )
    assert [tuple(row) for row in left] == [("record", "live"), ("replays", "live"), ("response", "live")]


async def test_forget_takes_the_points_and_the_replay_counts_too(
    store: PostgresStore, admin: asyncpg.Connection
) -> None:
    claim = await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
    await admin.execute(
        "INSERT INTO idempotency_recovery_points (tenant, key, life, step, position, done, result, fence, "
        "committed_at) SELECT tenant, key, created_at, 'charge', 0, true, '{}', $1, now() FROM idempotency_records",
        claim.fence,
    )
    assert await store.complete("t", "k", claim.fence, RESPONSE)
    assert (await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)).outcome is ClaimOutcome.COMPLETED
    await store.count_replays()
    assert await rows(admin, "replays", "k") == 1
    assert await store.forget("t", "k")
    assert (await rows(admin, "recovery_points", "k"), await rows(admin, "replays", "k")) == (0, 0)


async def test_a_completion_after_renewals_and_duplicates_still_lands(
    isolation: str, store: PostgresStore, admin: asyncpg.Connection
) -> None:
    """The lock a completion takes (FOR KEY SHARE) waits for no renewal or duplicate's count, and under REPEATABLE
    READ a row they updated after the snapshot does not fail it: they change no key."""
    async with store.transaction() as transaction:
        assert isinstance(transaction, PostgresTransaction)
        claim = await transaction.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
        await transaction.begin()
        assert await transaction.connection.fetchval("SELECT count(*) FROM idempotency_records") == 1  # a snapshot
        assert await store.renew("t", "k", claim.fence, lease=30)
        assert (await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)).outcome is ClaimOutcome.IN_PROGRESS
        assert await transaction.complete("t", "k", claim.fence, RESPONSE)
        renewing = asyncio.create_task(store.renew("t", "k", claim.fence, lease=30))
        assert await asyncio.wait_for(renewing, 10)  # not waiting for the completion's transaction
        await transaction.commit()
    replay = await store.claim("t", "k", FINGERPRINT, lease=30, ttl=60)
    assert (replay.outcome, replay.response) == (ClaimOutcome.COMPLETED, RESPONSE)
