"""A batch's result rows into their table in bulk: one row per key, in the form each dialect takes fastest.

Rows arrive as an Arrow table (what the sink collects from Spark) or as a list of dicts (tests, small
writes).  An Arrow table never becomes Python row objects on the way: a batch of a hundred thousand
events spent more time in per-row Python (dicts, bound parameters, ``COPY`` rows) than in its database.

* PostgreSQL through psycopg, from ``COPY_FROM_ROWS`` rows on: ``COPY`` into a temporary table, then one
  ``INSERT ... SELECT ... ON CONFLICT`` from it.  A table without increments (per-event rows, whose keys
  rarely come back) first takes a ``COPY`` straight into itself, under a savepoint: it costs PostgreSQL
  about half the staged upsert, and a key already stored rolls it back to the staged way
  (``_copy_direct``).  An Arrow table crosses as CSV that Arrow writes in C++;
* SQLite: ``executemany`` of the compiled upsert on tuples built column by column, ``SQLITE_CHUNK_ROWS``
  at a time, with timestamps and dates in SQLAlchemy's own text form (a key written either way is the
  same key);
* anything else (other column types, small writes): SQLAlchemy's ``executemany``.

Pure database code: no pyspark.  pyarrow is imported only when an Arrow table is written.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, Connection, MetaData, Table, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DataError

from airflow_stream_provider.state.dialect import on_conflict, upsert

if TYPE_CHECKING:
    import pyarrow as pa

Rows = Sequence[Mapping[str, Any]]

#: From this many rows a PostgreSQL upsert goes through COPY: below it, the temporary table's extra round
#: trips cost more than the multi-row INSERTs they replace.
COPY_FROM_ROWS = 200
#: Rows per CSV chunk handed to COPY: bounds the text held at once whatever the batch size.
COPY_CHUNK_ROWS = 20_000
#: After a direct COPY met a stored key, that table's next writes are staged: one write after the first
#: conflict, twice as many after each conflict in a row, at most this many.  A stream that repeats its
#: keys all the time stops paying for a COPY it rolls back, and one that rarely does goes back to direct.
STAGED_AFTER_CONFLICT_MAX = 64
_SAVEPOINT = "stream_direct_copy"
#: SQLSTATE unique_violation: a row's key is stored already.
_UNIQUE_VIOLATION = "23505"
#: Rows per ``executemany`` on SQLite: the Python values of a chunk exist at once (about 0.6 KB a row of the
#: example job's events), not those of the whole batch.
SQLITE_CHUNK_ROWS = 10_000
#: SQLAlchemy's text form of a DATETIME / DATE on SQLite (``sqlite.DATETIME``'s storage format).
SQLITE_DATETIME = "%Y-%m-%d %H:%M:%S"  # Arrow's %S carries the microseconds of a timestamp[us]
SQLITE_DATE = "%Y-%m-%d"


def is_table(rows: object) -> bool:
    """Whether ``rows`` is an Arrow table (without importing pyarrow for a list of dicts)."""
    return hasattr(rows, "num_rows") and hasattr(rows, "column_names")


def count(rows: Rows | pa.Table) -> int:
    return rows.num_rows if is_table(rows) else len(rows)


def write_rows(conn: Connection, table: Table, key: Sequence[str], increments: Sequence[str],
               rows: Rows | pa.Table) -> None:
    """Upsert ``rows`` into ``table`` inside ``conn``'s transaction, one row per key (``one_per_key``);
    no rows, nothing to do.  The temporary table of a COPY is dropped at the end of the transaction, committed or rolled back."""
    if not count(rows):
        return
    rows = one_per_key_table(rows, key, increments, table.name) if is_table(rows) \
        else one_per_key(rows, key, increments)
    dialect = conn.dialect
    if dialect.name == "postgresql" and dialect.driver == "psycopg" and count(rows) >= COPY_FROM_ROWS:
        _copy_upsert(conn, table, key, increments, rows)
        return
    try:
        if dialect.name == "sqlite" and is_table(rows) and _sqlite_ready(rows.schema):
            for chunk in rows.to_batches(max_chunksize=SQLITE_CHUNK_ROWS):
                columns = dict(zip(rows.column_names, _sqlite_columns(table, chunk), strict=True))
                _sqlite_executemany(conn, table, key, increments, columns)
        else:
            conn.execute(upsert(dialect.name, table, key, increments),
                         _pylist(table, rows) if is_table(rows) else rows)
    except OverflowError as err:  # sqlite3 binding an integer past 64 bits: a value the database cannot take
        raise DataError(f"a value of table {table.name!r} is out of the database's integer range: {err}", None,
                        err) from err


def one_per_key(rows: Rows, key: Sequence[str], increments: Sequence[str]) -> list[Mapping[str, Any]]:
    """One row per key: PostgreSQL refuses an upsert that touches the same row twice in one statement.
    Increments are summed; other columns keep the last row's value (the latest record wins).  Keys are
    compared as the database compares them (``_same_key``)."""
    merged: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        identity = tuple(_same_key(row[k]) for k in key)
        current = merged.get(identity)
        if current is None:
            merged[identity] = {**row, **{k: _plus_zero(row[k]) for k in key}}
            continue
        for column, value in row.items():
            if column not in key:
                current[column] = _summed(current[column], value) if column in increments else value
    return list(merged.values())


def _plus_zero(value: Any) -> Any:
    """-0.0 as 0.0 (IEEE addition of +0.0 does it), any other value as it is."""
    return value + 0.0 if isinstance(value, float) else value


def _same_key(value: Any) -> Any:
    """A key value as the databases compare it: -0.0 is 0.0 and every NaN is one NaN (PostgreSQL's float
    equality; SQLite stores a NaN as NULL, which a key column refuses).  A Python dict already takes 0.0
    and -0.0 as one key, but each NaN object as a key of its own, which PostgreSQL would be asked to upsert
    twice."""
    if isinstance(value, float) and value != value:
        return ("NaN",)
    return _plus_zero(value)


def _summed(a, b):
    """Two increments of one key as SQL's SUM and the upsert add them: a NULL counts as nothing."""
    return b if a is None else a if b is None else a + b


def one_per_key_table(rows: pa.Table, key: Sequence[str], increments: Sequence[str],
                      table_name: str = "?") -> pa.Table:
    """``one_per_key`` for an Arrow table, in Arrow: unchanged when every key is unique (the usual case).
    Otherwise each key's last row, taken whole by its index (the last row's value, even a null one), with
    its increments replaced by their sums; the columns and their types are the input's.  Arrow's
    aggregate "last" would do without the index, but has no kernel for some types (decimal128, which
    Spark's DecimalType arrives as); ``take`` has one for every type."""
    import pyarrow as pa

    rows = _float_keys_plus_zero(rows, key)
    if rows.num_rows < 2 or rows.group_by(list(key)).aggregate([]).num_rows == rows.num_rows:
        return rows
    sums = [c for c in rows.column_names if c in increments and c not in key]
    keys = [f"key{i}" for i in range(len(key))]
    index = pa.array(range(rows.num_rows), pa.int64())
    # Own names: Arrow names an aggregate "<column>_<function>", which could be another column's name.
    # Integers are summed as decimals: Arrow's integer sum wraps around silently past 64 bits.
    work = pa.Table.from_arrays([*(rows[k] for k in key), index, *(_summable(rows[c]) for c in sums)],
                                names=[*keys, "row", *(f"sum{i}" for i in range(len(sums)))])
    merged = work.group_by(keys, use_threads=False).aggregate(
        [("row", "max"), *((f"sum{i}", "sum") for i in range(len(sums)))]  # a sum skips nulls; all null: null
    )
    last = rows.take(merged["row_max"])
    for i, column in enumerate(sums):
        summed = _as_type(merged[f"sum{i}_sum"], rows.schema.field(column).type, table_name, column)
        at = last.schema.get_field_index(column)
        last = last.set_column(at, last.schema.field(at).with_type(summed.type), summed)
    return last


def _float_keys_plus_zero(rows: pa.Table, key: Sequence[str]) -> pa.Table:
    """``rows`` with -0.0 as 0.0 in its floating-point key columns.  Arrow groups the two apart (it hashes
    the bits), where both databases see one key: PostgreSQL would refuse to upsert it twice in one
    statement, and an increment would be stored as two partial sums applied one over the other.  NaNs
    Arrow groups as one, as PostgreSQL compares them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for name in key:
        at = rows.schema.get_field_index(name)
        kind = rows.schema.field(at).type
        if pa.types.is_floating(kind):
            rows = rows.set_column(at, rows.schema.field(at), pc.add(rows[name], pa.scalar(0.0, kind)))
    return rows


def _summable(values: pa.ChunkedArray) -> pa.ChunkedArray:
    import pyarrow as pa

    return values.cast(pa.decimal128(38, 0)) if pa.types.is_integer(values.type) else values


def _as_type(summed: pa.ChunkedArray, type_: pa.DataType, table_name: str, column: str) -> pa.ChunkedArray:
    """Sums in their column's own type.  A float's stays a double (the table's column is one, and a float32
    sum could overflow to infinity).  A sum the type cannot hold keeps a wider one, for the database to
    store or refuse as the value it is (an int32 column's sum as an int64: the table's column is a BIGINT).
    An integer sum past 64 bits is refused here, as the database refuses it when the upsert adds it to a
    stored value: a DataError naming the column, where Arrow's own sum wrapped around without a word."""
    import pyarrow as pa

    if pa.types.is_floating(type_):
        return summed
    try:
        return summed.cast(type_)
    except pa.ArrowInvalid as err:
        if not pa.types.is_integer(type_):
            return summed
        try:
            return summed.cast(pa.int64())
        except pa.ArrowInvalid:
            raise DataError(f"the increments of column {column!r} of table {table_name!r} for one key in this "
                            "batch add up to more than 64 bits hold", None, err) from err


def _copy_upsert(conn: Connection, table: Table, key: Sequence[str], increments: Sequence[str],
                 rows: Rows | pa.Table) -> None:
    quote = conn.dialect.identifier_preparer.quote
    names = [c.name for c in table.columns if not is_table(rows) or c.name in rows.column_names]
    if not increments and _copy_direct(conn, quote, table, names, rows):
        return
    stage = Table(f"stream_stage_{table.name}", MetaData(), *(Column(c.name, c.type) for c in table.columns))
    conn.exec_driver_sql(f"CREATE TEMPORARY TABLE {quote(stage.name)} (LIKE {quote(table.name)}) ON COMMIT DROP")
    with conn.connection.driver_connection.cursor() as cursor:
        _copy(cursor, quote, stage.name, names, rows, table)
    conn.execute(on_conflict(postgresql.insert(table).from_select(names, select(*(stage.c[n] for n in names))),
                             table, key, increments))
    conn.exec_driver_sql(f"DROP TABLE {quote(stage.name)}")  # a second write to the table in this transaction


def _copy_direct(conn: Connection, quote, table: Table, names: Sequence[str], rows: Rows | pa.Table) -> bool:
    """``COPY`` the rows straight into ``table`` (one row per key already); False, with nothing written, when
    a key is stored already or the table's writes are staged for now after such a conflict.  Any other
    refusal (a NULL key, a value out of range) is raised as the staged upsert would raise it."""
    staged = table.info.get("staged_writes_left", 0)
    if staged:
        table.info["staged_writes_left"] = staged - 1
        return False
    with conn.connection.driver_connection.cursor() as cursor:
        cursor.execute(f"SAVEPOINT {_SAVEPOINT}")
        try:
            _copy(cursor, quote, table.name, names, rows, table)
        except Exception as err:
            cursor.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            if getattr(err, "sqlstate", None) != _UNIQUE_VIOLATION:
                raise
            backoff = min(2 * table.info.get("staged_backoff", 0) or 1, STAGED_AFTER_CONFLICT_MAX)
            table.info.update(staged_backoff=backoff, staged_writes_left=backoff)
            return False
        cursor.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
    table.info["staged_backoff"] = 0
    return True


def _copy(cursor, quote, target: str, names: Sequence[str], rows: Rows | pa.Table, table: Table) -> None:
    """``COPY`` the ``names`` columns of ``rows`` into table ``target``: an Arrow table as Arrow's CSV where
    it reads back the same, anything else row by row."""
    columns = f"{quote(target)} ({', '.join(quote(n) for n in names)})"
    if is_table(rows) and _csv_ready(rows):
        with cursor.copy(f"COPY {columns} FROM STDIN (FORMAT csv)") as copy:
            for chunk in _csv_chunks(rows.select(names)):
                copy.write(chunk)
    else:
        rows = _pylist(table, rows) if is_table(rows) else rows
        with cursor.copy(f"COPY {columns} FROM STDIN") as copy:
            for row in rows:
                copy.write_row([row.get(name) for name in names])


def _csv_ready(rows: pa.Table) -> bool:
    """Whether Arrow's CSV text of every column reads back as the same value in PostgreSQL: strings are
    quoted (an empty string stays one, an unquoted empty field is NULL), numbers round-trip, timestamps
    are ISO text.  Binary and nested columns are not."""
    import pyarrow as pa

    return all(
        pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_floating(t)
        or pa.types.is_boolean(t) or pa.types.is_date(t) or pa.types.is_decimal(t)
        or (pa.types.is_timestamp(t) and t.tz is None)
        for t in rows.schema.types
    )


def _csv_chunks(rows: pa.Table):
    import pyarrow.csv as csv

    rows = _narrow_floats_as_doubles(rows)
    options = csv.WriteOptions(include_header=False)
    for batch in rows.to_batches(max_chunksize=COPY_CHUNK_ROWS):
        text = io.BytesIO()
        csv.write_csv(batch, text, options)
        yield text.getvalue()


def _narrow_floats_as_doubles(rows: pa.Table) -> pa.Table:
    """Float32 (and float16) columns as the doubles they hold.  Arrow writes a float32 as its shortest text
    (0.1f as ``0.1``), which the table's double column reads as another number than the one the other paths
    store (0.10000000149011612, the float's exact value): a key written by COPY in one batch and by an
    INSERT in another would be two keys."""
    import pyarrow as pa

    narrow = [i for i, t in enumerate(rows.schema.types) if pa.types.is_floating(t) and t.bit_width < 64]
    for at in narrow:
        field = rows.schema.field(at)
        rows = rows.set_column(at, field.with_type(pa.float64()), rows.column(at).cast(pa.float64()))
    return rows


def _sqlite_ready(schema: pa.Schema) -> bool:
    """Whether every column's type is one the SQLite path binds itself (``_sqlite_columns``)."""
    import pyarrow as pa

    return all(
        (pa.types.is_timestamp(t) and t.tz is None) or pa.types.is_date(t) or pa.types.is_string(t)
        or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
        for t in schema.types
    )


def _sqlite_columns(table: Table, rows: pa.RecordBatch) -> list[list]:
    """Each column of ``rows`` (bound for ``table``) as the values SQLAlchemy would bind on SQLite
    (``_sqlite_ready`` types)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = []
    for name, column in zip(rows.schema.names, rows.columns, strict=True):
        t = column.type
        if pa.types.is_timestamp(t):
            column = pc.strftime(column.cast(pa.timestamp("us")), SQLITE_DATETIME)
        elif pa.types.is_date(t):
            column = pc.strftime(column, SQLITE_DATE)
        columns.append(_pylist(table, column, name))
    return columns


def _pylist(table: Table, values: pa.Table | pa.Array, column: str | None = None) -> list:
    """``values.to_pylist()`` (a table's, or its ``column``'s), a string that is not valid UTF-8 raised as a
    value the database refuses: a DataError, so the sink isolates the record instead of failing the batch
    on every restart.  Arrow keeps a string's bytes unchecked (Spark's cast of binary to string does not
    check them either) until Python decodes them here; PostgreSQL's COPY refuses them itself."""
    try:
        return values.to_pylist()
    except UnicodeDecodeError as err:
        if column is None:  # which column: only on this rare path, a full validation is no cost to a batch
            column = next((c for c in values.column_names if not _valid(values[c])), "?")
        raise DataError(f"a value of column {column!r} of table {table.name!r} is not valid UTF-8", None,
                        err) from err


def _valid(values: pa.ChunkedArray) -> bool:
    import pyarrow as pa

    try:
        values.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _sqlite_executemany(conn: Connection, table: Table, key: Sequence[str], increments: Sequence[str],
                        columns: dict[str, list]) -> None:
    """The upsert compiled once, its parameters bound by position: the driver's ``executemany`` loops in C."""
    names = [c.name for c in table.columns if c.name in columns]
    compiled = upsert("sqlite", table, key, increments).compile(dialect=conn.dialect, column_keys=names)
    conn.exec_driver_sql(compiled.string, list(zip(*(columns[name] for name in compiled.positiontup), strict=True)))
