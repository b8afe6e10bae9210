"""Stripe's v1 wire conventions: secret keys, bracketed form parameters, and the ``{"error": {...}}`` envelope.

Close enough to the real thing that a Stripe client library pointed at the demo talks to it unchanged: the secret
key arrives as ``Authorization: Bearer sk_test_…`` (or as the Basic-auth user name, like ``curl -u sk_test_…:``),
POST bodies are ``application/x-www-form-urlencoded`` with nesting spelled ``metadata[order_id]=6735``, and every
error is a JSON object under ``error`` with ``type``, ``code`` and ``message`` (the middleware's own answers are
put in this envelope by ``edge.StripeEdge``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Scope

API_KEY = re.compile(r"sk_test_[0-9A-Za-z_]{1,200}")
WWW_AUTHENTICATE = 'Bearer realm="payments-demo"'  # sent with every 401
_ALPHABET = string.ascii_letters + string.digits
_NESTED = re.compile(r"([^\[\]]+)((?:\[[^\[\]]*\])*)")

METADATA_MAX_KEYS = 50
METADATA_MAX_KEY_LENGTH = 40
METADATA_MAX_VALUE_LENGTH = 500


def new_id(prefix: str) -> str:
    """A Stripe-looking object id: ``pi_`` and 24 random letters and digits."""
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(24))


# -- errors ----------------------------------------------------------------------------------------------------


class StripeError(Exception):
    """An error answered in Stripe's envelope.

    ``executed`` says whether the request changed anything before it failed. Raised with ``executed=False``
    (invalid parameters, unknown objects), the app marks the request as not executed, so the middleware releases
    the Idempotency-Key and a corrected retry may use it again: Stripe's rule.
    """

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        executed: bool = False,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.code = code
        self.param = param
        self.executed = executed
        self.extra = extra

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.code is not None:
            error["code"] = self.code
        if self.param is not None:
            error["param"] = self.param
        error.update(self.extra)
        return {"error": error}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, *, code: str, param: str | None = None) -> StripeError:
    """A 400 ``invalid_request_error`` for a bad parameter: nothing ran."""
    return StripeError(400, "invalid_request_error", message, code=code, param=param)


def missing(kind: str, object_id: str, param: str) -> StripeError:
    """A 404 ``resource_missing``: the request names an object this account does not have."""
    return StripeError(
        404, "invalid_request_error", f"No such {kind}: '{object_id}'", code="resource_missing", param=param
    )


# -- authentication: the secret key is the account ---------------------------------------------------------------


def api_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The well-formed test-mode secret key of a request (Bearer, or Basic with the key as user name), or None."""
    for name, value in headers:
        if name != b"authorization":
            continue
        scheme, _, credentials = value.decode("latin-1").strip().partition(" ")
        credentials = credentials.strip()
        if scheme.lower() == "basic":
            try:
                credentials = base64.b64decode(credentials, validate=True).decode("latin-1").partition(":")[0]
            except (binascii.Error, ValueError):
                return None
        elif scheme.lower() != "bearer":
            return None
        return credentials if API_KEY.fullmatch(credentials) else None
    return None


def account_id(key: str) -> str:
    """The account a secret key belongs to. The demo creates accounts on first use, so this is a pure function."""
    return "acct_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant(scope: Scope) -> str:
    """The middleware's tenant resolver: the account id, or ``""`` for requests the app will refuse with 401."""
    key = api_key(scope["headers"])
    return account_id(key) if key else ""


def authenticate(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The account id of a request, or a 401 in Stripe's envelope."""
    key = api_key(headers)
    if key is None:
        raise StripeError(
            401,
            "invalid_request_error",
            "Invalid API Key provided. This demo accepts test-mode secret keys (sk_test_ followed by letters, "
            "digits or underscores) as 'Authorization: Bearer sk_test_...' or as the Basic-auth user name.",
            code="api_key_invalid",
        )
    return account_id(key)


# -- form parameters ------------------------------------------------------------------------------------------


def decode_form(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Turn ``a[b][c]=v`` pairs into nested dicts, as Stripe's clients encode them, and lists into lists.

    A list arrives as ``a[]=x&a[]=y`` or ``a[0]=x&a[1]=y`` from Stripe's clients, and as ``a=x&a=y`` from OpenAPI
    tools (form style, exploded). A repeated name therefore makes a list, which a parameter expecting one value
    refuses.
    """
    decoded: dict[str, Any] = {}
    for name, value in pairs:
        match = _NESTED.fullmatch(name)
        if match is None:
            raise invalid(f"Invalid parameter name: {name!r}", code="parameter_unknown", param=name)
        path = [match.group(1), *(part[1:-1] for part in re.findall(r"\[[^\[\]]*\]", match.group(2)))]
        _insert(decoded, path, value, name)
    return decoded


def _insert(target: dict[str, Any], path: list[str], value: str, name: str) -> None:
    head, rest = path[0], path[1:]
    if not rest:
        existing = target.get(head)
        if existing is None:
            target[head] = value
        elif isinstance(existing, list):
            existing.append(value)
        elif isinstance(existing, str):
            target[head] = [existing, value]
        else:
            raise invalid(f"Invalid mix of nested and plain values for {head!r}.", code="parameter_unknown", param=head)
        return
    if rest[0] == "":  # a[]=x: append
        if len(rest) > 1:
            raise invalid(f"Invalid array parameter: {name!r}", code="parameter_unknown", param=name)
        existing = target.setdefault(head, [])
        if not isinstance(existing, list):
            raise invalid(f"Invalid mix of array and scalar for {head!r}.", code="parameter_unknown", param=head)
        existing.append(value)
        return
    child = target.setdefault(head, {})
    if not isinstance(child, dict):
        raise invalid(f"Invalid mix of nested and plain values for {head!r}.", code="parameter_unknown", param=head)
    _insert(child, rest, value, name)


# An integer parameter has at most 18 digits and an optional sign, so any fits PostgreSQL's bigint. The OpenAPI
# schema states these bounds where no narrower one applies (created[gte] and its siblings).
MAX_INTEGER = 10**18 - 1
MIN_INTEGER = -MAX_INTEGER


def integer(value: str, param: str) -> int:
    """A parameter's integer value, or a 400 naming ``param``."""
    if not re.fullmatch(r"-?[0-9]{1,18}", value):
        raise invalid(f"Invalid integer: {value}", code="parameter_invalid_integer", param=param)
    return int(value)


@dataclass(frozen=True, slots=True)
class MetadataUpdate:
    clear: bool  # unset every key first
    set: dict[str, str]
    unset: list[str]


class Params:
    """Typed access to decoded form parameters; ``done()`` refuses the ones nobody asked for."""

    def __init__(self, decoded: dict[str, Any]) -> None:
        self._values = dict(decoded)

    def _take(self, name: str, required: bool) -> Any:
        if name not in self._values:
            if required:
                raise invalid(f"Missing required param: {name}.", code="parameter_missing", param=name)
            return None
        return self._values.pop(name)

    def string(
        self, name: str, *, required: bool = False, max_length: int = 5000, unsettable: bool = False
    ) -> str | None:
        """A plain value. An empty one is Stripe's attempt to unset the parameter: None for text that may be unset
        (``unsettable``), else a 400, as Stripe answers for an id, a number, a flag, a filter or a cursor."""
        value = self._take(name, required)
        if value is None:
            return None
        if not isinstance(value, str):
            raise invalid(f"Invalid string: {name} must be a single plain value.", code="parameter_invalid", param=name)
        if "\x00" in value:
            raise invalid(f"Invalid string: {name} contains a NUL character.", code="parameter_invalid", param=name)
        if value == "":
            if required or not unsettable:
                raise invalid(
                    f"You passed an empty string for '{name}', which cannot be unset.",
                    code="parameter_invalid_empty",
                    param=name,
                )
            return None
        if len(value) > max_length:
            raise invalid(
                f"Invalid string: {name} is longer than {max_length} characters.", code="parameter_invalid", param=name
            )
        return value

    def integer(self, name: str, *, required: bool = False) -> int | None:
        value = self.string(name, required=required, max_length=20)
        return None if value is None else integer(value, name)

    def boolean(self, name: str) -> bool | None:
        value = self.string(name, max_length=5)
        if value is None:
            return None
        if value not in ("true", "false"):
            raise invalid(f"Invalid boolean: {value}", code="parameter_invalid_boolean", param=name)
        return value == "true"

    def choice(self, name: str, options: Iterable[str], *, required: bool = False) -> str | None:
        value = self.string(name, required=required, max_length=100)
        allowed = sorted(options)
        if value is not None and value not in allowed:
            raise invalid(f"Invalid {name}: must be one of {', '.join(allowed)}", code="parameter_invalid", param=name)
        return value

    def string_list(self, name: str) -> list[str] | None:
        """``a[]=x``, ``a[0]=x`` (Stripe's clients send this one), or ``a=x`` once or more."""
        value = self._take(name, False)
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if isinstance(value, dict) and all(k.isdigit() for k in value):
            value = [value[k] for k in sorted(value, key=int)]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise invalid(f"Invalid array: {name}", code="parameter_invalid", param=name)
        return list(value)

    def metadata(self) -> dict[str, str]:
        """``metadata[key]=value`` pairs, within Stripe's limits; ``metadata=`` (empty) means none."""
        value = self._take("metadata", False)
        if value is None or value == "":
            return {}
        if not isinstance(value, dict):
            raise invalid(
                "Invalid metadata: send it as metadata[key]=value pairs.", code="parameter_invalid", param="metadata"
            )
        if len(value) > METADATA_MAX_KEYS:
            raise invalid(
                f"Invalid metadata: at most {METADATA_MAX_KEYS} keys.", code="parameter_invalid", param="metadata"
            )
        for key, item in value.items():
            param = f"metadata[{key}]"
            if not isinstance(item, str):
                raise invalid(
                    f"Invalid metadata value for {key!r}: nesting is not allowed.",
                    code="parameter_invalid",
                    param=param,
                )
            if len(key) > METADATA_MAX_KEY_LENGTH or len(item) > METADATA_MAX_VALUE_LENGTH:
                raise invalid(
                    f"Metadata keys are at most {METADATA_MAX_KEY_LENGTH} and values at most "
                    f"{METADATA_MAX_VALUE_LENGTH} characters long.",
                    code="parameter_invalid",
                    param=param,
                )
            if "\x00" in key or "\x00" in item:  # PostgreSQL text cannot hold them
                raise invalid("Metadata may not contain NUL characters.", code="parameter_invalid", param="metadata")
        return dict(value)

    def metadata_update(self) -> MetadataUpdate | None:
        """Metadata in an update, Stripe's way: ``metadata[key]=value`` sets a key, ``metadata[key]=`` (empty) unsets
        it, and ``metadata=`` (empty) unsets them all. None when the request leaves metadata alone."""
        if "metadata" not in self._values:
            return None
        if self._values["metadata"] == "":
            del self._values["metadata"]
            return MetadataUpdate(clear=True, set={}, unset=[])
        values = self.metadata()
        return MetadataUpdate(
            clear=False, set={k: v for k, v in values.items() if v}, unset=sorted(k for k, v in values.items() if not v)
        )

    def raw(self, name: str) -> Any:
        """The value as decoded (a string, a list or a dict), for parameters of more than one shape; or None."""
        return self._take(name, False)

    def has(self, name: str) -> bool:
        """Whether the request carries ``name`` (an update tells "unset it", ``name=``, from "leave it alone")."""
        return name in self._values

    def done(self) -> None:
        if self._values:
            name = sorted(self._values)[0]
            raise invalid(f"Received unknown parameter: {name}", code="parameter_unknown", param=name)
