"""Tables of the state database: where the runtime and the Airflow side meet.

SQLAlchemy Core, so one definition serves SQLite (embedded default) and PostgreSQL.  Times are unix
seconds (float): comparable in both dialects without time-zone conversions.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

metadata = MetaData()

#: One row per stream job; ``epoch`` is the fencing token: only the run holding it may commit.
jobs = Table(
    "stream_jobs",
    metadata,
    Column("job_id", String(100), primary_key=True),
    Column("epoch", BigInteger, nullable=False, default=0),
    Column("generation", Integer, nullable=False, default=1),
    Column("version", String(200)),
    Column("updated_at", Float),
)

#: One row per checkpoint lineage.  A reset archives generation n (never deletes it) and starts n+1.
generations = Table(
    "stream_generations",
    metadata,
    Column("job_id", String(100), primary_key=True),
    Column("generation", Integer, primary_key=True),
    Column("checkpoint_path", Text, nullable=False),
    #: The concrete offsets the generation started from (Spark JSON): the start of its batch 0.
    Column("starting_offsets", Text),
    Column("created_at", Float),
    Column("archived_at", Float),
    Column("archive_path", Text),
    Column("reason", Text),
)

#: One row per driver lifetime.
runs = Table(
    "stream_runs",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("job_id", String(100), nullable=False, index=True),
    Column("epoch", BigInteger, nullable=False),
    Column("generation", Integer, nullable=False),
    Column("version", String(200)),
    Column("dry_run", Boolean, nullable=False, default=False),
    Column("host", String(255)),
    Column("pid", Integer),
    #: STARTING -> RUNNING -> STOPPING -> STOPPED | FAILED; a driver killed -9 stays RUNNING with an old
    #: heartbeat: the Airflow side concludes DEAD from that.
    Column("status", String(20), nullable=False),
    Column("started_at", Float),
    Column("heartbeat_at", Float),
    Column("query_started_at", Float),
    Column("last_batch_id", BigInteger),
    Column("last_batch_at", Float),
    Column("last_progress", Text),
    Column("stop_requested_at", Float),
    Column("ended_at", Float),
    Column("exit_code", Integer),
    Column("failure_kind", String(40)),
    Column("error_class", String(200)),
    Column("termination_message", Text),
    #: Where the driver's stdout/stderr go, when the launcher knows (local and client mode).
    Column("log_path", Text),
    #: The submission handle for cluster masters (driver id, YARN application id, pod name).
    Column("submission_id", Text),
    #: The driver's Spark UI (``SparkContext.uiWebUrl``), recorded at start; None when the UI is off.
    Column("ui_url", Text),
    #: The result tables the job's code writes (JSON list), recorded when the query starts: lineage.
    Column("outputs", Text),
    #: What was launched (job file and spec JSON, which holds no secret), recorded by the launcher once
    #: the query runs: an upgrade rolls back to exactly this.
    Column("application", Text),
    Column("spec", Text),
)

#: The stored offsets: per partition, the next offset not yet applied to the results.  They move
#: forward only inside the transaction that wrote the results they cover.
offsets = Table(
    "stream_offsets",
    metadata,
    Column("job_id", String(100), primary_key=True),
    Column("topic", String(249), primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("generation", Integer),
    Column("batch_id", BigInteger),
    Column("updated_at", Float),
)

#: The batch ledger: one row per (batch, partition) that a transaction committed.
batches = Table(
    "stream_batches",
    metadata,
    Column("job_id", String(100), primary_key=True),
    Column("generation", Integer, primary_key=True),
    Column("batch_id", BigInteger, primary_key=True),
    Column("topic", String(249), primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("start_offset", BigInteger, nullable=False),
    Column("end_offset", BigInteger, nullable=False),
    #: Rows, not Kafka records: what the job's transform made of the partition's records in the range (an
    #: explode makes several of one record, a filter none), of which applied + dead = read.  The records
    #: themselves are the offset range.
    Column("rows_read", BigInteger, nullable=False),
    Column("rows_applied", BigInteger, nullable=False),
    Column("rows_dead", BigInteger, nullable=False),
    Column("epoch", BigInteger, nullable=False),
    Column("run_id", String(64)),
    Column("committed_at", Float),
    #: When the driver began the batch (Spark handed it over): committed_at - started_at is its latency.
    Column("started_at", Float),
)

#: Ranges a reset gave up with ``allow_data_loss`` (fell out of retention, topic recreated, partition gone).
#: Written in the transaction that moves the stored offsets past them, so results, ledger and accepted
#: losses always add up to the stored offsets.  ``resume_offset`` is where the new generation starts the
#: partition (None: the partition no longer exists).
accepted_losses = Table(
    "stream_accepted_losses",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(100), nullable=False, index=True),
    Column("generation", Integer, nullable=False),
    Column("topic", String(249), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("start_offset", BigInteger, nullable=False),
    Column("end_offset", BigInteger),
    Column("resume_offset", BigInteger),
    Column("reason", Text, nullable=False),
    Column("accepted_at", Float, nullable=False),
)

#: Records the job could not turn into results, kept byte for byte with the reason.
dead_letters = Table(
    "dead_letters",
    metadata,
    Column("job_id", String(100), primary_key=True),
    Column("topic", String(249), primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("offset", BigInteger, primary_key=True),
    Column("key", LargeBinary),
    Column("value", LargeBinary),
    Column("error", Text, nullable=False),
    Column("generation", Integer),
    Column("batch_id", BigInteger),
    Column("recorded_at", Float),
)

#: Dead letters of a log that is gone: a topic recreated or truncated, a partition deleted.  Moved here, byte
#: for byte (the columns of ``dead_letters``), in the transaction that records the loss, because the new log
#: numbers its records from the old log's positions again and ``dead_letters`` is keyed by position.  A
#: position may be archived once per log that held it, hence the row id.
dead_letters_archive = Table(
    "dead_letters_archive",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    *(Column(c.name, c.type, nullable=c.nullable, index=c.name == "job_id") for c in dead_letters.columns),
    Column("archived_at", Float, nullable=False),
)

#: What the Airflow side did to keep a job alive: the restart budget is counted from here.
restarts = Table(
    "stream_restarts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(100), nullable=False, index=True),
    Column("at", Float, nullable=False),
    Column("action", String(40), nullable=False),
    Column("reason", Text),
    Column("failed_run_id", String(64)),
    Column("new_run_id", String(64)),
    #: a restart begun and never launched, closed by a stop someone asked for: no recovery finishes it
    Column("cancelled_at", Float),
    #: the task that began it (``holders.lease_owner``): once Airflow says that task has ended, a restart
    #: still begun for a dead, failed or stuck run is owed (``recovery.interrupted_restart``)
    Column("task", String(1000)),
    #: the task whose launch completed it: a retry of the task that began it can tell that another finished it
    Column("finished_by", String(1000)),
)

#: Launches their task gave up on before they registered, and could not kill (a driver on another host than
#: the task's, a cluster manager that did not answer): such a run may not register (``StateStore.begin_run``),
#: so a late driver cannot take the job's epoch from the run started after it.
cancelled_launches = Table(
    "stream_cancelled_launches",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("job_id", String(100), nullable=False),
    Column("cancelled_at", Float, nullable=False),
    Column("why", Text),
)

#: What the always-on watcher already reported: one row per (run, health, failure kind), so a condition
#: that merely persists never fires twice, also across triggerer restarts.  ``run_id`` and
#: ``failure_kind`` are empty strings where there is none (an unknown job; a DEAD or STUCK run).
health_reports = Table(
    "stream_health_reports",
    metadata,
    Column("job_id", String(100), primary_key=True),
    Column("run_id", String(64), primary_key=True),
    Column("health", String(20), primary_key=True),
    Column("failure_kind", String(40), primary_key=True),
    Column("reported_at", Float, nullable=False),
    Column("message", Text),
)


def add_missing_columns(engine: Engine, tables: Sequence[Table] | None = None) -> list[str]:
    """Add the columns a newer release defines to tables an older release created (``tables``: all of
    them); return what was added.

    New columns are always nullable without a default, so ``ALTER TABLE ... ADD COLUMN`` runs in place on
    both dialects and old rows read as NULL.  Two processes starting at once may both try: the loser's
    error is ignored once the column exists.
    """
    added = []
    inspector = inspect(engine)
    quote = engine.dialect.identifier_preparer.quote
    for table in metadata.sorted_tables if tables is None else tables:
        present = {column["name"] for column in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            if not column.nullable or column.default is not None:
                raise RuntimeError(f"{table.name}.{column.name} is missing from the state database and cannot "
                                   "be added in place (it is NOT NULL or has a default): migrate it by hand")
            ddl = (f"ALTER TABLE {quote(table.name)} ADD COLUMN {quote(column.name)} "
                   f"{column.type.compile(dialect=engine.dialect)}")
            try:
                with engine.begin() as conn:
                    conn.execute(text(ddl))
            except DBAPIError:
                if column.name not in {c["name"] for c in inspect(engine).get_columns(table.name)}:
                    raise
            added.append(f"{table.name}.{column.name}")
    return added
