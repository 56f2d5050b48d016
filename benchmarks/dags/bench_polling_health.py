"""The health DAG as it was before the always-on watcher, kept for the benchmarks only: scheduled every
5 minutes, it watches the job with a time-boxed sensor and acts on what the watch finds.  Between the
sensor's end and the next run, and after every recovery until the next run, nothing watches: the
benchmark ``mttr_real_airflow`` measures what that costs against ``stream_health``.

The sensor defers (no worker slot) for up to 4 minutes, looking every 2 seconds (one state-database
query and a process check in the triggerer), and fires when the job is DEAD, STUCK or FAILED, or is
owed a restart that stopped it and started none (INTERRUPTED_RESTART); a healthy job makes it time out softly, and the run ends skipped: nothing to do. Then:

* DATA_LOSS: fail loudly with the lost offset ranges; no automatic action can be right;
* CHECKPOINT_INCOMPATIBLE: reset to a new generation from the stored offsets when the Variable
  ``stream_reset_policy`` is ``auto``, otherwise fail saying how to decide;
* anything else (dead driver, stuck query, transient or user-code failure): recover, within the restart
  budget (RecoverStreamingJobOperator's table says what it does for each).
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG
from stream_job import DAG_ARGS, WATCH, act_on

from airflow_stream_provider.sensors.health import StreamHealthSensor

with DAG("bench_polling_health", schedule=dt.timedelta(minutes=5), max_active_runs=1, doc_md=__doc__,
         **{**DAG_ARGS, "tags": ["benchmark"]}):
    health = StreamHealthSensor(task_id="health", timeout=dt.timedelta(minutes=4).total_seconds(),
                                soft_fail=True, poke_interval=2, **WATCH)

    act_on(health.output)
