"""The facts behind a health verdict, gathered one way for every caller: the sensors and their trigger,
the always-on DAG's fresh diagnosis, and the controller before it decides a recovery."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from airflow_stream_provider import diagnosis
from airflow_stream_provider.diagnosis import Diagnosis, Thresholds
from airflow_stream_provider.hooks.driver import StreamDriverHook
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.state.records import RunRecord

log = logging.getLogger(__name__)


class HealthProbe:
    """One job's health check over its state and Kafka hooks.  Built once per watch, so a trigger polling
    every few seconds does not rebuild its database engine and Kafka client each time.

    :param job_id: the job to check.
    :param topics: the job's topics, for the Kafka lag.
    :param state: the state database's hook.
    :param kafka: the Kafka offsets hook.
    :param thresholds: when silence means dead, and idleness with lag means stuck.
    """

    def __init__(self, job_id: str, topics: Sequence[str], state: StreamStateHook, kafka: KafkaOffsetsHook,
                 thresholds: Thresholds):
        self.job_id = job_id
        self.topics = list(topics)
        self.state = state
        self.kafka = kafka
        self.thresholds = thresholds

    @classmethod
    def connect(cls, job_id: str, topics: Sequence[str], state_conn_id: str, kafka_conn_id: str,
                thresholds: Thresholds) -> HealthProbe:
        """A probe over the named Airflow connections."""
        return cls(job_id, topics, StreamStateHook(state_conn_id), KafkaOffsetsHook(kafka_conn_id), thresholds)

    def check(self) -> Diagnosis:
        return self.observe()[1]

    def observe(self) -> tuple[RunRecord | None, Diagnosis]:
        """The latest run and its diagnosis from the run, the driver process if it is on this host, and the
        Kafka lag (only worth reading while the query runs: it is the evidence for STUCK).  A run found
        dead is recorded DEAD."""
        run = self.state.latest_run(self.job_id)
        lag = None
        if run and run.status == "RUNNING":
            try:
                lag = self.kafka.lag(self.state.stored_offsets(self.job_id), self.topics)
            except Exception as err:  # the verdict stands without the lag; STUCK needs it
                log.warning("Could not read the Kafka lag of job %s: %r", self.job_id, err)
        alive = StreamDriverHook.is_alive(run) if run else None
        found = diagnosis.diagnose(self.job_id, run, driver_alive=alive, lag=lag, thresholds=self.thresholds)
        self.state.record_death(run, found)
        return run, found

    def close(self) -> None:
        self.state.close()
