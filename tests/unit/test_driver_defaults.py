"""The harness's settings for a long-running driver give way to what the deployment submitted."""

from __future__ import annotations

from pyspark import SparkConf

from airflow_stream_provider.runtime.harness import LONG_RUNNING_DRIVER_CONF, unless_submitted


def test_a_setting_the_deployment_submitted_is_left_to_it():
    submitted = SparkConf(loadDefaults=False).set("spark.ui.retainedJobs", "500")
    kept = unless_submitted(LONG_RUNNING_DRIVER_CONF, submitted)
    assert "spark.ui.retainedJobs" not in kept
    assert kept == {k: v for k, v in LONG_RUNNING_DRIVER_CONF.items() if k != "spark.ui.retainedJobs"}


def test_the_status_store_is_bounded_and_adaptive_execution_off_by_default():
    kept = unless_submitted(LONG_RUNNING_DRIVER_CONF, SparkConf(loadDefaults=False))
    assert int(kept["spark.ui.retainedJobs"]) <= 100 and int(kept["spark.ui.retainedStages"]) <= 100
    assert int(kept["spark.sql.ui.retainedExecutions"]) <= 100
    assert kept["spark.sql.adaptive.enabled"] == "false"


def test_the_deployments_spark_submit_conf_wins_over_the_jobs_defaults_and_the_spec_over_both():
    """The harness applied the job's defaults over what spark-submit was given (the connection's or the
    operator's conf): a deployment's shuffle partitions, pinned into a stateful job's checkpoint, were
    silently 4.  Merged as the harness merges them."""
    from airflow_stream_provider.spec import CHECKPOINT_MANAGER_CONF, StreamJobSpec

    spec = StreamJobSpec.from_dict({"job_id": "j", "version": "1", "checkpoint_root": "/data/ckpt",
                                    "database_url": "sqlite:////tmp/x.db",
                                    "kafka": {"bootstrap_servers": "b:9092", "topics": ["t"]},
                                    "spark_conf": {"spark.sql.session.timeZone": "Europe/Oslo"}})
    submitted = SparkConf(loadDefaults=False).setAll([
        ("spark.sql.shuffle.partitions", "8"), (CHECKPOINT_MANAGER_CONF, "x.Theirs"),
        ("spark.sql.streaming.minBatchesToRetain", "5"), ("spark.sql.session.timeZone", "UTC")])
    conf = {**unless_submitted(spec.session_defaults(), submitted), **spec.session_conf()}
    assert "spark.sql.shuffle.partitions" not in conf and CHECKPOINT_MANAGER_CONF not in conf
    assert conf["spark.sql.streaming.minBatchesToRetain"] == "100", "a spec field: the spec says"
    assert conf["spark.sql.session.timeZone"] == "Europe/Oslo"
