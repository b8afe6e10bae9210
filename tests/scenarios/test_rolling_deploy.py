"""A rolling deploy: the previous release and this one serve side by side on one schema, under traffic that sends
copies and retries of each request to both (docs/operations.md, "Upgrading while instances of the previous
version run"). Nothing runs twice; what the old instances cannot tell (a fingerprint keyed by a new instance) they
answer 422, as the changelog says, never with a second run."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import asyncpg
import httpx
import pytest

from faults.server import ServerProcess
from idempotency_mw import PostgresStore, __version__

pytestmark = pytest.mark.slow
REPOSITORY = Path(__file__).resolve().parents[2]


def previous_release() -> tuple[str, str]:
    """(version, commit) of the newest release in CHANGELOG.md: the commit that dated its heading."""
    changelog = (REPOSITORY / "CHANGELOG.md").read_text()
    heading = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert heading is not None, "CHANGELOG.md names no release"
    found = subprocess.run(
        ["git", "log", "--format=%H", "-S", heading.group(0), "--", "CHANGELOG.md"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert found, f"no commit introduced {heading.group(0)!r}: this test needs the repository's history"
    return heading.group(1), found[-1]


async def test_the_previous_release_and_this_one_side_by_side_run_nothing_twice(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    version, commit = previous_release()
    monkeypatch.syspath_prepend(str(REPOSITORY / "benchmarks"))  # its harness extracts a revision's library
    from common import library_copy  # type: ignore[import-not-found]

    _, old_library = library_copy(commit)
    env = {"ROLLING_DSN": migrated_url}
    connection = await asyncpg.connect(migrated_url)
    try:
        await connection.execute("CREATE TABLE rolling_effects (key text NOT NULL)")
    finally:
        await connection.close()
    app = "tests.scenarios.rolling_app:app"
    headers = {"Authorization": "Bearer sk_live_rolling"}
    async with (
        ServerProcess(app, env=env, library=old_library) as old,
        ServerProcess(app, env=env) as new,
        httpx.AsyncClient(timeout=30, headers=headers) as http,
    ):
        versions = [(await http.get(server.base_url + "/version")).json() for server in (old, new)]
        assert [v["version"] for v in versions] == [version, __version__]
        assert versions[0]["file"].startswith(str(old_library))
        keys = [f"rolling-{uuid.uuid4().hex[:8]}-{i}" for i in range(40)]
        answers: Counter[tuple[str, int]] = Counter()  # (which instance, status)

        async def send(server: ServerProcess, name: str, key: str) -> None:
            reply = await http.post(server.base_url + "/charges", json={"amount": 10}, headers={"Idempotency-Key": key})
            answers[name, reply.status_code] += 1

        async def operation(index: int) -> None:
            key = keys[index]
            first, second = ((old, "old"), (new, "new")) if index % 2 else ((new, "new"), (old, "old"))
            await asyncio.gather(send(*first, key), send(*second, key))  # two copies at once
            await send(*second, key)  # and a retry on each after they settled
            await send(*first, key)

        await asyncio.gather(*(operation(i) for i in range(len(keys))))
        # A key whose two copies met each other running got 409 on both: its retries ran it, or settle it here.
        for key in keys:
            reply = await http.post(new.base_url + "/charges", json={"amount": 10}, headers={"Idempotency-Key": key})
            assert reply.status_code in (201, 409), reply.text

    connection = await asyncpg.connect(migrated_url)
    try:
        runs = Counter(
            {
                row["key"]: row["n"]
                for row in await connection.fetch("SELECT key, count(*) AS n FROM rolling_effects GROUP BY key")
            }
        )
        # The new instance wrote the parts of the requests it claimed first; the old one left them alone.
        explained = "SELECT count(*) FROM idempotency_records WHERE request_parts IS NOT NULL"
        assert 0 < await connection.fetchval(explained) < len(keys)
    finally:
        await connection.close()
    assert max(runs.values()) == 1, runs  # never twice
    assert set(runs) == set(keys)  # every operation took effect
    assert set(answers) <= {(name, status) for name in ("old", "new") for status in (201, 409, 422)}
    assert answers["new", 422] == 0  # the new instance matches what the old one fingerprinted
    async with PostgresStore(migrated_url, min_size=1, max_size=1) as store:
        assert (await store.stats())["completed"] == len(keys)  # the old instance's responses have no life (0006)
        async with store.connection() as connection:
            await connection.execute("UPDATE idempotency_records SET expires_at = now() - interval '1 s'")
        assert await store.purge_expired() == len(keys)  # both instances' records, with their responses
        async with store.connection() as connection:
            assert await connection.fetchval("SELECT count(*) FROM idempotency_responses") == 0


async def test_the_previous_release_leaves_a_request_at_a_recovery_point_alone(
    migrated_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The previous release knows nothing of recovery points (docs/operations.md, "Handlers in steps and the previous
    release"), and never needs to: a retry it gets of a request this release left at a recovery point is answered 422
    (it cannot match a fingerprint this release stored keyed), so it neither runs the request from its start nor
    releases it with its points; the retry on this release resumes it. An expired one it claims afresh, as this
    release does (a new life: the old points are never resumed), and its purge removes a record in steps, points and
    all (the foreign key cascades)."""
    _, commit = previous_release()
    monkeypatch.syspath_prepend(str(REPOSITORY / "benchmarks"))
    from common import library_copy

    _, old_library = library_copy(commit)
    connection = await asyncpg.connect(migrated_url)
    try:
        await connection.execute("CREATE TABLE rolling_effects (key text NOT NULL)")
        env = {"ROLLING_DSN": migrated_url}
        app, headers = "tests.scenarios.rolling_app:app", {"Authorization": "Bearer sk_live_rolling"}
        stopped, expired, purged = (f"steps-{uuid.uuid4().hex[:8]}-{n}" for n in range(3))
        points = "SELECT count(*) FROM idempotency_recovery_points WHERE key = $1"
        effects = "SELECT count(*) FROM rolling_effects WHERE key = $1"
        async with (
            ServerProcess(app, env=env, library=old_library) as old,
            ServerProcess(app, env=env) as new,
            httpx.AsyncClient(timeout=30, headers=headers) as http,
        ):

            async def pay(server: ServerProcess, key: str, **more: str) -> httpx.Response:
                return await http.post(server.base_url + "/pay", headers={"Idempotency-Key": key, **more})

            for key in (stopped, expired, purged):  # each left at its recovery point by this release
                assert (await pay(new, key, **{"X-Stop": "create_charge"})).status_code == 500
                assert (await connection.fetchval(points, key), await connection.fetchval(effects, key)) == (1, 1)
            assert (await pay(old, stopped)).status_code == 422  # neither run again nor released
            assert await connection.fetchval(points, stopped) == 1
            resumed = await pay(new, stopped)
            assert (resumed.status_code, resumed.json()) == (201, {"charge": stopped, "state": "succeeded"})
            assert await connection.fetchval(effects, stopped) == 1  # its first step ran once

            await connection.execute(
                "UPDATE idempotency_records SET expires_at = now() - interval '1 second' WHERE key = $1", expired
            )
            assert (await pay(old, expired)).status_code == 201  # an expired key is absent: a new life
            assert await connection.fetchval(effects, expired) == 2
            replayed = await pay(new, expired)
            assert (replayed.status_code, replayed.headers.get("idempotent-replayed")) == (201, "true")

        await connection.execute(
            "UPDATE idempotency_records SET expires_at = now() - interval '1 second' WHERE key = $1", purged
        )
        command = [sys.executable, "-m", "idempotency_mw.cli", "--database-url", migrated_url, "gc"]
        gc = await asyncio.create_subprocess_exec(
            *command, env={**os.environ, "PYTHONPATH": str(old_library)}, cwd=old_library,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, errors = await asyncio.wait_for(gc.communicate(), 60)
        assert gc.returncode == 0, errors.decode()
        assert await connection.fetchval(points, purged) == 0  # the previous release's purge: points and all
    finally:
        await connection.close()
