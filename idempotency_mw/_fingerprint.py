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
What is stored is never that digest itself but an HMAC of it under a server secret (:class:`FingerprintKeys`): a
plain SHA-256 of a request whose only unknown is a low-entropy field (an amount, a card's CVC) is inverted by a
dictionary in a second, by anyone who can read the table. Only the keyed digest is stored, never the body.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import parse_qsl

import orjson

from idempotency_mw._keyring import check_key_id, named, parse_keys
from idempotency_mw._keys import SECRET_VARIABLE, AuthorizationTenant

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher

KEYS_VARIABLE = "IDEMPOTENCY_FINGERPRINT_KEYS"
MIN_KEY_BYTES = 32
DIGEST_BYTES = 32  # a SHA-256 digest: what a fingerprint written before fingerprints were keyed is, bare
_DERIVED = b"idempotency_mw fingerprint key v1"  # what a key derived from another secret is an HMAC of
_DERIVED_ID = b"idempotency_mw fingerprint key id v1"
GENERATE_KEY = 'python -c "import secrets; print(secrets.token_hex(32))"'


class FingerprintKeys:
    """The server's keys for request fingerprints, the current one first: a stored fingerprint is
    ``<key id>:`` and the HMAC-SHA256 of the request's digest under that key.

    The current key writes; every key listed still matches, so that after a rotation a retry of a request
    fingerprinted under the previous key is still the same request. Keep a previous key for one ``ttl`` after it
    stopped being current, then drop it. A key is at least 32 bytes (or characters of text); a key id is 1 to 64
    characters of ``A-Z a-z 0-9 . _ -``, stored in each fingerprint, so it must never name another key later.

    Where the operator gives none (``IDEMPOTENCY_FINGERPRINT_KEYS``), the middleware derives them from a secret it
    already has (:meth:`derived`): the default tenant resolver's, or the store's response keys.
    """

    def __init__(self, keys: Mapping[str, bytes | str] | Iterable[tuple[str, bytes | str]]) -> None:
        pairs = list(keys.items()) if isinstance(keys, Mapping) else list(keys)
        if not pairs:
            raise ValueError("FingerprintKeys needs at least one key: the first given is the one that writes")
        self._keys: dict[str, tuple[bytes, hmac.HMAC]] = {}
        for position, (key_id, key) in enumerate(pairs, 1):
            check_key_id("fingerprint key", key_id, position)
            name = named("fingerprint key", key_id, position)
            if key_id in self._keys:
                raise ValueError(f"{name} is given twice: each key needs an id of its own")
            material = key.encode() if isinstance(key, str) else key
            if not isinstance(material, bytes):
                raise TypeError(f"{name} must be bytes or text, not {type(key).__name__}")
            if len(material) < MIN_KEY_BYTES:
                raise ValueError(
                    f"{name} is {len(material)} bytes long; it must be at least {MIN_KEY_BYTES} "
                    f"(generate one with: {GENERATE_KEY})"
                )
            self._keys[key_id] = (key_id.encode() + b":", hmac.new(material, digestmod=hashlib.sha256))
        self.current = pairs[0][0]
        self.key_ids = tuple(self._keys)
        self._only = len(self._keys) == 1

    @classmethod
    def parse(cls, text: str) -> FingerprintKeys:
        """Keys written ``id:key,id:key``, the current one first: the form of ``IDEMPOTENCY_FINGERPRINT_KEYS``."""
        return cls(parse_keys("fingerprint key", text, "2026-11:<a random key of 32 characters or more>"))

    @classmethod
    def from_env(cls, variable: str = KEYS_VARIABLE) -> FingerprintKeys | None:
        """The keys in ``variable``, or None when it is unset or empty."""
        text = os.environ.get(variable, "")
        if not text.strip():
            return None
        try:
            return cls.parse(text)
        except ValueError as error:
            raise ValueError(f"{variable}: {error}") from None

    @classmethod
    def derived(cls, source: str, derive: Callable[[bytes], list[bytes]]) -> FingerprintKeys:
        """Keys derived from other secrets: ``derive(label)`` gives the HMAC-SHA256 of ``label`` under each secret,
        the current one first (``AuthorizationTenant.derive``, ``ResponseCipher.derive``), and ``source`` names them
        in each key id (``tenant-secret``, ``response-key``). Every instance with the same secrets derives the same
        keys and ids, and neither reveals the secret."""
        keys, tags = derive(_DERIVED), derive(_DERIVED_ID)
        return cls([(f"{source}.{tag.hex()[:12]}", key) for key, tag in zip(keys, tags, strict=True)])

    def digests(self, digest: bytes) -> tuple[bytes, ...]:
        """What a request with this :func:`fingerprint` is stored as under each key, the current one first: the first
        is written, and a record holding any of them is the same request."""
        if self._only:  # the common case: one key, one HMAC
            prefix, keyed = next(iter(self._keys.values()))
            mac = keyed.copy()
            mac.update(digest)
            return (prefix + mac.digest(),)
        found = []
        for prefix, keyed in self._keys.values():
            mac = keyed.copy()
            mac.update(digest)
            found.append(prefix + mac.digest())
        return tuple(found)

    def keyed(self, key_id: str) -> hmac.HMAC | None:
        """A fresh HMAC-SHA256 under the key ``key_id``, for a key derived from it (the request parts' of
        ``_parts.py``); None for a key not given."""
        found = self._keys.get(key_id)
        return None if found is None else found[1].copy()

    def __repr__(self) -> str:  # never the keys
        return f"FingerprintKeys(current={self.current!r}, key_ids={self.key_ids!r})"


def choose_fingerprint_keys(given: FingerprintKeys | str | None, tenant: object, store: object) -> FingerprintKeys:
    """The keys request fingerprints are stored under: ``given``; else ``IDEMPOTENCY_FINGERPRINT_KEYS``; else keys
    derived from the default tenant resolver's secret (or ``IDEMPOTENCY_TENANT_SECRET``, where the app resolves its
    tenants otherwise); else from the store's response keys. Never none: an unkeyed digest of a request is inverted
    by a dictionary in seconds by anyone who can read the table, so without any secret the middleware is not built.
    """
    if isinstance(given, str):
        return FingerprintKeys.parse(given)
    if given is not None:
        if not isinstance(given, FingerprintKeys):
            raise TypeError(f"fingerprint_keys must be FingerprintKeys or its text, not {type(given).__name__}")
        return given
    found = FingerprintKeys.from_env()
    if found is not None:
        return found
    if isinstance(tenant, AuthorizationTenant):
        return FingerprintKeys.derived("tenant-secret", tenant.derive)
    if os.environ.get(SECRET_VARIABLE):
        return FingerprintKeys.derived("tenant-secret", AuthorizationTenant().derive)
    cipher = getattr(store, "cipher", None)
    if cipher is not None:
        return derived_from_response_keys(cipher)
    raise ValueError(
        "the idempotency middleware stores each request's fingerprint keyed under a server secret, so that nobody "
        "who reads the table can tell what a request held by hashing guesses, and it has none: set "
        f"{KEYS_VARIABLE} to id:key (a random key of at least 32 characters, the same on every "
        'instance: python -c "import secrets; print(secrets.token_hex(32))"), or pass '
        f"fingerprint_keys=FingerprintKeys(...), or set {SECRET_VARIABLE}, or give the store a cipher "
        "(PostgresStore(..., cipher=ResponseCipher.from_env()))"
    )


def derived_from_response_keys(cipher: ResponseCipher) -> FingerprintKeys:
    """The fingerprint keys derived from the response keys, in their order (ids ``response-key.<tag>``). Re-sealing
    the responses never re-keys the fingerprints: a response key they are derived from stays until the records
    fingerprinted under it have expired (``idempotency-mw reencrypt`` says until when)."""
    return FingerprintKeys.derived("response-key", cipher.derive)


def fingerprint_key_id(stored: bytes) -> str | None:
    """The id of the key a stored fingerprint was written under; None for a bare SHA-256, written before fingerprints
    were keyed."""
    if len(stored) <= DIGEST_BYTES or stored[-DIGEST_BYTES - 1] != ord(":"):
        return None
    return stored[: -DIGEST_BYTES - 1].decode("ascii", "replace")


def fingerprint(
    method: str, path: str, query_string: bytes, content_type: bytes, body: bytes, exclude: frozenset[str] = frozenset()
) -> bytes:
    """Return the 32-byte SHA-256 digest that identifies this request's payload; ``exclude`` names fields of a JSON or
    form body to leave out (``"meta.attempt_id"`` reaches into objects). Never stored as it is: see
    :class:`FingerprintKeys`."""
    kind, canonical = canonical_body(content_type, body, exclude)
    method_bytes, path_bytes, query = method.encode(), path.encode(), canonical_query(query_string)
    # All lengths first, then the parts: one way to read it back.
    lengths = _LENGTHS.pack(len(method_bytes), len(path_bytes), len(query), len(kind), len(canonical))
    return hashlib.sha256(b"".join((lengths, method_bytes, path_bytes, query, kind, canonical))).digest()


_LENGTHS = struct.Struct(">5Q")


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
