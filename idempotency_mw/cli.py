"""The ``idempotency-mw`` command line: operate the PostgreSQL store from a shell.

``migrate`` creates or upgrades the tables (``--check`` and ``--sql`` only look), ``gc`` purges expired records in
batches, ``inspect`` and ``forget`` look at or delete one record, ``stats`` summarises the table, and ``reencrypt``
re-seals stored responses under the current response key (``encryption.py``). Every expected failure (no database
URL, a malformed one, a server that does not answer, a database not migrated yet, an unknown key) ends in one line
on stderr and a non-zero exit status, never a traceback: 0 success, 1 no such record, 2 usage error (including no
database URL), 3 database error, 4 migrations pending (``migrate --check``), 5 an older response key is still
needed by live records' fingerprints (``reencrypt``), 130 interrupted, 141 standard output closed by its reader
(``| head``: not a database error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from idempotency_mw import __version__
from idempotency_mw import _environment as environment
from idempotency_mw._cli_arguments import moment, non_negative, positive, schema_name, tenant_tag_text, utf8_text
from idempotency_mw._cli_display import (
    by_key,
    duration,
    format_listing,
    format_record,
    format_stalled,
    iso,
    listing_to_dict,
    plural,
    record_to_dict,
    stalled_to_dict,
)
from idempotency_mw._cli_errors import (
    EXIT_DATABASE,
    EXIT_INTERRUPTED,
    EXIT_KEY_NEEDED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_OUTPUT_CLOSED,
    EXIT_PENDING,
    EXIT_USAGE,
    PROG,
    CommandError,
    OutputClosed,
    explain,
    say,
)
from idempotency_mw._cli_tenants import record_id, tenants_to_list
from idempotency_mw._fingerprint import derived_from_response_keys
from idempotency_mw._keys import PREFIX, SECRET_VARIABLE
from idempotency_mw.postgres._recovery import (
    ResealedResults,
    reseal_step_results,
    stalled_requests,
    step_results_by_key,
)
from idempotency_mw.postgres._sql import check_schema, migration_statements, migrations
from idempotency_mw.postgres._store import PostgresStore
from idempotency_mw.store import ResealedBatch, SealedResponseError, StoreNotGranted, StoreNotMigrated

if TYPE_CHECKING:
    from idempotency_mw.encryption import ResponseCipher

KEYS_VARIABLE = "IDEMPOTENCY_RESPONSE_KEYS"  # as idempotency_mw.encryption, which needs the encryption extra

Command = Callable[[PostgresStore, argparse.Namespace], Awaitable[int]]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status (the console script passes it to ``sys.exit``)."""
    try:
        args = build_parser().parse_args(argv)
        _defaults_from_environment(args)
        return asyncio.run(_run(args))
    except CommandError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OutputClosed:
        _discard_stdout()
        return EXIT_OUTPUT_CLOSED


def _discard_stdout() -> None:
    """Point standard output at /dev/null: Python flushes it at exit, which would fail on the closed pipe again
    and print a warning (the recipe of the signal module's documentation)."""
    with contextlib.suppress(AttributeError, OSError, ValueError):  # not a real file (a test's capture)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# -- arguments ------------------------------------------------------------------------------------------------


def _global_options(*, after_command: bool = False) -> argparse.ArgumentParser:
    """``--database-url``, ``--timeout`` and ``--schema``, accepted before the command and after it (users type both
    orders). After the command they default to "not given" (``SUPPRESS``): a value given before the command stays."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=argparse.SUPPRESS if after_command else None,
        help="PostgreSQL URL, postgresql://user:password@host:port/database; SQLAlchemy's postgresql+asyncpg://… "
        "(any +driver) is taken too (default: $DATABASE_URL)",
    )
    parser.add_argument(
        "--timeout",
        type=positive(float),
        default=argparse.SUPPRESS if after_command else None,
        metavar="SECONDS",
        help=f"give up on connecting or on any one statement after this long (default: ${environment.STORE_TIMEOUT}, "
        "else 5)",
    )
    parser.add_argument(
        "--schema",
        type=schema_name,
        default=argparse.SUPPRESS if after_command else None,
        metavar="NAME",
        help="the PostgreSQL schema of the store's tables, as in PostgresStore(schema=...); migrate creates it "
        f"(default: ${environment.SCHEMA}, else public)",
    )
    return parser


def _defaults_from_environment(args: argparse.Namespace) -> None:
    """``--timeout`` and ``--schema`` when not given: from the environment the app reads too, else 5 and public."""
    try:
        args.timeout = environment.seconds(environment.STORE_TIMEOUT, args.timeout, 5.0)
        args.schema = check_schema(environment.text(environment.SCHEMA, args.schema, "public"))
    except ValueError as error:
        raise CommandError(str(error), EXIT_USAGE) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Operate the idempotency_mw PostgreSQL store.",
        parents=[_global_options()],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    after = [_global_options(after_command=True)]

    migrate = commands.add_parser("migrate", parents=after, help="create or upgrade the tables (safe to repeat)")
    migrate.set_defaults(handler=cmd_migrate)
    instead = migrate.add_mutually_exclusive_group()
    instead.add_argument(
        "--check", action="store_true", help="change nothing; exit 4 and name them when migrations are pending"
    )
    instead.add_argument(
        "--sql", action="store_true", help="change nothing; print the SQL migrate would run here, for review"
    )
    instead.add_argument(
        "--stamp",
        action="store_true",
        help="record the migrations as applied without running them (tables another tool created from them)",
    )

    gc = commands.add_parser("gc", parents=after, help="delete expired records in batches")
    gc.add_argument("--batch-size", type=positive(int), default=1000, help="records per batch (default: 1000)")
    gc.add_argument("--max-batches", type=positive(int), help="stop after this many batches (default: no limit)")
    gc.add_argument("--pause", type=non_negative(float), default=0.0, metavar="SECONDS", help="sleep between batches")
    gc.add_argument("--dry-run", action="store_true", help="count the expired records, delete nothing")
    gc.set_defaults(handler=cmd_gc)

    for name, handler, summary in (
        ("inspect", cmd_inspect, "show one record"),
        ("forget", cmd_forget, "delete one record, whatever its state"),
    ):
        sub = commands.add_parser(
            name,
            parents=after,
            help=summary,
            usage=f"{PROG} {name} [-h] [--authorization-from VARIABLE|-] [TENANT] KEY"
            + (" [--json] [--keys-from VARIABLE]" if name == "inspect" else "")
            + " [--database-url URL] [--timeout SECONDS] [--schema NAME]",
            description=f"{summary.capitalize()}. TENANT is the tenant string exactly as the app's tenant resolver "
            f"returned it. With the default resolver (AuthorizationTenant) --authorization-from may name it "
            f"instead: it computes the tenant from the client's Authorization header and {SECRET_VARIABLE}.",
        )
        sub.add_argument("tenant", nargs="?", metavar="TENANT", help="the tenant as stored")
        sub.add_argument("key", nargs="?", metavar="KEY", help="the Idempotency-Key as the client sent it")
        sub.add_argument(
            "--authorization-from",
            metavar="VARIABLE|-",
            help=f'where the client\'s Authorization header value ("Bearer sk_...") is: an environment variable, or '
            f"- for standard input (typed without echo at a terminal); the tenant is what the default resolver "
            f"derives from it with ${SECRET_VARIABLE}. Never on the command line, where ps and the shell's history "
            "would show it",
        )
        sub.add_argument("--authorization", metavar="VALUE", help=argparse.SUPPRESS)  # refused: see _authorization
        if name == "inspect":
            sub.add_argument("--json", action="store_true", help="machine-readable output")
            _keys_option(sub, f"the response keys, to show a sealed response (when set; default: ${KEYS_VARIABLE})")
        sub.set_defaults(handler=handler)

    listing = commands.add_parser(
        "list",
        parents=after,
        help="a tenant's records first claimed in a time window",
        usage=f"{PROG} list [-h] (TENANT | --tag TAG | --authorization-from VARIABLE|-) [--since WHEN] [--until WHEN] "
        "[--limit N] [--json] [--database-url URL] [--timeout SECONDS] [--schema NAME]",
        description="A tenant's records first claimed between --since and --until, oldest first, with each key's "
        "hash as the logs show it: for a support desk that knows the customer, or has a log line, and roughly "
        f"when. --tag finds the tenant by the tag the log lines show (it needs {SECRET_VARIABLE}, and reads every "
        "record of the window: keep it short).",
    )
    listing.add_argument("tenant", nargs="?", type=utf8_text, metavar="TENANT", help="the tenant as stored")
    listing.add_argument("--tag", type=tenant_tag_text, help="the tenant's tag in the log lines (8 hex digits)")
    listing.add_argument(
        "--authorization-from",
        metavar="VARIABLE|-",
        help="the client's Authorization header value, from an environment variable or standard input (-), as "
        "for inspect",
    )
    listing.add_argument("--authorization", metavar="VALUE", help=argparse.SUPPRESS)  # refused, as for inspect
    listing.add_argument(
        "--since",
        type=moment,
        default="24h",
        metavar="WHEN",
        help="an ISO 8601 time, or 90s, 30m, 2h, 7d ago (default: 24h)",
    )
    listing.add_argument("--until", type=moment, default="0s", metavar="WHEN", help="the same (default: now)")
    listing.add_argument("--limit", type=positive(int), default=100, help="records per tenant at most (default: 100)")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=cmd_list)

    stats = commands.add_parser("stats", parents=after, help="records by state, expired, past their lease, attempts")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    stats.set_defaults(handler=cmd_stats)

    stalled = commands.add_parser(
        "stalled",
        parents=after,
        help="requests stopped at a step that no retry has resumed",
        description="Requests of handlers that run in steps, stopped at a recovery point whose lease lapsed at least "
        "--lapsed-for ago and that no retry has resumed, oldest first, with the last step each reached: retry them "
        "with their key, or settle them with the other side and forget them (docs/operations.md, stalled requests). "
        "Exit status 1 when there is none.",
    )
    stalled.add_argument(
        "--lapsed-for", type=non_negative(float), default=60.0, metavar="SECONDS", help="(default: 60)"
    )
    stalled.add_argument("--limit", type=positive(int), default=100, help="requests at most (default: 100)")
    stalled.add_argument("--json", action="store_true", help="machine-readable output")
    stalled.set_defaults(handler=cmd_stalled)

    reencrypt = commands.add_parser(
        "reencrypt",
        parents=after,
        help="re-seal stored responses under the current response key, in batches",
        description="Re-seal every stored response sealed under an older key of the cipher under its current key "
        "(the first one), and with --seal-plain those stored plain too; in batches, safe beside live traffic and "
        "beside another run. Responses under keys that are not given are left as they are, and counted. Exit status 5 "
        "when an older key must stay all the same: live records' fingerprints are under a key derived from it.",
    )
    reencrypt.add_argument("--batch-size", type=positive(int), default=500, help="responses per batch (default: 500)")
    reencrypt.add_argument("--max-batches", type=positive(int), help="stop after this many batches (default: no limit)")
    reencrypt.add_argument(
        "--pause", type=non_negative(float), default=0.0, metavar="SECONDS", help="sleep between batches"
    )
    reencrypt.add_argument("--seal-plain", action="store_true", help="seal the responses stored plain as well")
    reencrypt.add_argument("--dry-run", action="store_true", help="count the responses by key, change nothing")
    _keys_option(reencrypt, f"the response keys, current first (default: ${KEYS_VARIABLE})")
    reencrypt.set_defaults(handler=cmd_reencrypt)

    return parser


def _keys_option(parser: argparse.ArgumentParser, summary: str) -> None:
    parser.add_argument(
        "--keys-from",
        metavar="VARIABLE",
        default=KEYS_VARIABLE,
        help=f"{summary}; the environment variable that holds them, id:key,id:key as the app's. Never the keys "
        "themselves on the command line, where the shell's history and ps would show them",
    )


# -- the database ---------------------------------------------------------------------------------------------


async def _run(args: argparse.Namespace) -> int:
    handler: Command = args.handler
    if handler in (cmd_inspect, cmd_forget):
        record_id(args)  # usage errors before any connection attempt
    async with _open_store(args) as store:
        try:
            return await handler(store, args)
        except (CommandError, OutputClosed):
            raise
        except Exception as error:
            raise explain(error, args.timeout) from error


@contextlib.asynccontextmanager
async def _open_store(args: argparse.Namespace) -> AsyncIterator[PostgresStore]:
    url = args.database_url or os.environ.get("DATABASE_URL")
    if not url:
        raise CommandError("no database: pass --database-url or set DATABASE_URL", EXIT_USAGE)
    cipher = _cipher(args)
    try:
        store = PostgresStore(url, timeout=args.timeout, min_size=1, max_size=1, schema=args.schema, cipher=cipher)
    except ValueError as error:  # not a PostgreSQL URL
        raise CommandError(f"invalid database URL: {error}") from error
    try:
        try:
            await store.open()
        except StoreNotMigrated as error:
            if args.handler is not cmd_migrate:  # migrate creates them, on a connection the store opens for it
                raise explain(error, args.timeout) from error
        except StoreNotGranted as error:
            # A support desk's or a monitoring job's role may only read, and migrate runs as the tables' owner: they
            # go on, and the store, which closed what the failed open() opened, connects again on first use.
            if args.handler is not cmd_migrate and not _only_reads(args):
                raise explain(error, args.timeout) from error
        except (ValueError, OverflowError) as error:  # asyncpg's DSN parser, a malformed or out-of-range port
            raise CommandError(f"invalid database URL: {error}") from error
        except Exception as error:
            raise explain(error, args.timeout) from error
        yield store
    finally:
        await store.close()


def _only_reads(args: argparse.Namespace) -> bool:
    """Whether the command only reads the store's tables: then a role granted SELECT on them alone runs it, though
    open() refuses that role for the store's requests (StoreNotGranted), which write."""
    if args.handler in (cmd_inspect, cmd_list, cmd_stats, cmd_stalled):
        return True
    return args.handler in (cmd_gc, cmd_reencrypt) and bool(args.dry_run)


def _cipher(args: argparse.Namespace) -> ResponseCipher | None:
    """The response keys from the environment variable ``--keys-from`` names: for ``reencrypt``, which needs them, and
    for ``inspect`` when the variable is set (to show a sealed response); None otherwise."""
    variable: str | None = getattr(args, "keys_from", None)
    if variable is None or (args.handler is not cmd_reencrypt and not os.environ.get(variable, "").strip()):
        return None
    try:
        from idempotency_mw.encryption import ResponseCipher
    except ImportError as error:
        raise CommandError(str(error), EXIT_USAGE) from None
    try:
        # Showing a record is no place to refuse a plain one: the app's own cipher decides what it replays.
        return ResponseCipher.from_env(variable, allow_plain=args.handler is not cmd_reencrypt)
    except ValueError as error:
        raise CommandError(str(error), EXIT_USAGE) from None


# -- commands -------------------------------------------------------------------------------------------------


async def cmd_migrate(store: PostgresStore, args: argparse.Namespace) -> int:
    if args.check or args.sql:
        return await _pending(store, args)
    if args.stamp:
        try:
            recorded = await store.stamp_migrations()
        except ValueError as error:
            raise CommandError(str(error)) from None
        for name in recorded:
            say(f"recorded {name} as applied")
        if not recorded:
            say("up to date")
        return EXIT_OK
    try:
        applied = await store.migrate()
    except asyncpg.exceptions.InsufficientPrivilegeError as error:
        raise CommandError(
            f"{error}: migrate creates tables, so it needs the CREATE privilege on schema {args.schema} (and on the "
            "database, to create a schema that does not exist): run it as the schema's owner; the app's runtime "
            "role needs only SELECT, INSERT, UPDATE and DELETE on the tables (docs/operations.md)"
        ) from None
    except (asyncpg.exceptions.DuplicateTableError, asyncpg.exceptions.DuplicateObjectError) as error:
        raise CommandError(
            f"{error}: the tables exist, but schema {args.schema}'s idempotency_schema_migrations does not record "
            f"them (created by another tool?). If they are this version's, record them with `{PROG} --schema "
            f"{args.schema} migrate --stamp`"
        ) from None
    for name in applied:
        say(f"applied {name}")
    if not applied:
        say("up to date")
    return EXIT_OK


async def _pending(store: PostgresStore, args: argparse.Namespace) -> int:
    """``migrate --check`` and ``migrate --sql``: what this database lacks, read only."""
    pending = await store.pending_migrations()
    if args.sql:
        applied = {version for version, name, _ in migrations(args.schema) if name not in pending}
        if not pending:
            say(f'-- schema "{args.schema}" is up to date: nothing to run')
            return EXIT_OK
        statements = migration_statements(args.schema, applied=applied)
        header = (
            f'-- idempotency_mw {__version__}: what migrate would run on schema "{args.schema}" ({", ".join(pending)})'
        )
        say("\n".join([header, "BEGIN;", *(f"{statement};\n" for statement in statements), "COMMIT;"]))
        return EXIT_OK
    if pending:
        say(f"pending: {', '.join(pending)}")
        return EXIT_PENDING
    say("up to date")
    return EXIT_OK


async def cmd_gc(store: PostgresStore, args: argparse.Namespace) -> int:
    if args.dry_run:
        count = await store.count_expired()
        if args.max_batches is not None:
            count = min(count, args.max_batches * args.batch_size)
        say(f"{count} expired record{plural(count)} would be deleted (dry run)")
        return EXIT_OK
    total = batches = 0
    while args.max_batches is None or batches < args.max_batches:
        deleted = await store.purge_expired(batch_size=args.batch_size)
        batches += 1
        total += deleted
        print(f"batch {batches}: deleted {deleted} ({total} so far)", file=sys.stderr, flush=True)
        if deleted < args.batch_size:  # the backlog is gone (rows locked by a concurrent gc were skipped)
            break
        if args.pause:
            await asyncio.sleep(args.pause)
    say(f"deleted {total} expired record{plural(total)}")
    return EXIT_OK


async def cmd_inspect(store: PostgresStore, args: argparse.Namespace) -> int:
    tenant, key = record_id(args)
    try:
        record = await store.inspect(tenant, key)
    except SealedResponseError as error:
        raise CommandError(f"cannot show the response of key {key!r} of tenant {tenant!r}: {error}") from error
    if record is None:
        raise _not_found(args, tenant, key)
    shown = record_to_dict(record, now=time.time())
    if args.json:
        say(json.dumps(shown, indent=2))
    else:
        say(format_record(shown))
    return EXIT_OK


async def cmd_forget(store: PostgresStore, args: argparse.Namespace) -> int:
    tenant, key = record_id(args)
    if not await store.forget(tenant, key):
        raise _not_found(args, tenant, key)
    say(f"forgot key {key!r} of tenant {tenant!r}")
    return EXIT_OK


async def cmd_list(store: PostgresStore, args: argparse.Namespace) -> int:
    if args.until <= args.since:
        raise CommandError("--until must be later than --since", EXIT_USAGE)
    tenants = await tenants_to_list(store, args)
    listed = [
        listing_to_dict(tenant, await store.list_records(tenant, args.since, args.until, limit=args.limit))
        for tenant in tenants
    ]
    say(json.dumps(listed, indent=2) if args.json else format_listing(listed, args.since, args.until))
    return EXIT_OK if any(entry["records"] for entry in listed) else EXIT_NOT_FOUND


async def cmd_stats(store: PostgresStore, args: argparse.Namespace) -> int:
    stats = await store.stats()
    if args.json:
        say(json.dumps(stats, indent=2))
        return EXIT_OK
    oldest = stats["oldest_in_progress_seconds"]
    rows = [
        ("in progress", str(stats["in_progress"])),
        ("completed", str(stats["completed"])),
        ("expired (awaiting gc)", str(stats["expired"])),
        ("past their lease", str(stats["past_lease"])),
        ("oldest in progress", "-" if oldest is None else duration(oldest)),
        ("attempts (all records)", str(stats["attempts"])),
        ("stalled at a step", str(stats["stalled"])),
    ]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        say(f"{label:<{width}}  {value}")
    return EXIT_OK


async def cmd_stalled(store: PostgresStore, args: argparse.Namespace) -> int:
    found = await stalled_requests(store, lapsed_for=args.lapsed_for, limit=args.limit)
    shown = stalled_to_dict(found, now=time.time())
    say(json.dumps(shown, indent=2) if args.json else format_stalled(shown))
    return EXIT_OK if found else EXIT_NOT_FOUND


async def cmd_reencrypt(store: PostgresStore, args: argparse.Namespace) -> int:
    """Re-seal the responses, then the step results (recovery points, docs/design.md §10): both are sealed under the
    store's cipher, and an old key can only go once neither needs it."""
    cipher = store.cipher
    assert cipher is not None  # _cipher gives reencrypt one, or stops
    if args.dry_run:
        say(by_key(await store.responses_by_key(), cipher, args.seal_plain, dry_run=True))
        if results := await step_results_by_key(store):
            say(by_key(results, cipher, args.seal_plain, dry_run=True, noun="step result"))
        await _kept_for_fingerprints(store, cipher)
        return EXIT_OK
    total, unreadable = await _reseal(store, args, "responses")
    say(f"re-sealed {total} response{plural(total)} under key {cipher.current!r}")
    counts = await store.responses_by_key()
    say(by_key(counts, cipher, args.seal_plain, dry_run=False))
    unreadable += _passed_over(counts, cipher, "response")
    left_results = 0
    results = await step_results_by_key(store)
    if any(key_id != cipher.current for key_id in results):  # something to re-seal (or to report as passed over)
        total, left_results = await _reseal(store, args, "step results")
        say(f"re-sealed {total} step result{plural(total)} under key {cipher.current!r}")
        results = await step_results_by_key(store)
    if results:
        say(by_key(results, cipher, args.seal_plain, dry_run=False, noun="step result"))
        left_results += _passed_over(results, cipher, "step result")
    kept = await _kept_for_fingerprints(store, cipher)
    left = [f"{n} {noun}{plural(n)}" for n, noun in ((unreadable, "response"), (left_results, "step result")) if n]
    if left:
        raise CommandError(f"{' and '.join(left)} could not be opened and were left as they are")
    for key_id, records in kept.items():
        print(
            f"{PROG}: key {key_id!r} is still needed by the fingerprints of {records} live record{plural(records)}: "
            "do not drop it yet",
            file=sys.stderr,
            flush=True,
        )
    return EXIT_KEY_NEEDED if kept else EXIT_OK


async def _kept_for_fingerprints(store: PostgresStore, cipher: ResponseCipher) -> dict[str, int]:
    """The older response keys that must stay whatever is sealed under them, reported on stdout: where the app
    derives its fingerprint keys from the response keys, the live records fingerprinted under a key derived from one
    of them (re-sealing never re-keys a fingerprint) are another request without it, their retries 422s, until they
    expire. Returns how many records hold each."""
    derived = dict(zip(derived_from_response_keys(cipher).key_ids, cipher.key_ids, strict=True))
    older = [fingerprint_key for fingerprint_key, key_id in derived.items() if key_id != cipher.current]
    kept: dict[str, int] = {}
    for fingerprint_key, (records, expires_at) in (await store.live_fingerprints_by_key(older)).items():
        key_id = derived[fingerprint_key]
        kept[key_id] = records
        has = "has its fingerprint" if records == 1 else "have their fingerprints"
        say(
            f"keep key {key_id!r} until {iso(expires_at.timestamp())}: {records} live record{plural(records)} "
            f"{has} under the fingerprint key derived from it ({fingerprint_key!r})"
        )
    return kept


async def _reseal(store: PostgresStore, args: argparse.Namespace, what: str) -> tuple[int, int]:
    """Re-seal ``what`` (the responses, or the step results) in batches: how many, and how many did not open."""
    total = batches = unreadable = 0
    after: Any = None
    while args.max_batches is None or batches < args.max_batches:
        if what == "responses":
            batch: ResealedBatch | ResealedResults = await store.reencrypt(
                batch_size=args.batch_size, seal_plain=args.seal_plain, after=after
            )
        else:
            batch = await reseal_step_results(
                store, batch_size=args.batch_size, seal_plain=args.seal_plain, after=after
            )
        batches += 1
        total += batch.resealed
        for tenant, key, why in batch.unreadable:
            unreadable += 1
            print(f"{PROG}: left key {key!r} of tenant {tenant!r} as it is: {why}", file=sys.stderr, flush=True)
        label = "batch" if what == "responses" else "step results batch"
        print(f"{label} {batches}: re-sealed {batch.resealed} ({total} so far)", file=sys.stderr, flush=True)
        after = batch.after
        if after is None:  # every one was looked at
            break
        if args.pause:
            await asyncio.sleep(args.pause)
    return total, unreadable


def _passed_over(counts: dict[str | None, int], cipher: ResponseCipher, noun: str) -> int:
    """Those sealed under a key that was not given (passed over: they cannot be opened here), reported on stderr."""
    left = 0
    for key_id, count in counts.items():
        if key_id is not None and key_id not in cipher.key_ids:
            left += count
            they, are = ("it", "is") if count == 1 else ("they", "are")
            print(
                f"{PROG}: left {count} {noun}{plural(count)} sealed under key {key_id!r} as {they} {are}: that key "
                f"was not given, so {they} cannot be opened here (give it after the current key)",
                file=sys.stderr,
                flush=True,
            )
    return left


def _not_found(args: argparse.Namespace, tenant: str, key: str) -> CommandError:
    message = f"no record for key {key!r} of tenant {tenant!r}"
    if args.authorization_from is not None:
        message += f" (if it should exist, check that {SECRET_VARIABLE} is the servers' secret)"
    elif not tenant.startswith(PREFIX):
        message += (
            " (TENANT must be exactly what the app's tenant resolver returned; with the default resolver, "
            "give the client's header with --authorization-from instead)"
        )
    return CommandError(message, EXIT_NOT_FOUND)


__all__ = [
    "EXIT_DATABASE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_OUTPUT_CLOSED",
    "EXIT_PENDING",
    "EXIT_USAGE",
    "CommandError",
    "build_parser",
    "main",
]

if __name__ == "__main__":  # python -m idempotency_mw.cli: the console script's twin
    sys.exit(main())
