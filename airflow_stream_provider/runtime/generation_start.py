"""Where a generation's batch 0 starts, for every stream the job reads.

A new generation resolves each stream's start once, from the spec (``earliest``, ``latest`` or the stored
offsets an upgrade's reset names), checks it against what Kafka still holds (invariant 5: a position out
of retention is DATA_LOSS with the exact ranges, unless the spec accepts the loss) and records it with the
generation before the query starts.  A restart before batch 0 committed then plans the same batch 0
again, and the sink knows where batch 0 starts.

A restart of a known generation takes the recorded start and compares the checkpoint with the stored
offsets: a checkpoint that lost every batch the generation committed starts past the stored offsets; one
restored from an older copy replays, and the sink skips what lies below them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kafka.errors import KafkaConfigurationError

from airflow_stream_provider import failures, kafka_client, kafka_offsets
from airflow_stream_provider.runtime.startup import StartupError
from airflow_stream_provider.spec import StreamJobSpec
from airflow_stream_provider.state import store as state

log = logging.getLogger("airflow_stream_provider.harness")

#: The checkpoint's newest planned position (None: it holds no batch); raises when it cannot be read.
CheckpointPosition = Callable[[], "kafka_offsets.Offsets | None"]


class GenerationStart:
    """The starting offsets of one generation's streams, resolved, checked and recorded once.

    :param spec: the job's spec (its generation, topics, starting offsets and data-loss policy).
    :param store: the state database, which records the generation's start and holds the stored offsets.
    :param checkpoint_position: reads the checkpoint's offsets log (see ``CheckpointPosition``).
    """

    def __init__(self, spec: StreamJobSpec, store: state.StateStore, checkpoint_position: CheckpointPosition):
        self.spec = spec
        self.store = store
        self._checkpoint_position = checkpoint_position
        #: every stream's start so far: the job's own topics, then any second stream (the sink's batch 0)
        self.offsets: kafka_offsets.Offsets = {}
        #: the generation's recorded start (None: not recorded yet) and what to record once every stream
        #: resolved its start; whether the checkpoint lost every batch the generation committed
        self._recorded: kafka_offsets.Offsets | None = None
        self._to_record: kafka_offsets.Offsets = {}
        self._checkpoint_lost = False

    def job_topics(self) -> kafka_offsets.Offsets:
        """The concrete offsets where batch 0 starts for the job's own topics (``spec.kafka.topics``)."""
        spec = self.spec
        known = self.store.get_generation(spec.job_id, spec.generation)
        if known is not None and known["starting_offsets"]:
            self._recorded = kafka_offsets.from_spark_json(known["starting_offsets"])
            self._check_checkpoint(self._recorded)
        return self.stream(spec.kafka.topics, spec.kafka.starting_offsets, "kafka.topics: topics")

    def stream(self, topics: Sequence[str], default: str, what: str) -> kafka_offsets.Offsets:
        """Where one stream's batch 0 starts: the recorded start, else resolved from the spec's explicit
        starting offsets for these topics (a reset names every topic the sink accounted for), else from
        the stream's own ``default``.  With a lost checkpoint, from the stored offsets past it.

        :param topics: the stream's topics.
        :param default: ``earliest`` or ``latest``, for a new generation that the spec starts so.
        :param what: how an error names these topics (``kafka.topics: topics``).
        """
        recorded = {tp: o for tp, o in (self._recorded or {}).items() if tp[0] in topics}
        start = recorded or self._resolve(topics, default, what)
        if not recorded:
            self._to_record.update(start)
        if self._checkpoint_lost:  # the stored offsets say what was applied; the records below are replays
            stored = self.store.stored_offsets(self.spec.job_id)
            start = {tp: max(o, stored.get(tp, o)) for tp, o in start.items()}
        self.offsets.update(start)
        return start

    def record(self) -> None:
        """Record where every stream of a new generation starts, before its query starts."""
        spec = self.spec
        if spec.kafka.starting_offsets not in ("earliest", "latest"):
            read = {topic for topic, _ in self.offsets}
            unread = sorted({t for t, _ in kafka_offsets.from_spark_json(spec.kafka.starting_offsets)} - read)
            if unread:  # e.g. a reset after an upgrade that dropped a second stream
                log.warning("kafka.starting_offsets names topics no stream of this job reads: %s", unread)
        if spec.dry_run:  # a preflight must not record anything
            return
        if self._recorded is None:
            self.store.ensure_generation(
                spec.job_id, spec.generation, spec.checkpoint_path, kafka_offsets.to_spark_json(self._to_record)
            )
        elif self._to_record:
            log.warning(
                "generation %s recorded no start for %s (recorded by an older version): batch 0 starts "
                "them at %s", spec.generation, sorted({t for t, _ in self._to_record}),
                kafka_offsets.to_spark_json(self._to_record),
            )

    def _resolve(self, topics: Sequence[str], default: str, what: str) -> kafka_offsets.Offsets:
        spec = self.spec
        try:  # kafka-python 3 bootstraps in the consumer's constructor: an unreachable broker fails there
            client = kafka_client.consumer(spec.kafka.bootstrap_servers, spec.kafka.python_options)
            earliest, latest = kafka_client.watermarks(client, topics)
        except Exception as err:
            if isinstance(err, TypeError | ValueError | KafkaConfigurationError):  # no broker would change this
                raise StartupError(
                    None,
                    f"the Kafka client refused the job's settings (kafka.client_options): {err!r}. Fix them in "
                    "the job spec",
                    failures.EXIT_CONFIG,
                ) from err
            raise StartupError(
                failures.FailureKind.TRANSIENT,
                f"cannot read partitions of {list(topics)} from "
                f"kafka.bootstrap_servers={spec.kafka.bootstrap_servers}: {err!r}. Check the broker "
                f"list and that the brokers are up",
            ) from err
        present = {topic for topic, _ in latest}
        absent = [t for t in topics if t not in present]
        if absent:
            raise StartupError(
                None,
                f"{what} {absent} do not exist on {spec.kafka.bootstrap_servers}. Create them or fix the job spec",
                failures.EXIT_CONFIG,
            )
        requested: str | kafka_offsets.Offsets = default
        if spec.kafka.starting_offsets not in ("earliest", "latest"):
            # stored offsets name every stream's topics: each stream takes its own part
            named = {
                tp: o
                for tp, o in kafka_offsets.from_spark_json(spec.kafka.starting_offsets).items()
                if tp[0] in topics
            }
            if named or list(topics) == list(spec.kafka.topics):
                requested = named
        if requested not in ("earliest", "latest") and isinstance(requested, str):
            requested = kafka_offsets.from_spark_json(requested)
        resolved = kafka_offsets.resolve(requested, earliest, latest)
        lost = kafka_offsets.find_lost_ranges(resolved, earliest, latest)
        if lost and spec.kafka.fail_on_data_loss:
            raise StartupError(
                failures.FailureKind.DATA_LOSS,
                "[KAFKA_DATA_LOSS.START_OFFSET_RESET] the starting offsets of generation "
                f"{spec.generation} are no longer in Kafka: "
                + "; ".join(r.describe() for r in lost)
                + ". Decide whether to accept the loss (failOnDataLoss=false) or restore the data",
            )
        if lost:
            log.warning(
                "starting offsets no longer in Kafka, skipped (failOnDataLoss=false): %s",
                "; ".join(r.describe() for r in lost),
            )
        return resolved

    def _check_checkpoint(self, recorded: kafka_offsets.Offsets) -> None:
        """Compare the checkpoint with the stored offsets.  A checkpoint that was lost, or restored from an
        older copy, makes Spark number its batches again and re-plan ranges the sink already applied: the
        stored offsets, not the checkpoint, say what was applied.  A lost one starts at the stored
        offsets; an older one replays, and the sink skips whatever lies below the stored offsets."""
        spec = self.spec
        try:
            position = self._checkpoint_position()
        except Exception as err:  # Spark itself reports an unreadable checkpoint, with its own error
            log.warning("could not read the offsets log of %s: %r", spec.checkpoint_path, err)
            return
        stored = self.store.stored_offsets(spec.job_id)
        topics = {t for t, _ in recorded}
        if position is None:
            ahead = {tp: o for tp, o in stored.items() if tp[0] in topics and o > recorded.get(tp, 0)}
            if ahead:
                self._checkpoint_lost = True
                log.warning(
                    "the checkpoint %s of generation %s is behind the stored offsets: it holds no batch "
                    "although the generation committed up to %s (lost or deleted). The query starts again "
                    "from the stored offsets; records below them are replays of applied batches and are not "
                    "applied again",
                    spec.checkpoint_path, spec.generation, kafka_offsets.to_spark_json(ahead),
                )
            return
        behind = {tp: o for tp, o in stored.items() if tp in position and o > position[tp]}
        if behind:
            log.warning(
                "the checkpoint %s of generation %s is behind the stored offsets (restored from an older "
                "copy?): its newest batch ends at %s, the results cover up to %s. Batches below the stored "
                "offsets are replays and are skipped; the records past them are applied once",
                spec.checkpoint_path, spec.generation,
                kafka_offsets.to_spark_json({tp: position[tp] for tp in behind}),
                kafka_offsets.to_spark_json(behind),
            )
