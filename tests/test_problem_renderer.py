"""The middleware's errors in the app's own envelope (``problem_renderer=``) and the status of a reused key
(``reused_key_status=``): every answer the middleware gives itself keeps its status, carries its stable code in the
``Idempotency-Problem`` header and its ``Retry-After``, whatever the body; a renderer that fails never costs the
answer. On both stores and in both modes where the answer comes from the store."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Scope

from idempotency_mw import (
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    Problem,
    ProblemCode,
    StoreUnavailable,
    idempotent,
    key_status_route,
)
from idempotency_mw.fastapi import setup
from idempotency_mw.store import Store
from idempotency_mw.testing import run_lifespan
from tests.conftest import client_for
from tests.test_docs import recipe

HELD = "held-"  # a key that starts so holds its handler until the test lets it go


class Hold:
    """A handler run with a held key: it says when it started, and waits until the test lets it go."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()


def envelope(problem: Problem, scope: Scope) -> Response:
    """An app's own error envelope, whose ``code`` is the app's (not the middleware's): only the header tells."""
    body = {"error": {"code": "conflict", "reason": problem.code, "message": problem.detail}}
    return JSONResponse(body, status_code=problem.status, headers={"x-envelope": "app"})


def shop(store: Store, transactional: bool, runs: Counter[str], hold: Hold, **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        runs["charge"] += 1
        if request.headers["idempotency-key"].startswith(HELD):
            hold.entered.set()
            await hold.release.wait()
        return JSONResponse({"id": "ch_1"}, status_code=201)

    @idempotent(required=True)
    async def refund(request: Request) -> Response:
        runs["refund"] += 1
        return JSONResponse({"id": "re_1"}, status_code=201)

    @idempotent(max_request_bytes=8)
    async def upload(request: Request) -> Response:
        runs["upload"] += 1
        return JSONResponse({"id": "up_1"}, status_code=201)

    @idempotent(check_uuid7_age=True)
    async def payout(request: Request) -> Response:
        runs["payout"] += 1
        return JSONResponse({"id": "po_1"}, status_code=201)

    @idempotent(max_response_bytes=16)
    async def export(request: Request) -> Response:
        runs["export"] += 1
        return Response(b"x" * 100, status_code=201)

    routes = [
        Route("/v1/charges", charge, methods=["POST"]),
        Route("/v1/refunds", refund, methods=["POST"]),
        Route("/v1/uploads", upload, methods=["POST"]),
        Route("/v1/payouts", payout, methods=["POST"]),
        Route("/v1/exports", export, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, retry_after=3, **options)
    return app


def in_envelope(answer: httpx.Response, status: int, code: str, retry_after: str | None = None) -> None:
    """``answer`` is the middleware's ``code`` problem with ``status``, in the app's envelope."""
    assert (answer.status_code, answer.headers["idempotency-problem"]) == (status, code)
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["x-envelope"] == "app"
    assert answer.headers.get("retry-after") == retry_after
    assert answer.json()["error"]["code"] == "conflict"
    assert answer.json()["error"]["reason"] == code
    assert answer.headers["content-length"] == str(len(answer.content))


async def test_every_answer_of_the_store_goes_out_in_the_apps_envelope(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode
    runs: Counter[str] = Counter()
    hold = Hold()

    async def rendered(problem: Problem, scope: Scope) -> Response:  # a renderer may be async
        return envelope(problem, scope)

    app = shop(store, transactional, runs, hold, problem_renderer=rendered, reused_key_status=409)
    unique = uuid.uuid4().hex
    async with client_for(app) as client:
        done = await client.post("/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": unique})
        assert done.status_code == 201
        assert "idempotency-problem" not in done.headers  # the app's own answers carry no code
        replay = await client.post("/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": unique})
        assert (replay.status_code, replay.headers["idempotent-replayed"]) == (201, "true")
        assert "idempotency-problem" not in replay.headers
        reused = await client.post("/v1/charges", json={"amount": 2}, headers={"Idempotency-Key": unique})
        in_envelope(reused, 409, "idempotency_key_reused")  # the status the app chose; no Retry-After: do not retry
        held = asyncio.create_task(client.post("/v1/charges", json={}, headers={"Idempotency-Key": HELD + unique}))
        await hold.entered.wait()
        running = await client.post("/v1/charges", json={}, headers={"Idempotency-Key": HELD + unique})
        in_envelope(running, 409, "idempotency_request_in_progress", retry_after="3")
        hold.release.set()
        assert (await held).status_code == 201
        big = await client.post("/v1/exports", headers={"Idempotency-Key": f"export-{unique}"})
        assert big.status_code == 201
        not_replayable = await client.post("/v1/exports", headers={"Idempotency-Key": f"export-{unique}"})
        in_envelope(not_replayable, 409, "idempotency_response_not_replayable")
        old = f"00000000-0001-7000-8000-{unique[:12]}"  # a UUIDv7 born in 1970
        expired = await client.post("/v1/payouts", headers={"Idempotency-Key": old})
        in_envelope(expired, 422, "idempotency_key_expired")  # not a reuse: it keeps its own status
    assert runs == Counter({"charge": 2, "export": 1})


async def test_every_refusal_before_the_store_goes_out_in_the_apps_envelope() -> None:
    runs: Counter[str] = Counter()
    app = shop(MemoryStore(), False, runs, Hold(), problem_renderer=envelope)
    async with (
        client_for(app) as client,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as anonymous,
    ):
        in_envelope(await client.post("/v1/refunds"), 400, "idempotency_key_missing")
        invalid = await client.post("/v1/charges", headers={"Idempotency-Key": "a,b"})
        in_envelope(invalid, 400, "idempotency_key_invalid")
        unknown = await anonymous.post("/v1/charges", headers={"Idempotency-Key": "k"})
        in_envelope(unknown, 400, "idempotency_tenant_unknown")
        large = await client.post("/v1/uploads", content=b"x" * 9, headers={"Idempotency-Key": "k"})
        in_envelope(large, 413, "request_too_large")
    assert runs == Counter()


class UnreachableMemory(MemoryStore):
    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection refused")


@pytest.mark.parametrize("where", ["memory", "postgres", "postgres, transactional"])
async def test_an_unreachable_store_is_answered_in_the_apps_envelope(where: str) -> None:
    store: Store = (
        UnreachableMemory() if where == "memory" else PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5)
    )
    runs: Counter[str] = Counter()
    app = shop(store, where.endswith("transactional"), runs, Hold(), problem_renderer=envelope)
    async with client_for(app) as client:
        down = await client.post("/v1/charges", json={}, headers={"Idempotency-Key": str(uuid.uuid4())})
    in_envelope(down, 503, "idempotency_store_unavailable", retry_after="3")
    assert runs == Counter()


# -- a renderer that fails -----------------------------------------------------------------------------------------


async def _streamed(problem: Problem, scope: Scope) -> Response:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"{}"

    return StreamingResponse(chunks(), status_code=problem.status)


FAILING = {
    "raises": lambda problem, scope: 1 / 0,
    "returns None": lambda problem, scope: None,
    "returns a dict": lambda problem, scope: {"error": problem.code},
    "streams": _streamed,
    "another status": lambda problem, scope: JSONResponse({"error": problem.code}),  # forgot status_code: 200
    "a background task": lambda problem, scope: JSONResponse(
        {"error": problem.code}, status_code=problem.status, background=BackgroundTask(print, "after")
    ),
}


@pytest.mark.parametrize("renderer", FAILING.values(), ids=list(FAILING))
async def test_a_renderer_that_fails_costs_nothing_but_its_envelope(
    renderer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    runs: Counter[str] = Counter()
    app = shop(MemoryStore(), False, runs, Hold(), problem_renderer=renderer)
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        async with client_for(app) as client:
            answers = [await client.post("/v1/refunds") for _ in range(3)]
    for answer in answers:  # the default answer, whole: never a 500, never a lost code
        assert (answer.status_code, answer.headers["idempotency-problem"]) == (400, "idempotency_key_missing")
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["code"] == "idempotency_key_missing"
    said = [r for r in caplog.records if "problem_renderer" in r.getMessage()]
    assert len(said) == 1  # once, not per request
    assert said[0].levelno == logging.ERROR
    assert "idempotency_key_missing" in said[0].getMessage()


def test_a_renderer_that_is_not_callable_is_refused_at_startup() -> None:
    with pytest.raises(TypeError, match="problem_renderer must be a callable"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), problem_renderer="json")  # type: ignore[arg-type]


# -- the status of a reused key ------------------------------------------------------------------------------------


async def test_a_route_chooses_the_status_of_a_reused_key(store_and_mode: tuple[Store, bool]) -> None:
    store, transactional = store_and_mode

    async def create(request: Request) -> Response:
        return JSONResponse({"id": "x"}, status_code=201)

    @idempotent(reused_key_status=400)
    async def stripe_like(request: Request) -> Response:
        return JSONResponse({"id": "y"}, status_code=201)

    app = Starlette(routes=[Route("/v1/a", create, methods=["POST"]), Route("/v1/b", stripe_like, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, transactional=transactional, reused_key_status=409)
    async with run_lifespan(app), client_for(app) as client:
        for path, status in (("/v1/a", 409), ("/v1/b", 400)):
            key = str(uuid.uuid4())
            await client.post(path, json={"n": 1}, headers={"Idempotency-Key": key})
            reused = await client.post(path, json={"n": 2}, headers={"Idempotency-Key": key})
            assert (reused.status_code, reused.json()["status"], reused.json()["code"]) == (
                status,
                status,
                "idempotency_key_reused",
            )
            assert reused.headers["idempotency-problem"] == "idempotency_key_reused"
            assert "retry-after" not in reused.headers


@pytest.mark.parametrize("status", [418, 404, 412, "409", True, None])
def test_any_other_status_of_a_reused_key_is_refused_at_startup(status: object) -> None:
    with pytest.raises(ValueError, match=r"reused_key_status is 422 .*, 409 or 400"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), reused_key_status=status)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reused_key_status"):
        IdempotencyMiddleware(Starlette(), MemoryStore(), routes={"/v1/*": {"reused_key_status": status}})


async def test_a_route_declaring_another_status_stops_the_server() -> None:
    @idempotent(reused_key_status=418)
    async def create(request: Request) -> Response:
        return Response(status_code=201)

    app = Starlette(routes=[Route("/v1/a", create, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    with pytest.raises(RuntimeError, match="reused_key_status"):
        async with run_lifespan(app):
            pass


# -- the status route ----------------------------------------------------------------------------------------------


async def test_the_status_routes_refusals_go_out_in_the_apps_envelope() -> None:
    store = MemoryStore()
    app = Starlette(routes=[key_status_route(store, problem_renderer=envelope)])
    async with (
        client_for(app) as client,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as anonymous,
    ):
        in_envelope(await client.get("/idempotency-keys/" + "x" * 300), 400, "idempotency_key_invalid")
        in_envelope(await anonymous.get("/idempotency-keys/k"), 400, "idempotency_tenant_unknown")
        assert (await client.get("/idempotency-keys/k")).json()["state"] == "absent"
    down = Starlette(routes=[key_status_route(UnreachableInspect(), problem_renderer=envelope)])
    async with client_for(down) as client:
        in_envelope(await client.get("/idempotency-keys/k"), 503, "idempotency_store_unavailable", retry_after="1")


class UnreachableInspect(MemoryStore):
    async def inspect(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("connection refused")


async def test_the_status_routes_refusals_carry_the_code_by_default() -> None:
    app = Starlette(routes=[key_status_route(MemoryStore())])
    async with client_for(app) as client:
        bad = await client.get("/idempotency-keys/" + "x" * 300)
    assert (bad.headers["idempotency-problem"], bad.headers["content-type"]) == (
        "idempotency_key_invalid",
        "application/problem+json",
    )


# -- OpenAPI -------------------------------------------------------------------------------------------------------

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["code", "reason", "message"]}},
}


def documented_app(**options: Any) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/charges", status_code=201)
    async def create_charge(body: dict[str, int]) -> dict[str, str]:  # a body: FastAPI documents its own 422
        return {"id": "ch_1"}

    @app.post("/v1/refunds", status_code=201)
    @idempotent(reused_key_status=400)
    async def create_refund(body: dict[str, int]) -> dict[str, str]:
        return {"id": "re_1"}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)
    return app


def test_openapi_documents_the_reused_key_under_its_status() -> None:
    app = documented_app(reused_key_status=409)
    setup(app)
    paths = app.openapi()["paths"]
    charges, refunds = paths["/v1/charges"]["post"]["responses"], paths["/v1/refunds"]["post"]["responses"]
    assert ProblemCode.KEY_REUSED in charges["409"]["description"]
    assert ProblemCode.KEY_REUSED not in charges["400"]["description"]
    assert ProblemCode.KEY_REUSED not in charges["422"]["description"]  # FastAPI's own 422 only
    assert "idempotency middleware" not in charges["422"]["description"]
    assert ProblemCode.KEY_REUSED in refunds["400"]["description"]
    assert ProblemCode.KEY_REUSED not in refunds["409"]["description"]
    codes = {  # the header names the codes each status may carry
        status: set(charges[status]["headers"]["Idempotency-Problem"]["schema"]["enum"])
        for status in ("400", "409", "413", "503")
    }
    assert codes == {
        "400": {ProblemCode.KEY_INVALID, ProblemCode.TENANT_UNKNOWN},
        "409": {ProblemCode.IN_PROGRESS, ProblemCode.NOT_REPLAYABLE, ProblemCode.KEY_REUSED},
        "413": {ProblemCode.REQUEST_TOO_LARGE},
        "503": {ProblemCode.STORE_UNAVAILABLE},
    }
    assert "Idempotency-Problem" not in charges["422"].get("headers", {})
    refused = refunds["400"]["headers"]["Idempotency-Problem"]["schema"]["enum"]
    assert set(refused) == {ProblemCode.KEY_INVALID, ProblemCode.TENANT_UNKNOWN, ProblemCode.KEY_REUSED}
    for status in ("400", "409", "413", "503"):
        problem = charges[status]["content"]["application/problem+json"]["schema"]
        assert problem == {"$ref": "#/components/schemas/IdempotencyProblem"}
    assert "retry-after" not in {name.lower() for name in charges["413"]["headers"]}


def test_openapi_documents_the_apps_envelope() -> None:
    app = documented_app(problem_renderer=envelope)
    setup(app, problem_schema=ERROR_SCHEMA)
    schema = app.openapi()
    charges = schema["paths"]["/v1/charges"]["post"]["responses"]
    ref = {"$ref": "#/components/schemas/IdempotencyProblem"}
    for status in ("400", "409", "413", "503"):
        assert charges[status]["content"] == {"application/json": {"schema": ref}}
        assert "Idempotency-Problem" in charges[status]["headers"]
    assert ProblemCode.KEY_REUSED in charges["422"]["description"]
    assert charges["422"]["content"] == {  # FastAPI's validation error, or the middleware's in the app's envelope
        "application/json": {"schema": {"anyOf": [{"$ref": "#/components/schemas/HTTPValidationError"}, ref]}}
    }
    assert schema["components"]["schemas"]["IdempotencyProblem"] == ERROR_SCHEMA


def test_openapi_without_the_envelopes_schema_promises_no_body() -> None:
    app = documented_app(problem_renderer=envelope)
    setup(app)
    charges = app.openapi()["paths"]["/v1/charges"]["post"]["responses"]
    assert "content" not in charges["409"]
    assert "Idempotency-Problem" in charges["409"]["headers"]


def test_an_envelopes_schema_without_a_renderer_is_refused() -> None:
    app = documented_app()
    setup(app, problem_schema=ERROR_SCHEMA)
    with pytest.raises(ValueError, match="problem_schema describes the body of a problem_renderer"):
        app.openapi()


# -- the guide's recipe --------------------------------------------------------------------------------------------


async def test_the_guides_envelope(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idempotency_database_url: str
) -> None:
    with recipe("envelope", tmp_path, monkeypatch, DATABASE_URL=idempotency_database_url) as module:
        key = str(uuid.uuid4())
        async with run_lifespan(module.app), client_for(module.app, token="sk_test_guide_envelope") as client:
            first = await client.post("/v1/charges", json={"amount": 5}, headers={"Idempotency-Key": key})
            reused = await client.post("/v1/charges", json={"amount": 6}, headers={"Idempotency-Key": key})
            described = orjson.loads((await client.get("/openapi.json")).content)
        await module.store.close()
    assert first.status_code == 201
    assert (reused.status_code, reused.headers["idempotency-problem"]) == (409, "idempotency_key_reused")
    error = reused.json()["error"]
    assert (error["type"], error["code"]) == ("idempotency_error", "idempotency_key_reused")
    assert error["message"].startswith("This Idempotency-Key was already used")
    documented = described["paths"]["/v1/charges"]["post"]["responses"]["409"]
    assert "idempotency_key_reused" in documented["description"]
    assert documented["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/IdempotencyProblem"
    assert described["components"]["schemas"]["IdempotencyProblem"] == module.ERROR_ENVELOPE
