"""The request fingerprint: what makes two requests "the same request" for one idempotency key.

SHA-256 over the lengths of five parts (method, path, query, body kind, canonical body), then the parts, so no two
different requests can produce the same byte stream. Bodies are canonicalised where their format allows: JSON is
parsed and re-serialised with sorted keys (key order and whitespace do not matter; numbers keep the precision
Python's own ``json`` gives them, so two amounts past 64 bits stay apart), form bodies become their decoded pairs
sorted by name (the order of repeated names is kept, it can matter); anything else is hashed as sent.
Only the digest is stored, never the body.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from urllib.parse import parse_qsl

import orjson


def fingerprint(method: str, path: str, query_string: bytes, content_type: bytes, body: bytes) -> bytes:
    """Return the 32-byte SHA-256 digest that identifies this request's payload."""
    kind, canonical = canonical_body(content_type, body)
    parts = (method.encode(), path.encode(), canonical_query(query_string), kind, canonical)
    lengths = _LENGTHS.pack(*map(len, parts))  # all lengths first, then the parts: one way to read it back
    return hashlib.sha256(lengths + b"".join(parts)).digest()


_LENGTHS = struct.Struct(">5Q")


def canonical_query(query_string: bytes) -> bytes:
    if not query_string:
        return b""
    return _canonical_pairs(query_string)


def canonical_body(content_type: bytes, body: bytes) -> tuple[bytes, bytes]:
    """Return ``(kind, canonical bytes)``; the kind keeps a JSON body and a raw body with equal bytes apart."""
    media_type = content_type.split(b";", 1)[0].strip().lower()
    if media_type == b"application/json" or media_type.endswith(b"+json"):
        try:
            return b"json", _canonical_json(body)
        except (ValueError, RecursionError):  # not valid JSON, or nested too deep to parse
            pass  # the raw bytes are the payload
    elif media_type == b"application/x-www-form-urlencoded":
        return b"form", _canonical_pairs(body)
    return b"raw", body


# orjson reads integers past 64 bits as floats, which would make 2**70 and 2**70 + 1 the same amount. Such integers
# have 20 digits or more, so a body with a 20-digit run takes the exact (slower) path of Python's json module.
_LONG_DIGIT_RUN = re.compile(rb"[0-9]{20}")


def _canonical_json(body: bytes) -> bytes:
    if _LONG_DIGIT_RUN.search(body) is None:
        return orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
    value = json.loads(body)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _canonical_pairs(encoded: bytes) -> bytes:
    # latin-1 maps every byte to one code point, so decoding can neither fail nor merge two different inputs.
    pairs = parse_qsl(encoded.decode("latin-1"), keep_blank_values=True, encoding="latin-1")
    pairs.sort(key=lambda pair: pair[0])  # stable: repeated names keep their relative order
    return orjson.dumps(pairs)
