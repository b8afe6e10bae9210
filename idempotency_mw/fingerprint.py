"""The request fingerprint: what makes two requests "the same request" for one idempotency key.

SHA-256 over the lengths of five parts (method, path, query, body kind, canonical body), then the parts, so no two
different requests can produce the same byte stream. Bodies are canonicalised where their format allows: JSON is
parsed and re-serialised with sorted keys (key order and whitespace do not matter; numbers compare by value, except
in a body holding a number that a double might not hold exactly, where every number compares as written, so two
amounts never merge), form bodies and query strings become their decoded pairs sorted by name (decoded as
Starlette decodes them; the order of repeated names is kept, it can matter), except a form-typed body that looks
like JSON, which an app may well read as JSON; anything else is hashed as sent.

The work is bounded. A body whose canonical form would cost much more per byte than ordinary JSON (a form with more
fields than Starlette itself reads, a flood of ``%XX`` escapes, thousands of values around a long number) is
hashed as sent instead: a retry sends the same bytes, so it still matches, and no two different bodies can merge.
Only the digest is stored, never the body.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import NoReturn
from urllib.parse import parse_qsl

import orjson
from starlette.types import Scope

from idempotency_mw.wire import header


def fingerprint(
    method: str, path: str, query_string: bytes, content_type: bytes, body: bytes, exclude: frozenset[str] = frozenset()
) -> bytes:
    """Return the 32-byte SHA-256 digest that identifies this request's payload; ``exclude`` names fields of a JSON or
    form body to leave out (``"meta.attempt_id"`` reaches into objects)."""
    kind, canonical = canonical_body(content_type, body, exclude)
    method_bytes, path_bytes, query = method.encode(), path.encode(), canonical_query(query_string)
    # All lengths first, then the parts: one way to read it back.
    lengths = _LENGTHS.pack(len(method_bytes), len(path_bytes), len(query), len(kind), len(canonical))
    return hashlib.sha256(b"".join((lengths, method_bytes, path_bytes, query, kind, canonical))).digest()


_LENGTHS = struct.Struct(">5Q")


def request_fingerprint(scope: Scope, body: bytes, exclude: frozenset[str] = frozenset()) -> bytes:
    """The :func:`fingerprint` of an ASGI request whose whole ``body`` was read."""
    query = scope.get("query_string", b"")
    return fingerprint(scope["method"], scope["path"], query, header(scope, b"content-type"), body, exclude)


def canonical_query(query_string: bytes) -> bytes:
    if not query_string:
        return b""
    pairs = _canonical_pairs(query_string)
    # Canonical pairs always start with "[", so a query hashed as sent can never meet another's canonical pairs.
    return pairs if pairs is not None else b"as sent:" + query_string


def canonical_body(content_type: bytes, body: bytes, exclude: frozenset[str] = frozenset()) -> tuple[bytes, bytes]:
    """Return ``(kind, canonical bytes)``; the kind keeps a JSON body and a raw body with equal bytes apart."""
    media_type = content_type.split(b";", 1)[0].strip().lower()
    if media_type == b"application/json" or media_type.endswith(b"+json"):
        try:
            canonical = _canonical_json(body, exclude)
        except (ValueError, RecursionError, orjson.JSONEncodeError):  # not JSON, or nested too deep to re-serialise
            canonical = None
        if canonical is not None:
            return b"json", canonical
    elif media_type == b"application/x-www-form-urlencoded":
        fields = _canonical_form(body, exclude)
        if fields is not None:
            return b"form", fields
    # Bytes the app reads by their content type's parameters (a multipart boundary, a charset) are another
    # request under other parameters: the kind carries the whole content type.
    return b"raw;" + b" ".join(content_type.lower().split()), body


# -- JSON --------------------------------------------------------------------------------------------------------
#
# orjson reads every number as a 64-bit integer or a double: integers outside [-2**63, 2**64) become doubles, and a
# float with more significant digits than a double holds (or too large or too small for one) is rounded. Either
# would make two different amounts one request. A number with at most 15 significant digits and an exponent of at
# most two digits always survives (a double holds any 15 significant digits, and such a number is within 10**±115,
# far from the double's limits), so only a body with a longer run of digits or a 3-digit exponent needs the exact
# reader. That test is a byte translation and three substring searches, so the common body pays almost nothing.

# Digits become "0", decimal points vanish and an exponent's "+" reads as "-", so a number's significant digits form
# one run of "0"s and its exponent one of three spellings.
_AS_ZEROS = bytes.maketrans(b"123456789E+", b"000000000e-")
_LONG_MANTISSA = b"0" * 16


# The exact reader costs about fifteen ordinary JSON bytes per value; past this many values (counted as commas and
# colons) the body is hashed as sent, so that path too stays within a few times the cost of ordinary JSON per byte.
_EXACT_VALUES_FREE = 1024
_EXACT_BYTES_PER_VALUE = 8


def _canonical_json(body: bytes, exclude: frozenset[str] = frozenset()) -> bytes | None:
    zeros = body.translate(_AS_ZEROS, b".")
    if zeros.find(_LONG_MANTISSA) < 0 and zeros.find(b"0e000") < 0 and zeros.find(b"0e-000") < 0:
        return orjson.dumps(_without(orjson.loads(body), exclude), option=orjson.OPT_SORT_KEYS)
    if body.count(b",") + body.count(b":") > _EXACT_VALUES_FREE + len(body) // _EXACT_BYTES_PER_VALUE:
        return None
    # Python's json reads the structure and hands every number over as written; orjson writes the result with
    # sorted keys and each number exactly as it came. Both steps stay in C.
    value = json.loads(
        body.decode(), parse_int=orjson.Fragment, parse_float=orjson.Fragment, parse_constant=_no_constant
    )
    return orjson.dumps(_without(value, exclude), option=orjson.OPT_SORT_KEYS)


def _without(value: object, exclude: frozenset[str]) -> object:
    """``value`` without the fields ``exclude`` names (dotted names reach into objects, never into arrays)."""
    for name in exclude:
        *parents, last = name.split(".")
        target = value
        for parent in parents:
            target = target.get(parent) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target.pop(last, None)
    return value


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; orjson and the RFC do not


# -- forms and query strings -------------------------------------------------------------------------------------

# Starlette refuses urlencoded forms with more fields than this (Request.form(max_fields=1000)), so an app cannot
# read such a body as a form anyway; 1000 "&" make 1001 fields. Decoding a %XX escape costs about forty ordinary
# JSON bytes: past the free allowance, one escape per this many bytes keeps a form within a few times the cost of
# JSON per byte.
_MAX_FIELDS = 1000
_ESCAPES_FREE = 1024
_BYTES_PER_ESCAPE = 16


def _canonical_form(body: bytes, exclude: frozenset[str] = frozenset()) -> bytes | None:
    """A form body's decoded pairs, sorted by name, as ``request.form()`` reads them; None for a body that looks like
    JSON, which is hashed as sent: Starlette's ``request.json()`` reads any body, ``curl -d '{...}'`` sends JSON typed
    as a form, and decoding it (``+`` to a space, ``%25`` to ``%``) would merge JSON bodies the app reads apart."""
    if body.lstrip()[:1] in (b"{", b"[", b'"'):
        return None
    return _canonical_pairs(body, exclude)


def _canonical_pairs(encoded: bytes, exclude: frozenset[str] = frozenset()) -> bytes | None:
    """The decoded pairs sorted by name, or None when decoding them would cost too much."""
    if encoded.count(b"&") >= _MAX_FIELDS:
        return None
    if encoded.count(b"%") > _ESCAPES_FREE + len(encoded) // _BYTES_PER_ESCAPE:
        return None
    # Read as Starlette reads them, or two requests the app reads apart could share a fingerprint: raw bytes as
    # latin-1, %XX escapes as UTF-8. Where an escape is not UTF-8, Starlette reads U+FFFD, which would merge
    # different bytes; surrogateescape keeps each such byte as its own lone surrogate instead.
    pairs = parse_qsl(encoded.decode("latin-1"), keep_blank_values=True, errors="surrogateescape")
    if exclude:
        pairs = [pair for pair in pairs if pair[0] not in exclude]
    pairs.sort(key=lambda pair: pair[0])  # stable: repeated names keep their relative order
    try:
        return orjson.dumps(pairs)
    except orjson.JSONEncodeError:
        # orjson refuses lone surrogates; Python's json writes them as \udcXX escapes. Each writes JSON that reads
        # back to its pairs, and only these pairs hold a surrogate, so the two can never write the same bytes.
        return json.dumps(pairs).encode()
