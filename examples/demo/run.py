"""``./dev demo`` (``python -m examples.demo``): the payments example behind a lossy network, driven by a client
that keeps retrying.

It starts PostgreSQL (embedded, unless ``DATABASE_URL`` is set), serves the payments example with uvicorn in a child
process on loopback, and beside it the payout provider (a process of its own, whose answers fail now and then),
puts the lossy proxy in front of the app, and sends logical payments through
``AsyncIdempotentClient``, concurrently. Then it audits the ledger against what the client was told and prints a
table. The exit status is 0 only when no operation took effect twice, none was lost, and the balances agree.

Everything it starts it also stops, on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import httpx

from examples.demo.audit import Audit, audit
from examples.demo.workload import Mix, Workload
from faults.proxy import LossyProxy, ProxyStats
from faults.server import ServerProcess, ServerStartFailed
from idempotency_mw.client import AsyncIdempotentClient, Retry
from idempotency_mw.devdb import local_database

APP = "examples.payments.app:app"
PROVIDER = "examples.payments.provider:app"  # the payout provider, a process of its own
DEMO_PAYOUT_RATE = 0.3  # payments followed by a payout: a handler in steps, with the payout provider between them
CLIENT_RETRY = Retry(attempts=8, deadline=30.0, backoff=0.05, max_backoff=2.0)


@dataclass(frozen=True)
class Network:
    drop_rate: float = 0.2
    reset_rate: float = 0.1
    cut_rate: float = 0.05
    provider_fail_rate: float = 0.1  # the payout provider's 503s before it transfers
    provider_lose_rate: float = 0.1  # and after it transferred (its answer lost)


@dataclass
class Report:
    mix: Mix
    network: Network
    workload: Workload
    proxy: ProxyStats
    audit: Audit
    seconds: float
    server_log: str
    provider: dict[str, int]  # the payout provider's own counts (GET /v1/stats)


async def run_demo(mix: Mix, network: Network, dsn: str, *, stream: TextIO = sys.stderr) -> Report:
    """Serve, drive, audit; stop everything started here, whatever happens."""
    run = secrets.token_hex(4)  # fresh accounts per run, so balances start at zero even on a reused database
    api_keys = [f"sk_test_demo_{run}_{n}" for n in range(max(1, mix.accounts))]
    # The demo's server creates its own tables, whatever PAYMENTS_MIGRATE says in the caller's environment. Its
    # request fingerprints are keyed under a key of this run's, unless the caller's environment gives one.
    env = {"DATABASE_URL": dsn, "PAYMENTS_POOL_SIZE": str(mix.concurrency + 4), "PAYMENTS_MIGRATE": "1"}
    if not os.environ.get("IDEMPOTENCY_FINGERPRINT_KEYS"):
        env["IDEMPOTENCY_FINGERPRINT_KEYS"] = f"demo-{run}:{secrets.token_hex(32)}"
    started = time.monotonic()
    bank = {
        "PROVIDER_FAIL_RATE": str(network.provider_fail_rate),
        "PROVIDER_LOSE_RATE": str(network.provider_lose_rate),
        "PROVIDER_SEED": str(mix.seed),
    }
    async with (
        ServerProcess(PROVIDER, env=bank) as provider,
        ServerProcess(APP, env={**env, "PAYMENTS_PROVIDER_URL": provider.base_url}) as server,
    ):
        async with LossyProxy(
            server.port,
            drop_rate=network.drop_rate,
            reset_rate=network.reset_rate,
            cut_rate=network.cut_rate,
            seed=mix.seed,
        ) as proxy:
            clients = {
                key: AsyncIdempotentClient(
                    base_url=proxy.url, retry=CLIENT_RETRY, headers={"Authorization": f"Bearer {key}"}, timeout=10.0
                )
                for key in api_keys
            }
            workload = Workload(mix, clients, run)
            progress = Progress(stream, mix.payments)
            follow = asyncio.create_task(progress.follow(workload, proxy.stats))
            try:
                await workload.run()
            finally:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)
                for client in clients.values():
                    await client.aclose()
            progress.finish(workload, proxy.stats)
        seconds = time.monotonic() - started
        async with (
            httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as direct,  # not through the proxy
            httpx.AsyncClient(base_url=provider.base_url, timeout=10.0) as bank_api,
        ):
            result = await audit(workload, dsn, direct, bank_api)
            counts = (await bank_api.get("/v1/stats")).json()
        return Report(mix, network, workload, proxy.stats, result, seconds, server.log_tail(), counts)


class Progress:
    """One progress line on stderr: redrawn in place on a terminal, printed every quarter otherwise."""

    def __init__(self, stream: TextIO, total: int) -> None:
        self.stream = stream
        self.total = max(total, 1)
        self.tty = stream.isatty()
        self.quarters_shown = 0

    def line(self, workload: Workload, proxy: ProxyStats) -> str:
        done = workload.payments_done
        filled = 30 * done // self.total
        return (
            f"payments {done:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (30 - filled)}] "
            f"attempts {workload.attempts}  dropped {proxy.dropped}  reset {proxy.resets}  "
            f"409s {workload.count_outcome(409)}"
        )

    async def follow(self, workload: Workload, proxy: ProxyStats) -> None:
        while True:
            self.show(workload, proxy)
            await asyncio.sleep(0.1 if self.tty else 0.25)

    def show(self, workload: Workload, proxy: ProxyStats) -> None:
        if self.tty:
            self.stream.write("\r" + self.line(workload, proxy))
            self.stream.flush()
            return
        quarters = 4 * workload.payments_done // self.total
        if quarters > self.quarters_shown:
            self.quarters_shown = quarters
            print(self.line(workload, proxy), file=self.stream, flush=True)

    def finish(self, workload: Workload, proxy: ProxyStats) -> None:
        self.show(workload, proxy)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- the table -------------------------------------------------------------------------------------------------


def _money(amount: int) -> str:
    return f"{amount / 100:,.2f}"


def _per_currency(totals: dict[tuple[str, str], int]) -> dict[str, int]:
    summed: dict[str, int] = {}
    for (_, currency), amount in totals.items():
        summed[currency] = summed.get(currency, 0) + amount
    return summed


def render(report: Report) -> str:
    mix, net, work, proxy, result = report.mix, report.network, report.workload, report.proxy, report.audit
    kinds = {
        kind: sum(op.kind == kind for op in work.operations)
        for kind in ("customer", "payment_intent", "refund", "payout")
    }
    bank = report.provider
    rows = [
        (
            "logical operations",
            len(work.operations),
            f"{kinds['payment_intent']} payment intents, {kinds['customer']} customers, {kinds['refund']} refunds, "
            f"{kinds['payout']} payouts",
        ),
        ("HTTP attempts", work.attempts, "every attempt of an operation carried its one Idempotency-Key"),
        ("replays received", sum(op.replayed for op in work.operations), "final answers the server replayed"),
        ("replays sent", proxy.replays, "as seen by the proxy, the dropped ones included"),
        ("409 in progress", work.count_outcome(409), "a retry met its original still running"),
        ("responses dropped", proxy.dropped, "by the proxy, after the server had processed the request"),
        ("connections reset", proxy.resets, "by the proxy, before the request reached the server"),
        ("requests cut", proxy.cut, "client hung up while the server was still working"),
        ("sent again later", sum(op.gave_up for op in work.operations), "after the client gave up, same key"),
        ("card declines", sum(op.declined for op in work.operations), "402, recorded and replayed like any answer"),
        (
            "provider transfers",
            result.provider_transfers,
            f"made by the payout provider, in {bank.get('calls', 0)} calls ({bank.get('failed', 0)} answered 503 "
            f"before, {bank.get('lost', 0)} after it transferred)",
        ),
        (
            "payouts retried",
            sum(op.kind == "payout" and len(op.outcomes) > 1 for op in work.operations),
            "took more than one attempt: a replay, or a resumption after the last step committed",
        ),
    ]
    lines = [
        f"payments demo: {mix.payments} logical payments, {mix.concurrency} at a time, in {report.seconds:.1f}s",
        f"network: {net.drop_rate:.0%} of responses dropped, {net.reset_rate:.0%} of connections reset, "
        f"{net.cut_rate:.0%} of requests cut mid-flight",
        f"seed {mix.seed} fixes the operations and the balances; timing decides which requests the proxy's dice hit,",
        "so the attempts, drops, resets, cuts and replays vary from run to run",
        "",
    ]
    lines += [f"  {label:<20} {value:>7}   {note}" for label, value, note in rows]

    believed, ledger, api = (_per_currency(t) for t in (result.believed, result.ledger, result.api))
    lines += ["", f"  {'balance':<20} {'expected':>14} {'ledger':>14} {'GET /v1/balance':>16}"]
    for currency in sorted(set(believed) | set(ledger)):
        lines.append(
            f"  {currency:<20} {_money(believed.get(currency, 0)):>14} {_money(ledger.get(currency, 0)):>14} "
            f"{_money(api.get(currency, 0)):>16}"
        )
    lines += [
        f"  {'(per account)':<20} {'agree' if result.balances_agree else 'DISAGREE':>14}",
        "",
        f"  {'duplicate effects':<20} {result.duplicates:>7}   "
        f"extra ledger entries per key: {result.duplicate_entries}, extra objects per operation: "
        f"{result.duplicate_objects}, extra provider transfers: {result.provider_duplicates}",
        f"  {'lost operations':<20} {len(result.lost):>7}",
    ]
    if result.out_of_step:
        lines.append(f"  {'out of step':<20} {result.out_of_step:>7}   payment intents that disagree with the ledger")
    for problem in (result.lost + result.unexpected)[:10]:
        lines.append(f"    {problem}")
    if result.unexpected:
        lines.append(f"  {'unexpected answers':<20} {len(result.unexpected):>7}")
    lines += [
        "",
        "OK: every operation took effect exactly once."
        if result.ok
        else "FAILED: see above; the server's log ends with:\n" + report.server_log,
    ]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------------------


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a rate is between 0 and 1, got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    defaults, network = Mix(), Network()
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Drive the Stripe-style payments example through a lossy proxy with a retrying client, then "
        "check the ledger: no payment may take effect twice, none may be lost. Uses DATABASE_URL if set, else an "
        "embedded PostgreSQL.",
    )
    parser.add_argument("--payments", type=_positive, default=defaults.payments, help="logical payments to make")
    parser.add_argument("--concurrency", type=_positive, default=defaults.concurrency, help="payments at a time")
    parser.add_argument("--accounts", type=_positive, default=defaults.accounts, help="accounts (tenants)")
    parser.add_argument("--drop-rate", type=_rate, default=network.drop_rate, help="share of responses dropped")
    parser.add_argument("--reset-rate", type=_rate, default=network.reset_rate, help="share of connections reset")
    parser.add_argument("--cut-rate", type=_rate, default=network.cut_rate, help="share of requests cut mid-flight")
    parser.add_argument(
        "--payout-rate", type=_rate, default=DEMO_PAYOUT_RATE, help="share of payments followed by a payout"
    )
    parser.add_argument(
        "--provider-fail-rate",
        type=_rate,
        default=network.provider_fail_rate,
        help="share of the payout provider's answers that are 503 before it transfers",
    )
    parser.add_argument(
        "--provider-lose-rate",
        type=_rate,
        default=network.provider_lose_rate,
        help="share of the payout provider's answers lost after it transferred",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="fixes the workload (operations, amounts, balances) and the proxy's sequence of throws; timing still "
        "decides which request meets which throw",
    )
    parser.add_argument("--quick", action="store_true", help="a short run: 40 payments, 8 at a time")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.drop_rate + args.reset_rate + args.cut_rate > 0.95:
        print("demo: the drop, reset and cut rates add up to more than 0.95", file=sys.stderr)
        return 2
    payments, concurrency = (
        (min(args.payments, 40), min(args.concurrency, 8))
        if args.quick
        else (
            args.payments,
            args.concurrency,
        )
    )
    if args.provider_fail_rate + args.provider_lose_rate > 0.9:
        print("demo: the provider's fail and lose rates add up to more than 0.9", file=sys.stderr)
        return 2
    mix = Mix(
        payments=payments, concurrency=concurrency, accounts=args.accounts, seed=args.seed, payout_rate=args.payout_rate
    )
    network = Network(
        drop_rate=args.drop_rate,
        reset_rate=args.reset_rate,
        cut_rate=args.cut_rate,
        provider_fail_rate=args.provider_fail_rate,
        provider_lose_rate=args.provider_lose_rate,
    )
    if not os.environ.get("DATABASE_URL"):
        print("starting an embedded PostgreSQL (set DATABASE_URL to use another one) ...", file=sys.stderr)
    try:
        with local_database() as dsn:
            report = asyncio.run(run_demo(mix, network, dsn))
    except KeyboardInterrupt:
        print("\ninterrupted: the server, the proxy and the database the demo started are stopped", file=sys.stderr)
        return 130
    except ServerStartFailed as error:
        print(f"demo: the payments server did not start. {error}", file=sys.stderr)
        return 1
    print(render(report))
    return 0 if report.audit.ok else 1
