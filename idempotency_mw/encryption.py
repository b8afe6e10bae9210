"""Stored responses encrypted at rest: AES-256-GCM under keys the operator provides, with rotation.

from idempotency_mw import PostgresStore
from idempotency_mw.encryption import ResponseCipher

store = PostgresStore(dsn, cipher=ResponseCipher.from_env())   # IDEMPOTENCY_RESPONSE_KEYS="2026-11:<base64>,..."

A stored response is what the API answered (names, addresses, the last digits of a card), kept for a day so that
a retry gets the same bytes. With a cipher, a store seals the status, the headers and the body together as it
completes a record, and opens them again for a replay or ``inspect``; the table holds the sealed bytes, the id of
the key they are sealed under, and the body's size.

Each sealed response has a random 96-bit nonce of its own, and its associated data binds it to its record (tenant
and key), to its body size, to the key id and to this format's version: moved to another record, or with any of
those changed, it no longer opens. Keys are named; the first is the current one, which seals; all of them open. A
response sealed under a key that is no longer given raises :class:`~idempotency_mw.store.UnknownKeyId`, naming it.
``idempotency-mw reencrypt`` re-seals what is under older keys (and, if asked, what was stored plain).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import struct
from collections.abc import Iterable, Mapping

try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
except ImportError as error:  # cryptography is an optional dependency of the package
    raise ImportError(
        "idempotency_mw.encryption needs cryptography: pip install 'idempotency-mw[encryption]'"
    ) from error

from idempotency_mw._keyring import check_key_id, named, parse_keys
from idempotency_mw.store import (
    PlainResponseRefused,
    SealedResponse,
    SealedResponseError,
    StoredResponse,
    UnknownKeyId,
    decode_headers,
    encode_headers,
)

__all__ = ["KEYS_VARIABLE", "PlainResponseRefused", "ResponseCipher", "SealedResponseError", "UnknownKeyId"]

KEYS_VARIABLE = "IDEMPOTENCY_RESPONSE_KEYS"
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's 96-bit nonce, drawn at random for every response
VERSION = 1  # the first byte of every sealed response, and part of what it is bound to
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_AAD_PREFIX = b"idempotency_mw response"
_STEP_AAD_PREFIX = b"idempotency_mw step result"
_STATUS_AND_HEADERS = struct.Struct(">HI")  # status, then the length of the headers' JSON


class ResponseCipher:
    """Seals and opens stored responses under the operator's keys: ``{key id: key}``, the current key first.

    A key is 32 bytes, given as bytes or as text: base64 (standard or URL-safe, padded or not) or 64 hex digits.
    A key id is 1 to 64 characters of ``A-Z a-z 0-9 . _ -`` (a date, say: ``2026-11``); it is stored beside each
    response, so it must never name another key later. Keys are checked here: a wrong length, a repeated id, or the
    same key under two ids is a ``ValueError`` naming the key id (never the key).

    A store with a cipher refuses to replay a response stored plain (:class:`PlainResponseRefused`): a role that can
    write the table but holds no key could otherwise replace a sealed response with a plain one of its own making
    (an injected ``Set-Cookie``, an HTML body), and it would be replayed to the tenant. ``allow_plain=True`` replays
    plain responses all the same, for the time between turning encryption on and the end of
    ``idempotency-mw reencrypt --seal-plain``: then remove it.
    """

    def __init__(
        self, keys: Mapping[str, bytes | str] | Iterable[tuple[str, bytes | str]], *, allow_plain: bool = False
    ) -> None:
        pairs = list(keys.items()) if isinstance(keys, Mapping) else list(keys)
        if not pairs:
            raise ValueError("ResponseCipher needs at least one key: the first given is the one that seals")
        self.allow_plain = allow_plain
        self._keys: dict[str, AESGCM] = {}
        self._derivers: dict[str, hmac.HMAC] = {}
        seen: dict[bytes, str] = {}
        for position, (key_id, key) in enumerate(pairs, 1):
            check_key_id("response key", key_id, position)
            name = named("response key", key_id, position)
            if key_id in self._keys:
                raise ValueError(f"{name} is given twice: each key needs an id of its own")
            material = _key_bytes(name, key)
            if material in seen:
                raise ValueError(f"{seen[material]} and {name} are the same key: a rotation needs a new one")
            seen[material] = name
            self._keys[key_id] = AESGCM(material)
            self._derivers[key_id] = hmac.new(material, digestmod=hashlib.sha256)
        self.current = pairs[0][0]  # the id of the key that seals
        self.key_ids = tuple(self._keys)

    @classmethod
    def parse(cls, text: str, *, allow_plain: bool = False) -> ResponseCipher:
        """Keys written ``id:key,id:key`` (commas or whitespace between them), the current key first: the form of
        ``IDEMPOTENCY_RESPONSE_KEYS``."""
        return cls(parse_keys("response key", text, "2026-11:<44 base64 chars>"), allow_plain=allow_plain)

    @classmethod
    def from_env(cls, variable: str = KEYS_VARIABLE, *, allow_plain: bool = False) -> ResponseCipher:
        """The keys in the environment variable ``variable`` (see :meth:`parse`); ``ValueError`` if it is unset or
        empty, since a store asked to encrypt must not quietly store plain responses."""
        text = os.environ.get(variable, "")
        if not text.strip():
            raise ValueError(
                f"{variable} is not set: give it the response keys, id:key,id:key with the current key first "
                '(a new key: python -c "from idempotency_mw.encryption import ResponseCipher; '
                'print(ResponseCipher.new_key())")'
            )
        try:
            return cls.parse(text, allow_plain=allow_plain)
        except ValueError as error:
            raise ValueError(f"{variable}: {error}") from None

    @staticmethod
    def new_key() -> str:
        """A fresh random key, as base64 text."""
        return base64.b64encode(AESGCM.generate_key(bit_length=8 * KEY_BYTES)).decode()

    def seal(self, tenant: str, key: str, response: StoredResponse) -> SealedResponse:
        """``response`` sealed under the current key, bound to the record ``(tenant, key)``."""
        headers = encode_headers(response.headers).encode()
        plain = b"".join(
            (
                _STATUS_AND_HEADERS.pack(response.status, len(headers)),
                headers,
                b"\x00" if response.body is None else b"\x01" + response.body,
            )
        )
        nonce = os.urandom(NONCE_BYTES)
        aad = _associated(self.current, tenant, key, response.body_size)
        sealed = bytes([VERSION]) + nonce + self._keys[self.current].encrypt(nonce, plain, aad)
        return SealedResponse(self.current, sealed, response.body_size)

    def open(self, tenant: str, key: str, sealed: SealedResponse) -> StoredResponse:
        """The response ``seal`` was given, byte for byte. :class:`UnknownKeyId` if its key is not among this
        cipher's; :class:`SealedResponseError` if it does not open (changed, or moved from another record)."""
        cipher = self._keys.get(sealed.key_id)
        if cipher is None:
            raise UnknownKeyId(sealed.key_id, self.key_ids)
        data = sealed.sealed
        if len(data) < 1 + NONCE_BYTES + 16 or data[0] != VERSION:
            raise SealedResponseError(
                f"the stored response is not in a sealed form this version reads (format {data[:1].hex() or 'none'})"
            )
        nonce, ciphertext = data[1 : 1 + NONCE_BYTES], memoryview(data)[1 + NONCE_BYTES :]  # no copy of the body
        try:
            plain = cipher.decrypt(nonce, ciphertext, _associated(sealed.key_id, tenant, key, sealed.body_size))
        except InvalidTag:
            raise SealedResponseError(
                f"the stored response does not open under key id {sealed.key_id!r}: it was changed, or it belongs to "
                "another record"
            ) from None
        status, length = _STATUS_AND_HEADERS.unpack_from(plain)
        start = _STATUS_AND_HEADERS.size
        headers = decode_headers(plain[start : start + length])
        rest = plain[start + length :]
        body = None if rest[:1] == b"\x00" else rest[1:]
        return StoredResponse(status, headers, body, sealed.body_size)

    def seal_step(self, tenant: str, key: str, step: str, result: bytes) -> tuple[str, bytes]:
        """A step's result (its recovery point, docs/design.md §10) sealed under the current key, bound to its record
        and step: ``(key id, sealed)``."""
        nonce = os.urandom(NONCE_BYTES)
        aad = _step_associated(self.current, tenant, key, step)
        return self.current, bytes([VERSION]) + nonce + self._keys[self.current].encrypt(nonce, result, aad)

    def open_step(self, tenant: str, key: str, step: str, key_id: str, sealed: bytes) -> bytes:
        """The result :meth:`seal_step` was given; :class:`UnknownKeyId` or :class:`SealedResponseError` as for a
        response."""
        cipher = self._keys.get(key_id)
        if cipher is None:
            raise UnknownKeyId(key_id, self.key_ids)
        if len(sealed) < 1 + NONCE_BYTES + 16 or sealed[0] != VERSION:
            raise SealedResponseError(f"the result of step {step!r} is not in a sealed form this version reads")
        try:
            return cipher.decrypt(sealed[1 : 1 + NONCE_BYTES], sealed[1 + NONCE_BYTES :],
                                  _step_associated(key_id, tenant, key, step))  # fmt: skip
        except InvalidTag:
            raise SealedResponseError(
                f"the result of step {step!r} does not open under key id {key_id!r}: it was changed, or it belongs to "
                "another record or step"
            ) from None

    def reseal(self, tenant: str, key: str, sealed: SealedResponse) -> SealedResponse:
        """``sealed`` opened and sealed again under the current key (a fresh nonce)."""
        return self.seal(tenant, key, self.open(tenant, key, sealed))

    def derive(self, label: bytes) -> list[bytes]:
        """For each key, current first, 32 bytes derived from it for another use (HMAC-SHA256 of ``label`` under the
        key): the fingerprint keys of a store that has no other secret (``fingerprint.FingerprintKeys.derived``)."""
        derived = []
        for deriver in self._derivers.values():
            mac = deriver.copy()
            mac.update(label)
            derived.append(mac.digest())
        return derived

    def __repr__(self) -> str:  # never the keys
        plain = ", allow_plain=True" if self.allow_plain else ""
        return f"ResponseCipher(current={self.current!r}, key_ids={self.key_ids!r}{plain})"


def _associated(key_id: str, tenant: str, key: str, body_size: int) -> bytes:
    """What a sealed response is bound to besides its own bytes: the format, the key, the record and the body's
    size, each length-prefixed so that no two different tuples give the same bytes."""
    parts = [_AAD_PREFIX, bytes([VERSION]), key_id.encode(), tenant.encode(), key.encode(), str(body_size).encode()]
    return b"".join(struct.pack(">I", len(part)) + part for part in parts)


def _step_associated(key_id: str, tenant: str, key: str, step: str) -> bytes:
    """What a sealed step result is bound to: its own format (never a response's), the key, the record and the step."""
    parts = [_STEP_AAD_PREFIX, bytes([VERSION]), key_id.encode(), tenant.encode(), key.encode(), step.encode()]
    return b"".join(struct.pack(">I", len(part)) + part for part in parts)


def _key_bytes(name: str, key: bytes | str) -> bytes:
    """The 32 bytes of a key given as bytes, hex or base64 text; ``name`` is how errors name it (``_keyring.named``)."""
    if isinstance(key, bytes):
        material = key
    elif isinstance(key, str):
        text = key.strip()
        if _HEX.fullmatch(text):
            material = bytes.fromhex(text)
        else:
            try:
                material = base64.b64decode(
                    text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4), validate=True
                )
            except (binascii.Error, ValueError):
                raise ValueError(
                    f"{name} is neither base64 nor 64 hex digits (a new key: ResponseCipher.new_key())"
                ) from None
    else:
        raise TypeError(f"{name} must be bytes or text, not {type(key).__name__}")
    if len(material) != KEY_BYTES:
        raise ValueError(
            f"{name} is {len(material)} bytes: AES-256-GCM needs {KEY_BYTES} "
            "(44 characters of base64, or 64 hex digits)"
        )
    return material
