"""Requests with steps outside the database (docs/design.md §10): each local step commits with a recovery point, an
outside step calls a provider with a key of its own, and a retry of a request that stopped between steps resumes
after the last recovery point, ending with the answer a first run gives; on each flavour of transactional store.

The provider is :class:`Provider`: it keeps its own idempotency keys, counts its real charges, and can be told to
fail before or after it charges (a lost response).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest
from fastapi import Depends, FastAPI, Header
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import (
    AuthorizationTenant,
    Event,
    IdempotencyContext,
    IdempotencyMiddleware,
    Outcome,
    idempotency_context,
)
from idempotency_mw._steps import MAX_RESULT_BYTES
from idempotency_mw.cli import main
from idempotency_mw.encryption import ResponseCipher
from idempotency_mw.fastapi import Idempotency, TenantDependency
from idempotency_mw.metrics import PrometheusMetrics
from idempotency_mw.postgres import PostgresStore
from idempotency_mw.postgres._recovery import stalled_requests
from tests.conftest import ISOLATION_LEVELS, client_for, opened, tenant_of
from tests.test_docs import recipe
from tests.test_transactional import FLAVOURS, Flavour, flavour_on


class ProviderDown(Exception):
    """The provider answered 5xx, or its answer was lost on the way back."""


class Provider:
    """A payment provider with idempotency keys of its own: a charge under a key it has seen returns the first
    result, and only a new key charges. ``fail`` makes the next call fail: ``"before"`` it charges, or ``"after"``
    (it charged, and the answer was lost)."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, Any]] = {}
        self.calls = 0
        self.fail: str | None = None
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.go.set()

    async def charge(self, key: str, amount: int) -> dict[str, Any]:
        self.calls += 1
        self.entered.set()
        await self.go.wait()
        failing, self.fail = self.fail, None
        if failing == "before":
            raise ProviderDown("503 from the provider")
        if key not in self.charges:
            self.charges[key] = {"id": f"ch_{len(self.charges) + 1}", "amount": amount}
        if failing == "after":
            raise ProviderDown("the provider's answer was lost")
        return self.charges[key]


class Plan:
    """What the handler does besides its steps: raise after a step (``crash_after``), or, the first time only, wait at
    a gate before the last local step (``hold`` cleared)."""

    def __init__(self) -> None:
        self.crash_after: str | None = None
        self.hold = asyncio.Event()
        self.held = asyncio.Event()
        self.hold.set()
        self.repeatable = True

    async def wait(self) -> None:
        if not self.held.is_set():
            self.held.set()
            await self.hold.wait()


def payments(flavour: Flavour, provider: Provider, plan: Plan, **options: Any) -> Starlette:
    """``POST /pay``: create a charge row (local), charge the provider (outside), record the provider's id (local);
    the answer is built from the steps' results."""

    async def pay(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        steps = context.steps
        key = context.key or request.headers["x-order"]  # a keyless request (switched off, observing) names its rows

        async def create() -> dict[str, Any]:
            await flavour.write(request, key, "created", flush=True)
            return {"charge": f"c-{key[:8]}", "amount": 1250}

        created = await steps.local("create_charge", create)
        if plan.crash_after == "create_charge":
            raise RuntimeError("crashed after create_charge")

        async def call(downstream_key: str) -> dict[str, Any]:
            return await provider.charge(downstream_key, created["amount"])

        paid = await steps.outside("provider_charge", call, repeatable=plan.repeatable)
        if plan.crash_after == "provider_charge":
            raise RuntimeError("crashed after provider_charge")
        await plan.wait()

        async def record() -> dict[str, Any]:
            await flavour.write(request, key, "recorded " + paid["id"], flush=True)
            return {"status": "succeeded"}

        recorded = await steps.local("record_charge", record)
        if plan.crash_after == "record_charge":
            return JSONResponse({"error": "late failure"}, status_code=500)
        return JSONResponse({**created, "provider": paid["id"], **recorded}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True, **options)
    return app


def first_answer(key: str, provider_id: str = "ch_1") -> dict[str, Any]:
    """What a first run of ``/pay`` answers."""
    return {"charge": f"c-{key[:8]}", "amount": 1250, "provider": provider_id, "status": "succeeded"}


@pytest.fixture(params=list(FLAVOURS))
async def flavour(request: pytest.FixtureRequest, idempotency_database_url: str) -> AsyncIterator[Flavour]:
    async with flavour_on(request.param, idempotency_database_url) as each:
        yield each


@pytest.fixture(params=[(name, level) for name in FLAVOURS for level in ISOLATION_LEVELS], ids=lambda p: ", ".join(p))
async def isolated_flavour(request: pytest.FixtureRequest, isolation_urls: dict[str, str]) -> AsyncIterator[Flavour]:
    name, level = request.param
    async with flavour_on(name, isolation_urls[level]) as each:
        yield each


async def pay(client: httpx.AsyncClient, key: str) -> httpx.Response:
    return await client.post("/pay", headers={"Idempotency-Key": key})


async def effects(flavour: Flavour, key: str) -> dict[str, int]:
    rows = await flavour.db.fetch(f"SELECT note, count(*) AS n FROM {flavour.table} WHERE key = $1 GROUP BY note", key)
    return {row["note"]: row["n"] for row in rows}


async def test_a_first_run_commits_each_step_and_replays_byte_for_byte(isolated_flavour: Flavour) -> None:
    flavour, provider, plan = isolated_flavour, Provider(), Plan()
    key = str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan)) as client:
        first = await pay(client, key)
        assert (first.status_code, first.json()) == (201, first_answer(key))
        again = await pay(client, key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert await effects(flavour, key) == {"created": 1, "recorded ch_1": 1}
    assert len(provider.charges) == 1
    info = await flavour.store.inspect(tenant_of(), key)
    assert info is not None
    assert (info.state, info.last_step) == ("completed", "record_charge")


@pytest.mark.parametrize(
    ("crash", "calls"),
    [
        ("create_charge", 1),  # the handler fails after the first commit: the provider was never called
        ("provider before", 2),  # the provider answers 5xx before it charges
        ("provider after", 2),  # the provider charged, and its answer was lost: the retry asks again, same key
        ("provider_charge", 2),  # the handler fails after the provider's answer, before the next commit
        ("record_charge", 1),  # a 5xx after the last step: the retry only answers
    ],
)
async def test_a_retry_resumes_after_the_last_recovery_point(isolated_flavour: Flavour, crash: str, calls: int) -> None:
    flavour, provider, plan = isolated_flavour, Provider(), Plan()
    key = str(uuid.uuid4())
    events: list[Event] = []
    async with client_for(payments(flavour, provider, plan, on_event=events.append)) as client:
        if crash.startswith("provider "):
            provider.fail = crash.split()[1]
        else:
            plan.crash_after = crash
        if crash in ("create_charge", "provider_charge") or crash.startswith("provider "):
            with pytest.raises((RuntimeError, ProviderDown)):
                await pay(client, key)
        else:
            assert (await pay(client, key)).status_code == 500
        assert events[-1].outcome is Outcome.STOPPED
        info = await flavour.store.inspect(tenant_of(), key)
        assert info is not None, "a request at a recovery point is never released"
        assert info.state == "in_progress"
        assert info.lease_expires_at is not None
        assert info.last_step == ("record_charge" if crash == "record_charge" else "create_charge")
        plan.crash_after = None
        retry = await pay(client, key)
    assert (retry.status_code, retry.json()) == (201, first_answer(key))
    assert "idempotent-replayed" not in retry.headers
    assert (events[-1].outcome, events[-1].resumed_from) == (Outcome.EXECUTED, info.last_step)
    assert await effects(flavour, key) == {"created": 1, "recorded ch_1": 1}
    assert len(provider.charges) == 1
    assert provider.calls == calls


async def test_a_retry_across_a_rotation_of_the_tenant_secret_calls_the_provider_with_the_same_key(
    flavour: Flavour,
) -> None:
    """The provider charged, and its answer was lost; the retry comes after the instance moved its claims to the new
    tenant secret (docs/guide.md, "Rotating the tenant secret"). It resumes the record kept under the old secret, and
    its provider key is the one the first run sent, which the provider deduplicates: one charge."""
    old, new = "old-tenant-secret-" + "o" * 20, "new-tenant-secret-" + "n" * 20
    provider, plan = Provider(), Plan()
    key = str(uuid.uuid4())
    provider.fail = "after"
    step_one = payments(flavour, provider, plan, tenant=AuthorizationTenant(old, others=[new]))
    async with client_for(step_one) as client:
        with pytest.raises(ProviderDown):
            await pay(client, key)
    step_two = payments(flavour, provider, plan, tenant=AuthorizationTenant(new, others=[old]))
    async with client_for(step_two) as client:
        retry = await pay(client, key)
    assert (retry.status_code, retry.json()) == (201, first_answer(key))
    assert (provider.calls, len(provider.charges)) == (2, 1)


async def test_a_cancelled_request_stays_at_its_recovery_point(flavour: Flavour) -> None:
    provider, plan = Provider(), Plan()
    plan.hold.clear()
    key = str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan)) as client:
        running = asyncio.create_task(pay(client, key))
        await asyncio.wait_for(plan.held.wait(), 5)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        for _ in range(100):  # the run settles in a task of its own
            info = await flavour.store.inspect(tenant_of(), key)
            if info is not None and info.lease_expires_at is not None and info.lease_expires_at < info.expires_at:
                lapsed = await flavour.db.fetchval(
                    "SELECT lease_expires_at <= now() FROM idempotency_records WHERE key = $1", key
                )
                if lapsed:
                    break
            await asyncio.sleep(0.02)
        plan.hold.set()
        retry = await pay(client, key)
    assert (retry.status_code, retry.json()) == (201, first_answer(key))
    assert await effects(flavour, key) == {"created": 1, "recorded ch_1": 1}
    assert len(provider.charges) == 1


async def test_a_zombie_cannot_commit_a_later_step(isolated_flavour: Flavour) -> None:
    """A worker whose lease was taken over after its first step cannot commit its second: the claim that took the
    key over resumes after the first step, and of the two, one commits each step (under READ COMMITTED the zombie
    sees the takeover; under REPEATABLE READ and SERIALIZABLE the first to commit a step's point wins)."""
    flavour, provider, plan = isolated_flavour, Provider(), Plan()
    plan.hold.clear()
    key = str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan)) as client:
        zombie = asyncio.create_task(pay(client, key))
        await asyncio.wait_for(plan.held.wait(), 5)
        await flavour.db.execute(
            "UPDATE idempotency_records SET lease_expires_at = now() - interval '1 second' WHERE key = $1", key
        )
        retry = await pay(client, key)  # takes the key over, resumes after create_charge, and completes
        plan.hold.set()
        answer = await zombie
    assert (retry.status_code, retry.json()) == (201, first_answer(key))
    assert answer.status_code == 409
    assert answer.json()["code"] == "idempotency_request_in_progress"
    assert await effects(flavour, key) == {"created": 1, "recorded ch_1": 1}
    assert len(provider.charges) == 1
    again = await client_for(payments(flavour, provider, plan)).post("/pay", headers={"Idempotency-Key": key})
    assert again.content == retry.content


async def test_an_unrepeatable_step_without_an_outcome_is_not_resumed(flavour: Flavour) -> None:
    provider, plan = Provider(), Plan()
    plan.repeatable = False
    key = str(uuid.uuid4())
    events: list[Event] = []
    async with client_for(payments(flavour, provider, plan, on_event=events.append)) as client:
        provider.fail = "after"  # it charged; nobody knows
        with pytest.raises(ProviderDown):
            await pay(client, key)
        for _ in range(2):  # answered so every time, and never called again
            answer = await pay(client, key)
            assert answer.status_code == 409
            assert answer.json()["code"] == "idempotency_step_not_resumable"
            assert "retry-after" not in answer.headers
            assert events[-1].outcome is Outcome.NOT_RESUMABLE
    assert provider.calls == 1
    assert await effects(flavour, key) == {"created": 1}
    info = await flavour.store.inspect(tenant_of(), key)
    assert info is not None
    assert (info.state, info.last_step) == ("in_progress", "provider_charge (began, outcome unknown)")
    assert isinstance(flavour.store, PostgresStore)
    stalled = [each for each in await stalled_requests(flavour.store) if each.key == key]
    assert [(each.last_step, each.last_step_done) for each in stalled] == [("provider_charge", False)]


async def test_an_unrepeatable_step_that_finished_is_resumed_after(flavour: Flavour) -> None:
    provider, plan = Provider(), Plan()
    plan.repeatable, plan.crash_after = False, "record_charge"
    key = str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan)) as client:
        assert (await pay(client, key)).status_code == 500
        plan.crash_after = None
        retry = await pay(client, key)
    assert (retry.status_code, retry.json()) == (201, first_answer(key))
    assert provider.calls == 1


async def test_step_results_are_sealed_under_the_stores_cipher(idempotency_database_url: str) -> None:
    cipher = ResponseCipher({"k1": ResponseCipher.new_key()})
    provider, plan = Provider(), Plan()
    plan.crash_after = "provider_charge"
    key = str(uuid.uuid4())
    async with flavour_on("asyncpg", idempotency_database_url) as flavour:
        assert isinstance(flavour.store, PostgresStore)
        flavour.store.cipher = cipher
        async with client_for(payments(flavour, provider, plan)) as client:
            with pytest.raises(RuntimeError):
                await pay(client, key)
            rows = await flavour.db.fetch(
                "SELECT result, sealed_with, sealed FROM idempotency_recovery_points WHERE key = $1", key
            )
            assert [(row["result"], row["sealed_with"]) for row in rows] == [(None, "k1")]
            assert b"c-" not in rows[0]["sealed"]
            plan.crash_after = None
            retry = await pay(client, key)
    assert (retry.status_code, retry.json()) == (201, first_answer(key))


async def test_reencrypt_reseals_step_results_and_the_request_resumes_under_the_new_key(
    migrated_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``idempotency-mw reencrypt`` re-seals step results as it does responses: after it, a store that holds only the
    new key resumes a request stopped under the old one; a plain result is sealed with ``--seal-plain``."""
    old, new = ResponseCipher.new_key(), ResponseCipher.new_key()
    provider, plan = Provider(), Plan()
    plan.crash_after = "provider_charge"
    keys = [str(uuid.uuid4()) for _ in range(3)]
    async with flavour_on("asyncpg", migrated_url) as flavour:
        assert isinstance(flavour.store, PostgresStore)
        async with client_for(payments(flavour, provider, plan)) as client:
            ciphers = (ResponseCipher({"old": old}), ResponseCipher({"old": old}), None)
            for key, cipher in zip(keys, ciphers, strict=True):
                flavour.store.cipher = cipher  # two stopped under the old key, one stored plain
                with pytest.raises(RuntimeError):
                    await pay(client, key)
        sealed_with = "SELECT sealed_with FROM idempotency_recovery_points WHERE key = $1"
        assert [await flavour.db.fetchval(sealed_with, key) for key in keys] == ["old", "old", None]
        monkeypatch.setenv("IDEMPOTENCY_RESPONSE_KEYS", f"new:{new},old:{old}")
        options = ["--database-url", flavour.url, "reencrypt", "--batch-size", "1"]
        assert await asyncio.to_thread(main, [*options, "--dry-run"]) == 0
        assert "under 'old': 2 step results, to re-seal" in capsys.readouterr().out.splitlines()
        assert await asyncio.to_thread(main, options) == 0
        out, err = capsys.readouterr()
        assert "re-sealed 2 step results under key 'new'" in out.splitlines()
        assert "step results batch 2: re-sealed 1 (2 so far)" in err
        assert [await flavour.db.fetchval(sealed_with, key) for key in keys] == ["new", "new", None]
        assert await asyncio.to_thread(main, [*options, "--seal-plain"]) == 0
        assert "under 'new' (current): 3 step results" in capsys.readouterr().out.splitlines()
        assert [await flavour.db.fetchval(sealed_with, key) for key in keys] == ["new"] * 3
        flavour.store.cipher = ResponseCipher({"new": new})  # the old key is gone
        plan.crash_after = None
        async with client_for(payments(flavour, provider, plan)) as client:
            answers = [await pay(client, key) for key in keys]
    assert [(answer.status_code, answer.json()) for answer in answers] == [
        (201, first_answer(key, f"ch_{n}")) for n, key in enumerate(keys, 1)
    ]


async def test_an_expired_record_claimed_afresh_does_not_resume_its_earlier_life(flavour: Flavour) -> None:
    provider, plan = Provider(), Plan()
    plan.crash_after = "provider_charge"
    key = str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan)) as client:
        with pytest.raises(RuntimeError):
            await pay(client, key)
        await flavour.db.execute(
            "UPDATE idempotency_records SET expires_at = now() - interval '1 second', "
            "created_at = created_at - interval '1 day' WHERE key = $1",
            key,
        )  # its points keep the life they were written in
        plan.crash_after = None
        retry = await pay(client, key)
    assert retry.status_code == 201
    assert await effects(flavour, key) == {"created": 2, "recorded ch_1": 1}  # a new life runs every step again


async def test_step_names_and_results_are_checked(flavour: Flavour) -> None:
    outcomes: list[str] = []

    async def handler(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        steps = context.steps

        async def nothing() -> object:
            return None

        async def big() -> object:
            return "x" * MAX_RESULT_BYTES

        async def not_json() -> object:
            return object()

        for name, run in (("", nothing), ("big", big), ("odd", not_json)):
            try:
                await steps.local(name, run)
            except (ValueError, TypeError) as error:
                outcomes.append(type(error).__name__)
        assert await steps.local("twice", nothing) is None
        try:
            await steps.local("twice", nothing)
        except ValueError as error:
            outcomes.append(str(error))
        assert steps.result("twice") is None
        return JSONResponse(orjson.loads(orjson.dumps(outcomes)))

    app = Starlette(routes=[Route("/check", handler, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=flavour.store, transactional=True)
    async with client_for(app) as client:
        answer = await client.post("/check", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 200
    assert answer.json()[:3] == ["ValueError", "ValueError", "TypeError"]
    assert "reached twice" in answer.json()[3]


async def test_steps_are_for_transactional_routes_with_a_key(idempotency_database_url: str) -> None:
    async def handler(request: Request) -> Response:
        context = idempotency_context(request)
        assert context is not None
        try:
            context.steps  # noqa: B018
        except LookupError as error:
            return JSONResponse({"error": str(error)})
        return JSONResponse({"error": None})

    async with opened(PostgresStore(idempotency_database_url)) as store:
        for transactional, key, expected in ((False, "k", "transactional routes"), (True, None, "no Idempotency-Key")):
            app = Starlette(routes=[Route("/x", handler, methods=["POST"])])
            app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional)
            headers = {"Idempotency-Key": f"{key}-{uuid.uuid4()}"} if key else {}
            async with client_for(app) as client:
                answer = await client.post("/x", headers=headers)
            assert expected in answer.json()["error"]


@pytest.mark.parametrize("switch", ["enabled=False", "observe=True"])
async def test_switched_off_or_observing_every_step_runs_and_none_is_recorded(flavour: Flavour, switch: str) -> None:
    """Not enforcing, a handler in steps runs as without the middleware: a failed attempt's committed step is run
    again by the next, nothing is read back or recorded; a local step still commits its writes, and an outside one
    calls with the key enforcing would send (a keyless request: a key drawn for the call)."""
    provider, plan = Provider(), Plan()
    options = {"enabled": False} if switch == "enabled=False" else {"observe": True}
    key, order = str(uuid.uuid4()), str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan, **options)) as client:
        plan.crash_after = "provider_charge"
        with pytest.raises(RuntimeError):
            await pay(client, key)
        assert await effects(flavour, key) == {"created": 1}  # its first step committed, as when enforcing
        plan.crash_after = None
        answer = await pay(client, key)
        keyless = await client.post("/pay", headers={"X-Order": order})
    assert (answer.status_code, answer.json()) == (201, first_answer(key))
    assert await effects(flavour, key) == {"created": 2, "recorded ch_1": 1}  # nothing was skipped
    assert (keyless.status_code, keyless.json()["provider"]) == (201, "ch_2")
    assert await effects(flavour, order) == {"created": 1, "recorded ch_2": 1}
    downstream = IdempotencyContext(tenant_of(), key).downstream_key("provider_charge")
    assert provider.calls == 3
    assert len(provider.charges) == 2
    assert downstream in provider.charges  # the same key on both attempts
    drawn = next(each for each in provider.charges if each != downstream)
    assert len(drawn) == 64
    assert int(drawn, 16) >= 0
    points = "SELECT count(*) FROM idempotency_recovery_points WHERE key = any($1::text[])"
    assert await flavour.db.fetchval(points, [key, order]) == 0
    info = await flavour.store.inspect(tenant_of(), key)
    if switch == "enabled=False":
        assert info is None
    else:  # observing records a fresh claim's answer, so that enforcing replays it; no step of it
        assert info is not None
        assert (info.state, info.last_step) == ("completed", None)


@pytest.mark.parametrize("switch", ["enabled=False", "observe=True"])
async def test_not_enforcing_steps_run_when_the_app_tells_its_tenant(
    idempotency_database_url: str, switch: str
) -> None:
    """A tenant the app tells from inside (``TenantDependency``): the handler's transaction and its steps come with
    the claim the dependency makes; not enforcing, every step runs and none is recorded, with the downstream key
    enforcing would send."""
    calls: list[str] = []

    async def account(authorization: str = Header()) -> str:
        return authorization.removeprefix("Bearer ")

    tenant = TenantDependency(account)
    api = FastAPI(dependencies=[Depends(tenant)])

    @api.post("/pay")
    async def pay_in_steps(info: Idempotency) -> dict[str, Any]:
        async def local() -> int:
            assert info.connection is not None
            return int(await info.connection.fetchval("SELECT 41 + 1"))

        async def outside(downstream_key: str) -> str:
            calls.append(downstream_key)
            return downstream_key

        steps = info.steps
        return {"first": await steps.local("first", local), "key": await steps.outside("call", outside)}

    options: dict[str, Any] = {"enabled": False} if switch == "enabled=False" else {"observe": True}
    key = str(uuid.uuid4())
    async with opened(PostgresStore(idempotency_database_url)) as store:
        api.add_middleware(IdempotencyMiddleware, store=store, transactional=True, tenant=tenant, **options)
        async with client_for(api) as client:
            answers = [
                await client.post("/pay", headers={"Idempotency-Key": key, "Authorization": "Bearer acct_1"})
                for _ in range(2)
            ]
        points = "SELECT count(*) FROM idempotency_recovery_points WHERE key = $1"
        async with store.connection() as db:
            recorded = await db.fetchval(points, key)
    downstream = IdempotencyContext("acct_1", key).downstream_key("call")
    assert [answer.json() for answer in answers] == [{"first": 42, "key": downstream}] * 2
    assert calls == [downstream, downstream]  # every step runs on every request, none is skipped
    assert recorded == 0


async def test_the_guides_steps_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    """The guide's recipe as written: the provider's first answer is a 503 after it charged; the retry resumes after
    the charge row, calls the provider again with the same key, and answers as a first run would."""
    charges: dict[str, int] = {}
    failed: list[str] = []

    def provider(request: httpx.Request) -> httpx.Response:
        key = request.headers["idempotency-key"]
        charges.setdefault(key, len(charges) + 1)
        if not failed:
            failed.append(key)
            return httpx.Response(503)
        return httpx.Response(200, json={"id": f"ch_{charges[key]}"})

    db = await asyncpg.connect(idempotency_database_url)
    try:
        await db.execute(
            "CREATE TABLE IF NOT EXISTS guide_charges (id serial PRIMARY KEY, amount int, state text, provider_id text)"
        )
        env = {"DATABASE_URL": idempotency_database_url, "PROVIDER_URL": "http://provider.test"}
        with recipe("steps", tmp_path, monkeypatch, **env) as module:
            module.provider = httpx.AsyncClient(
                transport=httpx.MockTransport(provider), base_url="http://provider.test"
            )
            transport = httpx.ASGITransport(app=module.app, raise_app_exceptions=False)
            headers = {"Authorization": "Bearer sk_test_guide_steps", "Idempotency-Key": str(uuid.uuid4())}
            async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as client:
                assert (await client.post("/v1/payments", json={"amount": 1250})).status_code == 500
                answer = await client.post("/v1/payments", json={"amount": 1250})
                again = await client.post("/v1/payments", json={"amount": 1250})
            await module.store.close()
        assert answer.status_code == 201
        charge_id = answer.json()["charge_id"]
        assert answer.json() == {"charge_id": charge_id, "provider_id": "ch_1", "state": "succeeded"}
        assert again.content == answer.content
        assert len(charges) == 1
        row = await db.fetchrow("SELECT state, provider_id FROM guide_charges WHERE id = $1", charge_id)
        assert row is not None
        assert tuple(row) == ("succeeded", "ch_1")
        assert await db.fetchval("SELECT count(*) FROM guide_charges WHERE id > $1", charge_id) == 0
    finally:
        await db.close()


async def test_the_metrics_count_resumed_requests_and_stalled_ones(flavour: Flavour) -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    provider, plan = Provider(), Plan()
    plan.crash_after = "provider_charge"
    key = str(uuid.uuid4())
    assert isinstance(flavour.store, PostgresStore)
    async with client_for(payments(flavour, provider, plan, on_event=metrics)) as client:
        with pytest.raises(RuntimeError):
            await pay(client, key)
        await metrics.update_from_store(flavour.store)
        assert registry.get_sample_value("idempotency_stalled_requests") >= 1  # type: ignore[operator]
        plan.crash_after = None
        assert (await pay(client, key)).status_code == 201
    labels = {"method": "POST", "route": "/pay", "step": "create_charge"}
    assert registry.get_sample_value("idempotency_resumed_requests_total", labels) == 1
    stopped = {"method": "POST", "route": "/pay", "outcome": "stopped"}
    assert registry.get_sample_value("idempotency_requests_total", stopped) == 1


async def test_the_command_line_lists_stalled_requests(flavour: Flavour, capsys: pytest.CaptureFixture[str]) -> None:
    provider, plan = Provider(), Plan()
    plan.crash_after = "create_charge"
    key = str(uuid.uuid4())
    async with client_for(payments(flavour, provider, plan)) as client:
        with pytest.raises(RuntimeError):
            await pay(client, key)
    options = ["--database-url", flavour.url]
    code = await asyncio.to_thread(main, [*options, "stalled", "--lapsed-for", "0", "--json", "--limit", "1000"])
    listed = [each for each in json.loads(capsys.readouterr().out) if each["key"] == key]
    assert code == 0
    assert [(each["tenant"], each["request"], each["last_step"], each["last_step_done"]) for each in listed] == [
        (tenant_of(), "POST /pay", "create_charge", True)
    ]
    await asyncio.to_thread(main, [*options, "stalled", "--lapsed-for", "0", "--limit", "1000"])
    assert f"{key}  POST /pay  after create_charge  lapsed " in capsys.readouterr().out
    await asyncio.to_thread(main, [*options, "inspect", tenant_of(), key])
    assert "last step    create_charge" in capsys.readouterr().out
    assert await asyncio.to_thread(main, [*options, "stalled", "--lapsed-for", "86400"]) == 1
    assert capsys.readouterr().out == "no stalled requests\n"
