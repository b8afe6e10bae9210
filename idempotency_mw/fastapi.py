"""FastAPI integration: the tenant from the app's own authentication, the transaction as a dependency, validation
errors that free the key, and OpenAPI.

from idempotency_mw.fastapi import IdempotencyConnection, TenantDependency, setup

tenant = TenantDependency(current_account, lambda account: account.id)  # the app's auth dependency
app = FastAPI(dependencies=[Depends(tenant)])
app.add_middleware(IdempotencyMiddleware, store=store, tenant=tenant, transactional=True)
setup(app)

@app.post("/v1/charges")
async def charge(db: IdempotencyConnection) -> dict: ...
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import asyncpg

try:
    from fastapi import Depends, FastAPI, Request
    from fastapi.dependencies.models import Dependant
    from fastapi.exception_handlers import request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
except ImportError as error:  # fastapi is an optional dependency of the package
    raise ImportError("idempotency_mw.fastapi needs fastapi: pip install 'idempotency-mw[fastapi]'") from error
from starlette.responses import Response
from starlette.routing import Mount

from idempotency_mw._context import IdempotencyContext, claim, idempotency_context, mark_not_executed
from idempotency_mw._keys import TenantFromApp
from idempotency_mw._middleware import IdempotencyMiddleware
from idempotency_mw._parts import COMPARED, MAX_FIELDS
from idempotency_mw._policy import Policy, idempotent, iter_routes
from idempotency_mw._problems import TYPE_BASE
from idempotency_mw._wire import EXPIRES_HEADER, MAX_KEY_LENGTH, PROBLEM_HEADER, ProblemCode


class TenantDependency(TenantFromApp):
    """The tenant of keyed requests from the app's own authentication dependency: the claim is taken as soon as that
    dependency has answered, before the handler's body runs, so the app's 401 comes before any answer of the
    middleware's, and the key is scoped by the account the app resolved.

    ``dependency`` is the app's (``async def current_account(api_key = Header(alias="X-API-Key")) -> Account``, which
    raises ``HTTPException(401)``); ``tenant`` turns what it returns into the tenant string (``str`` by default;
    None for no tenant). Use the same object twice: as a dependency of every route the middleware covers (the app's,
    a router's or the route's own: ``FastAPI(dependencies=[Depends(tenant)])``), which the middleware checks at
    startup, and as the middleware's ``tenant=``. ``Depends(tenant)`` gives what ``dependency`` returned, and
    FastAPI runs ``dependency`` once per request for both.
    """

    def __init__(self, dependency: Callable[..., Any], tenant: Callable[[Any], str | None] = str) -> None:
        if not callable(dependency):
            raise TypeError(f"TenantDependency needs the app's dependency (a callable), got {dependency!r}")
        self.dependency = dependency
        self.tenant_of = tenant
        # FastAPI reads the dependency's parameters from its signature: this one's depends on the app's.
        self.__signature__ = inspect.Signature(
            [
                inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
                inspect.Parameter("resolved", inspect.Parameter.KEYWORD_ONLY, default=Depends(dependency)),
            ]
        )

    async def __call__(self, request: Request, resolved: Any = None) -> Any:
        tenant = None if resolved is None else self.tenant_of(resolved)
        await claim(request, tenant)
        return resolved

    def __repr__(self) -> str:
        name = getattr(self.dependency, "__qualname__", repr(self.dependency))
        return f"TenantDependency({name})"

    def check(self, app: Any, covered: Callable[[Any, str, frozenset[str] | None], bool]) -> None:
        """Refuse an app with a covered route that does not depend on this tenant: a path operation without it, or a
        route that cannot have it (``app.add_route``, a mounted app's). Its keyed requests would never be claimed."""
        told = {(endpoint, path) for endpoint, path, dependant in _api_routes(app) if _depends_on(dependant, self)}
        missing = [
            f"{'/'.join(sorted(route.methods or ()))} {route.path}"
            for route in iter_routes(getattr(app, "routes", ()))
            if covered(route.endpoint, route.path, route.methods) and (route.endpoint, route.path) not in told
        ]
        if missing:
            raise ValueError(
                f"the idempotency middleware's tenant is {self!r}, which these covered routes do not depend on, so "
                f"their keyed requests would never be claimed: {', '.join(missing)}. Add Depends(tenant) to the app "
                "(FastAPI(dependencies=[...])), their router, or each route"
            )


def _api_routes(app: Any, prefix: str = "") -> Iterator[tuple[Any, str, Dependant]]:
    """(endpoint, full path, dependant with every dependency of its app and routers) of each path operation, also in
    mounted apps (whose routes have their own app's dependencies, not those of the app they are mounted in)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # an older FastAPI, whose included routes are flat and carry their routers' dependencies
        contexts: Any = getattr(app, "routes", ())
    else:
        contexts = iter_route_contexts(getattr(app, "routes", ()))
    for context in contexts:
        route = getattr(context, "original_route", context)
        if isinstance(route, Mount):
            yield from _api_routes(route, prefix + route.path)
            continue
        dependant = getattr(context, "dependant", None)
        path = getattr(context, "path_format", None)
        if isinstance(dependant, Dependant) and path is not None:
            yield context.endpoint, prefix + path, dependant


def _depends_on(dependant: Dependant, call: Any) -> bool:
    return any(sub.call is call or _depends_on(sub, call) for sub in dependant.dependencies)


def _context(request: Request) -> IdempotencyContext:
    context = idempotency_context(request)
    if context is None:
        raise RuntimeError("this route is not handled by IdempotencyMiddleware (is it added to the app?)")
    return context


def _connection(request: Request) -> asyncpg.Connection:
    context = _context(request)
    if context.transaction is None:
        raise RuntimeError(
            "this route is not transactional: use @idempotent(transactional=True) or "
            "IdempotencyMiddleware(transactional=True) to get its database transaction"
        )
    if context.connection is None:
        raise RuntimeError(
            f"this route's transaction is a {type(context.transaction).__name__}, not an asyncpg connection: "
            "with SQLAlchemyStore, take IdempotencySession (idempotency_mw.sqlalchemy) instead"
        )
    return context.connection


IdempotencyConnection = Annotated[asyncpg.Connection, Depends(_connection)]
"""The open transaction of a transactional route: write through it and the record commits with your writes."""

Idempotency = Annotated[IdempotencyContext, Depends(_context)]
"""The request's tenant, key and ``downstream_key(label)``."""


def setup(
    app: FastAPI, *, problem_schema: Mapping[str, Any] | None = None, problem_media_type: str = "application/json"
) -> None:
    """Free the key on FastAPI's request validation errors, and document covered operations in OpenAPI.

    With the middleware's ``problem_renderer`` (the app's own envelope for its errors), ``problem_schema`` is the JSON
    Schema of what the renderer returns, sent as ``problem_media_type``: the middleware's error responses are
    documented with it (as ``#/components/schemas/IdempotencyProblem``). Without it they are documented with their
    status, description and headers, and no body."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(
                original(), app, problem_schema=problem_schema, problem_media_type=problem_media_type
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _validation_error(request: Request, error: Exception) -> Response:
    mark_not_executed(request)  # nothing ran: a corrected retry may reuse the key
    assert isinstance(error, RequestValidationError)
    return await request_validation_exception_handler(request, error)


# The Idempotency-Key values keys.parse_key accepts, as one regular expression that ECMA 262 (JSON Schema, OpenAPI
# tools) and Python read alike: a bare token (visible ASCII but the comma, not opening with a quote), or an RFC 9651
# sf-string of visible ASCII with \" and \\ escaped (a space is refused even there). Either way the key itself is
# 1 to MAX_KEY_LENGTH characters. The whitespace HTTP allows around a field value is not part of it (RFC 9110
# §5.5), so the pattern leaves it out; the parser ignores it, as HTTP does.
_BARE_KEY = rf"[\x21\x23-\x2b\x2d-\x7e][\x21-\x2b\x2d-\x7e]{{0,{MAX_KEY_LENGTH - 1}}}"
_QUOTED_KEY = rf'"(?:[\x21\x23-\x5b\x5d-\x7e]|\\[\x22\x5c]){{1,{MAX_KEY_LENGTH}}}"'
KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 2 + 2 * MAX_KEY_LENGTH,  # a quoted key whose every character is escaped
    "pattern": f"^(?:{_BARE_KEY}|{_QUOTED_KEY})$",
}

CHANGED_SCHEMA = {
    "type": "object",
    "description": "With idempotency_key_reused, on an operation that explains it (explain_mismatch): what differs "
    "from the first request with the key. fields names the body fields this request sent that differ or were not "
    "in the first (a JSON Pointer for a JSON body, the field name for a form); missing_fields counts the first "
    "request's fields that this one lacks; compared says how the bodies were compared: field by field, by "
    "top-level member (a JSON body of more than 64 fields), or whole",
    "required": ["method", "path", "query", "body", "fields", "missing_fields", "compared"],
    "properties": {
        "method": {"type": "boolean"},
        "path": {"type": "boolean"},
        "query": {"type": "boolean"},
        "body": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}, "maxItems": MAX_FIELDS},
        "missing_fields": {"type": "integer", "minimum": 0, "maximum": MAX_FIELDS},
        "compared": {"type": "string", "enum": sorted(set(COMPARED.values()))},
    },
    "additionalProperties": False,
}
PROBLEM_SCHEMA = {
    "type": "object",
    "description": "RFC 9457 problem details, as the idempotency middleware answers",
    "required": ["type", "title", "status", "detail", "code"],
    "properties": {
        "type": {"type": "string", "example": TYPE_BASE + ProblemCode.KEY_REUSED},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {"type": "string", "enum": [code.value for code in ProblemCode]},
        "changed": CHANGED_SCHEMA,
    },
}
RETRY_AFTER = {
    "description": "Seconds to wait before retrying with the same key (with idempotency_request_in_progress and "
    "idempotency_store_unavailable)",
    "schema": {"type": "integer", "minimum": 0},
}
PROBLEM_REF = {"$ref": "#/components/schemas/IdempotencyProblem"}

# Idempotency-Expires, as _channels.http_date writes it: an IMF-fixdate (RFC 9110 §5.6.7).
_DAY, _MONTH = "(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)", "(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
EXPIRES = {
    "description": "Until when a retry with the same Idempotency-Key and the same request gets this answer again (an "
    "HTTP-date, rounded down to the second): the expiry of the answer's record. On an answer that is recorded, the "
    "first time and on every replay; never on one that frees the key",
    "schema": {
        "type": "string",
        "pattern": f"^{_DAY}, [0-9]{{2}} {_MONTH} [0-9]{{4}} [0-9]{{2}}:[0-9]{{2}}:[0-9]{{2}} GMT$",
    },
}


@dataclass(frozen=True)
class _Answer:
    """The middleware's answers under one status of a covered operation."""

    codes: list[ProblemCode]
    description: str  # naming each code
    retry_after: bool


def _problems(policy: Policy) -> dict[str, _Answer]:
    """The middleware's answers on a covered operation, by status: a reused key's under the route's status."""
    answers = [
        *([(400, ProblemCode.KEY_MISSING, "Idempotency-Key missing")] if policy.required else []),
        (400, ProblemCode.KEY_INVALID, "Idempotency-Key malformed"),
        (400, ProblemCode.TENANT_UNKNOWN, "sent without the credentials that scope the key"),
        (
            409,
            ProblemCode.IN_PROGRESS,
            "a request with this Idempotency-Key is still in progress: retry after Retry-After seconds, same key",
        ),
        (
            409,
            ProblemCode.NOT_REPLAYABLE,
            "a request with this Idempotency-Key completed, but its response cannot be replayed (over the storage "
            "limit, or cut short): do not retry",
        ),
        *(
            [
                (
                    409,
                    ProblemCode.STEP_NOT_RESUMABLE,
                    "an earlier attempt began a step that cannot be repeated and its outcome is unknown: do not retry",
                )
            ]
            if policy.transactional
            else []
        ),
        (413, ProblemCode.REQUEST_TOO_LARGE, "request body over the idempotency size limit"),
        (
            policy.reused_key_status,
            ProblemCode.KEY_REUSED,
            "this Idempotency-Key was used with another request"
            + (", and the answer's changed member says what differs" if policy.explain_mismatch else ""),
        ),
        *(
            [(422, ProblemCode.KEY_EXPIRED, f"a UUIDv7 key older than the {int(policy.ttl)}-second retention")]
            if policy.check_uuid7_age
            else []
        ),
        (
            503,
            ProblemCode.STORE_UNAVAILABLE,
            "the idempotency store is unavailable, nothing ran: retry after Retry-After seconds with the same key",
        ),
    ]
    by_status: dict[int, list[tuple[ProblemCode, str]]] = {}
    for status, code, text in sorted(answers, key=lambda answer: answer[0]):
        by_status.setdefault(status, []).append((code, text))
    return {
        str(status): _Answer(
            [code for code, _ in found], "; ".join(f"{text} ({code})" for code, text in found), status in (409, 503)
        )
        for status, found in by_status.items()
    }


def _problem_header(answer: _Answer) -> dict[str, Any]:
    return {
        "description": "The idempotency middleware's stable code for this answer, whatever its body (present on "
        "the middleware's own answers only)",
        "schema": {"type": "string", "enum": [code.value for code in answer.codes]},
    }


def document(
    schema: dict[str, Any],
    app: FastAPI,
    *,
    problem_schema: Mapping[str, Any] | None = None,
    problem_media_type: str = "application/json",
) -> dict[str, Any]:
    """Add the Idempotency-Key header, the replay headers (Idempotent-Replayed, Idempotency-Expires) and the problem
    responses to covered operations (see :func:`setup` for ``problem_schema`` and ``problem_media_type``)."""
    middleware = _built_middleware(app)
    if middleware is None:
        return schema
    rendered = middleware.envelope.renderer is not None
    if problem_schema is not None and not rendered:
        raise ValueError(
            "setup(problem_schema=...): problem_schema describes the body of a problem_renderer, and the "
            "IdempotencyMiddleware has none (its errors are application/problem+json, documented already)"
        )
    body: tuple[str, dict[str, Any]] | None = ("application/problem+json", PROBLEM_SCHEMA)  # media type and schema
    if rendered:
        body = None if problem_schema is None else (problem_media_type, dict(problem_schema))
    if body is not None:
        schema.setdefault("components", {}).setdefault("schemas", {})["IdempotencyProblem"] = body[1]
    for entry in iter_routes(app.routes):
        policy = middleware.routes.for_endpoint(entry.endpoint, entry.path)
        for method in (entry.methods or frozenset()) & policy.methods:
            operation = schema.get("paths", {}).get(entry.path, {}).get(method.lower())
            if operation is not None:
                _document_operation(operation, policy, None if body is None else body[0])
    return schema


def _key_format(policy: Policy) -> str:
    if isinstance(policy.key_format, str):
        return f" This operation takes keys that match {policy.key_format} (sent bare)."
    if policy.key_format is not None:
        refused = "" if policy.observe else ": any other is answered 400"
        return f" This operation takes keys of a format of its own{refused}."
    return ""


def _key_schema(policy: Policy) -> dict[str, Any]:
    """The header's schema: any key the middleware parses, or, for a route with a ``key_format`` pattern, the keys
    that match it, sent bare (the pattern is written for Python; keep it to what ECMA 262, JSON Schema's dialect,
    reads alike)."""
    if isinstance(policy.key_format, str):
        return {**KEY_SCHEMA, "maxLength": MAX_KEY_LENGTH, "pattern": f"^(?:{policy.key_format})$"}
    return dict(KEY_SCHEMA)


def _key_description(policy: Policy) -> str:
    if policy.observe:  # every answer is the app's own until the route enforces
        what = "This operation does not act on it yet: every request runs, a retry with the same key included."
    else:
        what = (
            "A retry with the same key and the same request gets the original response, replayed for "
            f"{int(policy.ttl)} seconds."
        )
    return (
        f"A unique key per logical operation (a UUID). {what} A key is 1 to {MAX_KEY_LENGTH} visible ASCII "
        'characters, sent bare (then without a comma) or as an RFC 9651 string ("8e03978e-…"); both spellings name '
        "the same key." + _key_format(policy)
    )


def _document_operation(operation: dict[str, Any], policy: Policy, media_type: str | None) -> None:
    """``media_type``: of the middleware's error bodies (their schema is ``IdempotencyProblem``), or None for none."""
    parameters = operation.setdefault("parameters", [])
    if not any(p.get("in") == "header" and p.get("name", "").lower() == "idempotency-key" for p in parameters):
        parameters.append(
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": policy.required and not policy.observe,
                "description": _key_description(policy),
                "schema": {"type": "string"} if policy.observe else _key_schema(policy),  # observing takes any
            }
        )
    if policy.observe:
        return  # observing: no replays, and none of the middleware's answers
    responses = operation.setdefault("responses", {})
    for status, response in responses.items():  # the app's own answers: the middleware's are never replayed
        if _may_be_replayed(status, policy):
            headers = response.setdefault("headers", {})
            headers["Idempotent-Replayed"] = {
                "description": "Present and true when this response is a replay of the original",
                "schema": {"type": "string", "enum": ["true"]},
            }
            headers[EXPIRES_HEADER] = EXPIRES
    for status, answer in _problems(policy).items():
        description = answer.description
        entry = responses.get(status)
        if entry is None:
            entry = responses[status] = {"description": description[0].upper() + description[1:]}
        else:  # the app's own answer with this status (FastAPI's 422 Validation Error): one or the other
            entry["description"] = f"{entry.get('description', '')}; or, from the idempotency middleware: {description}"
        if media_type is not None:
            content = entry.setdefault("content", {})
            own = content.get(media_type, {}).get("schema")
            content[media_type] = {"schema": PROBLEM_REF if own is None else {"anyOf": [own, PROBLEM_REF]}}
        headers = entry.setdefault("headers", {})
        headers[PROBLEM_HEADER] = _problem_header(answer)
        if answer.retry_after:
            headers["Retry-After"] = RETRY_AFTER


def _may_be_replayed(status: str, policy: Policy) -> bool:
    """Whether an answer documented under ``status`` (``"402"``, ``"4XX"``, ``"default"``) may be a replay: the
    policy records it, so a retry gets it again with the replay header (a declined card's 402 as much as a 201)."""
    if status == "default":
        return True
    if len(status) == 3 and status[0] in "12345" and status[1:].upper() == "XX":
        first = int(status[0]) * 100
        return any(policy.records(code) for code in range(first, first + 100))
    return status.isdigit() and policy.records(int(status))


def _built_middleware(app: FastAPI) -> IdempotencyMiddleware | None:
    """The app's middleware as it will be built (its routes' policies, its renderer), or None without one."""
    for middleware in app.user_middleware:
        if middleware.cls is IdempotencyMiddleware:  # type: ignore[comparison-overlap]
            options = dict(middleware.kwargs)
            store = options.pop("store", None)
            return IdempotencyMiddleware(app, store, **options)  # type: ignore[arg-type]
    return None


__all__ = ["Idempotency", "IdempotencyConnection", "document", "idempotent", "setup"]
