"""The SQLAlchemy ledger: accounts and transfers, each write idempotent and transactional.

``uvicorn examples.sqlalchemy_ledger.app:app`` serves it on ``$DATABASE_URL`` (from the repository root);
``create_app(dsn)`` builds one for tests. The POST handlers take ``session: IdempotencySession``: an
``AsyncSession`` on the app's own engine, in the transaction that also commits the idempotency record of the
response. A transfer and its record land together or not at all, and a retried transfer (same key, same body) gets
the recorded answer without moving money again.

Keys are scoped by the default tenant resolver (an HMAC of ``Authorization``, keyed by
``IDEMPOTENCY_TENANT_SECRET``). The example checks no credentials: any bearer token works.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from datetime import datetime

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from examples.sqlalchemy_ledger.models import SCHEMA, Account, Base, Transfer
from idempotency_mw import IdempotencyMiddleware, PostgresStore, idempotent
from idempotency_mw.fastapi import setup
from idempotency_mw.sqlalchemy import IdempotencySession, SQLAlchemyStore


class AccountIn(BaseModel):
    owner: str = Field(min_length=1, max_length=200)
    opening_balance: int = Field(default=0, ge=0)


class AccountOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    owner: str
    balance: int
    created_at: datetime


class TransferIn(BaseModel):
    source: int
    target: int
    amount: int = Field(gt=0)
    memo: str | None = Field(default=None, max_length=500)

    @model_validator(mode="after")
    def between_two_accounts(self) -> TransferIn:
        if self.source == self.target:
            raise ValueError("source and target must be different accounts")
        return self


class TransferOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    source_id: int
    target_id: int
    amount: int
    memo: str | None
    created_at: datetime


def create_app(dsn: str, *, pool_size: int = 10, migrate: bool = True) -> FastAPI:
    """The ledger on the PostgreSQL at ``dsn`` (a ``postgresql://`` URL).

    The engine's pool (``pool_size``) serves the handlers: a transactional request holds one connection from the
    start of its handler to its commit, and a request that cannot get one within the store's timeout is answered
    503 (retry later). The PostgresStore's own few connections only claim keys, renew leases and free keys. With
    ``migrate`` (the default) the startup creates the idempotency table and the ledger's tables.
    """
    engine = create_async_engine(make_url(dsn).set(drivername="postgresql+asyncpg"), pool_size=pool_size)
    store = SQLAlchemyStore(PostgresStore(dsn, min_size=1, max_size=4), engine)
    reads = async_sessionmaker(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if migrate:
                await store.store.migrate()
                async with engine.begin() as connection:
                    await connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
                    await connection.run_sync(Base.metadata.create_all)
            await store.open()  # checks, too, that the engine and the store reach the same database
            yield
        finally:
            await store.close()
            await engine.dispose()  # the engine is the app's: the store leaves it alone

    app = FastAPI(title="idempotency_mw SQLAlchemy ledger example", lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, store=store)
    setup(app)  # a request FastAPI refuses as invalid frees its key; OpenAPI documents the header

    @app.post("/accounts", status_code=201)
    @idempotent(transactional=True, required=True)
    async def open_account(body: AccountIn, session: IdempotencySession) -> AccountOut:
        account = Account(owner=body.owner, balance=body.opening_balance)
        session.add(account)
        await session.flush()  # for its id and created_at
        return AccountOut.model_validate(account)

    @app.post("/transfers", status_code=201)
    @idempotent(transactional=True, required=True)
    async def transfer(body: TransferIn, session: IdempotencySession) -> TransferOut:
        # Both rows locked, in id order so that two opposite transfers cannot deadlock.
        wanted = sorted((body.source, body.target))
        found = await session.scalars(
            select(Account).where(Account.id.in_(wanted)).order_by(Account.id).with_for_update()
        )
        accounts = {account.id: account for account in found}
        if len(accounts) < 2:
            # 404 frees the key: nothing happened, and the retry may name an account that exists by then.
            raise HTTPException(404, detail="no such account")
        source, target = accounts[body.source], accounts[body.target]
        if source.balance < body.amount:
            # A decision, recorded like a transfer: the retry is told the same, even if money arrived since.
            raise HTTPException(422, detail="insufficient funds")
        source.balance -= body.amount
        target.balance += body.amount
        transfer = Transfer(source_id=source.id, target_id=target.id, amount=body.amount, memo=body.memo)
        session.add(transfer)
        await session.flush()
        return TransferOut.model_validate(transfer)

    @app.get("/accounts/{account_id}")
    async def get_account(account_id: int) -> AccountOut:
        async with reads() as session:
            account = await session.get(Account, account_id)
            if account is None:
                raise HTTPException(404, detail="no such account")
            return AccountOut.model_validate(account)

    @app.get("/transfers/{transfer_id}")
    async def get_transfer(transfer_id: int) -> TransferOut:
        async with reads() as session:
            transfer = await session.get(Transfer, transfer_id)
            if transfer is None:
                raise HTTPException(404, detail="no such transfer")
            return TransferOut.model_validate(transfer)

    return app


_default_app: FastAPI | None = None


def __getattr__(name: str) -> FastAPI:
    """``app``: the ledger on ``$DATABASE_URL``, built on first use (``uvicorn examples.sqlalchemy_ledger.app:app``)."""
    global _default_app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _default_app is None:
        dsn = os.environ.get("DATABASE_URL")
        if not dsn:
            raise RuntimeError("set DATABASE_URL to the PostgreSQL the SQLAlchemy ledger example should use")
        _default_app = create_app(dsn)
    return _default_app
