"""The README, as a user reads it: its "Use it" snippet runs as written (with a real database URL filled in), the
figures it quotes are the published results it links to, and it holds no maintainer's notes."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from idempotency_mw import StoreUnavailable
from idempotency_mw.testing import run_lifespan

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARK_RESULTS = ROOT / "benchmarks" / "results" / "README.md"
FAULT_RESULTS = ROOT / "docs" / "faults-results.md"


def section(heading: str) -> str:
    """The README's section under ``## heading``, up to the next one."""
    text = README.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def use_it_snippet() -> str:
    match = re.search(r"```python\n(.*?)```", section("Use it"), re.DOTALL)
    assert match is not None
    return match.group(1)


def run_use_it_snippet(database_url: str) -> tuple[Any, Any]:
    """The snippet's ``app`` and ``store``, on ``database_url``."""
    snippet = use_it_snippet()
    assert "await store.close()" in snippet
    code = snippet.replace('"postgresql://app@db/app"', repr(database_url))
    namespace: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace["app"], namespace["store"]


AUTH = {"Authorization": "Bearer sk_test_readme"}


async def test_the_use_it_snippet_replays_and_opens_and_closes_its_store(idempotency_database_url: str) -> None:
    app, store = run_use_it_snippet(idempotency_database_url)
    async with run_lifespan(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", headers=AUTH) as client:
            key = {"Idempotency-Key": str(uuid.uuid4())}
            first = await client.post("/charges", headers=key, json={"amount": 500})
            again = await client.post("/charges", headers=key, json={"amount": 500})
            other = await client.post("/charges", headers=key, json={"amount": 900})
    assert first.status_code == 201
    assert (again.content, again.headers.get("idempotent-replayed")) == (first.content, "true")
    assert other.status_code == 422
    with pytest.raises(StoreUnavailable):
        await store.inspect("", "any")  # closed at shutdown


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient` is deprecated")
def test_the_use_it_snippet_serves_one_test_client_after_another(idempotency_database_url: str) -> None:
    """The README's module-level store, opened and closed by the lifespan once per test (``with TestClient(app):``,
    each on an event loop of its own): the second startup failed with "the idempotency store's pool is closed"."""
    from starlette.testclient import TestClient

    app, _ = run_use_it_snippet(idempotency_database_url)
    for _ in range(2):
        with TestClient(app, headers=AUTH) as client:
            key = {"Idempotency-Key": str(uuid.uuid4())}
            assert client.post("/charges", headers=key, json={"amount": 5}).status_code == 201
            assert client.post("/charges", headers=key, json={"amount": 5}).headers["idempotent-replayed"] == "true"


# -- the figures it quotes ----------------------------------------------------------------------------------------


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row of the markdown tables in ``text``, header and rule rows left out."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:] if rows else rows


NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def test_the_performance_figures_are_the_published_results() -> None:
    """A short summary (five rows at most) of the published results it links to: every number in the goal and
    measured columns is one the summary holds (it is re-measured as a whole: the README follows it, never the other
    way round), and its count of missed targets is the summary's."""
    results = BENCHMARK_RESULTS.read_text()
    rows = [row for row in table_rows(section("Performance")) if row[0] != "measure"]
    assert 3 <= len(rows) <= 5
    published = [row for row in table_rows(results) if len(row) > 3]
    for measure, goal, measured in rows:
        if measure == "targets missed":
            missed = sum("**missed**" in row[3] for row in published)
            judged = sum(row[3].strip("*") in ("met", "missed") for row in published)
            assert measured.startswith(f"{missed} of {judged},"), measured
            continue
        for number in NUMBER.findall(goal + " " + measured):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", results), f"{number} ({measured})"


OTHERS = re.compile(r"the other (\d+) scenarios")


def test_the_fault_table_is_the_published_results() -> None:
    """A short summary (five rows at most) of the published scenarios, as published: every one that lost or repeated
    an operation in a row of its own, the rest summed in one row."""
    published = {row[0]: row for row in table_rows(FAULT_RESULTS.read_text()) if row[0] != "scenario"}
    quoted = {row[0]: row for row in table_rows(section("Under faults")) if row[0] != "scenarios"}
    assert len(quoted) <= 5
    others = [name for name in quoted if OTHERS.fullmatch(name)]
    assert len(others) == 1, "one row sums the scenarios quoted on no row of their own"
    named = set(quoted) - set(others)
    assert named <= set(published)
    assert {scenario for scenario, row in published.items() if row[3] != "0" or row[4] != "0"} <= named
    for scenario in named:
        _, operations, duplicates, lost = quoted[scenario]
        row = published[scenario]
        assert (operations, duplicates, lost) == (row[1], row[3], row[4]), scenario
    rest = [row for scenario, row in published.items() if scenario not in named]
    match = OTHERS.fullmatch(others[0])
    assert match is not None
    _, operations, duplicates, lost = quoted[others[0]]
    assert int(match.group(1)) == len(rest)
    assert int(operations) == sum(int(row[1]) for row in rest)
    assert (duplicates, lost) == ("0", "0")


# -- written for someone who installs the package -----------------------------------------------------------------


def test_the_readme_holds_no_maintainers_notes() -> None:
    text = README.read_text()
    assert not re.search(r"\bissues?\s+\d", text, re.IGNORECASE), "an issue number"
    assert not re.search(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text), "a commit hash"
    target = r"(?<![\d.])1\d\.\d(?![\d.])(?!\s*(?:µs|ms|x|%|MiB))"  # "14.1 sits on the line"; not "19.7 µs"
    assert not re.search(target, text), "a target's number"
    assert "| module |" not in text, "the module map (docs/design.md has it)"
    assert len(text.split()) < 1500, "a README for someone who installs the package: short, with links for the rest"


def test_the_checkout_section_shows_the_two_commands() -> None:
    """.ci/run calls ./dev test, as the README tells a contributor to."""
    block = re.search(r"```sh\n(.*?)```", section("From a checkout of this repository"), re.DOTALL)
    assert block is not None
    assert [line.split("#")[0].strip() for line in block.group(1).splitlines()] == ["./dev demo", "./dev test"]
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()
