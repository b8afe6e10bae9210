"""Stripe's lists: ``{"object": "list", "data": [...], "has_more": ..., "url": ...}``, newest first, paged by cursor.

``limit`` (1 to 100, default 10) objects a page; ``starting_after=<id>`` continues towards older objects after the
last one of a page, ``ending_before=<id>`` goes back towards newer ones before the first one. ``created`` filters
on the creation time (``created=<t>`` or ``created[gte]=<t>``, with ``gt``, ``gte``, ``lt``, ``lte``), and each list
has the filters Stripe offers for it that these objects support (``FILTERS`` in the ledger). Stripe's client
libraries page through it all with ``auto_paging_iter()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg

from examples.payments import expansion, ledger, wire

DEFAULT_LIMIT = 10
MAX_LIMIT = 100


async def fetch_page(
    db: ledger.Connection,
    account: str,
    params: wire.Params,
    *,
    table: str,
    kind: str,
    render: Callable[[asyncpg.Record], dict[str, Any]],
) -> dict[str, Any]:
    """Read the list parameters (refusing any other), then fetch, render and expand one page."""
    limit = params.integer("limit")
    if limit is None:
        limit = DEFAULT_LIMIT
    elif not 1 <= limit <= MAX_LIMIT:
        raise wire.invalid(
            f"Invalid limit: must be an integer between 1 and {MAX_LIMIT}.", code="parameter_invalid", param="limit"
        )
    starting_after = params.string("starting_after", max_length=255)
    ending_before = params.string("ending_before", max_length=255)
    if starting_after is not None and ending_before is not None:
        raise wire.invalid(
            "You may only specify one of these parameters: ending_before, starting_after.",
            code="parameter_invalid",
            param="ending_before",
        )
    created = _created(params)
    equal = {}
    for column in sorted(ledger.FILTERS[table]):
        value = params.string(column, max_length=512)
        if value is not None:
            equal[column] = value
    expand = expansion.paths(params, kind, listed=True)
    params.done()

    after = await _cursor(db, table, account, kind, "starting_after", starting_after)
    before = await _cursor(db, table, account, kind, "ending_before", ending_before)
    rows, more = await ledger.page(
        db, table, account, equal=equal, created=created, after=after, before=before, limit=limit
    )
    data = [render(row) for row in rows]
    for item in data:
        await expansion.expand(db, account, kind, item, expand)
    return {"object": "list", "data": data, "has_more": more, "url": f"/v1/{table}"}


def _created(params: wire.Params) -> dict[str, int]:
    """``created=<t>`` (exactly then) or ``created[gt|gte|lt|lte]=<t>``: a Unix time in seconds."""
    if not params.has("created"):
        return {}
    value = params.raw("created")
    if isinstance(value, str):
        exact = wire.integer(value, "created")
        return {"gte": exact, "lte": exact}
    if not isinstance(value, dict) or not value or not set(value) <= set(ledger.COMPARISONS):
        raise wire.invalid(
            "Invalid created: send a Unix time, or created[gt], [gte], [lt] or [lte].",
            code="parameter_invalid",
            param="created",
        )
    bounds = {}
    for comparison, text in value.items():
        param = f"created[{comparison}]"
        if not isinstance(text, str):
            raise wire.invalid(f"Invalid integer: {param}", code="parameter_invalid_integer", param=param)
        bounds[comparison] = wire.integer(text, param)
    return bounds


async def _cursor(
    db: ledger.Connection, table: str, account: str, kind: str, param: str, object_id: str | None
) -> int | None:
    if object_id is None:
        return None
    seq = await ledger.position(db, table, account, object_id)
    if seq is None:
        raise wire.missing(kind, object_id, param)
    return seq
