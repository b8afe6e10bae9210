"""``expand[]``, as Stripe does it: a field that holds an object's id holds the object itself instead.

``expand[]=customer`` on a payment intent, ``expand[]=payment_intent.customer`` on a refund (a dotted path expands
what it reaches), ``expand[]=data.customer`` on a list of payment intents. Paths are checked before anything runs,
so a bad one is a 400 that frees the key; objects are read on the connection the request uses (in a write, its
transaction), so what is expanded is what that request sees.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from examples.payments import ledger, objects, wire

# What each kind of object may expand: field -> the kind of object it holds the id of.
EXPANDABLE: dict[str, dict[str, str]] = {
    "customer": {},
    "payment_intent": {"customer": "customer"},
    "refund": {"payment_intent": "payment_intent"},
    "balance": {},
}
MAX_DEPTH = 4  # Stripe's limit on a path's length

Path = tuple[str, ...]


def paths(params: wire.Params, kind: str, *, listed: bool = False) -> list[Path]:
    """The request's ``expand`` paths, checked against what ``kind`` (or, ``listed``, a list of it) can expand."""
    requested = params.string_list("expand") or []
    checked: list[Path] = []
    for value in requested:
        path = tuple(value.split("."))
        if len(path) > MAX_DEPTH:
            raise wire.invalid(
                f"You cannot expand more than {MAX_DEPTH} levels of a property ({value}).",
                code="parameter_invalid",
                param="expand",
            )
        if listed:
            if path[0] != "data" or len(path) < 2:
                raise _cannot(value)
            path = path[1:]
        current = kind
        for field in path:
            target = EXPANDABLE[current].get(field)
            if target is None:
                raise _cannot(value)
            current = target
        checked.append(path)
    return checked


def _cannot(value: str) -> wire.StripeError:
    return wire.invalid(f"This property cannot be expanded ({value}).", code="parameter_invalid", param="expand")


async def expand(db: ledger.Connection, account: str, kind: str, rendered: dict[str, Any], wanted: list[Path]) -> None:
    """Replace, in ``rendered`` (an object of ``kind``), every id that the ``wanted`` paths name by its object."""
    for path in wanted:
        await _follow(db, account, kind, rendered, path)


async def _follow(db: ledger.Connection, account: str, kind: str, rendered: dict[str, Any], path: Path) -> None:
    field, rest = path[0], path[1:]
    target = EXPANDABLE[kind][field]
    value = rendered.get(field)
    if isinstance(value, str):
        value = await _LOADERS[target](db, account, value)
        rendered[field] = value
    if isinstance(value, dict) and rest:  # None stays None, as at Stripe
        await _follow(db, account, target, value, rest)


async def _customer(db: ledger.Connection, account: str, object_id: str) -> dict[str, Any] | None:
    row = await ledger.find_customer(db, account, object_id)
    return objects.customer(row) if row is not None else None


async def _payment_intent(db: ledger.Connection, account: str, object_id: str) -> dict[str, Any] | None:
    row = await ledger.find_payment_intent(db, account, object_id)
    return objects.payment_intent(row) if row is not None else None


_LOADERS: dict[str, Callable[[ledger.Connection, str, str], Awaitable[dict[str, Any] | None]]] = {
    "customer": _customer,
    "payment_intent": _payment_intent,
}
