"""``state`` is the one door to the state database, checked on the source: no module outside
``airflow_stream_provider/state/`` builds or runs a statement or reaches for the engine, and ``state``
(the batch transaction included) imports neither pyspark nor airflow, since both sides use it."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.sources import PACKAGE, REPO, sources, top_level_imports

STATE = PACKAGE / "state"

#: SQLAlchemy names that build or run statements, or make engines and hook into them.
STATEMENT_NAMES = frozenset({
    "select", "insert", "update", "delete", "text", "func", "and_", "or_", "not_", "exists", "literal",
    "literal_column", "bindparam", "union", "union_all", "inspect", "create_engine", "event", "Engine",
    "Connection",
})
#: SQLAlchemy modules that only statement building needs.
STATEMENT_MODULES = ("sqlalchemy.dialects", "sqlalchemy.sql", "sqlalchemy.orm", "sqlalchemy.event")
#: Methods that run a statement or read its result.
EXECUTING = frozenset({"execute", "executemany", "exec_driver_sql", "scalar", "scalar_one", "scalars",
                       "mappings"})
#: An engine's methods that open a connection or a transaction.
ENGINE_CALLS = frozenset({"connect", "begin", "raw_connection"})
#: A table's methods that build a statement or run DDL.
TABLE_CALLS = frozenset({"insert", "update", "delete", "select", "create", "create_all", "drop", "drop_all"})


def _mentions_engine(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and "engine" in n.id.lower()) or (isinstance(n, ast.Attribute) and n.attr == "engine")
        for n in ast.walk(node)
    )


def _is_task_execute(call: ast.Call) -> bool:
    """``super().execute(context)`` and the like: an Airflow operator's ``execute``, not a statement's."""
    receiver = call.func.value
    if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super":
        return True
    if isinstance(receiver, ast.Name) and receiver.id == "self":
        return True
    first = call.args[0] if call.args else None
    return (isinstance(first, ast.Name) and first.id == "context") or any(k.arg == "context" for k in call.keywords)


def _on_schema_table(node: ast.AST) -> bool:
    """``schema.runs`` or ``upgrades`` style receivers: a table of the state database's schema."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "schema"


def statements_in(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` builds or runs SQL, or reaches the engine: ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sqlalchemy":
            if node.module.startswith(STATEMENT_MODULES):
                found.append(f"{where}: imports {node.module}")
            found += [f"{where}: imports sqlalchemy's {a.name}" for a in node.names if a.name in STATEMENT_NAMES]
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names if a.name.startswith(STATEMENT_MODULES)]
        elif isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"{where}: reaches the engine (.engine)")
        elif isinstance(node, ast.Attribute) and node.attr in STATEMENT_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id in ("sqlalchemy", "sa"):
            found.append(f"{where}: uses sqlalchemy.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, node.func.value
            if method in EXECUTING and not _is_task_execute(node):
                found.append(f"{where}: runs a statement (.{method})")
            elif method in ENGINE_CALLS and _mentions_engine(receiver):
                found.append(f"{where}: opens a connection (.{method} on an engine)")
            elif method in TABLE_CALLS and (_on_schema_table(receiver) or any(_mentions_engine(a) for a in node.args)):
                found.append(f"{where}: builds a statement on a table (.{method})")
    return found


@pytest.mark.parametrize("path", [p for p in sources(PACKAGE) if STATE not in p.parents],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_sql_outside_state(path):
    found = statements_in(path.read_text(), str(path.relative_to(REPO)))
    assert not found, (
        "SQL outside airflow_stream_provider/state/: give StateStore (state/store.py) or a module under "
        "state/ a named method for it, and call that instead:\n" + "\n".join(found)
    )


def test_the_scan_sees_statements():
    """The scan itself: each way of reaching the database is caught, the allowed neighbours are not."""
    caught = statements_in(
        "from sqlalchemy import select, text\n"
        "from sqlalchemy.dialects import sqlite\n"
        "with store.engine.connect() as conn:\n"
        "    conn.execute(select(schema.runs))\n"
        "    conn.exec_driver_sql('BEGIN')\n"
        "schema.restarts.insert()\n"
        "table.create(engine, checkfirst=True)\n"
    )
    assert {int(line.split(":")[1]) for line in caught} == set(range(1, 8)), caught
    assert statements_in(
        "from sqlalchemy import Column, MetaData, Table, exc\n"
        "from sqlalchemy.engine import make_url\n"
        "def execute(self, context):\n"
        "    return super().execute(context)\n"
        "store.record_restart('job', 'restart', 'why', None, None)\n"
        "frame.select('topic')\n"
    ) == []


@pytest.mark.parametrize("path", sources(STATE), ids=lambda p: str(p.relative_to(REPO)))
def test_state_imports_neither_side(path):
    assert not {"pyspark", "airflow"} & top_level_imports(path)


def test_the_batch_transaction_loads_without_pyspark_or_airflow():
    """What ``state.transaction`` pulls in when imported, transitively: no pyspark, no airflow."""
    probe = (
        "import sys\n"
        "import airflow_stream_provider.state.transaction\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'airflow'}))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


# -- the named methods that replaced statements elsewhere, on SQLite and PostgreSQL -------------------------
def test_generations_and_archives(store):
    assert store.current_generation("job") == 1 and store.generations("job") == []
    store.ensure_generation("job", 1, "/ckpt/job/gen-1", '{"t": {"0": 0}}')
    store.ensure_generation("job", 2, "/ckpt/job/gen-2", None)
    assert store.current_generation("job") == 2
    store.mark_archived("job", 2, "/ckpt/job/archive/gen-2", "reset")
    assert store.current_generation("job") == 1
    store.mark_archived("job", 1, "/ckpt/job/archive/gen-1", "reset")
    assert store.current_generation("job") == 3  # every generation archived: the next one
    assert [(g["generation"], g["archive_path"], g["reason"]) for g in store.generations("job")] == [
        (1, "/ckpt/job/archive/gen-1", "reset"), (2, "/ckpt/job/archive/gen-2", "reset")]


def test_restart_history_says_whether_the_new_run_committed(store):
    first = store.begin_run("job", 1, "1.0").run_id
    second = store.begin_run("job", 1, "1.0").run_id
    store.record_restart("job", "restart", "died " * 1000, first, second)
    store.record_restart("job", "restart", "again", second, None)
    store.record_progress(second, 0, None, committed=True)
    history = store.restarts_since("job", 0)
    assert [(r["failed_run_id"], r["new_run_committed"]) for r in history] == [(first, True), (second, False)]
    assert len(history[0]["reason"]) == 2000
    assert store.restarts_since("job", history[1]["at"] + 1) == []


def test_a_restart_recorded_again_for_the_same_new_run_counts_once(store):
    """A recovery records its restart at the submit and, if the database did not answer then, once the
    launch is over (or its retry picks the launch up): one restart, whichever way."""
    dead = store.begin_run("job", 1, "1.0").run_id
    new = store.begin_run("job", 1, "1.0").run_id
    store.record_restart("job", "restart", "DEAD", dead, None)  # begun, before the stop
    store.record_restart("job", "restart", "DEAD", dead, new)
    store.record_restart("job", "restart", "DEAD", dead, new)
    store.record_restart("job", "standby", "DEAD", dead, new)
    assert [(r["failed_run_id"], r["new_run_id"]) for r in store.restarts_since("job", 0)] == [(dead, new)]


def test_a_restart_names_the_task_that_began_it_and_the_one_that_finished_it(store):
    """The watcher asks Airflow about the task that began a restart still owed; a retry of a reset's task
    asks who finished the reset it began."""
    dead = store.begin_run("job", 1, "1.0").run_id
    new = store.begin_run("job", 1, "1.0").run_id
    store.record_restart("job", "reset", "manual reset", dead, None, "ops/manual__1/reset/-1")
    store.record_restart("job", "restart", "elsewhere", None, None, "other/r/recover/-1")
    store.record_restart("job", "reset", "manual reset", dead, new, "stream_health/a__1/recover/-1")
    mine = store.latest_restart("job", begun_by="ops/manual__1/reset/-1")
    assert (mine["new_run_id"], mine["task"], mine["finished_by"]) == (new, "ops/manual__1/reset/-1",
                                                                     "stream_health/a__1/recover/-1"), mine
    assert store.latest_restart("job")["task"] == "other/r/recover/-1"
    assert store.latest_restart("job", begun_by="nobody/r/t/-1") is None
    store.record_restart("job", "standby", "DEAD", new, "r3", "stream_health/a__2/recover/-1")  # launched at once
    assert (store.latest_restart("job")["task"], store.latest_restart("job")["finished_by"]) == (
        "stream_health/a__2/recover/-1", "stream_health/a__2/recover/-1")


def test_recent_runs_newest_first_with_dry_runs(store):
    ids = [store.begin_run("job", 1, "1.0", dry_run=(n == 1)).run_id for n in range(3)]
    assert [r.run_id for r in store.recent_runs("job", 2)] == ids[:0:-1]
    assert [r.dry_run for r in store.recent_runs("job", 5)] == [False, True, False]


def test_schema_table_and_ping(store, tmp_path):
    from sqlalchemy import BigInteger, Column, MetaData, Table, Text

    from airflow_stream_provider.state.store import StateStore

    store.ping()
    assert store.has_schema()
    empty = StateStore.from_url(f"sqlite:///{tmp_path / 'other.db'}")
    assert not empty.has_schema()
    empty.dispose()
    table = Table("front_door_results", MetaData(), Column("k", Text, primary_key=True), Column("n", BigInteger))
    store.ensure_table(table)
    store.ensure_table(table)  # exists already: nothing happens
    assert store.count(table) == 0


def test_connect_timeout_only_where_a_connection_can_wait():
    from sqlalchemy.engine import make_url

    from airflow_stream_provider.state.dialect import with_connect_timeout

    assert with_connect_timeout(make_url("postgresql+psycopg://u@h/db"), 7).query == {"connect_timeout": "7"}
    explicit = make_url("postgresql+psycopg://u@h/db?connect_timeout=30")
    assert with_connect_timeout(explicit, 7).query == {"connect_timeout": "30"}
    assert with_connect_timeout(make_url("sqlite:////tmp/x.db"), 7).query == {}


def test_restart_history_says_how_long_the_new_run_ran(store):
    """From its query's start to its end, or to its last heartbeat while it runs: the budget counts a restart
    whose run stayed up ``healthy_reset`` seconds as one that got somewhere (a quiet topic commits nothing)."""
    from sqlalchemy import update

    from airflow_stream_provider.state import schema

    first, up, ended = (store.begin_run("job", 1, "1.0").run_id for _ in range(3))
    store.record_restart("job", "restart", "died", first, up)
    store.record_restart("job", "restart", "died", up, ended)
    store.record_restart("job", "restart", "died", ended, None)
    store.mark_query_started(up)
    store.mark_query_started(ended)
    with store.engine.begin() as conn:
        started = store.now() - 700
        conn.execute(update(schema.runs).where(schema.runs.c.run_id.in_([up, ended])).values(query_started_at=started))
    store.heartbeat(up)
    store.finish_run(ended, status="FAILED", exit_code=1, failure_kind="USER_CODE", error_class=None, message="x")
    with store.engine.begin() as conn:
        conn.execute(update(schema.runs).where(schema.runs.c.run_id == ended).values(ended_at=started + 42))
    history = {r["new_run_id"]: r["new_run_up_s"] for r in store.restarts_since("job", 0)}
    assert 695 < history[up] < 710, history  # running: to its last heartbeat
    assert abs(history[ended] - 42) < 0.01, history  # ended: to its end
    assert history[None] == 0.0, "no run launched: nothing ran"
    failed = {r["new_run_id"]: r["new_run_failed"] for r in store.restarts_since("job", 0)}
    assert failed == {up: False, ended: True, None: False}, failed
    fenced, stopping = (store.begin_run("job", 1, "1.0").run_id for _ in range(2))
    store.record_restart("job", "restart", "died", ended, fenced)
    store.record_restart("job", "restart", "died", fenced, stopping)
    store.finish_run(fenced, status="FAILED", exit_code=5, failure_kind="CONCURRENT", error_class=None, message="x")
    store.request_stop(stopping)
    store.finish_run(stopping, status="FAILED", exit_code=1, failure_kind="USER_CODE", error_class=None, message="x")
    failed = {r["new_run_id"]: r["new_run_failed"] for r in store.restarts_since("job", 0)}
    assert (failed[fenced], failed[stopping]) == (False, False), "fenced, or failing as it stopped: not by itself"
