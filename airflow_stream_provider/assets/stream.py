"""``stream://<job_id>``: one asset per stream job, with the always-on watcher that updates it.

A DAG scheduled on the asset runs once per health transition the watcher reports (see
:mod:`airflow_stream_provider.triggers.watch`); the event's ``extra["payload"]`` holds the diagnosis.
The scheme is registered through provider info, so Airflow checks every ``stream://`` URI when a DAG file
is parsed and a malformed one is an import error that names the expected form.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import SplitResult, urlsplit

from airflow.sdk import Asset, AssetWatcher

from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.spec import JOB_ID_PATTERN
from airflow_stream_provider.triggers.watch import FIRE_ON, StreamJobWatchTrigger

SCHEME = "stream"
_FORM = f"{SCHEME}://<job_id>, the job_id being the spec's (letters, digits, '.', '_', '-'; at most 100)"


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """Airflow's URI handler for the scheme: ``stream://<job_id>`` and nothing else."""
    job_id = uri.netloc
    if not re.fullmatch(JOB_ID_PATTERN, job_id) or ".." in job_id or uri.path not in ("", "/") or uri.query:
        raise ValueError(f"{uri.geturl()!r} is not a stream job asset URI; expected {_FORM}")
    return uri._replace(path="")


def job_id_of(uri: str) -> str:
    """The job an asset URI names (checked as Airflow checks it)."""
    return sanitize_uri(urlsplit(uri)).netloc


def stream_job_asset(job_id: str, *, state_conn_id: str = StreamStateHook.default_conn_name,
                     kafka_conn_id: str = KafkaOffsetsHook.default_conn_name, fire_on: Sequence[str] = FIRE_ON,
                     heartbeat_timeout: float = 30.0, stuck_after: float = 300.0,
                     poll_interval: float = 1.0) -> Asset:
    """The job's asset, watched continuously: schedule a health DAG on it.

    :param job_id: the stream job's ``job_id``, as in its spec.
    :param state_conn_id: the state database the job's runs are recorded in.
    :param kafka_conn_id: the brokers, for the lag that tells a STUCK query from an idle one.
    :param fire_on: the conditions that make an event (DEAD, STUCK, FAILED, and NO_STANDBY: a healthy run
        that wants a warm standby and has none).
    :param heartbeat_timeout: seconds without a heartbeat after which a driver that cannot be checked as
        a process (another host, a cluster) counts as DEAD.
    :param stuck_after: seconds without a committed batch, while Kafka holds unread records, that make a
        running query STUCK.
    :param poll_interval: seconds between two polls of the state database (one query for all jobs).  A kill
        waits half of it on average before anyone knows; the query reads one row per job.
    """
    uri = f"{SCHEME}://{job_id}"
    job_id_of(uri)  # a bad job id fails here, at parse time, with the expected form
    trigger = StreamJobWatchTrigger(job_id=job_id, state_conn_id=state_conn_id, kafka_conn_id=kafka_conn_id,
                                    fire_on=fire_on, heartbeat_timeout=heartbeat_timeout,
                                    stuck_after=stuck_after, poll_interval=poll_interval)
    return Asset(uri=uri, name=f"stream_job_{job_id}", group="stream",
                 watchers=[AssetWatcher(name=f"stream_job_{job_id}_health", trigger=trigger)])
