"""Result rows in bulk on real SQLite and PostgreSQL: an Arrow table stores exactly what the same rows as
dicts store, so a key written one way is the same key written the other (a restart never doubles a
row), and one row per key comes out of Arrow as out of Python.
"""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal

import pyarrow as pa
import pytest
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Float,
    LargeBinary,
    MetaData,
    Numeric,
    Table,
    Text,
    select,
)

from airflow_stream_provider.state import bulk
from airflow_stream_provider.state.dialect import is_data_error

KEY = ("k", "minute")
INCREMENTS = ("n",)
ARROW_SCHEMA = pa.schema([("k", pa.string()), ("minute", pa.timestamp("us")), ("n", pa.int64()),
                          ("amount", pa.float64()), ("flag", pa.bool_()), ("day", pa.date32()),
                          ("note", pa.string())])


def _table(store, name: str, *extra: Column) -> Table:
    table = Table(name, MetaData(), Column("k", Text, primary_key=True), Column("minute", DateTime, primary_key=True),
                  Column("n", BigInteger), Column("amount", Float(53)), Column("flag", Boolean), Column("day", Date),
                  Column("note", Text), *extra)
    table.create(store.engine)
    return table


def _rows(count: int, seed: int = 3) -> list[dict]:
    """Rows with repeated keys, awkward text (empty, null, quotes, commas, newlines, non-ASCII) and floats
    that only round-trip in full precision."""
    rnd = random.Random(seed)
    notes = ["", None, 'say "hi", then\nleave', "plain", "ünïcode ✓", "\\N", "NULL"]
    base = dt.datetime(2026, 11, 22, 10, 15)
    return [
        {"k": f"u-{rnd.randrange(count // 3 or 1)}", "minute": base + dt.timedelta(minutes=rnd.randrange(3),
                                                                                    microseconds=rnd.choice([0, 7])),
         "n": rnd.randrange(1, 5), "amount": rnd.choice([0.1, 1 / 3, 12345678.123456789, -2.5e-300, None]),
         "flag": rnd.choice([True, False, None]), "day": dt.date(2026, 1, 1) + dt.timedelta(days=rnd.randrange(9)),
         "note": rnd.choice(notes)}
        for _ in range(count)
    ]


def _stored(store, table: Table) -> dict:
    with store.engine.connect() as conn:
        return {(r.k, r.minute): r._asdict() for r in conn.execute(select(table))}


def _write(store, table: Table, rows) -> None:
    with store.engine.begin() as conn:
        bulk.write_rows(conn, table, KEY, INCREMENTS, rows)


@pytest.mark.parametrize("count", [20, bulk.COPY_FROM_ROWS * 3])  # PostgreSQL: INSERT, then COPY
@pytest.mark.parametrize("chunk", [bulk.SQLITE_CHUNK_ROWS, 7])  # SQLite: in one executemany, or in many
def test_an_arrow_table_stores_what_the_same_rows_as_dicts_store(store, count, chunk, monkeypatch):
    monkeypatch.setattr(bulk, "SQLITE_CHUNK_ROWS", chunk)
    rows = _rows(count)
    as_dicts, as_arrow = _table(store, "as_dicts"), _table(store, "as_arrow")
    _write(store, as_dicts, rows)
    _write(store, as_arrow, pa.Table.from_pylist(rows, ARROW_SCHEMA))
    assert _stored(store, as_arrow) == _stored(store, as_dicts)
    assert len(_stored(store, as_arrow)) < count  # keys repeated: one row per key, increments summed


def test_a_key_written_as_dicts_is_the_same_key_written_from_arrow(store):
    """Timestamps are part of keys (per-minute aggregates): SQLite keeps them as text, so the Arrow path
    must write SQLAlchemy's form exactly, or a restart would add rows instead of adding to them."""
    rows = _rows(bulk.COPY_FROM_ROWS * 2, seed=5)
    table = _table(store, "mixed")
    _write(store, table, rows)
    once = _stored(store, table)
    _write(store, table, pa.Table.from_pylist(rows, ARROW_SCHEMA))
    twice = _stored(store, table)
    assert twice.keys() == once.keys()
    assert all(twice[key]["n"] == 2 * once[key]["n"] for key in once)


def test_one_row_per_key_in_arrow_is_one_row_per_key_in_python():
    rows = _rows(500, seed=11)
    expected = bulk.one_per_key(rows, KEY, INCREMENTS)
    merged = bulk.one_per_key_table(pa.Table.from_pylist(rows, ARROW_SCHEMA), KEY, INCREMENTS)
    assert merged.column_names == ARROW_SCHEMA.names
    assert sorted(merged.to_pylist(), key=lambda r: (r["k"], r["minute"])) == \
        sorted(expected, key=lambda r: (r["k"], r["minute"]))
    unique = pa.Table.from_pylist(expected, ARROW_SCHEMA)
    assert bulk.one_per_key_table(unique, KEY, INCREMENTS) is unique  # nothing to merge: the table itself


def test_a_column_arrow_cannot_write_as_text_takes_the_row_path(store):
    """Binary (and any type the fast paths do not know) goes through SQLAlchemy's rows: same result."""
    table = _table(store, "with_bytes", Column("raw", LargeBinary))
    rows = [{**row, "raw": bytes([i % 256, 0, 255])} for i, row in enumerate(_rows(bulk.COPY_FROM_ROWS + 5, seed=2))]
    _write(store, table, pa.Table.from_pylist(rows, ARROW_SCHEMA.append(pa.field("raw", pa.binary()))))
    stored = _stored(store, table)
    merged = {(r["k"], r["minute"]): r for r in bulk.one_per_key(rows, KEY, INCREMENTS)}
    assert {key: row["raw"] for key, row in stored.items()} == {key: row["raw"] for key, row in merged.items()}


@pytest.mark.parametrize("count", [3, bulk.COPY_FROM_ROWS * 2])
def test_a_refused_arrow_row_is_a_data_error_and_nothing_stays(store, count):
    """Poison isolation asks the database about a batch's rows: the Arrow paths must fail the same way."""
    table = _table(store, "refusing")
    rows = _rows(count, seed=4)
    rows[1] = {**rows[1], "k": None}  # NULL in a primary-key column
    with pytest.raises(Exception) as caught:
        _write(store, table, pa.Table.from_pylist(rows, ARROW_SCHEMA))
    assert is_data_error(caught.value), repr(caught.value)
    assert _stored(store, table) == {}


def test_a_postgresql_table_without_increments_takes_a_direct_copy_until_a_key_comes_back(store):
    """Per-event rows COPY straight into their table; a batch holding a key stored already rolls that
    back to the staged upsert (the latest row wins, as always), and the table's next writes are staged
    for a while before a direct COPY is tried again."""
    if store.dialect != "postgresql":
        pytest.skip("COPY is PostgreSQL's")
    table = Table("per_event", MetaData(), Column("k", Text, primary_key=True), Column("note", Text))
    table.create(store.engine)
    n = bulk.COPY_FROM_ROWS * 2

    def write(first: int, note: str) -> None:
        rows = pa.Table.from_pylist([{"k": f"e-{i}", "note": note} for i in range(first, first + n)])
        with store.engine.begin() as conn:
            bulk.write_rows(conn, table, ("k",), (), rows)

    def stored() -> dict:
        with store.engine.connect() as conn:
            return dict(conn.execute(select(table.c.k, table.c.note)).all())

    write(0, "first")
    assert table.info["staged_backoff"] == 0 and len(stored()) == n  # direct
    write(n // 2, "second")  # half the keys are stored: rolled back, staged
    assert table.info == {"staged_backoff": 1, "staged_writes_left": 1}
    assert stored()["e-0"] == "first" and stored()[f"e-{n // 2}"] == "second" and len(stored()) == n + n // 2
    write(n, "third")  # staged, as the conflict asked
    assert table.info["staged_writes_left"] == 0 and stored()[f"e-{n}"] == "third"
    write(n, "fourth")  # direct again, and still a conflict: staged for twice as long
    assert table.info == {"staged_backoff": 2, "staged_writes_left": 2} and stored()[f"e-{n}"] == "fourth"
    write(10 * n, "fifth")
    write(11 * n, "sixth")
    write(12 * n, "seventh")  # two staged, then direct without a conflict: the backoff is over
    assert table.info == {"staged_backoff": 0, "staged_writes_left": 0} and len(stored()) == 5 * n
    with store.engine.connect() as conn:
        staged = conn.exec_driver_sql("SELECT count(*) FROM pg_class WHERE relname LIKE 'stream_stage_%%'").scalar()
    assert staged == 0


@pytest.mark.parametrize("as_arrow", [False, True], ids=["dicts", "arrow"])
@pytest.mark.parametrize("padding", [0, bulk.COPY_FROM_ROWS])  # PostgreSQL: INSERT, then COPY
def test_a_null_increment_adds_nothing_across_batches_and_within_one(store, as_arrow, padding):
    """A key whose records hold no value in a batch sums to NULL there (SQL's SUM, Spark's ``sum``).  A later
    batch's value must still be added, as one SUM over both batches' records would give it; NULL + 10 kept
    the stored NULL, and the Python merge of one batch's rows refused None + 10."""
    table = _table(store, f"null_increments_{int(as_arrow)}_{padding}")
    minute = dt.datetime(2026, 11, 22, 10, 15)
    batches = [[("a", None), ("b", 4), ("c", None)],
               [("a", 10), ("b", None), ("c", None)],
               [("a", 1), ("a", None), ("d", None), ("d", 2)]]  # within one batch too
    for batch in batches:
        rows = [{"k": k, "minute": minute, "n": n, "amount": None, "flag": None, "day": None, "note": None}
                for k, n in batch + [(f"pad-{i}", 1) for i in range(padding)]]
        _write(store, table, pa.Table.from_pylist(rows, ARROW_SCHEMA) if as_arrow else rows)
    stored = {k: row["n"] for (k, _), row in _stored(store, table).items()}
    assert {k: stored[k] for k in "abcd"} == {"a": 11, "b": 4, "c": None, "d": 2}
    assert {stored[k] for k in stored if k.startswith("pad-")} <= {3}


def test_one_row_per_key_in_arrow_takes_the_last_row_of_any_column_type():
    """Arrow's aggregate "last" has no kernel for decimal128 (Spark's DecimalType): a key's last row, nulls
    included, must come out of every column type, in the input's schema, its increments summed."""
    schema = pa.schema([("k", pa.string()), ("n", pa.int32()), ("total", pa.decimal128(10, 2)),
                        ("price", pa.decimal128(10, 2)), ("at", pa.timestamp("us")), ("note", pa.string()),
                        ("raw", pa.binary()), ("flag", pa.bool_())])
    at = dt.datetime(2026, 11, 22, 10, 15, 0, 7)
    full = {"price": Decimal("9.99"), "at": at, "note": "first", "raw": b"\x00\xff", "flag": True}
    empty = dict.fromkeys(full)
    rows = [{"k": "a", "n": 1, "total": Decimal("1.10"), **full},
            {"k": "b", "n": None, "total": None, **empty},
            {"k": "c", "n": 3, "total": Decimal("2.50"), **empty},
            {"k": "a", "n": 2, "total": None, **empty},  # the last row's nulls win; a null increment adds nothing
            {"k": "b", "n": None, "total": None, **full},  # no increment at all: NULL
            {"k": "c", "n": 4, "total": Decimal("0.25"), **full, "note": "last", "flag": False}]
    merged = bulk.one_per_key_table(pa.Table.from_pylist(rows, schema), ("k",), ("n", "total"))
    assert merged.schema == schema
    assert sorted(merged.to_pylist(), key=lambda r: r["k"]) == [
        {"k": "a", "n": 3, "total": Decimal("1.10"), **empty},
        {"k": "b", "n": None, "total": None, **full},
        {"k": "c", "n": 7, "total": Decimal("2.75"), **full, "note": "last", "flag": False},
    ]


@pytest.mark.parametrize("arrow", [True, False])
@pytest.mark.parametrize("padding", [0, bulk.COPY_FROM_ROWS])  # PostgreSQL: INSERT, then COPY
def test_increments_of_one_key_past_64_bits_are_refused_not_wrapped(store, arrow, padding):
    """Arrow's integer sum wraps around past 64 bits: three increments of 2**62 were stored as -2**62."""
    table = _table(store, f"overflowing_{int(arrow)}_{padding}")
    rows = [{**row, "k": "big", "minute": dt.datetime(2026, 11, 22), "n": 2**62} for row in _rows(3, seed=8)]
    rows += [{**row, "k": f"pad-{i}"} for i, row in enumerate(_rows(padding, seed=9))]
    with pytest.raises(Exception) as caught:  # refused as the database refuses it, naming the column
        _write(store, table, pa.Table.from_pylist(rows, ARROW_SCHEMA) if arrow else rows)
    assert is_data_error(caught.value), repr(caught.value)
    assert _stored(store, table) == {}


def test_narrow_integer_increments_of_one_key_are_stored_past_their_type(store):
    """An int16 or int32 increment (Spark's ShortType, IntegerType) whose in-batch sum passes its type: the
    table's column is a BIGINT, which holds it."""
    table = Table("narrow_sums", MetaData(), Column("k", Text, primary_key=True), Column("n", BigInteger),
                  Column("m", BigInteger))
    table.create(store.engine)
    rows = pa.table({"k": ["a", "a"], "n": pa.array([20_000, 20_000], pa.int16()),
                     "m": pa.array([2**30, 2**30], pa.int32())})
    with store.engine.begin() as conn:
        bulk.write_rows(conn, table, ("k",), ("n", "m"), rows)
    with store.engine.connect() as conn:
        assert conn.execute(select(table.c.n, table.c.m)).one() == (40_000, 2**31)


def test_float_increments_of_one_key_are_summed_as_doubles(store):
    """A float32 column's sum in float32 overflowed to infinity; the table's column is a double."""
    table = Table("float_sums", MetaData(), Column("k", Text, primary_key=True), Column("x", Float(53)))
    table.create(store.engine)
    rows = pa.table({"k": ["a", "a"], "x": pa.array([3e38, 3e38], pa.float32())})
    with store.engine.begin() as conn:
        bulk.write_rows(conn, table, ("k",), ("x",), rows)
    with store.engine.connect() as conn:
        (stored,) = conn.execute(select(table.c.x)).scalars()
    assert stored == pytest.approx(6e38, rel=1e-6)


@pytest.mark.parametrize("padding", [0, bulk.COPY_FROM_ROWS])  # PostgreSQL: INSERT, then COPY
def test_a_decimal_column_with_a_key_twice_in_a_batch_is_stored(store, padding):
    """The commit of such a batch failed on every restart: Arrow could not merge the decimal column."""
    table = Table(f"balances_{padding}", MetaData(), Column("account", Text, primary_key=True),
                  Column("n", BigInteger), Column("balance", Numeric(10, 2)))
    table.create(store.engine)
    rows = [{"account": "a", "n": 1, "balance": Decimal("1.00")}, {"account": "a", "n": 2, "balance": Decimal("2.50")}]
    rows += [{"account": f"pad-{i}", "n": 1, "balance": Decimal(i)} for i in range(padding)]
    schema = pa.schema([("account", pa.string()), ("n", pa.int64()), ("balance", pa.decimal128(10, 2))])
    with store.engine.begin() as conn:
        bulk.write_rows(conn, table, ("account",), ("n",), pa.Table.from_pylist(rows, schema))
    with store.engine.connect() as conn:
        stored = {r.account: (r.n, r.balance) for r in conn.execute(select(table))}
    assert stored["a"] == (3, Decimal("2.50")) and len(stored) == 1 + padding


def _not_utf8(strings: pa.ChunkedArray, at: int) -> pa.Array:
    """``strings`` with the value at ``at`` made invalid UTF-8, as Spark's cast of binary to string hands
    it to Arrow (neither checks)."""
    raw = strings.cast(pa.binary()).to_pylist()
    raw[at] = b"\xff\xfebad"
    raw = pa.array(raw, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


@pytest.mark.parametrize("with_bytes", [False, True], ids=["text", "bytes"])  # SQLite: its own path, or rows
@pytest.mark.parametrize("count", [3, bulk.COPY_FROM_ROWS * 2])  # PostgreSQL: INSERT, then COPY
def test_a_string_that_is_not_utf8_is_a_data_error_and_nothing_stays(store, count, with_bytes):
    """Decoding it failed with a UnicodeDecodeError, which is no refused value to poison isolation: the
    sink failed the batch on every restart instead of isolating the record."""
    extra = (Column("raw", LargeBinary),) if with_bytes else ()
    table = _table(store, f"not_utf8_{count}_{int(with_bytes)}", *extra)
    rows = pa.Table.from_pylist(_rows(count, seed=6), ARROW_SCHEMA)
    rows = rows.set_column(rows.schema.get_field_index("note"), "note", _not_utf8(rows["note"], 1))
    if with_bytes:
        rows = rows.append_column(pa.field("raw", pa.binary()), pa.array([b"\x00"] * count, pa.binary()))
    with pytest.raises(Exception) as caught:
        _write(store, table, rows)
    assert is_data_error(caught.value), repr(caught.value)
    assert _stored(store, table) == {}
    if store.dialect == "sqlite" or count < bulk.COPY_FROM_ROWS or with_bytes:  # else PostgreSQL's CSV COPY
        assert f"column 'note' of table '{table.name}' is not valid UTF-8" in str(caught.value)


@pytest.mark.parametrize("count", [2, bulk.COPY_FROM_ROWS])  # PostgreSQL: INSERT, then COPY
@pytest.mark.parametrize("as_arrow", [True, False], ids=["arrow", "dicts"])
def test_a_float_key_is_one_key_as_the_database_compares_it(store, count, as_arrow):
    """0.0 and -0.0 are one key to both databases, and NaN is one key to PostgreSQL: a batch holding both
    spellings of a key writes one row with the increments summed, where Arrow grouped them apart and
    PostgreSQL refused to upsert the row twice in one statement."""
    table = Table("by_amount", MetaData(), Column("amount", Float(53), primary_key=True), Column("n", BigInteger))
    table.create(store.engine)
    schema = pa.schema([("amount", pa.float64()), ("n", pa.int64())])
    zeros = [{"amount": -0.0 if i % 2 else 0.0, "n": 1} for i in range(count)]
    padding = [{"amount": float(i + 1), "n": 1} for i in range(count)]

    def write(rows):
        with store.engine.begin() as conn:
            bulk.write_rows(conn, table, ("amount",), ("n",), pa.Table.from_pylist(rows, schema) if as_arrow else rows)

    def stored():
        with store.engine.connect() as conn:
            return {r.amount: r.n for r in conn.execute(select(table))}

    write(zeros + padding)
    write(zeros[1:2])  # -0.0 again, as a restart's replay would write it: added to the same row
    assert stored() == {0.0: count + 1, **{float(i + 1): 1 for i in range(count)}}

    nans = [{"amount": float("nan"), "n": 1}, {"amount": float("nan"), "n": 2}]
    if store.dialect == "sqlite":  # SQLite stores a NaN as NULL, which the key column refuses
        with pytest.raises(Exception) as caught:
            write(nans)
        assert is_data_error(caught.value), repr(caught.value)
    else:
        write(nans)
        assert [n for amount, n in stored().items() if amount != amount] == [3]  # one NaN row


def test_a_float32_key_is_the_same_key_by_copy_and_by_insert(store):
    """Spark's FloatType arrives as float32: a key written in a large batch (COPY on PostgreSQL) and in a
    small one (INSERT) is one row, its increments added, whichever way each batch went."""
    table = Table("by_ratio", MetaData(), Column("ratio", Float(53), primary_key=True), Column("n", BigInteger))
    table.create(store.engine)
    schema = pa.schema([("ratio", pa.float32()), ("n", pa.int64())])
    large = [{"ratio": 0.1 + i, "n": 1} for i in range(bulk.COPY_FROM_ROWS)]
    for rows in (large, large[:1]):  # the first batch by COPY on PostgreSQL, the second by INSERT
        with store.engine.begin() as conn:
            bulk.write_rows(conn, table, ("ratio",), ("n",), pa.Table.from_pylist(rows, schema))
    with store.engine.connect() as conn:
        stored = {r.ratio: r.n for r in conn.execute(select(table))}
    assert len(stored) == bulk.COPY_FROM_ROWS, "one row per float32 key"
    assert stored[float(pa.scalar(0.1, pa.float32()).as_py())] == 2
