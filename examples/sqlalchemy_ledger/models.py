"""The ledger's tables, as SQLAlchemy 2 declarative models: accounts with a balance, and the transfers that moved
money between them. The database refuses a negative balance and a transfer of nothing, whatever the code does."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, DateTime, ForeignKey, MetaData, String, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA = "sqlalchemy_ledger"


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class Account(Base):
    __tablename__ = "accounts"
    __table_args__ = (CheckConstraint("balance >= 0", name="accounts_balance_not_negative"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    owner: Mapped[str] = mapped_column(String(200))
    balance: Mapped[int] = mapped_column(BigInteger)  # in cents
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Transfer(Base):
    __tablename__ = "transfers"
    __table_args__ = (
        CheckConstraint("amount > 0", name="transfers_amount_positive"),
        CheckConstraint("source_id <> target_id", name="transfers_between_two_accounts"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    source_id: Mapped[int] = mapped_column(ForeignKey(Account.id))
    target_id: Mapped[int] = mapped_column(ForeignKey(Account.id))
    amount: Mapped[int] = mapped_column(BigInteger)  # in cents
    memo: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
