"""Bad configuration fails before anything starts, with a message that names the field and the fix.

Real Airflow operators against a real broker and a real state database; no driver may be started and
no run recorded in any of these cases.
"""

from __future__ import annotations

import re

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider.operators.base import StreamJobError
from airflow_stream_provider.operators.recover import RecoverStreamingJobOperator
from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator
from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
from stack.broker import free_port
from stack.jobs import EVENTS_JOB
from tests.dagtest import airflow as airflow_stack
from tests.dagtest.dagruns import runs


@pytest.fixture
def job(stream):
    """Operator arguments for the test's job (connections set by the ``stream`` fixture)."""
    params = stream["params"]
    return {"spec": params["spec"], "application": EVENTS_JOB, "conf": params["conf"],
            "env_vars": params["env_vars"], "driver_log_dir": params["driver_log_dir"], "ready_timeout": 30}


def _submit(job, **spec_changes):
    spec = {**job["spec"], **spec_changes}
    SubmitStreamingJobOperator(task_id="submit", **{**job, "spec": spec}).execute(context={})


def _nothing_started(stream):
    assert runs(stream["state"], stream["job_id"]) == []


@pytest.mark.parametrize(
    ("change", "field", "fix"),
    [
        ({"job_id": "../x"}, "job_id", "no '/' or '..'"),
        ({"kafka": {"topics": ["t"], "starting_offsets": '{"t": {"0": -7}}'}}, "kafka.starting_offsets",
         "earliest"),
        ({"trigger_interval": "soon"}, "trigger_interval", ""),
        ({"kafka": {"topics": ["t"], "source": "jvm-ish"}}, "kafka.source", "auto"),
        ({"checkpont_root": "/x"}, "checkpont_root", "Known fields"),
    ],
)
def test_invalid_spec_fields_are_named_with_the_fix(stream, job, change, field, fix):
    with pytest.raises(AirflowFailException, match=f"'{field}'") as raised:
        _submit(job, **change)
    assert fix in str(raised.value)
    _nothing_started(stream)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # set by the connections: a different value in the spec was dropped without a word
        (lambda spec: {"kafka": {**spec["kafka"], "bootstrap_servers": "elsewhere:9092"}},
         "spec sets kafka.bootstrap_servers to 'elsewhere:9092', but it comes from the connection "
         "'stream_kafka_default'"),
        (lambda spec: {"database_url": "sqlite:////tmp/another.db"},
         "spec sets database_url, but it comes from the connection 'stream_state_default'"),
        # a first submit ran as a dry run on the job's real checkpoint
        (lambda spec: {"dry_run": True}, "spec sets dry_run"),
        (lambda spec: {"kafka": None}, "spec's kafka is a NoneType, not a mapping"),
    ],
)
def test_what_the_spec_must_not_set_is_refused(stream, job, change, message):
    with pytest.raises(AirflowFailException, match=re.escape(message)):
        _submit(job, **change(job["spec"]))
    _nothing_started(stream)


def test_unknown_topic_is_refused_before_a_driver_starts(stream, job):
    with pytest.raises(AirflowFailException, match=r"'kafka.topics': topics \['no-such-topic'\] do not exist"):
        _submit(job, kafka={**job["spec"]["kafka"], "topics": ["no-such-topic"]})
    _nothing_started(stream)


def test_unreachable_brokers_are_named(stream, job, monkeypatch):
    port = free_port()  # nothing listens there
    monkeypatch.setenv(*airflow_stack.connection_env("stream_kafka_default", conn_type="stream_kafka",
                                                     host="127.0.0.1", port=port))
    with pytest.raises(StreamJobError, match=f"127.0.0.1:{port} .connection 'stream_kafka_default'.*nothing was started"):
        _submit(job)
    _nothing_started(stream)


def test_checkpoint_root_that_cannot_be_written(stream, job, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(AirflowFailException, match="'checkpoint_root'.*not a writable directory"):
        _submit(job, checkpoint_root=str(blocker / "checkpoints"))
    _nothing_started(stream)


def test_missing_connection_says_which_and_how(stream, job, monkeypatch):
    with monkeypatch.context() as patch, pytest.raises(AirflowFailException, match="stream_state_default.*Create it"):
        patch.delenv("AIRFLOW_CONN_STREAM_STATE_DEFAULT")
        _submit(job)
    _nothing_started(stream)


@pytest.mark.parametrize(
    ("operator", "argument", "choices"),
    [
        (SubmitStreamingJobOperator, {"if_running": "replcae"}, "replace"),
        (RecoverStreamingJobOperator, {"on_incompatible": "rest"}, "reset"),
        (UpgradeStreamingJobOperator, {"reset_policy": "Auto"}, "after_preflight"),
    ],
)
def test_misspelt_policies_list_the_choices(stream, job, operator, argument, choices):
    with pytest.raises(AirflowFailException, match=choices):
        operator(task_id="t", **job, **argument).execute(context={})
    _nothing_started(stream)


def test_the_example_jobs_size_limit_must_be_a_positive_number_of_bytes(tmp_path):
    """'64k' failed the query's start with a bare ValueError; 0 or a negative limit dead-lettered every record
    while the stored offsets moved past them.  The job's code runs in the drivers' Python, which has Spark."""
    import json
    import subprocess

    from stack.jobs import REPO, SPARK_BIN, spark_env

    script = tmp_path / "limit.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(REPO / 'spark_jobs')!r})\n"
        "from events_job import _max_value_bytes\n"
        "found = {}\n"
        "for setting in ('64k', '0', '-1', ' 65536 '):\n"
        "    try:\n"
        "        found[setting] = _max_value_bytes(setting)\n"
        "    except ValueError as err:\n"
        "        found[setting] = str(err)\n"
        "print('RESULT ' + json.dumps(found))\n")
    done = subprocess.run([str(SPARK_BIN / "python"), str(script)], env=spark_env(), capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-2000:]
    found = json.loads(lines[-1].removeprefix("RESULT "))
    assert found[" 65536 "] == 65536
    for refused in ("64k", "0", "-1"):
        assert "is not a positive number of bytes: give e.g. 65536" in found[refused], found


def test_an_hdfs_checkpoint_root_without_its_webhdfs_connection_is_refused(stream, job):
    """Its first reset or upgrade, in an incident maybe, would have found the connection missing."""
    with pytest.raises(AirflowFailException, match=r"is on HDFS.*Create the connection 'checkpoint_default' "
                                                   r"\(type stream_checkpoint"):
        _submit(job, checkpoint_root="hdfs://127.0.0.1:8020/checkpoints")
    _nothing_started(stream)
