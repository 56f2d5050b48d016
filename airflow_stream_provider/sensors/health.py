"""Sensors that wait for a stream job to need attention: driver death, a stuck query, a failure."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from airflow_stream_provider.diagnosis import Thresholds, check_conditions, check_failure_kinds, check_seconds
from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
from airflow_stream_provider.hooks.state import StreamStateHook
from airflow_stream_provider.lifecycle.health import HealthProbe
from airflow_stream_provider.links import STREAM_LINKS
from airflow_stream_provider.triggers.health import FIRE_ON, StreamHealthTrigger


class StreamHealthSensor(BaseSensorOperator):
    """Wait until the job is DEAD, STUCK or FAILED, or is owed a restart that was stopped half-way
    (INTERRUPTED_RESTART: its run is STOPPED, yet nobody asked for the stop) (``fire_on``); return the
    diagnosis (health, failure kind, Spark error class, evidence, advice) for the tasks downstream, such as
    ``RecoverStreamingJobOperator``.

    Deferrable by default: a stream is watched for hours, and a sleeping worker slot per stream would
    waste the pool.  ``deferrable=False`` pokes from a worker instead.

    :param job_id: the job to watch.
    :param topics: the job's topics, for the Kafka lag (the evidence for STUCK).
    :param state_conn_id: the ``stream_state`` connection.
    :param kafka_conn_id: the ``stream_kafka`` connection.
    :param fire_on: the conditions that end the wait: health values (``Health``), NO_STANDBY and
        INTERRUPTED_RESTART (``diagnosis.CONDITIONS``).
    :param failure_kinds: only a FAILED run of these kinds ends the wait, and nothing else does (when
        unset, every condition in ``fire_on``).
    :param heartbeat_timeout: seconds without a heartbeat after which a running driver counts as dead.
    :param stuck_after: seconds without a batch, with records waiting, after which a query is stuck.
    :param deferrable: wait in the triggerer (the default) instead of poking from a worker.
    """

    template_fields: Sequence[str] = ("job_id", "topics", "heartbeat_timeout", "stuck_after")
    ui_color = "#fdf2e9"
    operator_extra_links = STREAM_LINKS
    trigger_class = StreamHealthTrigger

    def __init__(self, *, job_id: str, topics: Sequence[str],
                 state_conn_id: str = StreamStateHook.default_conn_name,
                 kafka_conn_id: str = KafkaOffsetsHook.default_conn_name,
                 fire_on: Sequence[str] = FIRE_ON, failure_kinds: Sequence[str] | None = None,
                 heartbeat_timeout: float = 30.0, stuck_after: float = 300.0, deferrable: bool = True,
                 **kwargs):
        super().__init__(**kwargs)
        # at parse time: a misspelt condition or kind would wait for ever
        check_conditions(fire_on)
        check_failure_kinds(failure_kinds, fire_on)
        check_seconds(heartbeat_timeout=heartbeat_timeout, stuck_after=stuck_after)
        if isinstance(topics, str) and "{{" not in topics:  # a list of its letters: no lag, never STUCK
            raise ValueError(f"topics={topics!r} must be a list of topics, e.g. [{topics!r}]")
        self.job_id = job_id
        self.topics = topics
        self.state_conn_id = state_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.fire_on = tuple(fire_on)
        self.failure_kinds = tuple(failure_kinds) if failure_kinds else None
        self.heartbeat_timeout = heartbeat_timeout
        self.stuck_after = stuck_after
        self.deferrable = deferrable

    def _trigger(self) -> StreamHealthTrigger:
        return self.trigger_class(job_id=self.job_id, topics=list(self.topics), state_conn_id=self.state_conn_id,
                                   kafka_conn_id=self.kafka_conn_id, fire_on=self.fire_on,
                                   failure_kinds=self.failure_kinds, heartbeat_timeout=float(self.heartbeat_timeout),
                                   stuck_after=float(self.stuck_after), poll_interval=self.poke_interval)

    def execute(self, context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        trigger = self._trigger()
        found = self._probe.check()
        if trigger.matches(found):  # no need to defer for what is already true
            self.log.info("%s", found.summary())
            return found.to_dict()
        self.defer(trigger=trigger, method_name="execute_complete",
                   timeout=self.timeout if self.timeout else None)

    def execute_complete(self, context, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "fired":
            raise AirflowException(event.get("message", f"health trigger failed: {event}"))
        self.log.info("%s", event["message"])
        return event["diagnosis"]

    def poke(self, context) -> PokeReturnValue:
        found = self._probe.check()
        self.log.info("%s", found.summary())
        return PokeReturnValue(is_done=self._trigger().matches(found), xcom_value=found.to_dict())

    @cached_property
    def _probe(self) -> HealthProbe:
        return HealthProbe.connect(self.job_id, self.topics, self.state_conn_id, self.kafka_conn_id,
                                   Thresholds(float(self.heartbeat_timeout), float(self.stuck_after)))


class CheckpointIncompatibilitySensor(StreamHealthSensor):
    """Wait until a run of the job fails because its checkpoint cannot be read by its code (Spark's
    STATE_STORE_* / stateful-operator / source-count / log-version errors), and return the diagnosis with
    Spark's error class.  Spark validates lazily, so keep one watching after every restart and upgrade."""

    def __init__(self, **kwargs):
        kwargs.setdefault("fire_on", ("FAILED",))
        kwargs.setdefault("failure_kinds", ("CHECKPOINT_INCOMPATIBLE",))
        super().__init__(**kwargs)
