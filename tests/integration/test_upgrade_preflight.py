"""What an upgrade says and does when its preflight's dry run ended for a reason that is not the new code:
Kafka or the database away, memory, records gone from Kafka.  On real state databases; the dry run's end
stands in (``Preflight``): the preflights of real drivers are in ``tests/e2e/test_upgrades.py``."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider.lifecycle.controller import StreamJobError
from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase
from airflow_stream_provider.upgrade import Preflight, Verdict

UNREACHABLE = "kafka.errors.KafkaTimeoutError: Unable to bootstrap from [('10.0.0.5', 9092)]"


def _decided(state_store, tmp_path, kind: str, detail: str):
    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="/jobs/v2.py")
    ctx = {"policy": "auto", "generation": 1, "outcome": {}, "live_run_id": None}
    ctx["upgrade_id"] = UpgradeLog(state_store).begin("job", "1.0", "2.0", ctx)
    preflight = Preflight(Verdict.FAILED, detail, failure_kind=kind, run_id="dry-1")
    with pytest.raises((StreamJobError, AirflowFailException)) as raised:
        operator._decide({}, ctx, preflight)
    assert UpgradeLog(state_store).get(ctx["upgrade_id"]).phase == UpgradePhase.DONE, "nothing was stopped"
    return raised


@pytest.mark.parametrize(("kind", "retried"), [("TRANSIENT", True), ("RESOURCE", True), ("DATA_LOSS", False)])
def test_a_preflight_that_could_not_judge_the_new_version_does_not_call_it_broken(state_store, tmp_path, kind,
                                                                                 retried):
    """It said "Fix the new version and rerun", and failed the task for good even where Airflow's retries
    would pass once the service is back."""
    raised = _decided(state_store, tmp_path, kind, UNREACHABLE)
    assert isinstance(raised.value, StreamJobError) is retried
    message = str(raised.value)
    assert f"could not judge the new version: the dry run ended {kind}" in message
    assert "The new version was not judged" in message and "Fix the new version" not in message


def test_a_new_version_that_failed_its_preflight_is_still_called_broken(state_store, tmp_path):
    raised = _decided(state_store, tmp_path, "USER_CODE", "ZeroDivisionError in parse")
    assert isinstance(raised.value, AirflowFailException)
    assert "the new version failed its preflight" in str(raised.value) and "Fix the new version" in str(raised.value)


def test_a_dry_run_that_never_registered_is_killed_and_the_upgrade_stops_before_the_old_run(state_store, tmp_path):
    """Its driver not registered within the preflight's timeout (a cluster's queue, a machine out of memory),
    the preflight was INCONCLUSIVE: the upgrade stopped the old run for a new version nobody had seen start,
    and left the dry run's driver to come up later on a copy already removed."""
    import subprocess
    import time

    from airflow_stream_provider import local_driver

    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="/jobs/v2.py",
                                           preflight_timeout=1)
    # A process in its own group stands in for the dry run's spark-submit, still starting.
    starting = subprocess.Popen(["sleep", "60"], start_new_session=True)
    root = tmp_path / "job" / "preflight" / "1"
    root.mkdir(parents=True)
    ctx = {"policy": "auto", "generation": 1, "outcome": {}, "live_run_id": None, "preflight_began": time.time(),
           "preflight": {"root": str(root), "job_id": "job", "run_id": "dry-1", "pid": starting.pid,
                         "host": local_driver.this_host(), "submitted_at": time.time() - 1,
                         "log_path": str(tmp_path / "dry.log"), "submission_id": None, "reads_old_state": 1}}
    ctx["upgrade_id"] = UpgradeLog(state_store).begin("job", "1.0", "2.0", ctx)
    try:
        with pytest.raises(StreamJobError, match="could not judge the new version"):
            operator._dry_run_waited({}, {"outcome": "timeout"}, ctx)
        assert starting.wait(10) == -9, "the dry run's driver was killed"
    finally:
        starting.kill()
    assert UpgradeLog(state_store).get(ctx["upgrade_id"]).phase == UpgradePhase.DONE, "nothing was stopped"


def test_a_dry_run_that_recorded_its_failure_as_the_wait_timed_out_is_judged_by_it(state_store, tmp_path,
                                                                                     monkeypatch):
    """The dry run recorded a refused checkpoint just before the preflight's deadline and its JVM was still
    exiting when the wait timed out: the preflight read "timeout" as INCONCLUSIVE, and the upgrade stopped
    the old run for a version whose checkpoint Spark had refused."""
    from airflow_stream_provider.operators import upgrade

    spec = {"job_id": "job", "version": "2.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="/jobs/v2.py")
    dry = state_store.begin_run("job", 1, "2.0", dry_run=True).run_id
    state_store.finish_run(dry, status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                           error_class="STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY", message="refused")
    ctx = {"preflight": {"run_id": dry, "job_id": "job", "log_path": None, "reads_old_state": 1}}
    judged = []
    monkeypatch.setattr(UpgradeStreamingJobOperator, "_preflight_over",
                        lambda self, context, stopped, ctx, ending: judged.append(ending))
    operator._dry_run_waited({}, {"outcome": "timeout"}, ctx)
    assert judged == ["ended"]
    verdict = upgrade._verdict(state_store.get_run(dry), judged[0], None, 1)
    assert verdict.verdict == Verdict.INCOMPATIBLE, verdict
