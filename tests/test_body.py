"""body.py: a covered request's body, read once under a cap to be fingerprinted, then handed to the handler as it
came, once, before the real channel."""

from __future__ import annotations

import pytest
from starlette.types import Message, Receive

from idempotency_mw.body import BufferedBody, Read
from idempotency_mw.keys import InvalidKey


def channel(*messages: Message) -> tuple[Receive, list[Message]]:
    """A client's ``receive`` that sends ``messages`` in order, then the disconnect; and what is left to send."""
    left = list(messages)

    async def receive() -> Message:
        return left.pop(0) if left else {"type": "http.disconnect"}

    return receive, left


def chunk(body: bytes, more: bool = False) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_the_whole_body_is_read_from_its_chunks_and_handed_over_once() -> None:
    receive, _ = channel(chunk(b'{"amount":', more=True), chunk(b"", more=True), chunk(b" 10}"))
    body = BufferedBody(receive, limit=100)
    assert await body.read_all(b"") is Read.WHOLE
    assert (body.body, body.read) == (b'{"amount": 10}', True)
    assert await body.receive() == chunk(b'{"amount": 10}')  # the handler's first receive: all of it, at once
    assert body.delivered
    assert await body.receive() == {"type": "http.disconnect"}  # then the real channel, which tells of a hang-up


async def test_a_body_over_the_cap_is_refused_by_its_declared_length_before_anything_is_read() -> None:
    receive, left = channel(chunk(b"x" * 10))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"10") is Read.TOO_LARGE
    assert len(left) == 1  # nothing read
    assert not body.read


async def test_a_body_that_grows_past_the_cap_as_it_is_sent_is_refused() -> None:
    receive, _ = channel(chunk(b"x" * 5, more=True), chunk(b"x" * 5, more=True), chunk(b"x"))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"") is Read.TOO_LARGE  # no Content-Length (chunked), or one that lied
    assert not body.read


async def test_at_the_cap_exactly_the_body_is_read() -> None:
    receive, _ = channel(chunk(b"x" * 9))
    body = BufferedBody(receive, limit=9)
    assert await body.read_all(b"9") is Read.WHOLE
    assert body.body == b"x" * 9


async def test_a_client_that_hangs_up_mid_body_is_gone() -> None:
    receive, _ = channel(chunk(b"part", more=True), {"type": "http.disconnect"})
    body = BufferedBody(receive, limit=100)
    assert await body.read_all(b"100") is Read.GONE
    assert (body.body, body.read) == (b"part", False)  # kept for a handler that runs all the same (switched off)


@pytest.mark.parametrize(
    ("raw", "content_type", "payload"),
    [
        (b'{"id": "evt_1"}', b"application/json", {"id": "evt_1"}),
        (b'{"id": "evt_1"}', b"text/plain", {"id": "evt_1"}),  # JSON whatever its content type, as request.json()
        (b"id=evt_1&empty=", b"application/x-www-form-urlencoded; charset=utf-8", {"id": "evt_1", "empty": ""}),
    ],
)
async def test_the_payload_is_the_body_as_the_app_reads_it(raw: bytes, content_type: bytes, payload: object) -> None:
    receive, _ = channel(chunk(raw))
    body = BufferedBody(receive, limit=100)
    await body.read_all(b"")
    assert body.payload(content_type) == payload


async def test_a_payload_that_is_neither_json_nor_a_form_is_an_invalid_key() -> None:
    receive, _ = channel(chunk(b"id=evt_1"))
    body = BufferedBody(receive, limit=100)
    await body.read_all(b"")
    with pytest.raises(InvalidKey, match="JSON or a form"):
        body.payload(b"text/plain")
