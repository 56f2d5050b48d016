"""What differs between the state database's two dialects: SQLite (the embedded default) and PostgreSQL.

Everything else in ``state`` is dialect-neutral SQLAlchemy Core; what is not lives here:

* the engine: SQLite runs in WAL mode with ``BEGIN IMMEDIATE`` write transactions, so the driver's
  heartbeats and the sink's commits serialise instead of failing with "database is locked" halfway
  through; PostgreSQL gets a small pre-pinged pool whose sessions end a transaction left idle for
  ``IDLE_IN_TRANSACTION_TIMEOUT_S``;
* the upsert: both dialects spell ``INSERT ... ON CONFLICT`` through their own ``insert`` construct (how
  many rows reach it at once is ``bulk``'s business);
* a connection timeout for a quick reachability check (PostgreSQL's default waits minutes);
* which database errors mean "this value was refused" rather than "the database is unreachable".
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Engine, Table, create_engine, event, func
from sqlalchemy import exc as sql_errors
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL

#: The dialects the state database supports (``Engine.dialect.name``).
SUPPORTED = ("sqlite", "postgresql")

#: PostgreSQL ends a session that holds a transaction open this long without sending a statement.  Every
#: transaction here is database work only (rows are collected before it begins), so only a frozen process
#: (SIGSTOP, a suspended VM) waits that long inside one; meanwhile it holds the job's row, and a standby's
#: takeover would wait for it.  The default heartbeat timeout: such a takeover waits about as long as the
#: heartbeat takes to go stale.  A URL's own ``options`` may set another value.
IDLE_IN_TRANSACTION_TIMEOUT_S = 30


#: libpq's connection settings for the state database: give up connecting after 15 s; probe an idle
#: connection after 30 s, every 10 s, and drop it after 3 unanswered probes
POSTGRES_CONNECTION_BOUNDS = {"connect_timeout": 15, "keepalives": 1, "keepalives_idle": 30,
                              "keepalives_interval": 10, "keepalives_count": 3}


def engine_for(url: URL) -> Engine:
    """An engine for ``url`` (password already set), with the dialect's settings."""
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
        _sqlite_immediate_transactions(engine)
        return engine
    # A connection attempt, and a read from a peer that vanished (a half-open connection), bounded: a
    # trigger's or the driver's call would otherwise wait on the operating system's TCP retries, about 15 min.
    # A URL's own settings win.
    bounds = {name: value for name, value in POSTGRES_CONNECTION_BOUNDS.items() if name not in url.query}
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=2,
                         connect_args={"options": _postgres_options(url.query.get("options")), **bounds})


def _postgres_options(given: str | tuple[str, ...] | None) -> str:
    """The libpq ``options`` of a state connection: the URL's own, after the idle-in-transaction timeout."""
    given = " ".join(given) if isinstance(given, tuple) else (given or "")
    ours = f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_S * 1000}"
    return f"{ours} {given}".strip()  # a later -c of the same setting wins


def _sqlite_immediate_transactions(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record):  # pragma: no cover - exercised by every SQLite test
        dbapi_connection.isolation_level = None  # let SQLAlchemy's "begin" event issue BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection):  # pragma: no cover
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def with_connect_timeout(url: URL, seconds: int) -> URL:
    """``url`` with a connection timeout, for a check that must answer quickly (PostgreSQL only: SQLite
    opens a file; an explicit ``connect_timeout`` in the URL is kept)."""
    if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
        return url.update_query_dict({"connect_timeout": str(seconds)})
    return url


def insert_for(dialect: str):
    """The dialect's ``insert`` construct, which knows ``ON CONFLICT``."""
    if dialect == "postgresql":
        return postgresql.insert
    if dialect == "sqlite":
        return sqlite.insert
    raise ValueError(f"unsupported database dialect {dialect!r}: use SQLite or PostgreSQL")


def upsert(dialect: str, table: Table, key: Sequence[str], increments: Sequence[str] = ()):
    """``INSERT ... ON CONFLICT (key)``: ``increments`` columns are added to the stored value, every other
    column is overwritten; a table with key columns only ignores the conflict."""
    return on_conflict(insert_for(dialect)(table), table, key, increments)


def on_conflict(stmt, table: Table, key: Sequence[str], increments: Sequence[str]):
    """``stmt`` (an insert) with the upsert's ``ON CONFLICT (key)`` clause."""
    updates = {c.name: _added(table.c[c.name], stmt.excluded[c.name]) if c.name in increments
               else stmt.excluded[c.name] for c in table.columns if c.name not in key}
    if not updates:
        return stmt.on_conflict_do_nothing(index_elements=list(key))
    return stmt.on_conflict_do_update(index_elements=list(key), set_=updates)


def _added(stored, new):
    """An increment added to the stored value as a SUM over both batches' records would: a NULL on one
    side (a batch whose records held none) leaves the other side's value; NULL only when both are NULL.
    ``stored + new`` alone would keep a stored NULL forever."""
    return func.coalesce(stored + new, stored, new)


def is_data_error(err: BaseException) -> bool:
    """The database refused a value (SQLSTATE classes 22 data exception, 23 integrity constraint, 54
    program limit, e.g. a key too large to index), as opposed to being unreachable or misconfigured.
    SQLite raises SQLAlchemy's DataError/IntegrityError; PostgreSQL's driver also gives the SQLSTATE."""
    if isinstance(err, sql_errors.DataError | sql_errors.IntegrityError):
        return True
    # SQLAlchemy wraps the driver's error in ``orig``; a COPY (``bulk.write_rows``) raises psycopg's own
    state = getattr(getattr(err, "orig", None) or err, "sqlstate", None)
    return bool(state) and str(state)[:2] in ("22", "23", "54")
