"""What can go wrong in the command line, and how each failure is told: one line on stderr and an exit status,
never a traceback for what is expected (docs/cli.md, "Exit statuses")."""

from __future__ import annotations

import asyncpg

from idempotency_mw.store import StoreNotMigrated, StoreUnavailable

PROG = "idempotency-mw"
EXIT_OK, EXIT_NOT_FOUND, EXIT_USAGE, EXIT_DATABASE, EXIT_PENDING, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
# reencrypt: every response it could re-seal is re-sealed, but an older key still keys live records' fingerprints
EXIT_KEY_NEEDED = 5
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE: what a shell shows for a command whose reader went away (`| head`)


class CommandError(Exception):
    """An expected failure: printed as one line on stderr, and the process exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_DATABASE) -> None:
        super().__init__(message)
        self.code = code


class OutputClosed(Exception):
    """Standard output was closed by its reader (``idempotency-mw stats | head``): not a database error."""


def say(text: str) -> None:
    """Print a result on standard output; a reader that went away ends the command quietly, not as an error."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise OutputClosed from None


def explain(error: BaseException, timeout: float) -> CommandError:
    """Turn what asyncpg and the store raise into one line a person can act on."""
    if isinstance(error, StoreNotMigrated):
        option = "" if error.schema == "public" else f" --schema {error.schema}"
        return CommandError(
            f'the idempotency tables are missing from schema "{error.schema}" of this database: '
            f"run `{PROG}{option} migrate` first"
        )
    cause = error.__cause__ if isinstance(error, StoreUnavailable) and error.__cause__ else error
    if isinstance(cause, asyncpg.exceptions.ClientConfigurationError):
        return CommandError(f"invalid database URL: {cause}")
    if isinstance(cause, TimeoutError):
        return CommandError(f"the database did not answer within {timeout:g}s (is it up? see --timeout)")
    if isinstance(cause, OSError):
        return CommandError(f"cannot reach the database: {cause.strerror or cause}")
    if isinstance(
        cause,
        asyncpg.exceptions.InvalidCatalogNameError
        | asyncpg.exceptions.InvalidAuthorizationSpecificationError
        | asyncpg.exceptions.InvalidPasswordError,
    ):
        return CommandError(f"the database refused the connection: {cause}")
    if isinstance(cause, asyncpg.exceptions.PostgresError | asyncpg.exceptions.InterfaceError | StoreUnavailable):
        return CommandError(f"database error: {cause}")
    raise error  # not an expected failure: let the traceback show
