"""Parse the ``Idempotency-Key`` request header.

The IETF draft makes the header an RFC 8941/9651 structured-field *String* (``"8e03978e-…"``); Stripe and most
clients send a bare token (``8e03978e-…``). Both are accepted and name the same key. Anything else is refused
with a reason, never repaired: a key we rewrote silently could collide with another client's key.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from idempotency_mw.wire import KEY_HEADER, MAX_KEY_LENGTH

HEADER = KEY_HEADER.lower().encode("ascii")  # as ASGI servers pass header names


class InvalidKey(ValueError):
    """The header is present but is not a valid key; the message says why."""


class MissingKey(LookupError):
    """The request carries no ``Idempotency-Key`` header."""


class KeyFunctionFailed(InvalidKey):
    """A route's ``key_from`` function raised on this request's body (a JSON array where it expects an object): the
    request has no valid key, and its caller, who may be anyone, gets 400. The function's error is the cause."""


def key_from_headers(headers: list[tuple[bytes, bytes]], header: bytes = HEADER) -> str:
    """Return the key carried by raw ASGI ``headers`` (in ``Idempotency-Key``, or another lower-cased ``header``).

    Raises :class:`MissingKey` when there is none and :class:`InvalidKey` when the header is repeated or malformed.
    """
    found: bytes | None = None
    for name, value in headers:
        if name == header:  # ASGI servers lower-case header names
            if found is not None:
                raise InvalidKey(f"the {header.decode('latin-1')} header must appear exactly once")
            found = value
    if found is None:
        raise MissingKey()
    return parse_key(found)


def request_key(
    headers: list[tuple[bytes, bytes]], key_from: str | Callable[[Any], Any] | None, payload: Callable[[], Any]
) -> str:
    """A request's key: from the ``Idempotency-Key`` header, the header a route names instead, or what a route's
    function finds in the body's ``payload()`` (a webhook's event id; None when it has none)."""
    if key_from is None:
        return key_from_headers(headers)
    if isinstance(key_from, str):
        return key_from_headers(headers, key_from.lower().encode("latin-1"))
    body = payload()
    try:
        key = key_from(body)
    except Exception as error:
        raise KeyFunctionFailed(
            f"this route takes its idempotency key from the request body, and none could be read from this one "
            f"(a JSON {type(body).__name__})"
        ) from error
    if key is None:
        raise MissingKey()
    return key_from_payload(key)


def parse_key(raw: bytes) -> str:
    """Parse one header value: an sf-string (``"abc"``) or a bare token (``abc``)."""
    value = raw.strip(b" \t")
    if not value:
        raise InvalidKey("the Idempotency-Key header is empty")
    key = _parse_sf_string(value) if value[:1] == b'"' else _parse_token(value)
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidKey(f"an idempotency key is 1 to {MAX_KEY_LENGTH} characters long, this one has {len(key)}")
    return key


# Visible ASCII except the comma: every byte a bare key may hold (the loop below only runs to say what is wrong).
_BARE_TOKEN = re.compile(rb"[\x21-\x2b\x2d-\x7e]+")


def key_from_payload(value: object) -> str:
    """A key a route takes from the request body (a webhook's event id): a string of 1 to 255 visible ASCII
    characters, taken as it is (no quoting applies to it)."""
    if not isinstance(value, str):
        raise InvalidKey(f"the key taken from the body must be a string, not {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise InvalidKey(f"an idempotency key is 1 to {MAX_KEY_LENGTH} characters long, this one has {len(value)}")
    if not value.isascii() or not value.isprintable() or " " in value:
        raise InvalidKey("an idempotency key must be visible ASCII, without spaces or control characters")
    return value


def _parse_token(value: bytes) -> str:
    if _BARE_TOKEN.fullmatch(value):
        return value.decode("ascii")
    for byte in value:
        if byte > 0x7E:
            raise InvalidKey("an idempotency key must be ASCII")
        if byte < 0x21:
            raise InvalidKey("an idempotency key must not contain spaces or control characters")
        if byte == 0x2C:  # ","
            # A comma is how proxies join repeated fields: "a,b" may be two keys merged into one.
            raise InvalidKey("a bare idempotency key must not contain a comma (quote it as an sf-string)")
    return value.decode("ascii")


def _parse_sf_string(value: bytes) -> str:
    """RFC 9651 §4.2.5: DQUOTE *(unescaped / "\\" ( DQUOTE / "\\" )) DQUOTE, and nothing after it."""
    out = bytearray()
    index, end = 1, len(value)
    while index < end:
        byte = value[index]
        if byte == 0x5C:  # backslash
            index += 1
            if index >= end or value[index] not in (0x22, 0x5C):
                raise InvalidKey('bad escape in quoted idempotency key: only \\" and \\\\ are allowed')
            out.append(value[index])
        elif byte == 0x22:  # closing quote
            if index != end - 1:
                raise InvalidKey("unexpected characters after the quoted idempotency key")
            key = out.decode("ascii")
            if " " in key:
                raise InvalidKey("an idempotency key must not contain spaces")
            return key
        elif byte > 0x7E:
            raise InvalidKey("an idempotency key must be ASCII")
        elif byte < 0x20:
            raise InvalidKey("an idempotency key must not contain control characters")
        else:
            out.append(byte)
        index += 1
    raise InvalidKey("the quoted idempotency key has no closing quote")


def uuid7_time(key: str) -> float | None:
    """The creation time (Unix seconds) a UUIDv7 key carries in its first 48 bits, or None for other keys."""
    if len(key) != 36 or key[14] != "7":
        return None
    try:
        value = uuid.UUID(key)
    except ValueError:
        return None
    if value.version != 7 or value.variant != uuid.RFC_4122:
        return None
    return (value.int >> 80) / 1000


def outlived(key: str, ttl: float) -> bool:
    """Whether a UUIDv7 key was born more than ``ttl`` seconds ago: a record of it may have expired already."""
    born = uuid7_time(key)
    return born is not None and time.time() - born > ttl
