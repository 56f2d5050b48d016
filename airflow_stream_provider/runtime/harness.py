"""The job harness: one spec in, one running checkpointed query, one exit code out.

A job file holds only its business logic::

    def parse(records: DataFrame) -> DataFrame: ...        # Kafka records -> parsed, with an error column
    def results(events: DataFrame) -> list[Result]: ...    # good records -> result tables

    sys.exit(StreamHarness.from_argv().run(parse, results))

and the harness does the rest: Spark session and retention settings, the source (JVM connector or the
Python one), the generation's starting offsets checked against Kafka, the fencing epoch, the
transactional sink, the state listener, heartbeats, the stop marker, and an exit code that says why
the driver ended (see ``failures``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from pyspark import SparkConf
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from sqlalchemy import exc as sql_errors

from airflow_stream_provider import (
    confluent_reader,
    failures,
    faults,
    kafka_client,
    kafka_offsets,
    local_driver,
)
from airflow_stream_provider.runtime import kafka_source, planner_workers, source_lookup
from airflow_stream_provider.runtime.checkpoint_log import (
    OffsetLog,
    WriteBehindMarks,
    remove_unfinished_first_entry,
)
from airflow_stream_provider.runtime.fence_watch import FenceWatch, fenced
from airflow_stream_provider.runtime.generation_start import GenerationStart
from airflow_stream_provider.runtime.listener import StateListener
from airflow_stream_provider.runtime.poison import POISON_POLICIES, keeps_state
from airflow_stream_provider.runtime.sink import DEAD_LETTER_COLUMNS, ResultsFn, TransactionalSink
from airflow_stream_provider.runtime.standby import Standby, Takeover, run_warm_up
from airflow_stream_provider.runtime.startup import StartupClock, StartupError
from airflow_stream_provider.runtime.write_behind import WriteBehind
from airflow_stream_provider.spec import KAFKA_SECRETS_ENV, SpecError, StreamJobSpec, jvm_client_properties
from airflow_stream_provider.state import store as state
from airflow_stream_provider.state import transaction
from airflow_stream_provider.state.standbys import StandbyStatus
from airflow_stream_provider.takeover import Verdict

log = logging.getLogger("airflow_stream_provider.harness")

JVM_KAFKA_PROVIDER = "org.apache.spark.sql.kafka010.KafkaSourceProvider"
#: How long a graceful stop waits for the running batch to end before interrupting it (the sink makes
#: an interrupted batch harmless; waiting just avoids redoing work).
STOP_WAIT_S = 120.0
#: How long a driver ending TRANSIENT keeps trying to record that in an unreachable state database.
FINISH_RETRY_S = 30.0
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: Which allocator pyarrow uses, in the driver and (as an executor environment variable) in Spark's Python workers.
ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"
#: A stream driver runs for days, a few Spark queries every micro-batch; Spark's defaults suit a session
#: that runs a few hundred.  Its status store keeps the last 1,000 jobs, stages and SQL executions (each
#: with its plan and metrics): a running job's heap grew by about 40 MB until some 250 batches in.  Adaptive
#: execution runs each batch query's stages through two thread pools that start a thread per query and
#: keep it for an idle minute: 250 more JVM threads at a few queries a second, for batches of at most
#: ``max_offsets_per_trigger`` records whose plans it has nothing to adapt in.  Set unless spark-submit's
#: conf sets them; the job's ``spark_conf`` wins over both.
LONG_RUNNING_DRIVER_CONF = {
    "spark.ui.retainedJobs": "100",
    "spark.ui.retainedStages": "100",
    "spark.sql.ui.retainedExecutions": "100",
    "spark.sql.adaptive.enabled": "false",
}
_LOCAL_MASTER = re.compile(r"^local(\[(\d+|\*)\])?$")


def unless_submitted(defaults: dict[str, str], submitted: SparkConf) -> dict[str, str]:
    """The harness's defaults that spark-submit's conf leaves unset: a deployment's own settings win."""
    return {key: value for key, value in defaults.items() if not submitted.contains(key)}


class StreamHarness:
    """Runs one stream job inside the Spark driver: one spec in, one checkpointed query, one exit code out.

    A job file holds only its business logic and hands it to the harness::

        from airflow_stream_provider.runtime import Result, StreamHarness

        def parse(records: DataFrame) -> DataFrame: ...      # Kafka records -> parsed, with an error column
        def results(events: DataFrame) -> list[Result]: ...  # good records -> result tables

        if __name__ == "__main__":
            sys.exit(StreamHarness.from_argv().run(parse, results))

    The provider launches the file with ``--spec <StreamJobSpec JSON> --run-id ID --log-path P``, which
    :meth:`from_argv` reads.  A job that reads a second topic builds the harness first and takes that
    stream from :meth:`kafka_stream` inside its ``parse``.

    Building the harness validates the spec, opens the state database (creating its tables) and registers
    the run, which takes a new fencing epoch: from then on only this driver can commit for the job (a dry
    run, an upgrade's preflight, reads the current epoch instead and writes no results).  :meth:`run`
    starts Spark, resolves where the generation starts and checks it against Kafka, starts the query with
    the :class:`~airflow_stream_provider.runtime.sink.TransactionalSink` and the state listener, sends
    heartbeats, honours a graceful stop (requested in the state database, or SIGTERM), records why the
    driver ended and returns the matching exit code (see ``failures``).

    :param spec: the job's spec; validated here (``SpecError`` names a wrong field).
    :param run_id: the run id the launcher chose so that it can find this run; a new one when None.
    :param log_path: where the launcher sends this driver's output, recorded with the run.
    """

    def __init__(self, spec: StreamJobSpec, *, run_id: str | None = None, log_path: str | None = None,
                 standby: bool = False, successor: bool = False, warm_up_only: bool = False):
        self.startup = StartupClock()
        self.spec = spec.validate()
        self.store = state.StateStore.from_url(spec.database_url)
        #: a run that only loads what a start loads and records nothing (see ``_warm_up_only``)
        self.warm_up_only = warm_up_only
        if not warm_up_only:
            self.store.ensure_schema()
        self.run_id = run_id or uuid.uuid4().hex
        self.log_path = log_path
        self._stop_signalled = False
        # A stop may come as soon as the run is registered (below): the signal's default action would end the
        # process with its run left STARTING until found DEAD.  ``run`` honours the flag once Spark is up.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        #: A dry run (upgrade preflight) stops by itself once one batch ran through the sink.
        self._preflight_done = False
        self._rerun_of_batch_0 = False
        self._planners_released = False
        #: a standby registers now and takes an epoch only when it takes over (see ``runtime.standby``)
        self.standby: Standby | None = None
        #: ends the process should its main loop be held up once another run has taken the job (``_begin``)
        self._fence_watch: FenceWatch | None = None
        #: set while this thread builds a standby's warm-up query (a standby re-runs it in the background)
        self._warming = threading.local()
        if warm_up_only:
            self.startup.skip()
        elif standby or successor:
            self.standby = Standby(self.store, spec, self.run_id, pid=os.getpid(), log_path=log_path,
                                   successor=successor)
            self._standby_registered = self.standby.register()
            self.startup.skip()  # a standby's start is its warm-up; what counts is its takeover
        else:
            self._begin(self.store.begin_run(spec.job_id, spec.generation, spec.version, run_id=self.run_id,
                                             dry_run=spec.dry_run, host=local_driver.this_host(), pid=os.getpid(),
                                             log_path=log_path))
        self.startup.done("state_database")
        self.spark: SparkSession | None = None
        #: where each stream's batch 0 starts; made once the spec is final (a standby's takeover names it)
        self.start: GenerationStart | None = None
        #: What the sink needs to isolate a poison record (see ``run`` and ``sink``).
        self.on_poison = "dead_letter"
        self._transform: Callable[[DataFrame], DataFrame] | None = None
        self._stateful = True
        #: the exactly-once sink, whatever wraps it: a batch it handed to its writer must land before the run
        #: ends (``_finish``), and one a killed run left must land before the query starts
        self._transactional: TransactionalSink | None = None
        #: the job reads a second stream (``kafka_stream``), which the sink cannot read again from Kafka for
        #: a batch it must apply without its frame: its batches commit in line (no write-behind)
        self._second_stream = False

    def _begin(self, ticket: state.RunTicket) -> None:
        spec = self.spec
        self.ticket = ticket
        if not spec.dry_run:  # from the epoch on, for the whole run: a start can hang as well as a stop
            self._fence_watch = FenceWatch.for_run(self.store, spec.job_id, self.run_id, ticket.epoch,
                                                   heartbeat_s=spec.heartbeat_seconds,
                                                   heartbeat_timeout_s=spec.heartbeat_timeout_seconds).start()
        log.info(
            "job %s version %s generation %s: run %s holds epoch %s%s",
            spec.job_id,
            spec.version,
            spec.generation,
            self.run_id,
            ticket.epoch,
            " (dry run)" if spec.dry_run else "",
        )

    # -- entry points ------------------------------------------------------------------------------
    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> StreamHarness:
        """Parse ``--spec JSON [--run-id ID] [--log-path P]``; a bad spec exits 2 before anything starts.

        :param argv: the arguments without the program name; ``sys.argv[1:]`` when None.
        """
        parser = argparse.ArgumentParser(description="Run a checkpointed stream job")
        parser.add_argument("--spec", required=True, help="the job spec as JSON (StreamJobSpec.to_json)")
        parser.add_argument("--run-id", help="run id chosen by the launcher, so it can find this run")
        parser.add_argument("--log-path", help="where the launcher sends this driver's output")
        parser.add_argument("--standby", action="store_true",
                            help="start as the job's warm standby: take over when its active run is dead")
        parser.add_argument("--successor", action="store_true",
                            help="start as an upgrade's warm successor: start when the upgrade releases it")
        parser.add_argument("--warm-up-only", action="store_true",
                            help="run the job's code once on a throw-away query and exit, recording nothing "
                                 "(the launcher's class-data-sharing run)")
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            spec = StreamJobSpec.from_json(args.spec).with_kafka_secrets(
                json.loads(os.environ.get(KAFKA_SECRETS_ENV) or "{}"))
        except (SpecError, json.JSONDecodeError) as err:
            log.error("invalid job spec: %s", err)
            sys.exit(failures.EXIT_CONFIG)
        try:
            return cls(spec, run_id=args.run_id, log_path=args.log_path, standby=args.standby,
                       successor=args.successor, warm_up_only=args.warm_up_only)
        except state.LaunchCancelled as err:  # its task gave up on it: not a failure, and nothing to retry
            log.warning("%s", err)
            sys.exit(failures.EXIT_STOPPED)
        except (sql_errors.ArgumentError, ModuleNotFoundError) as err:  # a URL no installed driver serves
            log.error("cannot use the state database %s: %s. Fix the spec's database_url, or install its "
                      "driver where the job runs", spec.database_url, err)
            sys.exit(failures.EXIT_CONFIG)
        except Exception as err:
            classification = failures.classify(repr(err))
            log.error("could not register the run in the state database %s: %s", spec.database_url, err)
            sys.exit(failures.exit_code_for(classification.kind))

    def run(
        self,
        transform: Callable[[DataFrame], DataFrame],
        results: ResultsFn,
        *,
        on_poison: str = "dead_letter",
    ) -> int:
        """Start the query, keep it alive until it stops or fails, record why, return the exit code.

        :param transform: turns the Kafka records (Spark's Kafka columns) into parsed records that keep
            topic/partition/offset/key/value and add an ``error`` column (null for a good record).
        :param results: turns the good records into :class:`~airflow_stream_provider.runtime.result_tables.Result`
            tables.
        :param on_poison: what to do with a record the job's code fails on: ``dead_letter`` it and go on,
            or ``fail`` the run as POISON with the record's position (see ``sink``).
        :return: the driver's exit code (``failures.EXIT_STOPPED`` after a clean stop).
        """
        if self.warm_up_only:
            return self._warm_up_only(transform, results)
        try:
            if on_poison not in POISON_POLICIES:
                raise StartupError(
                    None,
                    f"on_poison={on_poison!r} is not one of {', '.join(POISON_POLICIES)}: fix the "
                    f"job's StreamHarness.run call",
                    failures.EXIT_CONFIG,
                )
            self.on_poison = on_poison
            # A stop may come while the driver starts (the stop operator's SIGTERM): it ends the start
            # with a clean stop, not the process at once with its run left STARTING.
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._start_spark()
            signal.signal(signal.SIGINT, self._on_sigterm)  # over PySpark's own, which raises KeyboardInterrupt
            if self._stop_signalled:
                return self._finish(state.STOPPED, failures.EXIT_STOPPED, None, None,
                                    "asked to stop before its query started")
            self.startup.done("spark_session")
            if self.standby is not None:
                ended = self._stand_by(transform, results)
                if ended is not None:
                    return ended
            self.start = GenerationStart(self.spec, self.store,
                                         OffsetLog(self.spark, self.spec.checkpoint_path).newest_position)
            records = transform(self._stream(self.spec.kafka.topics,
                                             kafka_offsets.to_spark_json(self.start.job_topics())))
            self.start.record()
            missing = [c for c in DEAD_LETTER_COLUMNS if c not in records.columns]
            if missing:
                raise StartupError(
                    None,
                    f"the transformed records lack columns {missing}: keep Kafka's "
                    f"topic/partition/offset/key/value and add an 'error' column (null for a "
                    f"good record)",
                    failures.EXIT_CONFIG,
                )
            self._transform, self._stateful = transform, keeps_state(records)
            self.startup.done("source")
            query = self._start_query(records, results)
            self.startup.done("query_start")
            return self._watch(query)
        except StartupError as err:
            return self._finish(state.FAILED, err.exit_code, err.kind, None, str(err))
        except Exception as err:
            return self._failed(err)
        finally:
            if self.spark is not None:
                self.spark.stop()

    def _warm_up_only(self, transform: Callable[[DataFrame], DataFrame], results: ResultsFn) -> int:
        """Start Spark, run the job's code once on a throw-away query (a standby's warm-up) and exit: the run
        a launcher uses to record the classes a driver's start loads (``jvm_archive``).  Records nothing,
        takes no epoch, writes no result."""
        try:
            self._start_spark()
            seconds = run_warm_up(lambda checkpoint: self._warm_up_query(transform, results, checkpoint),
                                  self.spec.job_id)
            log.info("warm-up only: the job's code ran once in %.1fs", seconds)
            return failures.EXIT_STOPPED
        finally:
            if self.spark is not None:
                self.spark.stop()

    # -- standby -----------------------------------------------------------------------------------
    def _stand_by(self, transform: Callable[[DataFrame], DataFrame], results: ResultsFn) -> int | None:
        """Warm up and wait (see ``runtime.standby``).  None once this driver took the job over: ``run``
        then goes on as any run's start would; else the exit code of a standby that refused or ended."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if not self._standby_registered:
            return failures.EXIT_STOPPED
        try:
            refused = self.standby.refusal()
            if refused is not None:
                return failures.EXIT_CONFIG
            outcome = self.standby.warm_up(lambda checkpoint: self._warm_up_query(transform, results, checkpoint),
                                           lambda: self._stop_signalled)
            if not isinstance(outcome, Verdict):
                outcome = self.standby.wait(lambda: self._stop_signalled)
        except BaseException as err:
            self.standby.log.end(self.run_id, StandbyStatus.ENDED, f"failed while standing by: {err!r}")
            raise
        if isinstance(outcome, Takeover):
            self.spec = outcome.spec  # a successor's release names its generation and starting offsets
            self._begin(outcome.ticket)
            # what a later restart of the job starts: this very code, as the launcher records for its runs
            self.store.record_launch(self.run_id, os.path.abspath(sys.argv[0]), self.spec.to_json())
            return None
        return failures.EXIT_CONFIG if outcome.action == "refuse" else failures.EXIT_STOPPED

    def _warm_up_query(self, transform: Callable[[DataFrame], DataFrame], results: ResultsFn,
                       checkpoint: str) -> StreamingQuery:
        """A throw-away query with the job's own code over the last record of each partition of its topics:
        it plans the source, forks the Python workers and starts the ``foreachBatch`` callback server.
        Nothing is written; its checkpoint is a scratch directory."""
        kafka = self.spec.kafka
        client = kafka_client.consumer(kafka.bootstrap_servers, kafka.python_options)
        earliest, latest = kafka_client.watermarks(client, kafka.topics)
        start = {tp: max(earliest[tp], latest[tp] - 1) for tp in latest}
        self._warming.on = True
        try:
            records = transform(self._stream(kafka.topics, kafka_offsets.to_spark_json(start)))
        finally:
            self._warming.on = False

        def batch(frame: DataFrame, batch_id: int) -> None:
            for result in results(frame.where(frame["error"].isNull())):
                result.frame.collect()
            frame.where(frame["error"].isNotNull()).collect()

        return (records.writeStream.queryName(f"{self.spec.job_id}-warm-up")
                .option("checkpointLocation", checkpoint).foreachBatch(batch).start())

    # -- setup -------------------------------------------------------------------------------------
    def _start_spark(self) -> None:
        builder = SparkSession.builder.appName(f"stream-{self.spec.job_id}-{self.spec.version}")
        # The JVM holds spark-submit's settings; a SparkConf made before it is up would not see them and
        # the default below would turn a cluster master into local mode.
        from pyspark import SparkContext  # the driver's full pyspark; not in pyspark-client installs

        SparkContext._ensure_initialized()
        source_lookup.start(SparkContext._jvm)  # beside the SparkContext's start, not after it
        submitted = SparkConf()
        master = submitted.get("spark.master", "local[2]")
        match = _LOCAL_MASTER.match(master)
        if match:  # local mode gives up a batch on the first task failure unless told to retry
            builder = builder.master(f"local[{match.group(2) or 2},4]")
        # Arrow's default allocator (jemalloc) keeps the buffers a batch freed: 40 MB in this process and
        # 10 MB in each read worker at a 100,000-record batch.  The system allocator hands them back.
        os.environ.setdefault(ARROW_POOL_ENV, "system")
        defaults = {**LONG_RUNNING_DRIVER_CONF, f"spark.executorEnv.{ARROW_POOL_ENV}": os.environ[ARROW_POOL_ENV],
                    **self.spec.session_defaults()}
        for key, value in {**unless_submitted(defaults, submitted), **self.spec.session_conf()}.items():
            builder = builder.config(key, value)
        self.spark = builder.getOrCreate()
        self.spark.sparkContext.setLogLevel(os.environ.get("STREAM_SPARK_LOG_LEVEL", "WARN"))
        ui_url = self.spark.sparkContext.uiWebUrl  # None with spark.ui.enabled=false
        if ui_url and not self.warm_up_only:  # for the operators' "Spark UI" link and the status page
            self.store.record_ui_url(self.run_id, ui_url)

    def kafka_stream(self, topics: Sequence[str], starting_offsets: str = "earliest") -> DataFrame:
        """A Kafka stream with the job's brokers, client options and source kind.

        The job's own records come from ``spec.kafka.topics``; a job that needs a second stream (a
        control topic, a join partner) asks for it here so both share one configuration.  Every
        stream's positions are in the offsets log, and the sink applies each record once.
        ``starting_offsets`` applies to a new generation that the spec starts from earliest/latest; a
        reset resumes the stream from its stored offsets.  Either way the concrete start is recorded
        with the generation's, so batch 0 covers this stream too.

        :param topics: the topics of the stream.
        :param starting_offsets: ``earliest`` or ``latest``: where the stream starts in a new generation
            that the spec starts from earliest/latest.
        """
        if getattr(self._warming, "on", False):  # a standby's warm-up query: nothing about it is recorded
            return self._stream(topics, "latest")
        if set(topics) - set(self.spec.kafka.topics):
            self._second_stream = True
            start = self.start.stream(topics, starting_offsets, "topics of the job's second stream")
            starting_offsets = kafka_offsets.to_spark_json(start)
        return self._stream(topics, starting_offsets)

    def _stream(self, topics: Sequence[str], starting_offsets: str) -> DataFrame:
        kind = self.spec.kafka.source
        if kind == "auto":
            kind = "jvm" if self._jvm_connector_present() else "python"
        reader = self.spark.readStream
        if kind == "jvm":
            reader = reader.format("kafka")
        else:
            self.spark.dataSource.register(kafka_source.KafkaDataSource)
            reader = reader.format(kafka_source.FORMAT)
        options = {
            "kafka.bootstrap.servers": self.spec.kafka.bootstrap_servers,
            "subscribe": ",".join(topics),
            "startingOffsets": starting_offsets,
            "failOnDataLoss": str(self.spec.kafka.fail_on_data_loss).lower(),
            **{f"kafka.{k}": v for k, v in self._client_properties(kind).items()},
        }
        if self.spec.kafka.max_offsets_per_trigger:
            options["maxOffsetsPerTrigger"] = str(self.spec.kafka.max_offsets_per_trigger)
        if kind == "python":
            options["reader"] = self._reader()
            if (tasks := self._read_tasks()) is not None:
                options["readTasks"] = str(tasks)
        log.info("reading %s through the %s Kafka source%s from %s", list(topics), kind,
                 f" ({options['reader']} reader)" if "reader" in options else "", starting_offsets)
        frame = reader.options(**options).load()
        return frame.select("topic", "partition", "offset", "key", "value", "timestamp")

    def _client_properties(self, kind: str) -> dict[str, str]:
        """The spec's ``kafka.client_options`` for the source: as given for the Python source, which reads
        through kafka-python; in the Java client's terms for Spark's connector (``kafka_java``)."""
        options = self.spec.kafka.client_options
        if kind != "jvm":
            return {k: str(v) for k, v in options.items()}
        try:  # a spec of source "auto" meets the JVM connector's terms only here
            found, left_out = jvm_client_properties(options)
        except SpecError as err:
            raise StartupError(None, str(err), failures.EXIT_CONFIG) from None
        for name, why in left_out.items():
            log.warning("kafka.client_options %s is not passed to Spark's JVM Kafka connector: %s", name, why)
        return found

    def _read_tasks(self) -> int | None:
        """How many tasks read a batch: the spec's choice, else half the cores in local mode, where the
        Python readers and the JVM share the driver's cores (on two cores one reader kept both busy at the
        same throughput as three), else one per partition."""
        if self.spec.kafka.read_tasks is not None:
            return self.spec.kafka.read_tasks
        context = self.spark.sparkContext
        return max(1, context.defaultParallelism // 2) if context.master.startswith("local") else None

    def _reader(self) -> str:
        """The read tasks' client; confluent-kafka must be importable here (and, on a cluster, on the
        executors: the same Python environment)."""
        reader = self.spec.kafka.reader
        if reader == confluent_reader.READER and not confluent_reader.available():
            raise StartupError(
                None,
                "kafka.reader is 'confluent-kafka' but the confluent_kafka package is not installed in the "
                "driver's Python. Install airflow-stream-provider[confluent] where Spark runs Python, or "
                "set kafka.reader to 'kafka-python'",
                failures.EXIT_CONFIG,
            )
        return reader

    def _jvm_connector_present(self) -> bool:
        try:  # through the context class loader: --packages jars are not on py4j's own loader
            jvm = self.spark._jvm
            jvm.java.lang.Thread.currentThread().getContextClassLoader().loadClass(JVM_KAFKA_PROVIDER)
            return True
        except Exception:
            return False

    def _start_query(self, records: DataFrame, results: ResultsFn) -> StreamingQuery:
        spec = self.spec
        # A dry run reads the live run's epoch and writes nothing; its sink's context holds none, so that a
        # commit reached by mistake is fenced instead of accepted under the live run's epoch.
        run = transaction.RunContext(spec.job_id, self.run_id, None if spec.dry_run else self.ticket.epoch,
                                     spec.generation)
        checkpoint = spec.checkpoint_path
        name = f"{spec.job_id}-gen{spec.generation}"
        self.listener = StateListener(self.store, self.run_id, name)
        self.spark.streams.addListener(self.listener)
        offset_log = OffsetLog(self.spark, checkpoint)
        if removed := remove_unfinished_first_entry(self.spark, offset_log):
            log.warning("removed what a killed driver left of the generation's first log entry: %s", removed)
        # A preflight copy that holds batch 0 with its commit dropped re-runs batch 0 on the old code's
        # checkpoint: that batch is the verdict, no later one need wait for new records.
        self._rerun_of_batch_0 = spec.dry_run and offset_log.source_offsets(0) is not None
        self.sink = self._new_sink(run, offset_log, results)
        self.listener.sink_phases = lambda batch_id: (clock.phases if (clock := self.sink.clocks.get(batch_id))
                                                      else None)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._transactional is not None:
            self._transactional.catch_up()
        return (
            records.writeStream.queryName(name)
            .option("checkpointLocation", checkpoint)
            .trigger(processingTime=spec.spark_trigger_interval)
            .foreachBatch(self._batch)
            .start()
        )

    def _batch(self, records: DataFrame, batch_id: int) -> None:
        """Spark's ``foreachBatch`` call.  The query is planned when its first batch gets here: the Python
        processes that planned it stay idle from then on (``planner_workers``), unless a standby's warm-up
        query still plans in the background (then at a later batch)."""
        if not self._planners_released and not (self.standby is not None and self.standby.rewarming()):
            self._planners_released = True
            planner_workers.release(records.sparkSession)
        self.sink(records, batch_id)

    def _new_sink(self, run: transaction.RunContext, offset_log: OffsetLog, results: ResultsFn):
        """The ``foreachBatch`` function.  Always the transactional sink; the benchmarks override this to
        measure what exactly-once costs against a plain append sink on the same pipeline."""
        self._transactional = TransactionalSink(
            store=self.store,
            run=run,
            offset_log=offset_log,
            generation_start=self.start.offsets,
            results=results,
            dry_run=self.spec.dry_run,
            after_commit=self._after_commit,
            on_poison=self.on_poison,
            # a transform that reads a second stream of its own cannot be run again on chosen records
            transform=None if self._second_stream else self._transform,
            read_raw=None if self._second_stream else self._read_raw,
            stateful=self._stateful,
            # the sink writes behind only where it can apply a batch again; it reads the marks either way
            behind=WriteBehind(WriteBehindMarks(self.spark, self.spec.checkpoint_path)),
        )
        return self._transactional

    def _read_raw(self, topic: str, partition: int, start: int, end: int) -> list[tuple]:
        """Records [start, end) of one partition with the source's columns, read on the driver: the sink
        re-runs the job's code on chosen records of a batch when isolating a poison record."""
        kafka = self.spec.kafka
        return [
            (r.topic, r.partition, r.offset, r.key, r.value,
             _EPOCH + dt.timedelta(milliseconds=r.timestamp) if r.timestamp >= 0 else None)
            for r in kafka_client.read_range(
                kafka.bootstrap_servers, kafka.python_options, topic, partition, start, end
            )
        ]

    def _after_commit(self, outcome: transaction.BatchOutcome) -> None:
        try:  # bookkeeping after the batch's transaction: a failure here must not fail a committed batch
            self.store.record_progress(self.run_id, outcome.batch_id, None, committed=True)
        except Exception as err:
            log.warning("batch %s committed; could not record its progress: %r", outcome.batch_id, err)
        self.startup.committed()
        if self.spec.dry_run:  # leave no other trace
            # Done once a batch that reads the previous batch's state ran: batch 0 starts from empty
            # state, so a stateful change shows only from batch 1 on.  A re-run of the copy's batch 0
            # is all an idle stream offers: the verdict says it proved no state.
            self._preflight_done = outcome.batch_id >= 1 or self._rerun_of_batch_0
            return
        try:  # make progress visible to standard Kafka lag tooling; the database stays the truth
            kafka_client.commit_group(
                self.spec.kafka.bootstrap_servers,
                self.spec.kafka.python_options,
                self.spec.kafka.consumer_group(self.spec.job_id),
                outcome.committed_offsets,
            )
        except Exception as err:
            log.warning("could not commit offsets to the consumer group: %r", err)

    # -- life --------------------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        log.info("%s: stopping gracefully", signal.Signals(signum).name)
        self._stop_signalled = True

    def _watch(self, query: StreamingQuery) -> int:
        while True:
            if query.awaitTermination(self.spec.heartbeat_seconds):
                exception = query.exception()
                if exception is not None:
                    return self._failed(exception)
                return self._finish(state.STOPPED, failures.EXIT_STOPPED, None, None, "query stopped")
            try:
                beat = self.store.heartbeat(self.run_id)
                stop = beat.stop_requested or self._stop_signalled
                epoch = None if self.spec.dry_run else beat.job_epoch  # a dry run holds no epoch of its own
                if self.listener.start_pending and not stop:  # the listener's write of it failed
                    self.listener.record_start()
            except Exception as err:
                log.warning("heartbeat failed: %r", err)
                stop, epoch = self._stop_signalled, None
            if epoch is not None and epoch != self.ticket.epoch:
                return self._fenced(query, epoch)
            failed = self._transactional.write_failure() if self._transactional is not None else None
            if failed is not None:  # a batch's commit failed in the writer while no next batch came
                query.stop()
                return self._failed(failed)
            if stop or self._preflight_done:
                return self._stop_gracefully(query)

    def _fenced(self, query: StreamingQuery, epoch: int) -> int:
        """Another run took the job's epoch (a standby or a new launch found this driver dead, e.g. after a
        long pause): this one's commits are rejected from now on, so it ends at once."""
        message = f"{fenced(self.run_id, self.ticket.epoch, epoch)}; its commits would be rejected, so it ends"
        log.error("%s", message)
        query.stop()
        return self._finish(state.FAILED, failures.exit_code_for(failures.FailureKind.CONCURRENT),
                            failures.FailureKind.CONCURRENT, None, message)

    def _stop_gracefully(self, query: StreamingQuery) -> int:
        """Let the running batch finish, then stop the query between batches."""
        self._stopping_bookkeeping(lambda: self.store.set_status(self.run_id, state.STOPPING), "its status")
        deadline = time.monotonic() + STOP_WAIT_S
        beat_at = time.monotonic()
        completed = self.listener.batches_completed
        # Stop between batches: when no trigger runs, or as soon as a batch completed (its state and
        # commit log written).  On a busy stream the next batch starts at once, so "no trigger" may
        # never be seen; stopping while the sink or a state store commits would fail the query.
        while (
            query.status["isTriggerActive"]
            and self.listener.batches_completed == completed
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
            if time.monotonic() - beat_at >= self.spec.heartbeat_seconds:
                # a batch may run for minutes: silent that long, a draining driver would read as dead to a
                # watcher that cannot see its process, and a standby would take over a stop
                beat_at = time.monotonic()
                self._stopping_bookkeeping(lambda: self.store.heartbeat(self.run_id), "a heartbeat")
        faults.maybe_crash("during_stop")
        query.stop()
        exception = query.exception()
        if exception is not None:
            return self._failed(exception)
        log.info("stopped gracefully after batch %s", query.lastProgress and query.lastProgress["batchId"])
        return self._finish(state.STOPPED, failures.EXIT_STOPPED, None, None, "stopped")

    def _stopping_bookkeeping(self, write: Callable[[], object], what: str) -> None:
        """A state-database write of a graceful stop, best effort: a stop asked for while the database is away
        (a SIGTERM, which it cannot record) still stops the query between batches and ends STOPPED, as its
        heartbeats ride out the outage."""
        try:
            write()
        except Exception as err:
            log.warning("stopping: could not record %s: %r", what, err)

    def _failed(self, err: BaseException) -> int:
        text = _describe(err)
        error_class = _error_class(err)
        classification = failures.classify(text, error_class)
        log.error(
            "query failed: %s [%s]: %s",
            classification.kind.value,
            classification.error_class,
            classification.evidence,
        )
        return self._finish(
            state.FAILED,
            failures.exit_code_for(classification.kind),
            classification.kind,
            classification.error_class,
            text[:20_000],
        )

    def _finish(
        self,
        status: str,
        exit_code: int,
        kind: failures.FailureKind | None,
        error_class: str | None,
        message: str,
    ) -> int:
        landed = self._flush_writes()
        if landed is not None and status == state.STOPPED:  # a clean stop leaves every batch in the database
            return self._failed(landed)
        watch = self._fence_watch
        with watch.recording if watch is not None else contextlib.nullcontext():  # one end is written
            if self._record_end(status, exit_code, kind, error_class, message) and watch is not None:
                watch.ended(exit_code)
        if status == state.FAILED:
            log.error(
                "run %s ended: exit %s (%s) %s", self.run_id, exit_code, kind and kind.value, message[:2000]
            )
        return exit_code

    def _record_end(self, status: str, exit_code: int, kind: failures.FailureKind | None, error_class: str | None,
                    message: str) -> bool:
        """Record why the run ended; whether that was written."""
        # A TRANSIENT end is often the state database itself going away: keep trying for a while, so the
        # provider reads "transient, restart when it is back" instead of a driver that vanished.
        deadline = time.monotonic() + (FINISH_RETRY_S if kind == failures.FailureKind.TRANSIENT else 0)
        while True:
            try:
                self.store.finish_run(self.run_id, status=status, exit_code=exit_code,
                                      failure_kind=kind.value if kind else None, error_class=error_class,
                                      message=message)
                return True
            except Exception as err:
                if time.monotonic() >= deadline:
                    log.error("could not record the end of run %s: %r", self.run_id, err)
                    return False
                log.warning("could not record the end of run %s yet (%r); retrying", self.run_id, err)
                time.sleep(2)

    def _flush_writes(self) -> Exception | None:
        """The query has stopped: wait for the batch handed to the sink's writer; what kept it from landing,
        if anything (its write-behind mark stays, and the next run applies it)."""
        if self._transactional is None:
            return None
        try:
            self._transactional.flush()
        except Exception as err:
            log.error("the batch handed to the writer did not land (%r); its write-behind mark stays, and the "
                      "job's next run applies it from Kafka", err)
            return err
        return None


def _describe(err: BaseException) -> str:
    """The full text to classify: message, Spark's stack/cause chain, and Python causes."""
    parts = [f"{type(err).__name__}: {err}"]
    # PySpark keeps the JVM message and stack trace in private attributes; the stack frames are the
    # only evidence for some checkpoint corruptions (e.g. "next on empty iterator" in OffsetSeqLog).
    for attr in ("_desc", "_stackTrace"):
        value = getattr(err, attr, None)
        if value and str(value) not in parts[0]:
            parts.append(str(value))
    cause = err.__cause__ or err.__context__
    while cause is not None and len(parts) < 10:
        parts.append(f"caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


def _error_class(err: BaseException) -> str | None:
    for attr in ("getCondition", "getErrorClass"):
        method = getattr(err, attr, None)
        if callable(method):
            try:
                value = method()
            except Exception:
                value = None
            if value:
                return value
    return None
