"""Issue 10 (defect 8): what the fingerprint costs per byte, for every body shape, against 1 MiB of ordinary JSON.

    .venv/bin/python benchmarks/fingerprint.py [--quick]     # prints the table, writes results/fingerprint.md
                                                             # and results/raw/fingerprint.json
    .venv/bin/python benchmarks/fingerprint.py --json        # prints the raw result only (what run.py reads)

The fingerprint runs on the event loop before anything else, for every keyed request, authenticated or not, so
no body shape may cost much more per byte than the JSON an API normally receives. Each shape is a body of about
1 MiB (the default ``max_request_bytes``); the shapes are timed interleaved, round after round, with the garbage
collector paused while a shape is timed, and a shape's cost is its median over rounds. The ratio is its cost per
byte divided by that of the typical JSON body in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from common import Target, load_average, machine, table, target_table

from idempotency_mw.fingerprint import (
    _BYTES_PER_ESCAPE,
    _ESCAPES_FREE,
    _EXACT_BYTES_PER_VALUE,
    _EXACT_VALUES_FREE,
    _MAX_FIELDS,
    canonical_body,
    fingerprint,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MiB = 1 << 20
JSON = b"application/json"
FORM = b"application/x-www-form-urlencoded"
BASELINE = "json-typical"
LIMIT = 4.0  # "a few times" the cost of ordinary JSON per byte, decided before measuring
SMALL = b'{"amount": 1250, "currency": "eur", "customer": "cus_42"}'  # the body overhead.py sends


def _payment(i: int) -> dict[str, Any]:
    return {
        "id": f"pi_{i:012d}",
        "amount": 1250 + i,
        "currency": "eur",
        "customer": f"cus_{i}",
        "description": f"Order #{i} for a customer, with some text",
        "metadata": {"order_id": str(i), "rate": round(0.25 + i % 500 / 1000, 3)},
        "captured": True,
        "refunds": [],
    }


def _fill(unit: bytes, size: int = MiB, sep: bytes = b",") -> bytes:
    """``unit`` repeated, separated by ``sep``, to about ``size`` bytes."""
    return sep.join([unit] * max(1, size // (len(unit) + len(sep))))


def _typical_json() -> bytes:
    items: list[bytes] = []
    total, i = 0, 0
    while total < MiB:
        item = orjson.dumps(_payment(i))
        items.append(item)
        total += len(item) + 1
        i += 1
    return b"[" + b",".join(items) + b"]"


def _exact_at_budget() -> bytes:
    """A long number (the exact reader), then as many small values as it reads before hashing the bytes instead."""
    values = _EXACT_VALUES_FREE + MiB // _EXACT_BYTES_PER_VALUE - 8
    head = b'{"amount":12345678901234567890,"values":[' + b",".join([b"1"] * values) + b'],"note":"'
    return head + b"x" * (MiB - len(head) - 2) + b'"}'


def _form(fields: int, value: bytes) -> bytes:
    return b"&".join(b"metadata%%5Bfield_%d%%5D=%s" % (n, value) for n in range(fields))


def _form_at_allowance() -> bytes:
    """The most fields a form may have, with as many escapes as it may hold, spread through its values."""
    fields = _MAX_FIELDS - 1
    field_bytes = MiB // fields - 1  # each field and its "&"
    name_bytes = len(b"metadata%5Bfield_000%5D=")  # two escapes per name
    escapes = (_ESCAPES_FREE + MiB // _BYTES_PER_ESCAPE) // fields - 2 - 1  # per value, one short of the allowance
    chunk = b"%C3" + b"x" * ((field_bytes - name_bytes) // escapes - 3)
    return _form(fields, chunk * escapes)


def shapes() -> dict[str, tuple[str, bytes, bytes, str]]:
    """name -> (description, content type, body, how it is read)."""
    typical = _typical_json()
    bodies: list[tuple[str, str, bytes, bytes]] = [
        (BASELINE, "JSON, an array of payment-like objects (the reference)", JSON, typical),
        ("json-small-ints", "JSON, `[1,1,1,…]`", JSON, b"[" + _fill(b"1") + b"]"),
        ("json-floats", "JSON, `[1.5,1.5,…]`", JSON, b"[" + _fill(b"1.5") + b"]"),
        (
            "json-15-digits",
            "JSON, `[123456789012345,…]`: the longest numbers read without the exact reader",
            JSON,
            b"[" + _fill(b"123456789012345") + b"]",
        ),
        ("json-empty-objects", "JSON, `[{},{},…]`", JSON, b"[" + _fill(b"{}") + b"]"),
        (
            "json-many-keys",
            "JSON, one object with 100,000 keys (sorted)",
            JSON,
            b"{" + b",".join(b'"k%06d":1' % n for n in range(MiB // 11)) + b"}",
        ),
        ("json-escaped-string", "JSON, one string of `\\u0041` escapes", JSON, b'["' + b"\\u0041" * (MiB // 6) + b'"]'),
        (
            "json-deep",
            "JSON, nested 1,000 deep, then a long string",
            JSON,
            b"[" * 1000 + b'"' + b"x" * MiB + b'"' + b"]" * 1000,
        ),
        (
            "json-exact-typical",
            "JSON, the reference with one 20-digit number",
            JSON,
            typical[:-1] + b",12345678901234567890]",
        ),
        (
            "json-exact-long-floats",
            "JSON, floats with more digits than a double holds (exact reader)",
            JSON,
            b"[" + _fill(b"0.1000000000000000000001") + b"]",
        ),
        (
            "json-exact-at-budget",
            "JSON, a 20-digit number and small values up to the exact reader's budget",
            JSON,
            _exact_at_budget(),
        ),
        (
            "json-exact-over-budget",
            "JSON, a 20-digit number then `1,1,1,…` past the budget",
            JSON,
            b"[12345678901234567890," + _fill(b"1") + b"]",
        ),
        ("form-plain", "form, 999 fields of plain text", FORM, _form(_MAX_FIELDS - 1, b"x" * (MiB // _MAX_FIELDS))),
        ("form-escapes", "form, 999 fields holding as many `%XX` escapes as are decoded", FORM, _form_at_allowance()),
        ("form-many-fields", "form, `a&a&a…` (the report's body)", FORM, _fill(b"a", sep=b"&")),
        ("form-all-escapes", "form, one value of `%41%41…`", FORM, b"a=" + b"%41" * (MiB // 3)),
        ("raw", "application/octet-stream", b"application/octet-stream", bytes(range(256)) * (MiB // 256)),
    ]
    read_as = {name: canonical_body(ctype, body)[0].decode() for name, _, ctype, body in bodies}
    for name in ("json-exact-at-budget", "form-escapes"):  # built to sit just inside the allowance
        if read_as[name] == "raw":
            raise SystemExit(f"{name} was hashed as sent: the shape no longer matches the allowances in fingerprint.py")
    return {name: (what, ctype, body, read_as[name]) for name, what, ctype, body in bodies}


def _time(call: Callable[[], object], repeat: int) -> float:
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        return (time.perf_counter() - started) / repeat
    finally:
        gc.enable()


def measure(quick: bool) -> dict[str, Any]:
    rounds, repeat = (5, 2) if quick else (11, 4)
    cases = shapes()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (_, ctype, body, _) in cases.items():
            seconds[name].append(_time(partial(fingerprint, "POST", "/v1/charges", b"", ctype, body), repeat))
    small = [_time(partial(fingerprint, "POST", "/v1/charges", b"", JSON, SMALL), 20000) for _ in range(rounds)]
    per_mib = {name: statistics.median(values) * 1000 * MiB / len(cases[name][2]) for name, values in seconds.items()}
    return {
        "rounds": rounds,
        "repeat": repeat,
        "small_body_us": statistics.median(small) * 1e6,
        "shapes": {
            name: {
                "description": what,
                "bytes": len(body),
                "read_as": read_as,
                "ms_per_mib": per_mib[name],
                "vs_json": per_mib[name] / per_mib[BASELINE],
            }
            for name, (what, _, body, read_as) in cases.items()
        },
    }


def targets(result: dict[str, Any]) -> list[Target]:
    worst_name, worst = max(((n, s["vs_json"]) for n, s in result["shapes"].items()), key=lambda item: item[1])
    return [
        Target(
            "10.8 fingerprint cost per byte, worst body shape vs 1 MiB of ordinary JSON",
            f"≤ {LIMIT:.0f}x",
            f"{worst:.2f}x ({worst_name})",
            worst <= LIMIT,
        )
    ]


def render(result: dict[str, Any]) -> str:
    rows = [
        [
            name,
            s["description"],
            s["read_as"],
            f"{s['bytes'] / MiB:.2f}",
            f"{s['ms_per_mib']:.1f}",
            f"{s['vs_json']:.2f}x",
        ]
        for name, s in result["shapes"].items()
    ]
    return "\n\n".join(
        [
            "# What the fingerprint costs per body shape",
            "Every keyed request is fingerprinted on the event loop before its key is claimed, authenticated or not, "
            "so no body shape may cost much more per byte than ordinary JSON. Each shape is a body of about 1 MiB "
            "(the default `max_request_bytes`), fingerprinted in process; the shapes run interleaved, "
            f"{result['rounds']} rounds of {result['repeat']} calls each, with the garbage collector paused while a "
            "shape is timed; a shape's cost is its median over rounds. *read as* is how the body was canonicalised: "
            "`json`, `form`, or `raw` (hashed as sent, because canonicalising it would cost too much or it is not "
            "JSON). The ratio is the cost per byte against the first row, measured in the same run.",
            table(["shape", "body", "read as", "MiB", "ms per MiB", "vs JSON"], rows),
            f"The common small body (`{SMALL.decode()}`) costs {result['small_body_us']:.1f} µs per fingerprint.",
            target_table(targets(result)),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON and write nothing")
    args = parser.parse_args()
    began = time.time()
    result = measure(args.quick)
    if args.json:
        print(json.dumps(result))
        return
    markdown = render(result)
    print(markdown)
    meta = {
        "started": datetime.datetime.fromtimestamp(began).strftime("%Y-%m-%d %H:%M"),
        "mode": "quick" if args.quick else "full",
        "minutes": (time.time() - began) / 60,
        "machine": machine(),
    }
    (RESULTS / "raw").mkdir(parents=True, exist_ok=True)
    (RESULTS / "raw" / "fingerprint.json").write_text(
        json.dumps({"meta": meta, "result": result}, indent=1, default=str) + "\n"
    )
    m = meta["machine"]
    footer = (
        f"_Measured {meta['started']} ({meta['mode']} mode, by `benchmarks/fingerprint.py` alone) on {m['cpu']}, "
        f"{m['cores']} cores, Python {m['python']}; load average {load_average()}: compare ratios within one run._"
    )
    (RESULTS / "fingerprint.md").write_text(markdown + "\n\n" + footer + "\n")


if __name__ == "__main__":
    main()
