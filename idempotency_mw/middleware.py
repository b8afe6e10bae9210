"""The Idempotency-Key middleware: the whole request flow, in the order it happens (docs/design.md).

``IdempotencyMiddleware`` holds the configuration and picks the requests it covers; ``IdempotentRequest`` owns one
covered request from start to finish:

1. parse the key (400 if malformed, or missing on a route that requires one);
2. resolve the tenant: a record is ``(tenant, key)``, never the key alone;
3. buffer the body (413 over the cap) and fingerprint it;
4. claim ``(tenant, key)`` in one store call: 422 for a different request, a replay for a completed one, 409 for
   one still running, or the key is ours with a fresh fence token;
5. run the handler while its lease is renewed (``leases.py``), copying its response as it goes out;
6. record a final response, or release the key for a transient one, always naming our fence;
7. (on a later retry) replay the stored response byte for byte, with ``Idempotent-Replayed: true``.

Step 6 happens as the response's final body message passes, before it reaches the client and before anything the
app runs after its response (background tasks). In transactional mode it happens inside the handler's own database
transaction, and the response is held until that has committed (``transaction.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw import problems
from idempotency_mw.capture import ResponseRecorder, replay
from idempotency_mw.context import NOT_EXECUTED_KEY, STATE_KEY, IdempotencyContext
from idempotency_mw.eager import outlasting, start_eagerly
from idempotency_mw.events import Event, EventHook, Outcome, hash_key, log_event, log_level, logger
from idempotency_mw.failures import FailureLog
from idempotency_mw.fingerprint import fingerprint
from idempotency_mw.keys import InvalidKey, MissingKey, key_from_headers, uuid7_time
from idempotency_mw.leases import HeldLease, LeaseKeeper
from idempotency_mw.policy import DAY, RELEASED_STATUSES, MiB, Policy, PolicyResolver
from idempotency_mw.routes import RouteMatch, RouteTemplates
from idempotency_mw.store import (
    Claim,
    ClaimOutcome,
    PoolExhausted,
    Store,
    StoreUnavailable,
    Transaction,
    TransactionalStore,
    TransactionEnded,
)
from idempotency_mw.tenants import AuthorizationTenant, TenantResolver
from idempotency_mw.transaction import Claimed, State, TransactionalRun

T = TypeVar("T")

# ASGI extensions that let a response send its body around ``send`` (from a file), where it could not be recorded.
WITHHELD_EXTENSIONS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


class IdempotencyMiddleware:
    """Make covered requests (POST and PATCH by default) that carry an ``Idempotency-Key`` run at most once.

    ``app.add_middleware(IdempotencyMiddleware, store=PostgresStore(dsn))``. Every keyword below is also a
    field of :class:`~idempotency_mw.policy.Policy`, except:

    - ``tenant``: maps the ASGI scope to the tenant that owns the key (sync or async), or to None when it cannot
      tell (the keyed request is then refused with 400); by default
      :class:`~idempotency_mw.tenants.AuthorizationTenant`, an HMAC of the ``Authorization`` header keyed by
      ``IDEMPOTENCY_TENANT_SECRET``.
    - ``routes``: per-path overrides, ``{"/v1/refunds*": {"required": True}}`` (``*`` matches anything).
    - ``on_event``: called with an :class:`~idempotency_mw.events.Event` when a keyed request ends; if it also
      has a ``started(scope)`` method, that is called when the request reaches the store (metrics use it for
      an in-flight gauge).
    - ``retry_after``: the ``Retry-After`` seconds sent with 409 and 503.
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Store,
        *,
        tenant: TenantResolver | None = None,
        methods: tuple[str, ...] | frozenset[str] = ("POST", "PATCH"),
        required: bool = False,
        ttl: float = DAY,
        lease: float = 30.0,
        transactional: bool = False,
        fail_open: bool = False,
        max_request_bytes: int = MiB,
        max_response_bytes: int = 8 * MiB,
        released_statuses: frozenset[int] = RELEASED_STATUSES,
        retry_window: float | None = None,
        check_uuid7_age: bool = False,
        routes: Mapping[str, Mapping[str, Any]] | None = None,
        on_event: EventHook | None = log_event,
        retry_after: int = 1,
    ) -> None:
        if tenant is None:
            tenant = AuthorizationTenant()  # fails here, with what to set, when no secret is configured
        if not callable(tenant):
            raise TypeError("tenant must be a callable taking the ASGI scope")
        if not isinstance(retry_after, int) or retry_after < 0:
            raise ValueError("retry_after must be a whole number of seconds >= 0")
        default = Policy(
            required=required,
            ttl=ttl,
            lease=lease,
            transactional=transactional,
            fail_open=fail_open,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            released_statuses=frozenset(released_statuses),
            methods=methods,  # type: ignore[arg-type]  # a collection; Policy checks and freezes it
            retry_window=retry_window,
            check_uuid7_age=check_uuid7_age,
        )
        self.app = app
        self.store = store
        self.tenant = tenant
        self.tenant_unknown_logged = False  # the operator hears of unscoped keyed requests once, not per request
        self.policies = PolicyResolver.build(default, routes or {})
        self.failures = FailureLog(logger)  # store failures: the first in full, then a summary now and then
        self.leases = LeaseKeeper(store, self.failures)  # renews the lease of every handler still running
        self.routes = RouteTemplates(app)  # until the routes are scanned (at startup, or the first request)
        self.on_event = on_event
        self.on_started = getattr(on_event, "started", None)
        self.retry_after = retry_after
        self._check_transactional(default, *(p for _, p in self.policies.patterns))

    def _check_transactional(self, *policies: Policy) -> None:
        if any(p.transactional for p in policies) and not isinstance(self.store, TransactionalStore):
            raise TypeError(
                f"transactional mode needs a store with database transactions (PostgresStore, or SQLAlchemyStore "
                f"from idempotency_mw.sqlalchemy), "
                f"not {type(self.store).__name__}"
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                return await self._lifespan(scope, receive, send)
            return await self.app(scope, receive, send)
        if not self.policies.scanned:  # no lifespan (a test transport): requests scan until a scan succeeds
            self._scan(scope)
        if scope["method"] not in self.policies.methods:
            await self.app(scope, receive, send)
            return
        policy = self.policies.resolve(scope)
        if scope["method"] not in policy.methods:
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope["method"], scope["path"], scope.get("root_path", ""))
        if route.routed is False:  # the router answers 404 or 405 (or redirects): nothing runs, nothing to claim
            await self.app(scope, receive, send)
            return
        await IdempotentRequest(self, policy, route.template, scope, receive, send).run()

    def _scan(self, scope: Scope) -> None:
        """Read the app's routes, which are all declared by now: their ``@idempotent`` declarations, and their
        templates (to label events by route)."""
        app = scope.get("app", self.app)
        self.policies.scan(app, check=lambda found: self._check_transactional(*found))
        self.routes = RouteTemplates(app)

    def route_of(self, method: str, path: str, root_path: str) -> RouteMatch:
        """The route a request is for (its template, ``/v1/charges/{id}``, or ``<unmatched>``), and whether one takes
        it. Give the path and root path as the request arrived: the router rewrites ``scope["root_path"]`` on its
        way through a Mount."""
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :]
        return self.routes.match(method, path)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the per-route policies at startup, so a bad one stops the server instead of the first payment."""
        first = await receive()
        if first["type"] == "lifespan.startup" and not self.policies.scanned:
            try:
                self._scan(scope)
            except (TypeError, ValueError) as error:
                await send({"type": "lifespan.startup.failed", "message": f"idempotency_mw: {error}"})
                return
        delivered = False

        async def receive_again() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return first
            return await receive()

        await self.app(scope, receive_again, send)


class IdempotentRequest:
    """One covered request, from its key to its recorded (or released) response."""

    def __init__(
        self,
        middleware: IdempotencyMiddleware,
        policy: Policy,
        route: str,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.middleware = middleware
        self.store = middleware.store
        self.policy = policy
        self.route = route  # the template of the route it is for, to label its event
        self.scope = scope
        self.path = scope["path"]  # before the router rewrites it
        self.receive = receive
        self.send = send
        self.key: str | None = None
        self.tenant = ""
        self.fence: int | None = None
        self.body = b""
        self.body_delivered = False
        self.outcome: Outcome | None = None
        self.status: int | None = None
        self.started = time.perf_counter()
        self.store_seconds = 0.0
        self.attempts = 0
        self.lease: HeldLease | None = None
        self.recorder: ResponseRecorder | None = None  # the response on its way out, once the handler runs
        self.settling: asyncio.Future[None] | None = None
        self.emitted = False
        self.reached_store = False

    async def run(self) -> None:
        """Steps 1 to 5 in one method, read top to bottom. Each coroutine level between the server and the handler
        is passed through at every wait of every request, so the fresh path keeps them few: here, ``_execute`` and
        the app's own (in a transaction, ``_execute_in_transaction`` and ``TransactionalRun.run``)."""
        try:
            # 1. The key, validated before anything touches the store.
            try:
                self.key = key_from_headers(self.scope["headers"])
            except MissingKey:
                if self.policy.required:
                    return await self._refuse(problems.key_missing(), Outcome.KEY_MISSING)
                if self.policy.transactional:
                    self.body_delivered = True  # nothing was buffered: the handler reads the real channel
                    return await self._execute_in_transaction()
                return await self.middleware.app(self.scope, self.receive, self.send)  # not ours: untouched
            except InvalidKey as error:
                return await self._refuse(problems.key_invalid(str(error)), Outcome.KEY_INVALID)

            # 2. The tenant: none means the key cannot be scoped, and an unscoped key must never meet another's.
            tenant = self.middleware.tenant(self.scope)
            if tenant is not None and not isinstance(tenant, str):
                tenant = await self._awaited_tenant(tenant)
            if tenant is None:
                self._tenant_unknown()
                return await self._refuse(problems.tenant_unknown(), Outcome.TENANT_UNKNOWN)
            self.tenant = tenant

            # 3. The body, capped, and the fingerprint.
            if not await self._read_body():
                return
            digest = fingerprint(
                self.scope["method"],
                self.scope["path"],
                self.scope.get("query_string", b""),
                self._header(b"content-type"),
                self.body,
            )

            # 4. The claim: one store call decides what happens next.
            self.outcome = Outcome.STORE_ERROR  # until something better is known: every started request ends
            self._notify_started()
            started = time.perf_counter()
            claiming = start_eagerly(  # a task of its own: a cancellation must not lose a claim that landed
                self.store.claim(self.tenant, self.key, digest, lease=self.policy.lease, ttl=self.policy.ttl),
                "idempotency claim",
            )
            try:
                claim = await outlasting(claiming)
            except asyncio.CancelledError:
                # Cancelled (a server shutting down, an outer timeout) while the claim was on its way: it may have
                # landed. A claim that turns out to be ours is released, so the key is not left to its lease.
                self.settling = asyncio.ensure_future(self._abandon(claiming))
                raise
            except Exception as error:
                self.store_seconds += time.perf_counter() - started
                self.middleware.failures.failed("claim a key", error)
                if self.policy.fail_open:
                    self.outcome = Outcome.UNPROTECTED
                    return await self.middleware.app(self.scope, self._receive_buffered, self._send_tracked)
                return await self._refuse(
                    problems.store_unavailable(self.middleware.retry_after), _store_failure(error)
                )
            del claiming  # finished: not kept alive through the handler's run
            self.store_seconds += time.perf_counter() - started
            self.middleware.failures.succeeded()
            self.attempts = claim.attempts
            if claim.outcome is not ClaimOutcome.OWNED:
                return await self._answer(claim)
            if self.policy.check_uuid7_age and self._key_outlived_retention():
                # No record is left to compare with: running now could repeat an operation whose record was purged.
                await self._release(claim.fence)
                return await self._refuse(problems.key_expired(int(self.policy.ttl)), Outcome.KEY_EXPIRED)

            # 5. The key is ours: run the handler while its lease is renewed.
            self.fence = claim.fence
            self.lease = self.middleware.leases.hold(self.tenant, self.key, claim.fence, self.policy.lease)
            try:
                if self.policy.transactional:
                    await self._execute_in_transaction()
                else:
                    await self._execute()
            finally:
                self._drop_lease()
        finally:
            if self.settling is not None and not self.settling.done():
                # Cancelled while settling: report the outcome once the settlement (which goes on) knows it.
                self.settling.add_done_callback(lambda _: self._emit())
            else:
                self._emit()  # unless the outcome was already reported when it was decided

    async def _abandon(self, claiming: asyncio.Future[Claim]) -> None:
        """The claim of a request that was cancelled: release it once it is known to be ours."""
        self.outcome = Outcome.CANCELLED
        try:
            claim = await claiming
        except Exception:
            self.outcome = Outcome.STORE_ERROR  # the claim failed: nothing of it is left
            return
        if claim.outcome is ClaimOutcome.OWNED:
            await self._release(claim.fence)

    async def _answer(self, claim: Claim) -> None:
        """A claim that is not ours: a different request (422), one still running (409), or one completed: replayed
        (7.), or a 409 when its response was not stored in full."""
        if claim.outcome is ClaimOutcome.MISMATCH:
            await self._refuse(problems.key_reused(), Outcome.KEY_REUSED)
        elif claim.outcome is ClaimOutcome.IN_PROGRESS:
            await self._refuse(problems.in_progress(self.middleware.retry_after), Outcome.IN_PROGRESS)
        else:
            assert claim.response is not None  # COMPLETED: the other outcome, OWNED, runs the handler
            if claim.response.body is None:  # completed, but not stored in full (over the cap, or cut short)
                response = claim.response
                await self._refuse(
                    problems.response_not_replayable(
                        response.status, response.body_size, self.policy.max_response_bytes
                    ),
                    Outcome.NOT_REPLAYABLE,
                )
            else:
                # 7. Replay.
                self._decide(Outcome.REPLAYED, claim.response.status)
                await replay(claim.response, self.send)

    # -- 5 and 6: running the handler, then recording or releasing -------------------------------------------

    async def _execute(self) -> None:
        """Run the handler with its response streaming through; settle as its final body message passes."""
        assert self.key is not None
        self._set_context(IdempotencyContext(self.tenant, self.key))
        self.recorder = ResponseRecorder(self.send, max_body=self.policy.max_response_bytes)
        # Settled as the final body passed, unless the response never finished: an error, a cancelled request (a
        # client that hung up, a server shutting down), or a stream cut short. Settle it all the same; a cancelled
        # request does not wait for that (the settlement goes on in its own task).
        try:
            await self.middleware.app(self._app_scope(), self._receive_buffered, self._send_recorded)
        except asyncio.CancelledError:
            self._start_settling()
            raise
        except BaseException:
            await self._settle()
            raise
        if self.settling is None or not self.settling.done():  # settled already, as its final body passed
            await self._settle()

    async def _send_recorded(self, message: Message) -> None:
        """The handler's ``send``: copy each message, and settle before the final body message goes on (what
        ``_settle`` does, written out: this wait is on every fresh request's path, one coroutine level fewer)."""
        assert self.recorder is not None
        going, decide = self.recorder.record(message)
        if decide:
            await outlasting(self._start_settling())
            self._emit()  # before the final body goes out, while a server span still records
        if going is not None:
            await self.recorder.forward(going)

    def _start_settling(self) -> asyncio.Future[None]:
        if self.settling is None:
            self.settling = start_eagerly(self._record_or_release(), "idempotency settlement")
        return self.settling

    async def _settle(self) -> None:
        """Record a final answer, release anything else: once, in a task of its own (eager.py).

        Waited for through ``outlasting``: a request cancelled while its outcome is being written (a server shutting
        down, an outer timeout) still finishes writing it, or the key would stay in progress and the handler run
        again once the lease lapsed. A final answer that started going out is recorded even when it was cut short
        (the client hung up mid-stream, or the handler failed mid-stream): its effect has happened, so the retry must
        not run it again. Such a record has no body, and a retry is told that the response cannot be replayed.
        """
        await outlasting(self._start_settling())
        self._emit()  # before the final body goes out, while a server span still records

    async def _record_or_release(self) -> None:
        recorder = self.recorder
        assert recorder is not None
        assert self.fence is not None
        self._drop_lease()
        self.status = recorder.status
        if not self._is_final(recorder.status):
            return await self._release(self.fence)
        assert self.key is not None
        started = time.perf_counter()
        response = recorder.stored_response()
        try:
            try:
                completed = await self.store.complete(self.tenant, self.key, self.fence, response)
            except StoreUnavailable:
                raise
            except Exception as refused:
                # The database refused the response itself (a header it cannot hold). The effect has happened: the
                # key completes all the same, without a response to replay, rather than run again after its lease.
                self.middleware.failures.failed("store a response (the key completes without it)", refused)
                completed = await self.store.complete(self.tenant, self.key, self.fence, response.unreplayable())
        except Exception as error:
            # The client has its response; the claim stays until its lease lapses, then a retry runs again.
            self.middleware.failures.failed("record a completed response", error)
            self.outcome = _store_failure(error)
            return
        finally:
            self.store_seconds += time.perf_counter() - started
        self.outcome = Outcome.EXECUTED if completed else Outcome.FENCED_OUT

    async def _release(self, fence: int) -> None:
        """Free the key for the retry. Shielded: it must happen even when the request was cancelled."""
        assert self.key is not None
        self.outcome = Outcome.RELEASED
        try:
            await asyncio.shield(self._timed(self.store.release(self.tenant, self.key, fence)))
        except Exception as error:
            self.middleware.failures.failed("release a key (it frees itself when its lease lapses)", error)
            self.outcome = _store_failure(error)

    async def _execute_in_transaction(self) -> None:
        """Run the handler in a transaction that also writes the record (``transaction.py``), then answer by how
        that transaction ended. Without a key (``self.fence`` is None) the handler still gets its transaction."""
        store = self.store
        assert isinstance(store, TransactionalStore)  # checked when the middleware was built
        claimed = None
        if self.fence is not None:
            assert self.key is not None
            claimed = Claimed(self.tenant, self.key, self.fence)
        run = TransactionalRun(
            store,
            self.send,
            max_body=self.policy.max_response_bytes,
            claimed=claimed,
            is_final=self._is_final,
            on_settled=self._on_transaction_settled,
        )
        try:
            await run.run(self.middleware.app, self._app_scope(), self._receive_buffered, self._lend)
        except BaseException as error:
            if not await self._answer_transaction(run, error):
                raise  # from here, so its traceback holds no frame that holds it (tests/test_cycles.py)
            return
        await self._answer_transaction(run, None)

    async def _answer_transaction(self, run: TransactionalRun, raised: BaseException | None) -> bool:
        """Answer by how the transaction ended, ``raised`` being what the app raised. True when that answer (a 409
        or 503) replaces it; False when it is to go on as it is."""
        self.status = run.status
        if run.state in (State.COMMITTED, State.RECORDED):
            if self.fence is not None:
                self.outcome = Outcome.EXECUTED
            return False  # what the app raised after the commit (a background task) undoes nothing
        if run.state is State.ROLLED_BACK and raised is None:
            return False  # a transient answer: released and reported when it settled
        # Nothing committed: free the key for the retry (unless the rollback's settling freed it already), then
        # answer as the transaction ended.
        if self.fence is not None and run.state is not State.FENCED_OUT and self.outcome is not Outcome.RELEASED:
            await self._release(self.fence)
        if run.state is State.FENCED_OUT:
            # A newer claim owns the key: our writes were rolled back, and the client hears what a retry would.
            await self._refuse(problems.in_progress(self.middleware.retry_after), Outcome.FENCED_OUT)
            return True
        if run.state is State.UNAVAILABLE:
            assert run.failure is not None
            self.middleware.failures.failed("run the handler's transaction", run.failure)
            await self._refuse(problems.store_unavailable(self.middleware.retry_after), _store_failure(run.failure))
            return True
        if run.state is State.REFUSED:
            # The database refused the transaction itself: a deferred constraint at COMMIT, or an error the handler
            # caught but that aborted the transaction. Nothing was committed; the key is free again. Or the
            # handler ended the transaction itself, and the record was refused (TransactionEnded says so).
            assert run.failure is not None
            if isinstance(run.failure, TransactionEnded):
                logger.error("idempotency: %s", run.failure)
                raise run.failure from raised
            logger.error(
                "idempotency: the handler's transaction could not commit (%s); nothing was committed. If the "
                "handler recovers from database errors, run the statements that may fail in a savepoint "
                "(asyncpg: async with connection.transaction(): ...; "
                "SQLAlchemy: async with session.begin_nested(): ...)",
                type(run.failure).__name__,
            )
            raise run.failure from raised
        assert raised is not None  # rolled back because the handler failed, was cancelled, or never finished
        return False

    async def _on_transaction_settled(self, run: TransactionalRun) -> None:
        """Committed or rolled back, just before the held response goes out: free a released key, report."""
        self._drop_lease()
        self.status = run.status
        if self.fence is None:
            return  # no key, no record
        if run.state in (State.COMMITTED, State.RECORDED):
            self.outcome = Outcome.EXECUTED
        else:
            await self._release(self.fence)
        self._emit()

    def _lend(self, transaction: Transaction) -> None:
        self._set_context(IdempotencyContext(self.tenant, self.key, transaction))

    def _key_outlived_retention(self) -> bool:
        """A UUIDv7 key carries its birth time: one older than the ttl may have had a record that expired."""
        assert self.key is not None
        born = uuid7_time(self.key)
        return born is not None and time.time() - born > self.policy.ttl

    def _is_final(self, status: int | None) -> bool:
        """A final outcome is recorded (and, in a transaction, committed); anything else releases the key."""
        if status is None or self.scope.get("state", {}).get(NOT_EXECUTED_KEY):
            return False
        return self.policy.records(status)

    # -- helpers --------------------------------------------------------------------------------------------

    async def _awaited_tenant(self, tenant: object) -> str | None:
        """What a tenant resolver gave, awaited if it is awaitable and checked: a ``str`` or None. A sync resolver's
        ``str`` or None needs no coroutine and skips this; anything else it returns comes here to be refused."""
        if inspect.isawaitable(tenant):
            tenant = await tenant
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"the tenant resolver must return a str or None, not {type(tenant).__name__}")
        return tenant

    def _tenant_unknown(self) -> None:
        if not self.middleware.tenant_unknown_logged:
            self.middleware.tenant_unknown_logged = True
            logger.warning(
                "idempotency: a request with an Idempotency-Key got 400 idempotency_tenant_unknown because the "
                "tenant resolver could not tell whose key it is (the default resolver needs exactly one "
                "Authorization header). If your clients authenticate otherwise (cookies, a gateway), pass tenant= a "
                "resolver that returns their account; to let requests without credentials share one namespace, "
                'pass tenant=AuthorizationTenant(anonymous="public"). Logged once per middleware.'
            )

    async def _read_body(self) -> bool:
        """Buffer the request body; False when the request ended here (413, or the client left)."""
        limit = self.policy.max_request_bytes
        declared = self._header(b"content-length")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(problems.request_too_large(limit), Outcome.REQUEST_TOO_LARGE)
            return False
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return False  # nothing ran, nothing was claimed
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(problems.request_too_large(limit), Outcome.REQUEST_TOO_LARGE)
                return False
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        self.body = b"".join(chunks)
        return True

    async def _receive_buffered(self) -> Message:
        """The handler's ``receive``: the buffered body once, then the real channel (for disconnects)."""
        if not self.body_delivered:
            self.body_delivered = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        return await self.receive()

    async def _send_tracked(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)

    def _header(self, name: bytes) -> bytes:
        for key, value in self.scope["headers"]:
            if key == name:
                return bytes(value)
        return b""

    def _set_context(self, context: IdempotencyContext) -> None:
        self.scope.setdefault("state", {})[STATE_KEY] = context

    def _app_scope(self) -> Scope:
        """The scope the handler sees: without the extensions that send a body around ``send`` (a file path), which
        the recorder could not capture. Starlette's FileResponse then streams the file through ``send``."""
        extensions = self.scope.get("extensions")
        if extensions and not WITHHELD_EXTENSIONS.isdisjoint(extensions):
            self.scope["extensions"] = {k: v for k, v in extensions.items() if k not in WITHHELD_EXTENSIONS}
        return self.scope

    def _drop_lease(self) -> None:
        if self.lease is not None:
            self.middleware.leases.drop(self.lease)
            self.lease = None

    async def _refuse(self, problem: problems.Problem, outcome: Outcome) -> None:
        self._decide(outcome, problem.status)
        await problem.send(self.send)

    def _decide(self, outcome: Outcome, status: int | None) -> None:
        """The answer is known: report it now, before it goes out (a server span ends with the last body message)."""
        self.outcome, self.status = outcome, status
        self._emit()

    async def _timed(self, operation: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await operation
        finally:
            self.store_seconds += time.perf_counter() - started

    def _notify_started(self) -> None:
        self.reached_store = True
        started = self.middleware.on_started
        if started is not None:
            try:
                started(self.scope)
            except Exception:
                logger.exception("idempotency on_event.started hook failed")

    def _emit(self) -> None:
        """Report the outcome to the ``on_event`` hook, once."""
        hook = self.middleware.on_event
        if self.emitted or hook is None or self.outcome is None:
            return
        self.emitted = True
        if hook is log_event and not logger.isEnabledFor(log_level(self.outcome)):
            return  # the default hook would drop this event: do not build it
        event = Event(
            self.outcome,
            self.scope["method"],
            self.path,
            self.route,
            self.tenant,
            hash_key(self.key),
            self.status,
            time.perf_counter() - self.started,
            self.store_seconds,
            self.attempts,
            self.reached_store,
        )
        try:
            hook(event)
        except Exception:
            logger.exception("idempotency on_event hook failed")


def _store_failure(error: BaseException) -> Outcome:
    """An exhausted pool is its own outcome: the fix is a larger ``max_size``, not the database team."""
    return Outcome.POOL_EXHAUSTED if isinstance(error, PoolExhausted) else Outcome.STORE_ERROR
