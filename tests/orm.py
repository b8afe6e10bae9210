"""The ORM models the SQLAlchemy tests write through the session the middleware lends, in a schema of their own."""

from __future__ import annotations

from sqlalchemy import MetaData, UniqueConstraint
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlmodel import Field, SQLModel

SCHEMA = "imw_sqla"


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class Effect(Base):
    __tablename__ = "effects"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str]
    note: Mapped[str]


class Once(Base):
    """A value that may appear once, checked only at COMMIT (a deferred constraint)."""

    __tablename__ = "once"
    __table_args__ = (UniqueConstraint("value", name="once_value", deferrable=True, initially="DEFERRED"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    value: Mapped[int]


class Note(SQLModel, table=True):
    """A SQLModel table: SQLModel's AsyncSession works as the handler's session too."""

    __tablename__ = "sqlmodel_notes"
    __table_args__ = {"schema": SCHEMA}

    id: int | None = Field(default=None, primary_key=True)
    key: str


def sqlalchemy_url(dsn: str) -> str:
    return make_url(dsn).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


async def create_tables(dsn: str) -> None:
    """The models' tables (and their schema) in the database at ``dsn``, if they are not there yet."""
    engine = create_async_engine(sqlalchemy_url(dsn))
    try:
        async with engine.begin() as connection:
            await connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            await connection.run_sync(Base.metadata.create_all)
            await connection.run_sync(SQLModel.metadata.create_all)
    finally:
        await engine.dispose()
