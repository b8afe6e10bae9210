"""problems.py: the middleware's own error responses, RFC 9457 ``application/problem+json`` with a stable ``code``:
the shape every one of them has, and the status, code (in the body and the ``Idempotency-Problem`` header) and
Retry-After of each. In the app's own envelope: tests/test_problem_renderer.py."""

from __future__ import annotations

import orjson
import pytest
from starlette.types import Message

from idempotency_mw import _problems as problems
from idempotency_mw._problems import TYPE_BASE, Problem
from idempotency_mw._wire import ProblemCode
from tests.calls import recorder

EVERY_PROBLEM = {
    "key_missing": (problems.key_missing(), 400, None),
    "tenant_unknown": (problems.tenant_unknown("exactly one X-API-Key header"), 400, None),
    "key_invalid": (problems.key_invalid("the key is empty"), 400, None),
    "key_reused": (problems.key_reused(), 422, None),
    "key_reused, 409": (problems.key_reused(409), 409, None),
    "key_reused, 400": (problems.key_reused(400), 400, None),
    "in_progress": (problems.in_progress(3), 409, 3),
    "request_too_large": (problems.request_too_large(1024), 413, None),
    "store_unavailable": (problems.store_unavailable(2), 503, 2),
    "not_replayable": (problems.response_not_replayable(201, 5000, 1000), 409, None),
    "key_expired": (problems.key_expired(86400), 422, None),
}


@pytest.mark.parametrize(("problem", "status", "retry_after"), EVERY_PROBLEM.values(), ids=list(EVERY_PROBLEM))
async def test_every_problem_is_problem_json_with_a_stable_code(
    problem: Problem, status: int, retry_after: int | None
) -> None:
    sent: list[Message] = []
    await problem.send(recorder(sent))
    start, body_message = sent
    assert (start["type"], start["status"], body_message["type"]) == (
        "http.response.start",
        status,
        "http.response.body",
    )
    body = orjson.loads(body_message["body"])
    assert list(body) == ["type", "title", "status", "detail", "code"]
    assert body["status"] == status
    assert body["code"] in {code.value for code in ProblemCode}
    assert body["type"] == TYPE_BASE + body["code"]
    assert body["title"]
    assert body["detail"]
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/problem+json"
    assert headers[b"content-length"] == str(len(body_message["body"])).encode()
    assert headers[b"idempotency-problem"] == body["code"].encode()
    assert headers.get(b"retry-after") == (str(retry_after).encode() if retry_after is not None else None)


def test_the_details_say_what_the_client_can_do() -> None:
    assert "exactly one X-API-Key header" in problems.tenant_unknown("exactly one X-API-Key header").detail
    assert "the credentials this API expects" in problems.tenant_unknown().detail
    assert problems.key_invalid("the key is empty").detail == "the key is empty."
    assert "at most 1024 bytes" in problems.request_too_large(1024).detail
    assert "86400-second" in problems.key_expired(86400).detail
    over = problems.response_not_replayable(201, 5000, 1000).detail
    assert "larger than the 1000-byte storage limit" in over
    assert "status 201" in over
    cut = problems.response_not_replayable(201, 10, 1000).detail
    assert "cut short" in cut
