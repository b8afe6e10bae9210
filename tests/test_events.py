"""events.py: the event of each keyed request, and the log line of the default hook.

Store failures in the log and in the outcomes: a dead database is one traceback, not one per request, and an
exhausted pool says so (its own outcome, a log line naming the pool's size) instead of reading like an outage.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import uuid
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, MemoryStore, PostgresStore, StoreUnavailable, _events
from idempotency_mw._events import Event, FailureLog, Outcome, tenant_tag
from tests.apps import Probe, build_app
from tests.conftest import client_for, tenant_of


async def test_log_lines_tell_the_tenants_of_one_key_apart(caplog: pytest.LogCaptureFixture) -> None:
    """One key used by two accounts runs twice, legitimately: the two log lines must not read like one operation
    executed twice. Each names its tenant by a short tag, never by the tenant itself."""
    app = build_app(MemoryStore(), Probe())
    with caplog.at_level(logging.DEBUG, logger="idempotency_mw"):
        for token in ("sk_alice", "sk_bob"):
            answer = await client_for(app, token=token).post("/charge", headers={"Idempotency-Key": "k-1"})
            assert answer.status_code == 201
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("idempotency executed")]
    assert len(lines) == 2
    assert lines[0] != lines[1]
    assert all(" tenant=" in line for line in lines)


async def test_log_records_carry_their_fields_for_json_logging(caplog: pytest.LogCaptureFixture) -> None:
    """A JSON formatter (python-json-logger, structlog's bridge) writes a record's extra attributes as fields: the
    outcome, route, status, tenant tag and key hash are there without parsing the message."""
    app = build_app(MemoryStore(), Probe())
    with caplog.at_level(logging.DEBUG, logger="idempotency_mw"):
        for _ in range(2):
            await client_for(app, token="sk_alice").post("/status/201", headers={"Idempotency-Key": "k-json"})
    executed, replayed = [r for r in caplog.records if hasattr(r, "idempotency_outcome")]
    fields = {name: value for name, value in vars(replayed).items() if name.startswith("idempotency_")}
    duration = fields.pop("idempotency_duration_ms")
    assert fields == {
        "idempotency_outcome": "replayed",
        "idempotency_method": "POST",
        "idempotency_route": "/status/{code}",
        "idempotency_path": "/status/201",
        "idempotency_tenant_tag": tenant_tag(tenant_of("sk_alice")),
        "idempotency_key_hash": vars(executed)["idempotency_key_hash"],
        "idempotency_status": 201,
        "idempotency_attempts": 0,
    }
    assert isinstance(duration, float)
    assert vars(executed)["idempotency_outcome"] == "executed"
    assert len(vars(executed)["idempotency_key_hash"]) == 12


def test_a_tenant_tag_is_short_stable_and_not_the_tenant() -> None:
    assert tenant_tag("acct_1") == tenant_tag("acct_1")
    assert tenant_tag("acct_1") != tenant_tag("acct_2")
    assert len(tenant_tag("acct_1")) == 8
    assert "acct" not in tenant_tag("acct_1")
    assert tenant_tag("") == "-"


def test_a_tenant_tag_is_keyed_by_the_secret_set_after_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every instance tags a tenant alike when they share the tenant secret, also when the app sets it after
    importing the package (a settings module, a test's fixture): the key is read at the first tag, not at import.
    (Read at import, it fell back to a key of the process: two instances tagged one tenant apart.)"""
    monkeypatch.setenv("IDEMPOTENCY_TENANT_SECRET", "s" * 40)
    _events._tag_key.cache_clear()  # as just imported, with no tag made yet
    try:
        assert tenant_tag("acct_1") == hmac.new(b"s" * 40, b"acct_1", hashlib.sha256).hexdigest()[:8]
    finally:
        _events._tag_key.cache_clear()


def test_outcomes_name_themselves() -> None:
    assert Outcome("executed") is Outcome.EXECUTED


def idempotency_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name.startswith("idempotency_mw")]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_failure_in_full_then_a_summary_per_interval_then_the_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("idempotency_mw"), interval=10.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="idempotency_mw"):
        for _ in range(50):
            log.failed("claim a key", ConnectionRefusedError(111, "Connection refused"))
        clock.now += 10.0
        log.failed("renew a lease", TimeoutError())
        for _ in range(30):
            log.failed("claim a key", ConnectionRefusedError(111, "Connection refused"))
        clock.now += 2.5
        log.succeeded()
        log.succeeded()  # nothing more to say
        log.failed("claim a key", OSError("again"))
    records = idempotency_records(caplog)
    assert [record.levelname for record in records] == ["ERROR", "WARNING", "WARNING", "ERROR"]
    first, summary, recovered, again = records
    assert first.exc_info is not None
    assert "failed to claim a key: ConnectionRefusedError: [Errno 111] Connection refused" in first.getMessage()
    assert summary.exc_info is None
    assert "50 more failure(s) in the last 10s" in summary.getMessage()
    assert "49 x claim a key" in summary.getMessage()
    assert "1 x renew a lease: TimeoutError" in summary.getMessage()
    assert recovered.getMessage() == "idempotency store answers again after 12.5s and 81 failure(s)"
    assert again.exc_info is not None  # a new outage starts with the whole story again


async def test_a_dead_database_is_one_traceback_not_one_per_request(caplog: pytest.LogCaptureFixture) -> None:
    """200 requests against a database that refuses connections: 200 answers of 503 (the metrics count each), and
    in the log one traceback plus at most a summary line or two, not 200 tracebacks and 200 warnings."""
    events: list[Event] = []
    dead = PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5)
    client = client_for(build_app(dead, Probe(), on_event=events.append))
    with caplog.at_level(logging.DEBUG, logger="idempotency_mw"):
        for _ in range(200):
            response = await client.post("/charge", content=b"a", headers={"Idempotency-Key": str(uuid.uuid4())})
            assert response.status_code == 503
    assert [event.outcome for event in events] == [Outcome.STORE_ERROR] * 200
    records = idempotency_records(caplog)
    assert sum(record.exc_info is not None for record in records) == 1
    assert len(records) <= 5, [record.getMessage() for record in records]


class FlakyStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = True

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("connection refused")
        return await super().claim(*args, **kwargs)


async def test_the_log_says_when_the_store_answers_again(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore()
    client = client_for(build_app(store, Probe()))
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        for _ in range(3):
            assert (await client.post("/charge", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 503
        store.down = False
        assert (await client.post("/charge", headers={"Idempotency-Key": str(uuid.uuid4())})).status_code == 201
    messages = [record.getMessage() for record in idempotency_records(caplog)]
    assert len(messages) == 2
    assert "failed to claim a key: StoreUnavailable: connection refused" in messages[0]
    assert messages[1].startswith("idempotency store answers again after")
    assert "3 failure(s)" in messages[1]


async def test_an_exhausted_pool_is_its_own_outcome_and_names_its_size(
    idempotency_database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Transactional handlers hold every connection a claim could use: the next request waits ``timeout`` and gets
    503, like an outage, but its outcome and log say that the pool is the problem, and how big it is."""
    entered, go = asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        entered.set()
        await go.wait()
        return JSONResponse({"ok": True}, status_code=201)

    events: list[Event] = []
    store = PostgresStore(idempotency_database_url, max_size=2, timeout=0.3)  # one connection for new work
    app = Starlette(routes=[Route("/slow", slow, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, store=store, transactional=True, tenant=lambda scope: "t-pool", on_event=events.append
    )
    client = client_for(app)
    try:
        holder = asyncio.create_task(client.post("/slow", headers={"Idempotency-Key": str(uuid.uuid4())}))
        await asyncio.wait_for(entered.wait(), 5)
        with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
            waited = await client.post("/slow", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert waited.status_code == 503
        assert waited.json()["code"] == "idempotency_store_unavailable"
        assert [event.outcome for event in events] == [Outcome.POOL_EXHAUSTED]
        logged = " ".join(record.getMessage() for record in idempotency_records(caplog))
        assert "max_size=2" in logged
        assert "raise max_size" in logged
        go.set()
        assert (await holder).status_code == 201
    finally:
        go.set()
        await store.close()
