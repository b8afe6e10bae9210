"""How the command line shows what it read: a record (as text or JSON), counts of sealed responses, durations."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from idempotency_mw._events import hash_key, tenant_tag
from idempotency_mw._fingerprint import DIGEST_BYTES, fingerprint_key_id
from idempotency_mw._parts import COMPARED, read_parts
from idempotency_mw.store import RecordInfo, RecordLine, StalledRequest

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher

PREVIEW_BYTES = 200


def record_to_dict(record: RecordInfo, *, now: float) -> dict[str, Any]:
    """The record as plain JSON types; what ``inspect --json`` prints and the text view is made from."""
    response = None
    if record.response is not None:
        stored = record.response
        body_preview, encoding = (None, None) if stored.body is None else preview(stored.body)
        response = {
            "status": stored.status,
            "headers": [[name.decode("latin-1"), value.decode("latin-1")] for name, value in stored.headers],
            "body_size": stored.body_size,
            "body_stored": stored.body is not None,
            "body_preview": body_preview,
            "body_preview_encoding": encoding,
            "sealed_with": record.sealed_with,
        }
    return {
        "tenant": record.tenant,
        "key": record.key,
        "state": record.state,
        "expired": record.expires_at <= now,
        "fence": record.fence,
        "attempts": record.attempts,
        "created_at": iso(record.created_at),
        "expires_at": iso(record.expires_at),
        "lease_expires_at": None if record.lease_expires_at is None else iso(record.lease_expires_at),
        "request": record.request,  # None: written before records kept it
        "replays": record.replays,
        "last_replayed_at": None if record.last_replayed_at is None else iso(record.last_replayed_at),
        "last_step": record.last_step,  # None: its handler did not run in steps (docs/design.md §10)
        "fingerprint": record.fingerprint[-DIGEST_BYTES:].hex(),
        "fingerprint_key": fingerprint_key_id(record.fingerprint),  # None: unkeyed, written before keys existed
        "request_parts": request_parts(record.parts),
        "response": response,
    }


def request_parts(stored: bytes | None) -> dict[str, Any] | None:
    """That a record's request parts are stored (explain_mismatch), how many body fields, under which key: never
    anything else of them, which are keyed digests anyway. None when it has none."""
    if stored is None:
        return None
    parts = read_parts(stored)
    if parts is None:
        return {"key": None, "fields": None, "body_compared": None, "bytes": len(stored)}  # a later version's
    compared = COMPARED[parts.mode]
    return {"key": parts.key_id, "fields": len(parts.fields), "body_compared": compared, "bytes": len(stored)}


def format_record(shown: dict[str, Any]) -> str:
    state = shown["state"] + (" (expired: counts as absent, awaiting gc)" if shown["expired"] else "")
    key_id = shown["fingerprint_key"]
    keyed = "unkeyed: written before fingerprints were keyed" if key_id is None else f"key {key_id!r}"
    rows: list[tuple[str, str]] = [
        ("tenant", shown["tenant"] or "'' (empty)"),
        ("key", shown["key"]),
        ("request", shown["request"] or "-"),
        ("state", state),
        ("fence", str(shown["fence"])),
        ("attempts", str(shown["attempts"])),
        ("replays", _replays(shown["replays"], shown["last_replayed_at"])),
        ("created", shown["created_at"]),
        ("expires", shown["expires_at"]),
        ("lease until", shown["lease_expires_at"] or "-"),
        ("fingerprint", f"{shown['fingerprint']} ({keyed})"),
    ]
    if shown.get("last_step") is not None:
        rows.insert(4, ("last step", shown["last_step"]))
    if shown["request_parts"] is not None:  # written by a route that explains a mismatch
        rows.append(("request parts", _parts(shown["request_parts"])))
    response = shown["response"]
    if response is not None:
        rows.append(("status", str(response["status"])))
        headers = [f"{name}: {value}" for name, value in response["headers"]] or ["-"]
        rows.extend(("headers" if i == 0 else "", header) for i, header in enumerate(headers))
        if response.get("sealed_with") is not None:
            rows.append(("sealed with", f"key {response['sealed_with']!r}"))
        rows.append(("body size", f"{response['body_size']} bytes"))
        if not response["body_stored"]:
            rows.append(("body", "not stored (over max_response_bytes, or cut short: replays answer 409)"))
        else:
            text = response["body_preview"].replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
            more = "…" if response["body_size"] > PREVIEW_BYTES else ""
            rows.append((f"body ({response['body_preview_encoding']})", text + more))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {visible(value)}" for label, value in rows)


def visible(text: str) -> str:
    """``text`` as a terminal shows it, never acts on it: a control character (an escape sequence's, a bell) is
    written as its escape (``\\x1b``). What the app stored (a resolver's tenant, a response header, a step's name)
    is not the command line's to trust."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _parts(parts: dict[str, Any]) -> str:
    if parts["key"] is None:
        return f"{parts['bytes']} bytes, in a format this version does not read"
    body = "compared whole" if parts["body_compared"] == "whole" else f"{parts['fields']} {parts['body_compared']}"
    return f"{parts['bytes']} bytes: method, path, query, body ({body}), under key {parts['key']!r}"


def _replays(count: int, last: str | None) -> str:
    """How often the response was replayed, as written so far: the store writes its counts every few seconds."""
    return f"{count} (last {last})" if last is not None else str(count)


def preview(body: bytes) -> tuple[str, str]:
    """The first ``PREVIEW_BYTES`` of a body: as text when it is printable UTF-8, else as hex."""
    head = body[:PREVIEW_BYTES]
    for cut in range(4):  # the cut may split a multi-byte character: drop up to 3 trailing bytes
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if all(c.isprintable() or c in "\n\r\t" for c in text):
            return text, "text"
        break
    return head.hex(), "hex"


def iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC).isoformat(timespec="milliseconds")


def duration(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {whole % 3600 // 60:02d}m"


def plural(count: int) -> str:
    return "" if count == 1 else "s"


def by_key(
    counts: dict[str | None, int], cipher: ResponseCipher, seal_plain: bool, *, dry_run: bool, noun: str = "response"
) -> str:
    """What is stored under which key, and what a run does (or did not do) about it: ``noun`` the responses, or the
    step results."""
    lines = []
    for key_id, count in counts.items():
        things = f"{count} {noun}{plural(count)}"
        if key_id is None:
            if seal_plain:
                what = "to seal" if dry_run else "plain (new ones stored by a store without a cipher)"
            else:
                what = "left plain (--seal-plain seals them)"
            lines.append(f"plain: {things}, {what}")
        elif key_id == cipher.current:
            lines.append(f"under {key_id!r} (current): {things}")
        elif key_id in cipher.key_ids:
            what = "to re-seal" if dry_run else "not re-sealed yet (locked by another run? run again)"
            lines.append(f"under {key_id!r}: {things}, {what}")
        else:
            what = "a key not given: they cannot be opened here"
            lines.append(f"under {key_id!r}: {things}, {what}")
    return "\n".join(lines) or f"no stored {noun}s"


def listing_to_dict(tenant: str, lines: list[RecordLine]) -> dict[str, Any]:
    """One tenant's records as ``list --json`` prints them (and the text view is made from)."""
    return {
        "tenant": tenant,
        "tag": tenant_tag(tenant),
        "records": [
            {
                "key": line.key,
                "key_hash": hash_key(line.key),
                "request": line.request,
                "state": line.state,
                "status": line.status,
                "sealed_with": line.sealed_with,
                "body_size": line.body_size,
                "attempts": line.attempts,
                "replays": line.replays,
                "created_at": iso(line.created_at),
                "expires_at": iso(line.expires_at),
            }
            for line in lines
        ],
    }


def format_listing(listed: list[dict[str, Any]], since: float, until: float) -> str:
    blocks = []
    for entry in listed:
        records = entry["records"]
        tenant = visible(entry["tenant"]) or "'' (empty)"
        head = f"tenant {tenant}: {len(records)} record{plural(len(records))} first claimed "
        head += f"between {iso(since)} and {iso(until)}"
        rows = [("created", "key", "key hash", "request", "state", "status", "attempts", "replays")]
        for record in records:
            status = "-" if record["status"] is None else str(record["status"])
            if record["sealed_with"] is not None:
                status = f"sealed ({record['sealed_with']})"
            created, key, key_hash = record["created_at"], record["key"], record["key_hash"]
            request, attempts, replays = record["request"] or "-", str(record["attempts"]), str(record["replays"])
            rows.append((created, visible(key), key_hash, visible(request), record["state"], status, attempts, replays))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
        blocks.append("\n".join([head, *(table if records else [])]))
    return "\n\n".join(blocks)


def stalled_to_dict(stalled: list[StalledRequest], *, now: float) -> list[dict[str, Any]]:
    """Requests stopped at a recovery point, as plain JSON types (``stalled --json``)."""
    return [
        {
            "tenant": each.tenant,
            "key": each.key,
            "request": each.request,
            "last_step": each.last_step,
            "last_step_done": each.last_step_done,  # False: an unrepeatable step began, its outcome unknown
            "created_at": iso(each.created_at),
            "lapsed_at": iso(each.lapsed_at),
            "expires_at": iso(each.expires_at),
            "expired": each.expires_at <= now,
        }
        for each in stalled
    ]


def format_stalled(shown: list[dict[str, Any]]) -> str:
    """One line per stalled request: its tenant, key, request, last step, and when it lapsed and expires."""
    if not shown:
        return "no stalled requests"
    lines = []
    for each in shown:
        step = each["last_step"] + ("" if each["last_step_done"] else " (began, outcome unknown)")
        expiry = "expired" if each["expired"] else f"expires {each['expires_at']}"
        tenant = each["tenant"] or "''"
        lines.append(
            visible(
                f"{tenant}  {each['key']}  {each['request'] or '-'}  after {step}  lapsed {each['lapsed_at']}  {expiry}"
            )
        )
    return "\n".join(lines)
