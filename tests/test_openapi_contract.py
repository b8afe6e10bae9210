"""Schemathesis as a gate: every check, every phase, against what the OpenAPI schemas promise.

Three targets: a bare FastAPI app behind the middleware (``setup(app)`` applied, a ``MemoryStore``); the same app
with the middleware's errors in an envelope of its own and a reused key answered 409 (``problem_renderer=``,
``reused_key_status=``, the envelope's schema given to ``setup``); and the payments example on the suite's
PostgreSQL. Each runs twice, in process and seeded (30 and 15 examples per operation and
phase, about 400 to 1,600 requests and 4 to 11 seconds a run): with a fresh ``Idempotency-Key`` per request, and
with keys as schemathesis draws them, which repeat (its coverage phase sends ``0`` with every case of an
operation), so requests meet the records of others and of themselves. Every check schemathesis has runs, stateful
phase included, except ``max_response_time``, which needs a limit and would only time a shared machine.

A run fails on any check failure that ``ACCEPTED`` does not list. Each entry says why the answer is right and the
check cannot know it. Anything else is a bug: in the schemas the middleware or the example documents, or in what
they answer.
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import orjson
import pytest
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install schemathesis)")
from schemathesis.config import SchemathesisConfig  # noqa: E402
from schemathesis.engine import StopReason, events, from_schema  # noqa: E402
from schemathesis.python import asgi as st_asgi  # noqa: E402

from examples.payments.app import create_app  # noqa: E402
from idempotency_mw import IdempotencyMiddleware, MemoryStore, Problem, ProblemCode, idempotent  # noqa: E402
from idempotency_mw._keys import InvalidKey, parse_key  # noqa: E402
from idempotency_mw.fastapi import setup  # noqa: E402

UUID_KEYS = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
KEY_FORMATS = {"/v1/payouts": UUID_KEYS}  # the bare app's routes with a key_format
SEED = 1  # another seed draws other requests; the list below holds for seeds 1 to 5
EXAMPLES = {"bare": 30, "envelope": 30, "payments": 10}  # per operation and phase: 5, 5 and 14 operations
TARGETS = ("bare", "envelope", "payments")
FORM = "application/x-www-form-urlencoded"
KEYS = ("fresh", "reused")

# Untraced by coverage (pytest-cov's no_cover): its C tracer is called on every Python call, measured or not, and
# hypothesis and schemathesis make many, so the six runs took 129 s of CPU traced and 64 s untraced. Every line and
# branch of the library they reach, the rest of the suite reaches too (checked against a run of the rest), so the
# coverage measured is the same; what this module checks is the schemas against the answers, not lines.
pytestmark = pytest.mark.no_cover


# -- the bare app --------------------------------------------------------------------------------------------------


class Charge(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount: int = Field(ge=1, le=1_000_000)

    @field_validator("amount", mode="before")
    @classmethod
    def _json_integer(cls, value: object) -> object:
        """JSON Schema's integer (``1``, ``1.0``), which the schema promises; pydantic's lax ``int`` would also take
        ``true`` and ``"1"``, and schemathesis would rightly call that accepting invalid data."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("amount must be a JSON integer")
        return value


class ChargeOut(BaseModel):
    id: str
    amount: int


def bare_app(**options: Any) -> FastAPI:
    """What a user writes: a create (201, with Location, which schemathesis' stateful phase follows), its reads, a
    route whose key is required, one that takes UUID keys only, and one that only observes. GET and POST share a
    path, as FastAPI apps do. A reused key's 422 says what changed (explain_mismatch), so its ``changed`` member is
    held to the schema too. ``options``: the middleware's, and ``problem_schema`` for ``setup``."""
    problem_schema = options.pop("problem_schema", None)
    app = FastAPI(title="bare app behind the middleware")
    charges: dict[str, int] = {}

    @app.post("/v1/charges", status_code=201)
    async def create_charge(body: Charge, response: Response) -> ChargeOut:
        charge = "ch_" + uuid.uuid4().hex
        charges[charge] = body.amount
        response.headers["Location"] = f"/v1/charges/{charge}"
        return ChargeOut(id=charge, amount=body.amount)

    @app.get("/v1/charges")
    async def list_charges() -> list[ChargeOut]:
        return [ChargeOut(id=charge, amount=amount) for charge, amount in charges.items()]

    @app.get("/v1/charges/{charge}", responses={404: {"description": "No such charge"}})
    async def retrieve_charge(charge: str) -> ChargeOut:
        if charge not in charges:
            raise HTTPException(404, "No such charge")
        return ChargeOut(id=charge, amount=charges[charge])

    @app.post("/v1/refunds", status_code=201)
    @idempotent(required=True)
    async def create_refund(body: Charge) -> ChargeOut:
        return ChargeOut(id="re_" + uuid.uuid4().hex, amount=body.amount)

    @app.post("/v1/payouts", status_code=201)
    @idempotent(required=True, key_format=UUID_KEYS)  # a route that takes UUIDs only: documented, and held to it
    async def create_payout(body: Charge) -> ChargeOut:
        return ChargeOut(id="po_" + uuid.uuid4().hex, amount=body.amount)

    @app.post("/v1/quotes", status_code=201)
    @idempotent(required=True, observe=True)  # observed: it promises none of the middleware's answers, and gets none
    async def create_quote(body: Charge) -> ChargeOut:
        return ChargeOut(id="qt_" + uuid.uuid4().hex, amount=body.amount)

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **{"explain_mismatch": True, **options})
    setup(app, problem_schema=problem_schema)
    return app


# An API's own error envelope (Stripe's shape), for the middleware's errors as much as the app's.
ENVELOPE_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "code", "message"],
            "additionalProperties": False,
            "properties": {
                "type": {"type": "string", "enum": ["idempotency_error"]},
                "code": {"type": "string", "enum": [code.value for code in ProblemCode]},
                "message": {"type": "string"},
            },
        }
    },
}


def envelope(problem: Problem, scope: Scope) -> JSONResponse:
    error = {"type": "idempotency_error", "code": problem.code, "message": problem.detail}
    return JSONResponse({"error": error}, status_code=problem.status)


def envelope_app() -> FastAPI:
    return bare_app(problem_renderer=envelope, reused_key_status=409, problem_schema=ENVELOPE_SCHEMA)


# -- keys ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    replayed: bool
    code: str | None  # the problem's code, or the code in Stripe's envelope
    explained: bool = False  # a problem that says what changed (its changed member)


def answer_code(body: bytes) -> str | None:
    return _error_field(body, "code")


def _error_field(body: bytes, name: str) -> str | None:
    """A field of an error answer: of the problem document, or of the error in Stripe's envelope."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    value = error.get(name) if isinstance(error, dict) else document.get(name)
    return value if isinstance(value, str) else None


def with_keys(app: ASGIApp, keys: str, answers: Counter[Answer]) -> ASGIApp:
    """``app`` with the requests' keys set for the run: ``fresh`` makes every key the parser accepts a new UUID,
    ``reused`` leaves them as schemathesis draws them. Keys the parser refuses stay as they are, so schemathesis'
    invalid keys still get their 400. Every answer is counted, to show each run met what it is named for."""

    async def keyed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if keys == "fresh":
            taken = KEY_FORMATS.get(scope["path"])
            scope = {**scope, "headers": [_fresh(name, value, taken) for name, value in scope["headers"]]}
        start: Message = {}
        body = bytearray()

        async def counted(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    headers = dict(start.get("headers", ()))
                    replayed = headers.get(b"idempotent-replayed") == b"true"
                    explained = b'"changed":{' in body
                    answers[Answer(start["status"], replayed, answer_code(bytes(body)), explained)] += 1
            await send(message)

        await app(scope, receive, counted)

    return keyed


def _fresh(name: bytes, value: bytes, taken: str | None) -> tuple[bytes, bytes]:
    """A new UUID for a key the route takes (``taken``: the pattern of a route's ``key_format``); any other key as
    drawn, so that it still gets its 400."""
    if name != b"idempotency-key":
        return name, value
    try:
        key = parse_key(value)
    except InvalidKey:
        return name, value
    if taken is not None and not re.fullmatch(taken, key):
        return name, value
    return name, str(uuid.uuid4()).encode()


# -- running schemathesis ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A failed check, with the answer that failed it."""

    target: str
    keys: str
    phase: str
    check: str
    method: str
    path: str
    key: str | None  # as generated (a fresh-keys run sent a UUID instead of a valid one); curl hides it
    status: int | None
    code: str | None
    param: str | None  # the parameter a Stripe error names
    detail: str | None  # of a problem, or of FastAPI's own error
    title: str
    message: str
    undeclared_fields: frozenset[str] | None  # of a form body, as sent: fields its schema does not declare
    curl: str

    def __str__(self) -> str:
        return (
            f"[{self.target}, {self.keys} keys] {self.phase} {self.check}: {self.method} {self.path} "
            f"(Idempotency-Key: {self.key!r}) -> {self.status} {self.code or ''}: {self.title}\n    {self.curl}"
        )


@dataclass
class Run:
    failures: list[Failure] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    phases: set[str] = field(default_factory=set)  # the phases that ran
    answers: Counter[Answer] = field(default_factory=Counter)
    requests: int = 0
    seconds: float = 0.0


def run_schemathesis(target: str, keys: str, app: ASGIApp, authorization: str) -> Run:
    run = Run()
    config = SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "continue-on-failure": True,
            "suppress-health-check": ["all"],  # a slow draw or a filtered one is not the API's failure
            "headers": {"Authorization": authorization},
            "generation": {"max-examples": EXAMPLES[target], "database": "none"},
            "checks": {"enabled": True},
        }
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", with_keys(app, keys, run.answers), config=config)
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            run.failures.extend(_failures(target, keys, str(event.phase), event.recorder))
            run.requests += len(event.recorder.interactions)
        elif isinstance(event, events.PhaseFinished) and event.status.value != "skip":
            run.phases.add(event.phase.name.value)
        elif isinstance(event, events.NonFatalError):
            run.errors.append(f"{event.label}: {event.info}")
        elif isinstance(event, events.FatalError):
            run.errors.append(repr(event.exception))
        elif isinstance(event, events.EngineFinished):
            run.seconds = event.running_time
            if event.stop_reason != StopReason.COMPLETED:
                run.errors.append(f"the run stopped early: {event.stop_reason}")
            run.errors.extend(f"after the run: {failure.title}" for failure in event.failures)
    return run


def _failures(target: str, keys: str, phase: str, recorder: Any) -> Iterator[Failure]:
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.failure_info is None:
                continue
            case = recorder.cases[case_id].value
            interaction = recorder.interactions.get(case_id)
            response = interaction.response if interaction is not None else None
            yield Failure(
                target=target,
                keys=keys,
                phase=phase,
                check=check.name,
                method=case.method,
                path=case.path,
                key=(case.headers or {}).get("Idempotency-Key"),
                status=response.status_code if response is not None else None,
                code=_error_field(response.content, "code") if response is not None else None,
                param=_error_field(response.content, "param") if response is not None else None,
                detail=_error_field(response.content, "detail") if response is not None else None,
                title=check.failure_info.failure.title,
                message=check.failure_info.failure.message,
                undeclared_fields=_undeclared_fields(case, interaction),
                curl=case.as_curl_command(),
            )


def _undeclared_fields(case: Any, interaction: Any) -> frozenset[str] | None:
    """The fields of a form body, as it was sent, that the operation's form schema does not declare."""
    form = case.operation.definition.raw.get("requestBody", {}).get("content", {}).get(FORM)
    if form is None or interaction is None or not interaction.request.body:
        return None
    declared = set(form["schema"].get("properties", {}))
    sent = {name.partition("[")[0] for name, _ in parse_qsl(interaction.request.body.decode(), keep_blank_values=True)}
    return frozenset(sent - declared)


# -- what the checks cannot know -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deviation:
    check: str
    reason: str
    applies: Callable[[Failure], bool]


ACCEPTED = [
    Deviation(
        "positive_data_acceptance",
        "a key used before for another request is refused by design (422 idempotency_key_reused; the example "
        "answers Stripe's 400 idempotency_error): which keys a client has used is no part of a schema",
        lambda f: f.keys == "reused" and f.code == "idempotency_key_reused",
    ),
    Deviation(
        "positive_data_acceptance",
        "a declined test card (pm_card_chargeDeclined...) is the outcome of a valid request: 402 card_error, "
        "recorded and replayed",
        lambda f: f.target == "payments" and f.status == 402 and f.code == "card_declined",
    ),
    Deviation(
        "positive_data_acceptance",
        "answers the objects' state decides: confirming an intent that already succeeded, refunding one that did "
        "not, or more than is left",
        lambda f: (
            f.target == "payments"
            and f.status == 400
            and f.code in {"payment_intent_unexpected_state", "charge_already_refunded", "amount_too_large"}
        ),
    ),
    Deviation(
        "positive_data_acceptance",
        "starting_after and ending_before exclude each other, as at Stripe; OpenAPI has no way to say so of two "
        "query parameters",
        lambda f: f.target == "payments" and f.code == "parameter_invalid" and f.param == "ending_before",
    ),
    Deviation(
        "negative_data_rejection",
        "an undeclared form field whose value is an empty object or list ({'x': {}}) has no pair in a urlencoded "
        "body, so what the server received declares every field: schemathesis judges the body before encoding",
        lambda f: "violates `additionalProperties`" in f.message and f.undeclared_fields == frozenset(),
    ),
    Deviation(
        "allow_header_conformance",
        "Starlette's router answers a 405 with the methods of the first route whose path matched (Allow: POST on "
        "/v1/charges, which has GET too); the router's answer, not the middleware's (the example's handler fixes "
        "it: allowed_methods)",
        lambda f: f.target in ("bare", "envelope") and f.status == 405,
    ),
    Deviation(
        "content_type_conformance",
        "FastAPI answers a JSON body it cannot parse with its own 400 {'detail': ...} as application/json, which "
        "FastAPI does not document; the 400 in the schema is the middleware's problem+json",
        lambda f: f.target == "bare" and f.status == 400 and f.detail == "There was an error parsing the body",
    ),
    Deviation(
        "response_schema_conformance",
        "the same undocumented 400 of FastAPI's, where the app's envelope documents the middleware's 400 as "
        "application/json too: FastAPI's body is not the envelope",
        lambda f: f.target == "envelope" and f.status == 400 and f.detail == "There was an error parsing the body",
    ),
    Deviation(
        "status_code_conformance",
        "the same 400 of FastAPI's on the route that only observes: there the middleware answers nothing, so it "
        "documents no 400 of its own, and the app's answer is what the app without the middleware would give",
        lambda f: (
            f.target in ("bare", "envelope")
            and f.path == "/v1/quotes"
            and f.status == 400
            and f.detail == "There was an error parsing the body"
        ),
    ),
]


def accepted(failure: Failure) -> bool:
    return any(d.check == failure.check and d.applies(failure) for d in ACCEPTED)


# -- the tests -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(idempotency_database_url: str) -> Iterator[Callable[[str, str], Run]]:
    """Each (target, keys) run on its own app, once; payments on an account of its own. A run is checked by the one
    test that asks for it: the fixture is per pytest-xdist worker, so a second test of the same run on another
    worker would repeat it (15 to 45 s of schemathesis)."""
    done: dict[tuple[str, str], Run] = {}

    def get(target: str, keys: str) -> Run:
        if (target, keys) not in done:
            if target == "payments":
                app: ASGIApp = create_app(idempotency_database_url, pool_size=4)
            else:
                app = bare_app() if target == "bare" else envelope_app()
            authorization = f"Bearer sk_test_contract_{uuid.uuid4().hex[:12]}"
            done[target, keys] = run_schemathesis(target, keys, app, authorization)
        return done[target, keys]

    try:
        yield get
    finally:
        st_asgi.shutdown_lifespans()  # the payments apps' pools, opened on schemathesis' event loop


@pytest.mark.parametrize("keys", KEYS)
@pytest.mark.parametrize("target", TARGETS)
def test_schemathesis_finds_nothing_but_the_accepted_deviations(
    runs: Callable[[str, str], Run], target: str, keys: str
) -> None:
    run = runs(target, keys)
    assert run.errors == []
    assert {"coverage", "fuzzing", "stateful"} <= run.phases
    assert run.requests > 200
    replays = sum(n for answer, n in run.answers.items() if answer.replayed)
    reused = sum(n for answer, n in run.answers.items() if answer.code == "idempotency_key_reused")
    explained = sum(n for answer, n in run.answers.items() if answer.explained)
    if keys == "fresh":
        assert (replays, reused) == (0, 0)  # no request met another's record
    else:
        assert replays > 0
        assert reused > 0
        assert (explained > 0) == (target == "bare")  # the bare app says what changed; the example does not
    assert not any(answer.status >= 500 for answer in run.answers)
    if keys == "reused":
        # A keyed request for a method no route of the path has (PATCH on a POST-only path), whose key was used
        # before, gets the router's 405, not the middleware's answer about the key.
        unsupported = [f for f in run.failures if f.check == "unsupported_method"]
        assert unsupported == [], "\n".join(str(f) for f in unsupported)
    if (target, keys) == ("envelope", "reused"):
        # The run with the app's envelope met what it is there for: reused keys, answered with the status it chose.
        assert {answer.status for answer in run.answers if answer.code == "idempotency_key_reused"} == {409}
    unexpected = [f for f in run.failures if not accepted(f)]
    assert unexpected == [], "\n".join(str(f) for f in unexpected[:20])
