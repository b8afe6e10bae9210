"""Which tenant a command means: the tenant as stored, the one the default resolver derives from a client's
Authorization header (never taken on the command line), or the ones the log lines tag alike."""

from __future__ import annotations

import argparse
import getpass
import os
import sys

from idempotency_mw._cli_arguments import utf8_text
from idempotency_mw._cli_display import iso
from idempotency_mw._cli_errors import EXIT_NOT_FOUND, EXIT_USAGE, CommandError
from idempotency_mw._events import tenant_tag
from idempotency_mw._keys import SECRET_VARIABLE, AuthorizationTenant
from idempotency_mw.postgres._store import PostgresStore


def record_id(args: argparse.Namespace) -> tuple[str, str]:
    """``(tenant, key)`` from ``TENANT KEY`` or ``--authorization-from SOURCE KEY``."""
    _refuse_credential_in_argv(args)
    if args.authorization_from is not None:
        if args.key is not None:
            raise CommandError("give either TENANT or --authorization-from, not both", EXIT_USAGE)
        if args.tenant is None:
            raise CommandError("KEY is required", EXIT_USAGE)
        key = _text("KEY", args.tenant)  # the one positional argument given is the key
        return _tenant_of_authorization(args), key
    if args.tenant is None or args.key is None:
        raise CommandError("TENANT and KEY are required (or --authorization-from SOURCE and KEY)", EXIT_USAGE)
    return _text("TENANT", args.tenant), _text("KEY", args.key)


def _text(name: str, value: str) -> str:
    """``value`` of the argument ``name``, refused as bad input (exit 2) when it is not UTF-8: checked here, not by
    argparse, which would name the first positional argument TENANT even where it is the KEY."""
    try:
        return utf8_text(value)
    except argparse.ArgumentTypeError as error:
        raise CommandError(f"{name} {error}", EXIT_USAGE) from None


def _refuse_credential_in_argv(args: argparse.Namespace) -> None:
    if args.authorization is not None:
        raise CommandError(
            "a client's credential is not taken on the command line, where ps and the shell's history would show "
            "it: put it in an environment variable and give --authorization-from VARIABLE, or give "
            "--authorization-from - and type or pipe it on standard input",
            EXIT_USAGE,
        )


def _tenant_of_authorization(args: argparse.Namespace) -> str:
    """The tenant the default resolver derives from the Authorization value ``--authorization-from`` names."""
    if not hasattr(args, "authorization_value"):  # read once: stdin cannot be read twice
        args.authorization_value = _authorization(args.authorization_from)
    try:
        value = args.authorization_value.encode("latin-1")
    except UnicodeEncodeError:
        raise CommandError("the Authorization value must be a latin-1 header value", EXIT_USAGE) from None
    tenant = _default_resolver()({"headers": [(b"authorization", value)]})
    if tenant is None:
        raise CommandError("the Authorization value is empty: give the client's header value", EXIT_USAGE)
    return tenant


def _authorization(source: str) -> str:
    """The client's Authorization header value: from standard input (``-``: typed without echo at a terminal, or
    the first line of what is piped) or from the environment variable ``source``."""
    if source == "-":
        if sys.stdin.isatty():
            return getpass.getpass("the client's Authorization header value: ")
        return sys.stdin.readline().rstrip("\r\n")
    value = os.environ.get(source)
    if value is None:
        raise CommandError(f"--authorization-from {source}: that environment variable is not set", EXIT_USAGE)
    return value


async def tenants_to_list(store: PostgresStore, args: argparse.Namespace) -> list[str]:
    """The tenant ``list`` was given: as stored, by its log tag, or by the client's Authorization header."""
    _refuse_credential_in_argv(args)
    given = [name for name, value in (("TENANT", args.tenant), ("--tag", args.tag)) if value is not None]
    if args.authorization_from is not None:
        given.append("--authorization-from")
    if len(given) != 1:
        raise CommandError("give one of TENANT, --tag or --authorization-from", EXIT_USAGE)
    if args.tenant is not None:
        return [args.tenant]
    if args.authorization_from is not None:
        return [_tenant_of_authorization(args)]
    if not os.environ.get(SECRET_VARIABLE):
        raise CommandError(
            f"--tag needs the secret the servers tag tenants with: set {SECRET_VARIABLE} to the same value",
            EXIT_USAGE,
        )
    tagged = [
        tenant for tenant in await store.tenants_between(args.since, args.until) if tenant_tag(tenant) == args.tag
    ]
    if not tagged:
        raise CommandError(
            f"no tenant tagged {args.tag} has records first claimed between {iso(args.since)} and {iso(args.until)} "
            f"(if it should, widen the window, and check that {SECRET_VARIABLE} is the servers' secret)",
            EXIT_NOT_FOUND,
        )
    return tagged


def _default_resolver() -> AuthorizationTenant:
    """The default resolver with the servers' secret, which must be in this environment too."""
    if not os.environ.get(SECRET_VARIABLE):
        raise CommandError(
            f"--authorization-from needs the secret the servers' default tenant resolver uses: set {SECRET_VARIABLE} "
            "to the same value (or give TENANT as stored)",
            EXIT_USAGE,
        )
    try:
        return AuthorizationTenant()
    except ValueError as error:
        raise CommandError(str(error), EXIT_USAGE) from error
