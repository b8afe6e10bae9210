"""What changed between two requests under one key, for a 422 that says so (``explain_mismatch``), without storing
either request.

A route that opts in writes, with its claim, the request's parts as keyed digests: one each for the method, the path,
the query and the body, and for a JSON or form body one pair per field: a digest of the field's name (a JSON Pointer,
RFC 6901, for each leaf of a JSON body; the field name of a form) and one of its value. Each is an HMAC-SHA256 under a
key derived from the fingerprint key that writes (:class:`FingerprintKeys`), truncated to 8 bytes, so that nobody who
reads the table learns a name or a value by hashing guesses, and named by that key's id. They are made from what the
fingerprint hashes (``canonical_body``, less ``fingerprint_exclude``), so two requests differ in a part exactly where
their fingerprints see them differ.

The stored parts are bounded: at most ``MAX_FIELDS`` fields. A JSON body with more leaves is compared by its
top-level members (each member's canonical JSON as one value), and one with more members than that, like any body
that is neither JSON nor a form, as a whole. At most ``MAX_FIELDS`` fields of 16 bytes each, plus 32 for the method,
path, query and body, plus a header: under 1.2 KB.

A 422 then compares the request's own parts with the record's, in process (:func:`explain`): the method, the path,
the query, the body; and the fields this request sent whose value differs, or that the first request did not send,
by name (the caller sent them); and how many fields the first request had that this one lacks (their names are not
stored, so they cannot be told). A record without parts, or with parts under a key no longer given, gets the plain
422.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import Scope

from idempotency_mw._fingerprint import FingerprintKeys, canonical_body, canonical_query

MAX_FIELDS = 64  # fields compared one by one; past this, top-level members, then the body as a whole
DIGEST_BYTES = 8  # of each keyed digest: a name, a value, a part
BINDING_BYTES = 8  # the tail of the fingerprint the parts were written with (sql/queries.sql, claim)
VERSION = 1
# The bytes the claim writes: the tail of the fingerprint written with them (a record whose fingerprint another
# writer replaced never answers with these), the format's version, the length of the key's id and the id, how the
# body is compared, how many fields; then the keyed digests of the method, path, query and body, then of each field's
# name and value, in the order of their keyed names (which says nothing of the body's order).
_LABEL = b"idempotency_mw request parts key v1"  # what the parts key is an HMAC of, under a fingerprint key
_LENGTH = struct.Struct(">Q")

# How a body is compared: leaf by leaf (JSON), field by field (a form), member by member (a JSON body with more
# leaves than MAX_FIELDS), or as one value. Bodies compared in two different ways compare as wholes.
WHOLE, LEAVES, MEMBERS, FORM = b"w", b"j", b"m", b"f"
COMPARED = {LEAVES: "fields", FORM: "fields", MEMBERS: "members", WHOLE: "whole"}

Field = tuple[str, bytes, bytes]  # (the name as the caller sent it, the SHA-256 of its name, of its value)


@dataclass(frozen=True, slots=True)
class RequestParts:
    """A request's parts as SHA-256 digests, kept in memory for the request's life and never stored as they are:
    ``stored`` is what the claim writes (keyed, under the current fingerprint key), and :func:`explain` keys them under
    whichever key a record's parts name."""

    keys: FingerprintKeys
    mode: bytes
    method: bytes
    path: bytes
    query: bytes
    body: bytes
    fields: tuple[Field, ...]
    stored: bytes


@dataclass(frozen=True, slots=True)
class StoredParts:
    """A record's parts, read back: still keyed digests, readable only with the key ``key_id`` names."""

    key_id: str
    mode: bytes
    method: bytes
    path: bytes
    query: bytes
    body: bytes
    fields: dict[bytes, bytes]  # keyed digest of a name -> keyed digest of its value


@dataclass(frozen=True, slots=True)
class Changes:
    """What differs between a request and the first request with its key: the ``changed`` member of the 422."""

    method: bool
    path: bool
    query: bool
    body: bool
    fields: tuple[str, ...]  # sent by this request, and different or absent in the first
    missing_fields: int  # of the first request, absent in this one: not named, their names are not stored
    compared: str  # how the bodies were compared: "fields", "members" or "whole"

    def member(self) -> dict[str, Any]:
        """The problem's ``changed`` member: the same seven names on every explained 422 (docs/semantics.md)."""
        return {
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "body": self.body,
            "fields": list(self.fields),
            "missing_fields": self.missing_fields,
            "compared": self.compared,
        }

    def words(self) -> str:
        """What differs, as the detail says it: 'the query and the body (changed or added: "/amount") differ'."""
        named = [f"the {part}" for part in ("method", "path", "query") if getattr(self, part)]
        if self.body:
            told = []
            if self.fields:
                names = (json.dumps(name, ensure_ascii=False) for name in self.fields)
                told.append("changed or added: " + ", ".join(names))
            if self.missing_fields:
                count = self.missing_fields
                told.append(f"{count} field{'' if count == 1 else 's'} of the first request missing")
            named.append("the body" + (f" ({'; '.join(told)})" if told else ""))
        if len(named) == 1:
            return named[0] + " differs"
        return ", ".join(named[:-1]) + " and " + named[-1] + " differ"


def request_parts(
    scope: Scope, content_type: bytes, body: bytes, exclude: frozenset[str], keys: FingerprintKeys, written: bytes
) -> RequestParts:
    """The parts of a request, as its fingerprint reads it (``exclude``: the route's ``fingerprint_exclude``), and as
    stored with the fingerprint ``written`` under the current key."""
    kind, canonical = canonical_body(content_type, body, exclude)
    mode, fields = _fields(kind, canonical)
    method = hashlib.sha256(b"method:" + scope["method"].encode()).digest()
    path = hashlib.sha256(b"path:" + scope["path"].encode()).digest()
    query = hashlib.sha256(b"query:" + canonical_query(scope.get("query_string", b""))).digest()
    body_digest = hashlib.sha256(b"body:" + _LENGTH.pack(len(kind)) + kind + canonical).digest()
    key = _parts_key(keys, keys.current)
    assert key is not None  # the current key is always given
    key_id = keys.current.encode("ascii")
    stored = b"".join(
        (
            written[-BINDING_BYTES:],
            bytes((VERSION, len(key_id))),
            key_id,
            mode,
            bytes((len(fields),)),
            *[_keyed(key, digest) for digest in (method, path, query, body_digest)],
            *sorted([_keyed(key, name) + _keyed(key, value) for _, name, value in fields]),
        )
    )
    return RequestParts(keys, mode, method, path, query, body_digest, fields, stored)


def explain(own: RequestParts | None, stored: bytes | None) -> Changes | None:
    """What differs between a request (its ``own`` parts) and the record whose parts are ``stored``; None when there is
    nothing to compare (the route does not opt in, the record has no parts, or they are under a key no longer given),
    or when no part differs (the fingerprint saw what the parts cannot: then the plain 422 says it)."""
    if own is None or stored is None:
        return None
    theirs = read_parts(stored)
    if theirs is None:
        return None
    key = _parts_key(own.keys, theirs.key_id)
    if key is None:
        return None
    method, path, query, body = (
        _keyed(key, digest) != stored_digest
        for digest, stored_digest in (
            (own.method, theirs.method),
            (own.path, theirs.path),
            (own.query, theirs.query),
            (own.body, theirs.body),
        )
    )
    if not (method or path or query or body):
        return None
    comparable = own.mode == theirs.mode and own.mode != WHOLE
    fields: list[str] = []
    missing = 0
    if body and comparable:
        left = dict(theirs.fields)
        for name, name_digest, value_digest in own.fields:
            if left.pop(_keyed(key, name_digest), None) != _keyed(key, value_digest):
                fields.append(name)
        missing = len(left)
    compared = COMPARED[own.mode] if comparable else COMPARED[WHOLE]
    return Changes(method, path, query, body, tuple(fields), missing, compared)


def read_parts(stored: bytes) -> StoredParts | None:
    """A record's parts as written by :func:`request_parts`; None for bytes in another format (a later version's)."""
    try:
        head = BINDING_BYTES
        version, length = stored[head], stored[head + 1]
        if version != VERSION:
            return None
        at = head + 2 + length
        key_id = stored[head + 2 : at].decode("ascii")
        mode, count = stored[at : at + 1], stored[at + 1]
        at += 2
        method, path, query, body = (stored[at + i * DIGEST_BYTES : at + (i + 1) * DIGEST_BYTES] for i in range(4))
        pairs = stored[at + 4 * DIGEST_BYTES :]
    except (IndexError, UnicodeDecodeError):
        return None
    if mode not in COMPARED or len(body) != DIGEST_BYTES or len(pairs) != count * 2 * DIGEST_BYTES:
        return None
    fields = {
        pairs[i : i + DIGEST_BYTES]: pairs[i + DIGEST_BYTES : i + 2 * DIGEST_BYTES]
        for i in range(0, len(pairs), 2 * DIGEST_BYTES)
    }
    return StoredParts(key_id, mode, method, path, query, body, fields)


# -- making them ---------------------------------------------------------------------------------------------------


def _fields(kind: bytes, canonical: bytes) -> tuple[bytes, tuple[Field, ...]]:
    """How a body with this canonical form is compared, and its fields."""
    if kind == b"json":
        try:
            # The canonical form, read back exactly: every number as written there (the fingerprint's reading of it).
            value = json.loads(canonical, parse_int=orjson.Fragment, parse_float=orjson.Fragment)
        except (ValueError, RecursionError):
            return WHOLE, ()
        leaves = _leaves(value)
        if leaves is not None:
            return LEAVES, tuple(_field(name, leaf) for name, leaf in leaves)
        members = _members(value)
        if members is not None:
            return MEMBERS, tuple(_field(name, member) for name, member in members)
    elif kind == b"form":
        pairs = json.loads(canonical)  # sorted by name, repeated names in the order sent (_fingerprint.py)
        fields = [(name, [value for _, value in group]) for name, group in itertools.groupby(pairs, lambda p: p[0])]
        if len(fields) <= MAX_FIELDS:
            return FORM, tuple(_form_field(name, values) for name, values in fields)
    return WHOLE, ()


# A JSON field is named by its JSON Pointer, where an array's element is marked "~2" before its index (which no
# pointer holds: "~" is written "~0"), so that it is never the object member of the same name: "/a/~20" is the first
# element of "a", "/a/0" its member "0". Shown as the pointer: without the marks.
_ELEMENT = "~2"


def _field(name: str, value: object) -> Field:
    """A leaf (or top-level member) of a JSON body: its name as above, and its value's canonical JSON."""
    name_digest = hashlib.sha256(b"name:" + name.encode()).digest()
    value_digest = hashlib.sha256(b"value:" + name_digest + orjson.dumps(value)).digest()
    return name.replace(_ELEMENT, ""), name_digest, value_digest


def _form_field(name: str, values: list[str]) -> Field:
    """A form field and its values (a repeated name is one field, its values in order). Names are read as Starlette
    reads them; a byte that is not UTF-8 is kept apart as a lone surrogate, and shown as U+FFFD."""
    name_digest = hashlib.sha256(b"name:=" + name.encode("utf-8", "surrogatepass")).digest()
    value_digest = hashlib.sha256(b"value:" + name_digest + json.dumps(values).encode()).digest()
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in name), name_digest, value_digest


def _leaves(value: object) -> list[tuple[str, object]] | None:
    """Each leaf of a JSON value (a scalar, an empty object or array) with its name, in document order; None past
    ``MAX_FIELDS`` leaves, before it looks further: each node still to visit holds a leaf at least."""
    found: list[tuple[str, object]] = []
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        name, node = stack.pop()
        if not node or not isinstance(node, dict | list):
            found.append((name, node))
        elif len(found) + len(stack) + len(node) > MAX_FIELDS:
            return None
        elif isinstance(node, dict):
            stack.extend((f"{name}/{_escaped(member)}", child) for member, child in reversed(node.items()))
        else:
            stack.extend((f"{name}/{_ELEMENT}{index}", child) for index, child in reversed(list(enumerate(node))))
    return found


def _members(value: object) -> list[tuple[str, object]] | None:
    """The top-level members (or elements) of a JSON object (or array), when there are at most ``MAX_FIELDS``."""
    if isinstance(value, dict) and len(value) <= MAX_FIELDS:
        return [(f"/{_escaped(member)}", child) for member, child in value.items()]
    if isinstance(value, list) and len(value) <= MAX_FIELDS:
        return [(f"/{_ELEMENT}{index}", child) for index, child in enumerate(value)]
    return None


def _escaped(member: str) -> str:
    """A member's name in a JSON Pointer (RFC 6901): "~" is written "~0", "/" "~1"."""
    return member.replace("~", "~0").replace("/", "~1") if "~" in member or "/" in member else member


# -- keys ----------------------------------------------------------------------------------------------------------


def _parts_key(keys: FingerprintKeys, key_id: str) -> hmac.HMAC | None:
    """An HMAC-SHA256 under the parts key derived from the fingerprint key ``key_id`` (copied for each digest: the key
    is set up once); None for a key not given."""
    fingerprint_key = keys.keyed(key_id)
    if fingerprint_key is None:
        return None
    fingerprint_key.update(_LABEL)
    return hmac.new(fingerprint_key.digest(), digestmod=hashlib.sha256)


def _keyed(key: hmac.HMAC, digest: bytes) -> bytes:
    mac = key.copy()
    mac.update(digest)
    return mac.digest()[:DIGEST_BYTES]
