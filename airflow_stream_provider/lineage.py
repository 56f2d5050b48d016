"""OpenLineage for the operators that launch a driver (with ``apache-airflow-providers-openlineage``
installed: the ``openlineage`` extra).

A launch reads the job's Kafka topics (namespace ``kafka://<first bootstrap server>``) and writes its result
tables and the dead-letter table (namespace from the state connection: ``postgres://host:port`` with
``database.schema.table`` names, or ``sqlite://<path>``).  The tables are the ones the job's newest run
wrote (its sink records them at its first batch, ``stream_runs.outputs``), so they follow the job's code
across an upgrade; a job's very first launch names them only once its first batch ran.  No credential
reaches a namespace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url

from airflow_stream_provider.spec import StreamJobSpec

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

#: PostgreSQL's schema for tables created without one (the sink's result tables).
DEFAULT_PG_SCHEMA = "public"


def kafka_namespace(bootstrap_servers: str) -> str:
    return f"kafka://{bootstrap_servers.split(',')[0].strip()}"


def table_names(database_url: str, tables: list[str]) -> tuple[str, list[str]]:
    """The namespace of the state database and the dataset names of ``tables`` in it."""
    url = make_url(database_url)
    if url.get_backend_name() == "postgresql":
        return f"postgres://{url.host}:{url.port or 5432}", [
            f"{url.database}.{DEFAULT_PG_SCHEMA}.{table}" for table in tables]
    return f"{url.get_backend_name()}://{url.database or ''}", list(tables)


def job_lineage(job: StreamJobSpec, tables: list[str]) -> OperatorLineage:
    """The datasets of ``job``: its topics in, ``tables`` (in its state database) out."""
    from airflow.providers.openlineage.extractors import OperatorLineage
    from openlineage.client.event_v2 import Dataset

    topics = kafka_namespace(job.kafka.bootstrap_servers)
    namespace, names = table_names(job.database_url, tables)
    return OperatorLineage(inputs=[Dataset(namespace=topics, name=topic) for topic in job.kafka.topics],
                           outputs=[Dataset(namespace=namespace, name=name) for name in names])
