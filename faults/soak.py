"""The soak: every fault scenario, bigger and again and again, for a few minutes; then the table of what happened.

    .venv/bin/python -m faults.soak --minutes 5            # writes docs/faults-results.md
    .venv/bin/python -m faults.soak --minutes 1 --only storm,crash --output /tmp/soak.md

It starts its own PostgreSQL servers (one for the scenarios, one that the outage scenario stops and freezes), runs
the scenarios round after round until the time is up (a round is never cut short), adds up each scenario's
operations, injected faults, duplicate effects, lost operations and the peak resident memory of the processes it
watched, prints the table and writes it as Markdown. The exit status is 1 if a guarantee broke: an error, a lost
operation, or a duplicate effect in a mode that promises exactly once (plain mode's duplicates are its documented
window, and asynchronous replication's lost commits its documented loss: reported, not failed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

if __package__ in (None, ""):  # ``python faults/soak.py``: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faults.bigbodies import run_big_bodies
from faults.crash import run_crash
from faults.failover import run_failover
from faults.lossy import run_lossy
from faults.outage import run_outage
from faults.pg import DisposablePostgres
from faults.pgbouncer import PgBouncer, install_pgbouncer
from faults.report import Result, markdown_table
from faults.steps import GAPS, run_steps
from faults.storm import run_storm
from faults.waiting import run_waiting
from faults.zombie import run_zombie

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "faults-results.md"
Scenario = Callable[[], Awaitable[Result]]


# Scenarios whose lost operations are the measurement, not a failure: asynchronous replication acknowledges
# commits the standby may not have when the primary dies.
MAY_LOSE = {"primary failover, asynchronous replication"}


def scenarios(
    dsn: str, outage_pg: DisposablePostgres, bouncer: Callable[[], str], repeatable: str
) -> dict[str, list[tuple[Scenario, bool]]]:
    """Scenario groups by name; each entry is (run one round, promises exactly once). ``bouncer()`` starts (once)
    a PgBouncer in front of ``dsn`` and returns its DSN; ``repeatable`` is a database of the same server whose
    sessions default to REPEATABLE READ."""

    async def first(coroutine: Awaitable[tuple[Result, Any]]) -> Result:
        return (await coroutine)[0]

    return {
        "storm": [(lambda: first(run_storm(dsn, payments=500, copies=5, in_flight=25)), True)],
        "pgbouncer": [(lambda: first(run_storm(dsn, payments=500, copies=5, in_flight=25, pgbouncer=bouncer())), True)],
        "storm-wait": [(lambda: first(run_storm(dsn, payments=500, copies=5, in_flight=25, on_conflict="wait")), True)],
        "crash-wait": [
            (lambda: first(run_crash(dsn, transactional=True, operations=60, lease=2.0, on_conflict="wait")), True),
        ],
        "wait": [
            (lambda: first(run_waiting(dsn, operations=200, app_pool=8)), True),
            (lambda: first(run_waiting(repeatable, operations=200)), True),
            (lambda: first(run_waiting(repeatable, operations=200, app_pool=8)), True),
        ],
        "storm-rr": [(lambda: first(run_storm(repeatable, payments=500, copies=5, in_flight=25)), True)],
        "crash-rr": [
            (lambda: first(run_crash(repeatable, transactional=True, operations=60, lease=2.0)), True),
            (lambda: first(run_crash(repeatable, transactional=True, sqlalchemy=True, operations=60, lease=2.0)), True),
            (lambda: first(run_crash(repeatable, transactional=False, operations=60, lease=2.0)), False),
        ],
        "crash": [
            (lambda: first(run_crash(dsn, transactional=True, operations=60, lease=2.0)), True),
            (lambda: first(run_crash(dsn, transactional=True, sqlalchemy=True, operations=60, lease=2.0)), True),
            (lambda: first(run_crash(dsn, transactional=False, operations=60, lease=2.0)), False),
        ],
        "outage": [
            (lambda: first(run_outage(mode="stop", clients=10, downtime=5.0, cooldown_calls=10, pg=outage_pg)), True),
            (lambda: first(run_outage(mode="freeze", clients=10, downtime=5.0, cooldown_calls=10, pg=outage_pg)), True),
            (
                lambda: first(
                    run_outage(mode="kill", clients=10, kills=5, downtime=1.0, cooldown_calls=10, pg=outage_pg)
                ),
                True,
            ),
        ],
        "lossy": [(lambda: first(run_lossy(dsn, payments=300, concurrency=20)), True)],
        "zombie": [
            (lambda: first(run_zombie(dsn, transactional=True)), True),
            (lambda: first(run_zombie(dsn, transactional=False)), False),
        ],
        "failover": [
            (lambda: first(run_failover(synchronous=True, clients=10, standby_lag=0.5, cooldown=5.0)), True),
            # Asynchronous replication loses what the standby had not received: reported, not failed.
            (lambda: first(run_failover(synchronous=False, clients=10, standby_lag=0.5, cooldown=5.0)), False),
        ],
        "steps": [(lambda: first(run_steps(dsn, operations=100, copies=3, kills=5)), True)],
        "big": [
            (lambda: first(run_big_bodies(dsn, transactional=True, parallel=8)), True),
            (lambda: first(run_big_bodies(dsn, transactional=False, parallel=8)), True),
        ],
    }


async def soak(minutes: float, only: set[str] | None) -> tuple[dict[str, Result], list[str], int]:
    results: dict[str, Result] = {}
    problems: list[str] = []
    rounds = 0
    deadline = time.monotonic() + minutes * 60
    with contextlib.ExitStack() as stack:
        main_pg = stack.enter_context(DisposablePostgres())
        outage_pg = stack.enter_context(DisposablePostgres())
        bouncers: list[PgBouncer] = []

        def bouncer() -> str:
            if not bouncers:
                bouncers.append(stack.enter_context(PgBouncer(main_pg.dsn, pool_mode="transaction")))
            return bouncers[0].dsn

        repeatable = await repeatable_read_database(main_pg.dsn)
        groups = scenarios(main_pg.dsn, outage_pg, bouncer, repeatable)
        chosen = [name for name in groups if only is None or name in only]
        while rounds == 0 or time.monotonic() < deadline:
            rounds += 1
            for name in chosen:
                for run, exactly_once in groups[name]:
                    started = time.monotonic()
                    try:
                        result = await run()
                    except Exception:
                        problems.append(f"round {rounds}, {name}: {traceback.format_exc()}")
                        print(problems[-1], file=sys.stderr, flush=True)
                        continue
                    slept = result.measures.get("slept out their wait", 0)
                    if (
                        (result.lost and result.scenario not in MAY_LOSE)
                        or (exactly_once and result.duplicates)
                        or slept
                    ):
                        problems.append(
                            f"round {rounds}, {result.scenario}: {result.duplicates} duplicates, {result.lost} lost, "
                            f"{slept:g} waiters slept out their wait"
                        )
                    if result.scenario in results:
                        results[result.scenario].merge(result)
                    else:
                        results[result.scenario] = result
                    print(
                        f"round {rounds} {result.scenario}: {result.operations} ops, {result.duplicates} dup, "
                        f"{result.lost} lost ({time.monotonic() - started:.1f} s)",
                        flush=True,
                    )
    for result in results.values():
        _finish_notes(result)
    return results, problems, rounds


async def repeatable_read_database(dsn: str) -> str:
    """A database of ``dsn``'s server whose sessions default to REPEATABLE READ (an app's common choice)."""
    name = "soak_repeatable_read"
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await connection.execute(f"CREATE DATABASE {name}")
        await connection.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'")
    finally:
        await connection.close()
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


def _finish_notes(result: Result) -> None:
    """Turn the summed measures into the table's notes, where a round's own note would undersell the run."""
    m = result.measures
    if result.scenario.startswith("crash"):
        kills = int(m.get("kills", 0))
        result.faults = f"{kills} SIGKILLs with {int(m.get('mid-flight at kill', 0))} handlers mid-flight, restarts"
        if "plain" in result.scenario:
            result.notes.insert(
                0,
                f"{int(m.get('committed at kill', 0))} effects were committed but not recorded at the kills; "
                f"{result.duplicates} of them ran again (the seen-set window)",
            )
    elif result.scenario.startswith("database outage"):
        result.notes = [
            f"{int(m.get('503s', 0))} x 503 while down, slowest {m.get('worst 503 seconds', 0):.2f} s, slowest "
            f"attempt {m.get('worst attempt seconds', 0):.2f} s (store timeout 1 s)"
        ]
    elif result.scenario == "lossy network":
        result.faults = (
            f"{int(m['resets'] + m['dropped'] + m['cut'])} ({int(m['resets'])} resets, {int(m['dropped'])} answers "
            f"dropped, {int(m['cut'])} clients cut off)"
        )
    elif result.scenario.startswith("zombie"):
        result.faults = f"{int(m.get('pauses', 0))} SIGSTOPs past the lease, takeover by a second worker, SIGCONT"
    elif result.scenario.startswith("primary failover"):
        failovers = int(m.get("failovers", 0))
        result.faults = (
            f"{failovers} primary SIGKILLs under traffic (the standby 0.5 s behind), standby promoted 1 s later"
        )
        result.notes = [
            f"{int(m.get('acknowledged lost', 0))} of {int(m.get('acknowledged', 0))} acknowledged calls lost, "
            f"{int(m.get('rerun on resend', 0))} ran again when resent; {int(m.get('gap 503s', 0))} x 503 in the "
            f"gaps; first success at most {m.get('worst seconds to first success', 0):.1f} s after a kill; "
            f"{int(m.get('in flight 503', 0))} of {int(m.get('in flight at kill', 0))} requests in flight at the "
            f"kills answered 503, the rest 201"
        ]
    elif result.scenario.startswith("waiting"):
        result.notes = [
            f"copies that slept out their wait after their original settled: {int(m.get('slept out their wait', 0))} "
            f"of {int(m.get('replays', 0)) + int(m.get('slept out their wait', 0))}; slowest replay "
            f"{m.get('worst replay lag, s', 0):.2f} s after its original's answer; {int(m.get('other answers', 0))} "
            "other answers"
        ]
    elif result.scenario.startswith("steps"):
        kills, caught = int(m.get("kills", 0)), sum(int(m.get(f"caught {gap}", 0)) for gap in GAPS[1:])
        result.faults = (
            f"{kills} SIGKILLs with {caught} payouts between two steps, restarts; 3 copies of each; "
            f"{int(m.get('network faults', 0))} network faults; {int(m.get('provider 503s', 0))} provider 503s"
        )
        result.notes = [
            "caught at the kills: " + ", ".join(f"{int(m.get(f'caught {gap}', 0))} {gap}" for gap in GAPS),
            f"{int(m.get('provider transfers', 0))} provider transfers in {int(m.get('provider calls', 0))} calls; "
            f"{int(m.get('mismatched answers', 0))} answers that disagree with their effect",
        ]
    elif result.scenario.startswith("storm"):
        result.notes = [
            f"duplicate copies answered: {int(m.get('conflicts', 0))} x 409, {int(m.get('replays', 0))} replays, "
            f"{int(m.get('other answers', 0))} other"
        ]


def render(results: dict[str, Result], problems: list[str], rounds: int, minutes: float, command: str) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = [
        "# Fault soak results",
        "",
        f"Generated by `{command}` on {when} ({machine}): {rounds} rounds in {minutes:.1f} minutes.",
        "See [faults.md](faults.md) for what each scenario does and what the numbers mean.",
        "",
        markdown_table(results.values()),
        "",
    ]
    if problems:
        lines += ["## Problems", "", *(f"- {p.strip().splitlines()[-1]}" for p in problems), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the fault scenarios for a while and publish the table.")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to keep starting rounds (default 5)")
    parser.add_argument(
        "--only",
        help="comma-separated groups: storm, storm-wait, wait, storm-rr, crash, crash-wait, crash-rr, outage, lossy, "
        "zombie, failover, pgbouncer, big, steps",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"Markdown file (default {DEFAULT_OUTPUT})")
    args = parser.parse_args(argv)
    only = {name.strip() for name in args.only.split(",")} if args.only else None
    # The apps under fault key their request fingerprints under the tenant secret (their resolvers are their own).
    os.environ.setdefault("IDEMPOTENCY_TENANT_SECRET", "faults-soak-tenant-secret-" + "0" * 40)
    if only is None or "pgbouncer" in only:
        install_pgbouncer()  # the soak sets up its own machine (for the test suite, ./dev test does)
    started = time.monotonic()
    results, problems, rounds = asyncio.run(soak(args.minutes, only))
    elapsed = (time.monotonic() - started) / 60
    command = "python -m faults.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    report = render(results, problems, rounds, elapsed, command.strip())
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print(f"written to {args.output}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
