"""The datasets a launch names for OpenLineage: Kafka topics in, result tables out, no credential."""

from __future__ import annotations

from airflow_stream_provider.lineage import job_lineage, table_names
from airflow_stream_provider.spec import StreamJobSpec


def _spec(database_url: str) -> StreamJobSpec:
    return StreamJobSpec.from_dict({"job_id": "orders", "version": "1", "checkpoint_root": "/ckpt", "database_url": database_url,
                                    "kafka": {"topics": ["orders", "refunds"],
                                              "bootstrap_servers": "kafka-1:9092, kafka-2:9092"}})


def test_postgres_tables_are_named_database_schema_table_without_the_password():
    namespace, names = table_names("postgresql+psycopg://stream:hunter2@db.internal/results", ["events"])
    assert (namespace, names) == ("postgres://db.internal:5432", ["results.public.events"])


def test_a_launch_reads_its_topics_and_writes_the_tables_its_driver_named():
    lineage = job_lineage(_spec("postgresql://stream@db:6432/results"), ["dead_letters", "events"])
    assert [(d.namespace, d.name) for d in lineage.inputs] == [("kafka://kafka-1:9092", "orders"),
                                                              ("kafka://kafka-1:9092", "refunds")]
    assert [(d.namespace, d.name) for d in lineage.outputs] == [("postgres://db:6432", "results.public.dead_letters"),
                                                               ("postgres://db:6432", "results.public.events")]


def test_before_any_driver_named_its_tables_only_the_topics_are_known():
    lineage = job_lineage(_spec("sqlite:////var/lib/stream/state.db"), [])
    assert [d.name for d in lineage.inputs] == ["orders", "refunds"] and lineage.outputs == []
