"""The payments example: a Stripe-style API whose every write runs in transactional mode.

``uvicorn examples.payments.app:app --lifespan on`` serves it on ``$DATABASE_URL`` (from the repository root, with
``IDEMPOTENCY_FINGERPRINT_KEYS`` set: docs/payments.md);
``create_app(dsn)`` builds one for tests. Each POST handler writes through ``db: IdempotencyConnection``, the
transaction the middleware opened for it: the ledger rows and the idempotency record of the response commit
together, and the client hears the answer only after that commit. A retried request with the same key gets the
recorded answer and never writes again.

Which answers are recorded follows Stripe: a request refused before anything ran (bad parameters, an unknown
object, a bad API key) frees its key, so the corrected retry may reuse it; a request that ran (a payment, a card
decline, a refund refused because of what the ledger holds) is recorded and replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, compile_path
from starlette.types import Scope

from examples.payments import edge, expansion, ledger, lists, objects, wire
from examples.payments.migrate import apply_migrations
from examples.payments.wire import StripeError
from idempotency_mw import IdempotencyMiddleware, PostgresStore, __version__, mark_not_executed
from idempotency_mw.fastapi import Idempotency, IdempotencyConnection, setup
from idempotency_mw.postgres import postgres_url

# The smallest charge (in the currency's smallest unit) is 50 everywhere here; Stripe's minimums vary a little.
CURRENCIES = ("chf", "eur", "gbp", "jpy", "usd")
MIN_AMOUNT = 50
MAX_AMOUNT = 99_999_999

# Stripe's test payment methods: None succeeds; the others are declined with (code, decline_code, message).
DEFAULT_PAYMENT_METHOD = "pm_card_visa"
TEST_PAYMENT_METHODS: dict[str, tuple[str, str, str] | None] = {
    "pm_card_visa": None,
    "pm_card_mastercard": None,
    "pm_card_amex": None,
    "pm_card_chargeDeclined": ("card_declined", "generic_decline", "Your card was declined."),
    "pm_card_chargeDeclinedInsufficientFunds": (
        "card_declined",
        "insufficient_funds",
        "Your card has insufficient funds.",
    ),
}
REFUND_REASONS = ("duplicate", "fraudulent", "requested_by_customer")

# Connections per app process: the store's (``pool_size``, for writes) plus this many for the GET endpoints.
READ_POOL_SIZE = 4
HEALTH_TIMEOUT = 2.0  # seconds for GET /healthz to get a connection and an answer


# -- dependencies ----------------------------------------------------------------------------------------------


async def _account(request: Request) -> str:
    return wire.authenticate(request.headers.raw)


async def _params(request: Request) -> wire.Params:
    """Parse the form ourselves: FastAPI's ``Form()`` knows nothing of ``metadata[key]=value``."""
    pairs: list[tuple[str, str]] = []
    for name, value in (await request.form()).multi_items():
        if not isinstance(value, str):
            raise wire.invalid("File uploads are not accepted here.", code="parameter_invalid", param=name)
        pairs.append((name, value))
    return wire.Params(wire.decode_form(pairs))


async def _query(request: Request) -> wire.Params:
    """The query string, parsed like a form (``expand[0]=customer``, ``created[gte]=…``), for GET endpoints."""
    return wire.Params(wire.decode_form(request.query_params.multi_items()))


Account = Annotated[str, Depends(_account)]
Params = Annotated[wire.Params, Depends(_params)]
Query = Annotated[wire.Params, Depends(_query)]


# -- OpenAPI: form bodies, query parameters and error responses --------------------------------------------------


def _text(max_length: int, prefix: str = "", *, unsettable: str = "") -> dict[str, Any]:
    """A string parameter. PostgreSQL text cannot hold NUL characters, so strings with one are refused (400).

    An empty value is refused too, as ``wire.Params.string`` refuses it, unless ``unsettable`` says what it means
    instead (Stripe's rule: an empty value unsets the parameter, where it can be unset).
    """
    schema: dict[str, Any] = {"type": "string", "maxLength": max_length, "pattern": f"^{prefix}[^\\u0000]*$"}
    if unsettable:
        schema["description"] = unsettable
    else:
        schema["minLength"] = len(prefix) or 1
    return schema


_LEFT_UNSET = "An empty value leaves it unset (null)"
_UNSETS = "An empty value unsets it (null)"


_METADATA = {
    "type": "object",
    "description": "Up to 50 keys, sent as metadata[key]=value",
    "maxProperties": wire.METADATA_MAX_KEYS,
    "propertyNames": {"minLength": 1, "maxLength": wire.METADATA_MAX_KEY_LENGTH, "pattern": r"^[^\[\]\u0000]+$"},
    # A value may be empty: an update's metadata[key]= unsets the key (_METADATA_UPDATE).
    "additionalProperties": {"type": "string", "maxLength": wire.METADATA_MAX_VALUE_LENGTH, "pattern": "^[^\\u0000]*$"},
}
_METADATA_UPDATE = {
    **_METADATA,
    "description": "Sets the keys given; metadata[key]= (empty) unsets a key. Up to 50 keys in all.",
}
_PAYMENT_METHOD = {"type": "string", "enum": sorted(TEST_PAYMENT_METHODS)}


def _expand(kind: str, *, listed: bool = False) -> dict[str, Any]:
    """The ``expand`` parameter's schema: the paths ``kind`` can expand (``data.…`` in a list)."""
    found: list[str] = []

    def walk(current: str, prefix: str) -> None:
        for field, target in expansion.EXPANDABLE[current].items():
            found.append(prefix + field)
            walk(target, prefix + field + ".")

    walk(kind, "data." if listed else "")
    return {
        "type": "array",
        "description": "Fields to expand: an id becomes the object it names",
        "items": {"type": "string", "enum": found} if found else {"type": "string", "not": {}},
    }


def _form(properties: dict[str, Any], *, required: tuple[str, ...] = (), kind: str) -> dict[str, Any]:
    properties = {**properties, "expand": _expand(kind)}
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    content: dict[str, Any] = {"schema": schema}
    encoding = {"expand": {"style": "form", "explode": True}}  # also accepted: expand[]=x, expand[0]=x
    if "metadata" in properties:
        encoding["metadata"] = {"style": "deepObject", "explode": True}
    if "payment_method_types" in properties:
        encoding["payment_method_types"] = {"style": "form", "explode": True}  # also accepted: a[]=x, a[0]=x
    content["encoding"] = encoding
    return {"requestBody": {"required": bool(required), "content": {"application/x-www-form-urlencoded": content}}}


def _id_filter(prefix: str) -> dict[str, Any]:
    """A list's filter on an object's id: any text of up to 512 characters (``lists.fetch_page``), not only
    ``<prefix>…``, since an id that names no object of the account only finds nothing."""
    return {**_text(512), "description": f"The id of an object ({prefix}…): only what refers to it"}


def _query_parameters(kind: str, *, filters: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A GET's query parameters: ``expand``, and for a list (``filters`` given) its paging and filters."""
    listed = filters is not None
    parameters: list[dict[str, Any]] = [
        {"name": "expand", "in": "query", "style": "form", "explode": True, "schema": _expand(kind, listed=listed)}
    ]
    if filters is not None:
        cursor = _text(255)
        parameters += [
            {
                "name": "limit",
                "in": "query",
                "schema": {"type": "integer", "minimum": 1, "maximum": lists.MAX_LIMIT, "default": lists.DEFAULT_LIMIT},
            },
            {"name": "starting_after", "in": "query", "schema": cursor, "description": "An id: the page after it"},
            {"name": "ending_before", "in": "query", "schema": cursor, "description": "An id: the page before it"},
            {
                "name": "created",
                "in": "query",
                "style": "deepObject",
                "explode": True,
                "description": "Created in this range (Unix time); created=<t> is exactly then",
                "schema": {
                    "type": "object",
                    "properties": {
                        c: {"type": "integer", "minimum": wire.MIN_INTEGER, "maximum": wire.MAX_INTEGER}
                        for c in ledger.COMPARISONS
                    },
                    "additionalProperties": False,
                },
            },
            *({"name": name, "in": "query", "schema": schema} for name, schema in filters.items()),
        ]
    return {"parameters": parameters}


# The app's own error answers. The middleware's (a reused key, a request in progress, ...) are added to each write's
# answers by idempotency_mw.fastapi and put in Stripe's words by _translate_problems.
_ERROR_DESCRIPTIONS = {
    400: "Invalid parameters, or a request the objects' state refuses (invalid_request_error)",
    401: "Missing or invalid API key (invalid_request_error, code api_key_invalid)",
    402: "The card was declined (card_error); the payment intent is in the error",
    404: "No such object (invalid_request_error, code resource_missing)",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": objects.ErrorEnvelope, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def _link(operation: str, parameter: str) -> dict[str, Any]:
    return {"operationId": operation, "parameters": {parameter: "$response.body#/id"}}


# What each create answers with leads to: for readers of the schema, and for schemathesis' stateful tests.
_LINKS = {
    ("/v1/customers", "post"): {
        "RetrieveCustomer": _link("RetrieveCustomer", "customer"),
        "UpdateCustomer": _link("UpdateCustomer", "customer"),
    },
    ("/v1/payment_intents", "post"): {
        "RetrievePaymentIntent": _link("RetrievePaymentIntent", "intent"),
        "UpdatePaymentIntent": _link("UpdatePaymentIntent", "intent"),
        "ConfirmPaymentIntent": _link("ConfirmPaymentIntent", "intent"),
    },
    ("/v1/refunds", "post"): {
        "RetrieveRefund": _link("RetrieveRefund", "refund"),
        "UpdateRefund": _link("UpdateRefund", "refund"),
    },
}

_REQUEST_ID_HEADER = {
    "description": "The request's id (req_...); a replay carries the original request's",
    "schema": {"type": "string", "pattern": "^req_"},
}


_ENVELOPE = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}
_RETRY_AFTER_HEADER = {
    "description": "Seconds to wait before retrying with the same key",
    "schema": {"type": "integer", "minimum": 0},
}
_SHOULD_RETRY_HEADER = {
    "description": "Whether sending the same request again can succeed (Stripe's client libraries obey it)",
    "schema": {"type": "string", "enum": ["true", "false"]},
}


def _translate_problems(responses: dict[str, Any]) -> None:
    """Document the middleware's answers as ``edge.StripeEdge`` sends them: Stripe's status, type and code.

    idempotency_mw.fastapi names each problem code it may answer in the description of its status; the edge answers
    each with another status or code (a reused key: 400 ``idempotency_error``, not 422; a request in progress:
    ``idempotency_key_in_use``), so the entries are rebuilt from the app's own descriptions and the translations.
    """
    landed: dict[str, list[edge.Translation]] = {}
    retry_after: set[str] = set()
    for status, response in list(responses.items()):
        if "application/problem+json" not in response.get("content", {}):
            continue
        description = response.get("description", "")
        for code, translation in edge.TRANSLATIONS.items():
            if code in description:
                landed.setdefault(str(translation.status), []).append(translation)
                if "Retry-After" in response.get("headers", {}):
                    retry_after.add(str(translation.status))
        own = _ERROR_DESCRIPTIONS.get(int(status)) if status.isdigit() else None
        if own is None or not description.startswith(own):
            del responses[status]  # the middleware's alone: rebuilt below where a translation lands
            continue
        response["description"] = own
        response["content"] = dict(_ENVELOPE)
        response.get("headers", {}).pop("Retry-After", None)
        response.get("headers", {}).pop("Idempotency-Problem", None)  # the edge sends Stripe's words, not the code
    for status, translations in landed.items():
        response = responses.setdefault(status, {"content": dict(_ENVELOPE)})
        said = "; ".join(f"{t.meaning} ({t.type}, code {t.code})" for t in translations)
        own = response.get("description")
        response["description"] = (
            f"{own}; or, from the idempotency layer: {said}" if own else said[:1].upper() + said[1:]
        )
        headers = response.setdefault("headers", {})
        headers["Stripe-Should-Retry"] = _SHOULD_RETRY_HEADER
        if status in retry_after:
            headers["Retry-After"] = _RETRY_AFTER_HEADER


def _document(schema: dict[str, Any]) -> dict[str, Any]:
    """Describe what the app really sends: Stripe envelopes (not problem+json, not FastAPI's 422) and the headers.

    ``edge.StripeEdge`` answers the middleware's 422 (key reused) as Stripe does, with a 400 ``idempotency_error``,
    and FastAPI's validation errors are the app's 400s, so no operation answers 422.
    """
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            _translate_problems(responses)
            responses.pop("422", None)  # FastAPI's validation error: the app answers it with a 400
            for response in responses.values():
                response.setdefault("headers", {})["Request-Id"] = _REQUEST_ID_HEADER
    for (path, method), links in _LINKS.items():
        operation = schema.get("paths", {}).get(path, {}).get(method)
        if operation is not None:
            operation["responses"]["200"]["links"] = links
    components = schema.setdefault("components", {})
    components.get("schemas", {}).pop("IdempotencyProblem", None)
    for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
    components["securitySchemes"] = {
        "secretKey": {"type": "http", "scheme": "bearer", "description": "A test-mode secret key: sk_test_..."},
        "basic": {"type": "http", "scheme": "basic", "description": "The secret key as user name, no password"},
    }
    schema["security"] = [{"secretKey": []}, {"basic": []}]
    return schema


# -- endpoints -------------------------------------------------------------------------------------------------

router = APIRouter(prefix="/v1")

_CUSTOMER_FIELDS = {"email": 512, "name": 256, "description": 1000}  # and their maximum lengths


@router.post(
    "/customers",
    summary="Create a customer",
    operation_id="CreateCustomer",
    response_model=objects.Customer,
    responses=_errors(400, 401),
    openapi_extra=_form(
        {**{f: _text(n, unsettable=_LEFT_UNSET) for f, n in _CUSTOMER_FIELDS.items()}, "metadata": _METADATA},
        kind="customer",
    ),
)
async def create_customer(account: Account, params: Params, db: IdempotencyConnection) -> Response:
    email = params.string("email", max_length=512, unsettable=True)
    name = params.string("name", max_length=256, unsettable=True)
    description = params.string("description", max_length=1000, unsettable=True)
    metadata = params.metadata()
    expand = expansion.paths(params, "customer")
    params.done()
    await ledger.ensure_account(db, account)
    row = await ledger.insert_customer(db, account, email=email, name=name, description=description, metadata=metadata)
    return await _render(db, account, "customer", objects.customer(row), expand)


@router.get(
    "/customers",
    summary="List customers, newest first",
    operation_id="ListCustomers",
    response_model=objects.CustomerList,
    responses=_errors(400, 401, 404),
    openapi_extra=_query_parameters("customer", filters={"email": _text(512)}),
)
async def list_customers(account: Account, query: Query, request: Request) -> Response:
    page = await lists.fetch_page(
        request.app.state.pool, account, query, table="customers", kind="customer", render=objects.customer
    )
    return JSONResponse(page)


@router.get(
    "/customers/{customer}",
    summary="Retrieve a customer",
    operation_id="RetrieveCustomer",
    response_model=objects.Customer,
    responses=_errors(400, 401, 404),
    openapi_extra=_query_parameters("customer"),
)
async def retrieve_customer(customer: str, account: Account, query: Query, request: Request) -> Response:
    expand = expansion.paths(query, "customer")
    query.done()
    pool = request.app.state.pool
    row = await ledger.find_customer(pool, account, customer)
    if row is None:
        raise wire.missing("customer", customer, "customer")
    return await _render(pool, account, "customer", objects.customer(row), expand)


@router.post(
    "/customers/{customer}",
    summary="Update a customer: the parameters given (an empty value unsets one)",
    operation_id="UpdateCustomer",
    response_model=objects.Customer,
    responses=_errors(400, 401, 404),
    openapi_extra=_form(
        {**{f: _text(n, unsettable=_UNSETS) for f, n in _CUSTOMER_FIELDS.items()}, "metadata": _METADATA_UPDATE},
        kind="customer",
    ),
)
async def update_customer(customer: str, account: Account, params: Params, db: IdempotencyConnection) -> Response:
    fields = {f: params.string(f, max_length=n, unsettable=True) for f, n in _CUSTOMER_FIELDS.items() if params.has(f)}
    return await _update(
        db,
        account,
        params,
        customer,
        fields,
        table="customers",
        kind="customer",
        param="customer",
        render=objects.customer,
    )


@router.post(
    "/payment_intents",
    summary="Create a payment intent; with confirm=true, capture it at once",
    operation_id="CreatePaymentIntent",
    response_model=objects.PaymentIntent,
    responses=_errors(400, 401, 402, 404),
    openapi_extra=_form(
        {
            "amount": {"type": "integer", "minimum": MIN_AMOUNT, "maximum": MAX_AMOUNT},
            "currency": {"type": "string", "enum": list(CURRENCIES)},
            "customer": _text(255, "cus_"),
            "payment_method": _PAYMENT_METHOD,
            "confirm": {"type": "boolean"},
            "description": _text(1000, unsettable=_LEFT_UNSET),
            "payment_method_types": {"type": "array", "items": {"type": "string", "enum": ["card"]}},
            "metadata": _METADATA,
        },
        required=("amount", "currency"),
        kind="payment_intent",
    ),
)
async def create_payment_intent(
    account: Account, params: Params, db: IdempotencyConnection, idempotency: Idempotency
) -> Response:
    amount = params.integer("amount", required=True)
    currency = (params.string("currency", required=True, max_length=3) or "").lower()
    customer = params.string("customer", max_length=255)
    payment_method = params.string("payment_method", max_length=255)
    confirm = params.boolean("confirm") or False
    description = params.string("description", max_length=1000, unsettable=True)
    methods = params.string_list("payment_method_types")
    metadata = params.metadata()
    expand = expansion.paths(params, "payment_intent")
    params.done()
    assert amount is not None
    _check_amount(amount, currency)
    if methods is not None and set(methods) != {"card"}:
        raise wire.invalid(
            "Only payment_method_types[]=card is supported.", code="parameter_invalid", param="payment_method_types"
        )
    if confirm and payment_method is None:
        payment_method = DEFAULT_PAYMENT_METHOD
    _check_payment_method(payment_method)

    await ledger.ensure_account(db, account)
    if customer is not None and await ledger.find_customer(db, account, customer) is None:
        raise wire.missing("customer", customer, "customer")
    intent = await ledger.insert_payment_intent(
        db,
        account,
        amount=amount,
        currency=currency,
        customer=customer,
        payment_method=payment_method,
        description=description,
        metadata=metadata,
    )
    if not confirm:
        return await _render(db, account, "payment_intent", objects.payment_intent(intent), expand)
    assert payment_method is not None
    return await _confirm(db, intent, payment_method, idempotency.key, expand)


@router.get(
    "/payment_intents",
    summary="List payment intents, newest first",
    operation_id="ListPaymentIntents",
    response_model=objects.PaymentIntentList,
    responses=_errors(400, 401, 404),
    openapi_extra=_query_parameters("payment_intent", filters={"customer": _id_filter("cus_")}),
)
async def list_payment_intents(account: Account, query: Query, request: Request) -> Response:
    page = await lists.fetch_page(
        request.app.state.pool,
        account,
        query,
        table="payment_intents",
        kind="payment_intent",
        render=objects.payment_intent,
    )
    return JSONResponse(page)


@router.post(
    "/payment_intents/{intent}/confirm",
    summary="Confirm a payment intent: capture it with its payment method",
    operation_id="ConfirmPaymentIntent",
    response_model=objects.PaymentIntent,
    responses=_errors(400, 401, 402, 404),
    openapi_extra=_form({"payment_method": _PAYMENT_METHOD}, kind="payment_intent"),
)
async def confirm_payment_intent(
    intent: str, account: Account, params: Params, db: IdempotencyConnection, idempotency: Idempotency
) -> Response:
    payment_method = params.string("payment_method", max_length=255)
    expand = expansion.paths(params, "payment_intent")
    params.done()
    _check_payment_method(payment_method)
    row = await ledger.find_payment_intent(db, account, intent, lock=True)
    if row is None:
        raise wire.missing("payment_intent", intent, "intent")
    if row["status"] == "succeeded":
        return _refused(
            "You cannot confirm this PaymentIntent because it has a status of succeeded.",
            code="payment_intent_unexpected_state",
        )
    method = payment_method or row["payment_method"] or DEFAULT_PAYMENT_METHOD
    return await _confirm(db, row, method, idempotency.key, expand)


@router.get(
    "/payment_intents/{intent}",
    summary="Retrieve a payment intent",
    operation_id="RetrievePaymentIntent",
    response_model=objects.PaymentIntent,
    responses=_errors(400, 401, 404),
    openapi_extra=_query_parameters("payment_intent"),
)
async def retrieve_payment_intent(intent: str, account: Account, query: Query, request: Request) -> Response:
    expand = expansion.paths(query, "payment_intent")
    query.done()
    pool = request.app.state.pool
    row = await ledger.find_payment_intent(pool, account, intent)
    if row is None:
        raise wire.missing("payment_intent", intent, "intent")
    return await _render(pool, account, "payment_intent", objects.payment_intent(row), expand)


@router.post(
    "/payment_intents/{intent}",
    summary="Update a payment intent's description and metadata",
    operation_id="UpdatePaymentIntent",
    response_model=objects.PaymentIntent,
    responses=_errors(400, 401, 404),
    openapi_extra=_form(
        {"description": _text(1000, unsettable=_UNSETS), "metadata": _METADATA_UPDATE}, kind="payment_intent"
    ),
)
async def update_payment_intent(intent: str, account: Account, params: Params, db: IdempotencyConnection) -> Response:
    if params.has("description"):
        fields = {"description": params.string("description", max_length=1000, unsettable=True)}
    else:
        fields = {}
    return await _update(
        db,
        account,
        params,
        intent,
        fields,
        table="payment_intents",
        kind="payment_intent",
        param="intent",
        render=objects.payment_intent,
    )


@router.post(
    "/refunds",
    summary="Refund part or (by default) the rest of a captured payment intent",
    operation_id="CreateRefund",
    response_model=objects.Refund,
    responses=_errors(400, 401, 404),
    openapi_extra=_form(
        {
            "payment_intent": _text(255, "pi_"),
            "amount": {"type": "integer", "minimum": 1, "maximum": MAX_AMOUNT},
            "reason": {"type": "string", "enum": list(REFUND_REASONS)},
            "metadata": _METADATA,
        },
        required=("payment_intent",),
        kind="refund",
    ),
)
async def create_refund(
    account: Account, params: Params, db: IdempotencyConnection, idempotency: Idempotency
) -> Response:
    intent_id = params.string("payment_intent", required=True, max_length=255)
    amount = params.integer("amount")
    reason = params.choice("reason", REFUND_REASONS)
    metadata = params.metadata()
    expand = expansion.paths(params, "refund")
    params.done()
    assert intent_id is not None
    if amount is not None and not 1 <= amount <= MAX_AMOUNT:
        raise wire.invalid("Invalid positive integer", code="parameter_invalid_integer", param="amount")

    await ledger.ensure_account(db, account)
    intent = await ledger.find_payment_intent(db, account, intent_id, lock=True)  # concurrent refunds take turns
    if intent is None:
        raise wire.missing("payment_intent", intent_id, "payment_intent")
    # From here on the answer depends on the ledger, so it is recorded: a retry hears the same decision.
    if intent["status"] != "succeeded":
        return _refused(
            f"This PaymentIntent has a status of {intent['status']}: only a succeeded one can be refunded.",
            code="payment_intent_unexpected_state",
            param="payment_intent",
        )
    refundable = intent["amount_received"] - intent["amount_refunded"]
    if refundable == 0:
        return _refused(
            f"PaymentIntent {intent_id} has already been refunded.",
            code="charge_already_refunded",
            param="payment_intent",
        )
    if amount is None:
        amount = refundable
    elif amount > refundable:
        return _refused(
            f"Refund amount ({amount}) is greater than the unrefunded amount of the payment ({refundable}).",
            code="amount_too_large",
            param="amount",
        )
    row = await ledger.insert_refund(
        db, intent, amount=amount, reason=reason, metadata=metadata, idempotency_key=idempotency.key
    )
    return await _render(db, account, "refund", objects.refund(row), expand)


@router.get(
    "/refunds",
    summary="List refunds, newest first",
    operation_id="ListRefunds",
    response_model=objects.RefundList,
    responses=_errors(400, 401, 404),
    openapi_extra=_query_parameters("refund", filters={"payment_intent": _id_filter("pi_")}),
)
async def list_refunds(account: Account, query: Query, request: Request) -> Response:
    page = await lists.fetch_page(
        request.app.state.pool, account, query, table="refunds", kind="refund", render=objects.refund
    )
    return JSONResponse(page)


@router.get(
    "/refunds/{refund}",
    summary="Retrieve a refund",
    operation_id="RetrieveRefund",
    response_model=objects.Refund,
    responses=_errors(400, 401, 404),
    openapi_extra=_query_parameters("refund"),
)
async def retrieve_refund(refund: str, account: Account, query: Query, request: Request) -> Response:
    expand = expansion.paths(query, "refund")
    query.done()
    pool = request.app.state.pool
    row = await ledger.find_refund(pool, account, refund)
    if row is None:
        raise wire.missing("refund", refund, "refund")
    return await _render(pool, account, "refund", objects.refund(row), expand)


@router.post(
    "/refunds/{refund}",
    summary="Update a refund's metadata",
    operation_id="UpdateRefund",
    response_model=objects.Refund,
    responses=_errors(400, 401, 404),
    openapi_extra=_form({"metadata": _METADATA_UPDATE}, kind="refund"),
)
async def update_refund(refund: str, account: Account, params: Params, db: IdempotencyConnection) -> Response:
    return await _update(
        db, account, params, refund, {}, table="refunds", kind="refund", param="refund", render=objects.refund
    )


@router.get(
    "/balance",
    summary="The account's balance per currency: the sum of its ledger entries",
    operation_id="RetrieveBalance",
    response_model=objects.Balance,
    responses=_errors(400, 401),
    openapi_extra=_query_parameters("balance"),
)
async def retrieve_balance(account: Account, query: Query, request: Request) -> Response:
    expansion.paths(query, "balance")  # nothing here can be expanded: any path is refused
    query.done()
    return JSONResponse(objects.balance(await ledger.balance(request.app.state.pool, account)))


def _payouts_router() -> APIRouter:
    """``POST /v1/payouts``, for an app that has a payout provider (``create_app(provider_url=...)``): a handler in
    steps, with a call to the provider between two local steps (``examples/payments/payouts.py``)."""
    from examples.payments import payouts  # httpx: only an app with a provider needs it

    payouts_router = APIRouter(prefix="/v1")

    @payouts_router.post(
        "/payouts",
        summary="Pay out to the account's bank, through the payout provider (a handler in steps)",
        operation_id="CreatePayout",
        response_model=payouts.Payout,
        responses=_errors(400, 401),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/x-www-form-urlencoded": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "amount": {"type": "integer", "minimum": MIN_AMOUNT, "maximum": MAX_AMOUNT},
                                "currency": {"type": "string", "enum": list(CURRENCIES)},
                                "metadata": _METADATA,
                            },
                            "required": ["amount", "currency"],
                            "additionalProperties": False,
                        },
                        "encoding": {"metadata": {"style": "deepObject", "explode": True}},
                    }
                },
            }
        },
    )
    async def create_payout(account: Account, params: Params, idempotency: Idempotency, request: Request) -> Response:
        amount = params.integer("amount", required=True)
        currency = params.choice("currency", CURRENCIES, required=True)
        metadata = params.metadata()
        params.done()
        assert amount is not None
        assert currency is not None
        _check_amount(amount, currency)
        provider = request.app.state.provider
        pause = request.app.state.pause_between_steps
        payout = await payouts.pay_out(
            idempotency, provider, account=account, amount=amount, currency=currency, metadata=metadata, pause=pause
        )
        return JSONResponse(payout)

    return payouts_router


# -- helpers ---------------------------------------------------------------------------------------------------


async def _render(
    db: ledger.Connection, account: str, kind: str, rendered: dict[str, Any], expand: list[expansion.Path]
) -> Response:
    await expansion.expand(db, account, kind, rendered, expand)
    return JSONResponse(rendered)


async def _update(
    db: ledger.Connection,
    account: str,
    params: wire.Params,
    object_id: str,
    fields: dict[str, str | None],
    *,
    table: str,
    kind: str,
    param: str,
    render: Callable[[asyncpg.Record], dict[str, Any]],
) -> Response:
    """Apply an update's ``fields`` and metadata to the object ``object_id`` (the path parameter ``param``), and
    answer with the object as it now is."""
    metadata = params.metadata_update()
    expand = expansion.paths(params, kind)
    params.done()
    row = await ledger.update(db, table, account, object_id, fields, metadata)
    if row is None:
        raise wire.missing(kind, object_id, param)
    rendered = render(row)
    if len(rendered["metadata"]) > wire.METADATA_MAX_KEYS:  # raised, so the update rolls back and the key is free
        raise wire.invalid(
            f"Invalid metadata: at most {wire.METADATA_MAX_KEYS} keys.", code="parameter_invalid", param="metadata"
        )
    return await _render(db, account, kind, rendered, expand)


def _check_amount(amount: int, currency: str) -> None:
    if currency not in CURRENCIES:
        raise wire.invalid(
            f"Invalid currency: {currency}. This demo supports {', '.join(CURRENCIES)}.",
            code="parameter_invalid",
            param="currency",
        )
    if amount < MIN_AMOUNT:
        raise wire.invalid(
            f"Amount must be at least {MIN_AMOUNT} {currency} (in the smallest unit).",
            code="amount_too_small",
            param="amount",
        )
    if amount > MAX_AMOUNT:
        raise wire.invalid(f"Amount must be no more than {MAX_AMOUNT}.", code="amount_too_large", param="amount")


def _check_payment_method(payment_method: str | None) -> None:
    if payment_method is not None and payment_method not in TEST_PAYMENT_METHODS:
        raise wire.missing("PaymentMethod", payment_method, "payment_method")


def _refused(message: str, *, code: str, param: str | None = None) -> Response:
    """A 400 that was decided by the ledger's state: it is recorded and replayed like any other answer."""
    return StripeError(400, "invalid_request_error", message, code=code, param=param, executed=True).response()


async def _confirm(
    db: ledger.Connection, intent: Any, payment_method: str, key: str | None, expand: list[expansion.Path]
) -> Response:
    decline = TEST_PAYMENT_METHODS[payment_method]
    if decline is None:
        captured = await ledger.capture(db, intent, payment_method, key)
        return await _render(db, intent["account"], "payment_intent", objects.payment_intent(captured), expand)
    code, decline_code, message = decline
    error = {"type": "card_error", "code": code, "decline_code": decline_code, "message": message}
    declined = await ledger.decline(db, intent, error)
    # The decline is an outcome, not a refusal: it is committed and recorded, and a retry replays this 402.
    return StripeError(
        402,
        "card_error",
        message,
        code=code,
        executed=True,
        decline_code=decline_code,
        payment_intent=objects.payment_intent(declined),
    ).response()


# -- error handlers --------------------------------------------------------------------------------------------


async def _stripe_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StripeError)
    if not error.executed:
        mark_not_executed(request)  # nothing ran: the key is released, and a corrected retry may reuse it
    headers = {"WWW-Authenticate": wire.WWW_AUTHENTICATE} if error.status == 401 else None
    return error.response(headers)


async def _validation_error(request: Request, error: Exception) -> Response:
    mark_not_executed(request)
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0] if error.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return wire.invalid(str(first.get("msg", "Invalid request")), code="parameter_invalid", param=param).response()


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    headers = dict(error.headers or {})
    if error.status_code == 404:
        message = f"Unrecognized request URL ({request.method}: {request.url.path})."
    elif error.status_code == 405:
        allowed = allowed_methods(request.app.routes, request.scope)
        message = f"Unsupported method for {request.url.path}: use {', '.join(allowed)}."
        headers["Allow"] = ", ".join(allowed)
    else:
        message = str(error.detail)
    body = StripeError(error.status_code, "invalid_request_error", message).body()
    return JSONResponse(body, status_code=error.status_code, headers=headers)


def allowed_methods(routes: Iterable[BaseRoute], scope: Scope) -> list[str]:
    """Every method of every route whose path template matches the request's path, for a 405's ``Allow``.

    RFC 9110 §15.5.6: ``Allow`` lists the methods the resource supports. Starlette's router answers a 405 from the
    first route whose path matched, so with GET and POST on one path as two routes (FastAPI's ``@get`` and
    ``@post``), a PUT would be told ``Allow: POST`` or ``Allow: GET`` alone. Nothing here is specific to this app.
    """
    path = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    methods: set[str] = set()
    for template, allowed in _route_methods(routes):
        if compile_path(template)[0].fullmatch(path):
            methods |= allowed
    return sorted(methods)


def _route_methods(routes: Any, prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """(path template, methods) of every route below ``routes``, through Mounts and included routers (FastAPI 0.160
    and later keep those as branches, which ``iter_route_contexts`` walks with their full paths)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # an older FastAPI: included routes are copied in flat
        found: Any = ((route, getattr(route, "path_format", None)) for route in routes)
    else:
        found = ((context.original_route, context.path_format) for context in iter_route_contexts(list(routes)))
    for route, path in found:
        if isinstance(route, Mount):
            yield from _route_methods(route.routes, prefix + route.path)
        elif path is not None and getattr(route, "methods", None):
            yield prefix + path, set(route.methods)


async def _server_error(request: Request, error: Exception) -> Response:
    # Reached only after the middleware rolled the transaction back and released the key, or, for a handler in steps
    # (a payout), left the request at its last recovery point: retrying with the same key is safe either way. This
    # answer is sent from outside every middleware (Starlette's ServerErrorMiddleware), so it stamps itself.
    message = "An unexpected error occurred; nothing was saved, or the request stopped after a step. Retry it."
    body = StripeError(500, "api_error", message).body()
    headers = {name.decode(): value.decode("latin-1") for name, value in edge.stamped([], request.scope)}
    return JSONResponse(body, status_code=500, headers={**headers, "Stripe-Should-Retry": "true"})


# -- the app ---------------------------------------------------------------------------------------------------


async def _health(request: Request) -> Response:
    """For a container's health check: the app serves, and its database answers within ``HEALTH_TIMEOUT``."""
    pool: asyncpg.Pool = request.app.state.pool
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT), pool.acquire() as connection:
            await connection.fetchval("SELECT 1")
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
        return JSONResponse({"status": "unavailable", "detail": f"the database: {error or type(error).__name__}"}, 503)
    return JSONResponse({"status": "ok"})


def create_app(
    dsn: str,
    *,
    pool_size: int = 20,
    migrate: bool = True,
    prepared_statements: bool = True,
    on_conflict: str = "reject",
    provider_url: str | None = None,
    pause_between_steps: float = 0.0,
) -> FastAPI:
    """The payments API on the PostgreSQL at ``dsn``.

    With ``provider_url`` (a payout provider, ``examples/payments/provider.py``), it also serves ``POST /v1/payouts``,
    a handler in steps that calls the provider between two local steps; ``pause_between_steps`` (seconds) makes it
    wait after each step, so that the fault harness can crash the app between them (``faults/steps.py``).

    With ``migrate`` (the default) the lifespan startup applies the idempotency migrations and the payments schema
    (``examples.payments.migrate``), which needs a role that may create them. With ``migrate=False`` the app runs
    no DDL at all: the tables must exist (``python -m examples.payments.migrate``), and the app's role needs only to
    read and write rows, as in docker-compose.yml.

    Writes run on the connection the store lends them: a transactional request holds one from its claim's commit
    to its own commit, so ``pool_size`` (the store's ``max_size``) bounds how many writes run at once; the others
    wait for a connection (up to the store's timeout, then a 503 the client retries). Reads (the GET endpoints)
    use a small asyncpg pool of the app's own (``READ_POOL_SIZE``). One process holds at most
    ``pool_size + READ_POOL_SIZE`` connections.

    ``prepared_statements=False`` is for a transaction-pooling PgBouncer at ``dsn``: neither the store nor the read
    pool then keeps named prepared statements (docs/operations.md, "Connection poolers").
    """
    dsn = postgres_url(dsn)  # the read pool is asyncpg's, which takes no postgresql+asyncpg://
    store = PostgresStore(dsn, min_size=2, max_size=pool_size, prepared_statements=prepared_statements)
    statement_cache_size = 100 if prepared_statements else 0  # 100: asyncpg's default

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with asyncpg.create_pool(
                dsn,
                min_size=1,
                max_size=READ_POOL_SIZE,
                timeout=store.timeout,
                statement_cache_size=statement_cache_size,
            ) as pool:
                if migrate:
                    await apply_migrations(store, pool)
                app.state.pool = pool
                if provider_url is None:
                    yield
                else:
                    import httpx  # only an app with a provider needs it

                    async with httpx.AsyncClient(base_url=provider_url, timeout=5.0) as provider:
                        app.state.provider = provider
                        yield
        finally:
            await store.close()  # the store built from a DSN owns its connections: close them at shutdown

    app = FastAPI(
        title="idempotency_mw payments example",
        version=__version__,
        description="A Stripe-style API (customers, payment intents, refunds, balance) whose writes commit their "
        "Idempotency-Key record in the same transaction as their ledger entries.",
        lifespan=lifespan,
    )
    app.include_router(router)
    if provider_url is not None:
        app.include_router(_payouts_router())
        app.state.pause_between_steps = pause_between_steps
    app.add_api_route("/healthz", _health, methods=["GET"], include_in_schema=False)
    # The last added is the outermost: StampHeaders inside the middleware (what it adds is recorded and replayed),
    # StripeEdge outside (it sees, and speaks Stripe for, the middleware's own answers).
    app.add_middleware(edge.StampHeaders)
    app.add_middleware(
        IdempotencyMiddleware, store=store, transactional=True, tenant=wire.tenant, on_conflict=on_conflict
    )
    app.add_middleware(edge.StripeEdge)
    setup(app)
    app.add_exception_handler(StripeError, _stripe_error)
    app.add_exception_handler(RequestValidationError, _validation_error)  # replaces setup()'s, and releases too
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)

    documented = app.openapi
    done = False

    def openapi() -> dict[str, Any]:
        nonlocal done
        schema = documented()
        if not done:
            _document(schema)
            done = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


_default_app: FastAPI | None = None


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true or false), got {os.environ[name]!r}")


def _positive(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip() or str(default)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return int(text)


def __getattr__(name: str) -> FastAPI:
    """``app``: the API on ``$DATABASE_URL``, built on first use (``uvicorn examples.payments.app:app --lifespan on``).

    ``PAYMENTS_POOL_SIZE`` (20) is the store's ``max_size``; ``PAYMENTS_MIGRATE=0`` keeps DDL out of the startup;
    ``PAYMENTS_PREPARED_STATEMENTS=0`` is for a transaction-pooling PgBouncer at ``$DATABASE_URL``;
    ``PAYMENTS_ON_CONFLICT=wait`` makes a duplicate wait for its original instead of answering 409;
    ``PAYMENTS_PROVIDER_URL`` (a payout provider, ``examples/payments/provider.py``) adds ``POST /v1/payouts``, and
    ``PAYMENTS_PAUSE_BETWEEN_STEPS`` (seconds, for the fault harness) makes it wait after each of its steps.
    """
    global _default_app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _default_app is None:
        dsn = os.environ.get("DATABASE_URL")
        if not dsn:
            raise RuntimeError("set DATABASE_URL to the PostgreSQL the payments example should use")
        _default_app = create_app(
            dsn,
            pool_size=_positive("PAYMENTS_POOL_SIZE", 20),
            migrate=_flag("PAYMENTS_MIGRATE", True),
            prepared_statements=_flag("PAYMENTS_PREPARED_STATEMENTS", True),
            on_conflict=os.environ.get("PAYMENTS_ON_CONFLICT", "").strip() or "reject",
            provider_url=os.environ.get("PAYMENTS_PROVIDER_URL", "").strip() or None,
            pause_between_steps=float(os.environ.get("PAYMENTS_PAUSE_BETWEEN_STEPS", "").strip() or "0"),
        )
    return _default_app
