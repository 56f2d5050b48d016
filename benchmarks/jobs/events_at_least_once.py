"""The example job with a plain append sink instead of the transactional one: the at-least-once
reference the exactly-once throughput is compared with.

Same source, same parse, same result frames, same Arrow collection, one database transaction per
batch; what it leaves out is what exactly-once costs: planning against the stored offsets, the epoch
check, upserts instead of inserts, the ledger and the offsets rows.  A replayed batch is appended
again, so this sink is for measuring only.

    spark-submit benchmarks/jobs/events_at_least_once.py --spec '<StreamJobSpec JSON>'
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from sqlalchemy import BigInteger, Column, Float, MetaData, Table, insert

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # spark_jobs/ (driver side only: no UDFs)

from airflow_stream_provider.runtime import StreamHarness
from airflow_stream_provider.runtime.result_tables import sql_type
from airflow_stream_provider.runtime.sink import DEAD_LETTER_COLUMNS, _collect
from spark_jobs.events_job import parse, results

#: One row per batch, so throughput is measured the same way as from the exactly-once ledger.
BATCH_LOG = "alo_batches"


class AppendSink:
    def __init__(self, store, results_fn):
        self.engine = store.engine
        self.results = results_fn
        self.metadata = MetaData()
        self.tables: dict[str, Table] = {}
        self.log = Table(BATCH_LOG, self.metadata, Column("batch_id", BigInteger), Column("rows_read", BigInteger),
                         Column("written_at", Float(53)))
        self.metadata.create_all(self.engine, tables=[self.log])

    def _table(self, name: str, frame: DataFrame) -> Table:
        if name not in self.tables:
            table = Table(name, self.metadata, *[Column(f.name, sql_type(f.dataType)) for f in frame.schema.fields])
            table.create(self.engine, checkfirst=True)
            self.tables[name] = table
        return self.tables[name]

    def __call__(self, records: DataFrame, batch_id: int) -> None:
        frame = records.persist()
        try:
            read = frame.count()
            dead = frame.where(F.col("error").isNotNull()).select(*DEAD_LETTER_COLUMNS)
            writes = [(self._table("alo_dead_letters", dead), _collect(dead))]
            for result in self.results(frame.where(F.col("error").isNull())):
                writes.append((self._table(result.table, result.frame), _collect(result.frame)))
            with self.engine.begin() as conn:
                for table, rows in writes:
                    if rows:
                        conn.execute(insert(table), rows)
                conn.execute(insert(self.log), [{"batch_id": batch_id, "rows_read": read, "written_at": time.time()}])
        finally:
            frame.unpersist()


class AtLeastOnceHarness(StreamHarness):
    def _new_sink(self, run, offset_log, results_fn):
        return AppendSink(self.store, results_fn)


if __name__ == "__main__":
    sys.exit(AtLeastOnceHarness.from_argv().run(parse, results))
