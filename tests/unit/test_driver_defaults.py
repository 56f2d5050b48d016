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
