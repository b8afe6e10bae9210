"""The payments example's OpenAPI schema names what clients receive. Schemathesis runs over it, every check, in
tests/test_openapi_contract.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from examples.payments.app import create_app
from examples.payments.edge import TRANSLATIONS
from idempotency_mw._wire import ProblemCode


@pytest.fixture(scope="module")
def documented() -> dict[str, Any]:
    """The example's OpenAPI schema (building it opens no connection)."""
    schema: dict[str, Any] = create_app("postgresql://unused@127.0.0.1:1/unused").openapi()
    return schema


def writes(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path, operations in schema["paths"].items():
        if "post" in operations:
            yield path, operations["post"]


# What the middleware may answer on the example's writes: no route requires a key, and check_uuid7_age is off.
MIDDLEWARE_CODES = set(ProblemCode) - {ProblemCode.KEY_MISSING, ProblemCode.KEY_EXPIRED}


def test_the_middlewares_answers_are_documented_as_clients_receive_them(documented: dict[str, Any]) -> None:
    """The edge answers the middleware's problems in Stripe's words (409 idempotency_key_in_use, 401 api_key_invalid
    for a keyed request without credentials, 400 idempotency_error for a reused key): the schema names those."""
    text = json.dumps(documented)
    for code, translation in TRANSLATIONS.items():
        if translation.code != code:  # a name clients never see
            assert code not in text, code
    for path, operation in writes(documented):
        for code in MIDDLEWARE_CODES:
            translation = TRANSLATIONS[code]
            response = operation["responses"][str(translation.status)]
            assert translation.code in response["description"], (path, code)
            assert translation.type in response["description"], (path, code)
        for status in ("409", "503"):
            assert "Retry-After" in operation["responses"][status]["headers"], path
    conflict = documented["paths"]["/v1/payment_intents"]["post"]["responses"]["409"]["description"]
    assert "idempotency_key_in_use" in conflict
    bad_request = documented["paths"]["/v1/payment_intents"]["post"]["responses"]["400"]["description"]
    assert "api_key_invalid" not in bad_request
