"""An upgrade whose new version cannot even be submitted once the old run has stopped (the brokers away
for the check before the start, a topic gone): the upgrade's own failure path runs, as for a new version
that failed as it started.  Escaping the flow, the error said "nothing was started" although the old run
was stopped, and the upgrade's record stayed in STARTING, so every recovery left the job alone for half
an hour."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider import recovery
from airflow_stream_provider.lifecycle.controller import StreamJobController, StreamJobError
from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.upgrades import UpgradeLog, UpgradePhase

SPEC = {"job_id": "job", "version": "1.0"}


def _unreachable(self, spec):
    """The controller's own check before a start, refusing: the brokers cannot be taken down for one check
    only, so it raises what it raises when they do not answer."""
    raise StreamJobError("Kafka at the job's brokers is unreachable: NoBrokersAvailable; check the connection's "
                         "brokers and that they are up; nothing was started")


def _past_its_stop(store, tmp_path, topic: str, decision: str) -> tuple[UpgradeStreamingJobOperator, dict, str]:
    """An upgrade from 1.0 to 2.0 whose old run has just stopped: the operator, its flow state (the upgrade
    not begun yet), and the old run's id."""
    old = store.begin_run("job", 1, "1.0").run_id
    store.finish_run(old, status="STOPPED", exit_code=0, message="stopped by the upgrade")
    spec = {**SPEC, "checkpoint_root": str(tmp_path / "checkpoints"), "kafka": {"topics": [topic]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="/jobs/v2.py", version="2.0")
    previous = {"application": "/jobs/v1.py", "spec_json": operator.job.to_json()}
    ctx = {"generation": 1, "outcome": {}, "previous": previous, "policy": "after_preflight",
           "decision": {"action": decision, "why": "preflight", "reset_on_start_failure": False}}
    return operator, ctx, old


def _fails_past_its_stop(store, operator: UpgradeStreamingJobOperator, ctx: dict, old: str) -> str:
    """Begin the upgrade and run its flow from the old run's stop; the message it fails with."""
    ctx["upgrade_id"] = UpgradeLog(store).begin("job", "1.0", "2.0", ctx)
    with pytest.raises(AirflowFailException) as failed:
        operator._old_stopped({}, {"run_id": old, "outcome": "stopped"}, ctx)
    return str(failed.value)


@pytest.mark.parametrize(("decision", "prewarmed"), [("reuse", False), ("reset", False), ("reset", True)],
                         ids=["reuse", "reset", "reset-successor-gone"])
def test_a_new_version_refused_before_its_submit_rolls_back_and_ends_the_upgrade(state_store, monkeypatch, tmp_path,
                                                                                 topic, decision, prewarmed):
    monkeypatch.setattr(StreamJobController, "check_before_start", _unreachable)
    operator, ctx, old = _past_its_stop(state_store, tmp_path, topic, decision)
    if prewarmed:  # its warm successor is gone by the stop (never recorded here): started cold instead
        ctx["successor"] = {"standby_id": "gone", "application": "/jobs/v2.py", "spec": operator.job.to_json()}
    message = _fails_past_its_stop(state_store, operator, ctx, old)
    assert message.startswith("job job: the upgrade to version 2.0 failed after the old run was stopped: Kafka at "
                              "the job's brokers is unreachable"), message
    assert "The rollback to version 1.0 (/jobs/v1.py) failed too" in message
    assert "The job is down; start a known-good version by hand." in message
    record = UpgradeLog(state_store).latest("job")
    assert record.phase == UpgradePhase.DONE, record
    assert not recovery.upgrade_in_charge(record, time.time()), "recoveries act on the job again"


def test_a_rollback_refused_before_its_submit_leaves_the_old_versions_checkpoint(state_store, monkeypatch, tmp_path,
                                                                                  topic):
    """The new version found the checkpoint incompatible; the rollback to the old one is refused before its
    submit (the brokers away).  The latest run is still the new version's: its incompatibility is no reason
    to reset the generation the old code reads, which would throw its streaming state away."""
    monkeypatch.setattr(StreamJobController, "check_before_start", _unreachable)
    old = state_store.begin_run("job", 1, "1.0").run_id
    state_store.finish_run(old, status="STOPPED", exit_code=0, message="stopped by the upgrade")
    new = state_store.begin_run("job", 1, "2.0").run_id
    state_store.finish_run(new, status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                           error_class="STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA",
                           message="the new code cannot use the checkpoint")
    spec = {**SPEC, "checkpoint_root": str(tmp_path / "checkpoints"), "kafka": {"topics": [topic]}}
    operator = UpgradeStreamingJobOperator(task_id="upgrade", spec=spec, application="/jobs/v2.py", version="2.0")
    previous = {"application": "/jobs/v1.py", "spec_json": operator.job.to_json()}
    ctx = {"generation": 1, "outcome": {}, "previous": previous, "error": "version 2.0 refused the checkpoint"}
    ctx["upgrade_id"] = UpgradeLog(state_store).begin("job", "1.0", "2.0", ctx)
    kept = Path(operator.controller.checkpoints.generation_path("job", 1))
    (kept / "offsets").mkdir(parents=True)
    (kept / "offsets" / "0").write_text("v1\n")  # the old version's checkpoint, one batch planned

    with pytest.raises(AirflowFailException) as failed:
        operator._rollback_stopped({}, None, ctx)
    assert "The rollback to version 1.0 (/jobs/v1.py) failed too: Kafka at the job's brokers is unreachable" \
        in str(failed.value), failed.value
    assert state_store.current_generation("job") == 1, "the old version's generation was archived"
    assert (kept / "offsets" / "0").exists()
    assert UpgradeLog(state_store).latest("job").phase == UpgradePhase.DONE


def test_a_new_generation_that_cannot_resume_from_the_stored_offsets_rolls_back(state_store, monkeypatch, tmp_path,
                                                                                topic):
    """The upgrade's reset finds, once the old run has stopped, that Kafka no longer holds the stored offsets
    (here: the topic's log is behind them, as after its recreation).  The error escaped the flow saying
    "Nothing was archived or started", with the job down and the upgrade's record in STARTING; it now takes
    the flow's failure path: the rollback, on the generation that was never archived."""
    monkeypatch.setattr(StreamJobController, "check_before_start", _unreachable)  # the rollback's own start
    operator, ctx, old = _past_its_stop(state_store, tmp_path, topic, "reset")
    with state_store.engine.begin() as conn:  # applied up to offset 300 of each partition: Kafka holds none
        conn.execute(schema.offsets.insert(), [
            {"job_id": "job", "topic": topic, "partition": p, "next_offset": 300, "generation": 1, "batch_id": 4}
            for p in (0, 1, 2)])
    message = _fails_past_its_stop(state_store, operator, ctx, old)
    assert message.startswith("job job: the upgrade to version 2.0 failed after the old run was stopped: job job: "
                              "cannot resume from the stored offsets"), message
    assert "The rollback to version 1.0 (/jobs/v1.py) failed too" in message, message
    assert UpgradeLog(state_store).latest("job").phase == UpgradePhase.DONE
    assert state_store.current_generation("job") == 1


def test_a_new_version_refused_before_its_submit_does_not_reset_for_an_older_runs_incompatibility(
        state_store, monkeypatch, tmp_path, topic):
    """The job was down: its latest run had found the checkpoint incompatible before this upgrade began.  The
    new version is refused before its submit (the brokers away), so that run is still the latest; the
    decision allows a reset on a start refusal, but the new code never saw the checkpoint, and a reset would
    archive it, state and all."""
    monkeypatch.setattr(StreamJobController, "check_before_start", _unreachable)
    operator, ctx, _ = _past_its_stop(state_store, tmp_path, topic, "reuse")
    ctx["decision"]["reset_on_start_failure"] = True
    earlier = state_store.begin_run("job", 1, "1.5").run_id
    state_store.finish_run(earlier, status="FAILED", exit_code=3, failure_kind="CHECKPOINT_INCOMPATIBLE",
                           error_class="STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA",
                           message="an earlier version could not use the checkpoint")
    kept = Path(operator.controller.checkpoints.generation_path("job", 1))
    (kept / "offsets").mkdir(parents=True)
    (kept / "offsets" / "0").write_text("v1\n")
    message = _fails_past_its_stop(state_store, operator, ctx, earlier)
    assert "Kafka at the job's brokers is unreachable" in message, message
    assert state_store.current_generation("job") == 1, "the checkpoint was archived for another run's refusal"
    assert (kept / "offsets" / "0").exists()


def test_only_a_run_a_start_of_the_flow_registered_is_its_own_refusal(state_store, tmp_path, topic):
    """A run is the flow's own when it took an epoch past the job's at the flow's start: no clock is compared
    (a run's start is by the database's clock, read back in the worker's terms).  A preflight's dry run takes
    no epoch."""
    operator, _, _ = _past_its_stop(state_store, tmp_path, topic, "reuse")
    incompatible = {"status": "FAILED", "exit_code": 3, "failure_kind": "CHECKPOINT_INCOMPATIBLE",
                    "error_class": "STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY", "message": "refused"}
    older = state_store.begin_run("job", 1, "1.5").run_id
    state_store.finish_run(older, **incompatible)
    since = operator._epoch()
    assert operator._own_refusal(since) is None, "a run older than the start"
    own = state_store.begin_run("job", 1, "2.0").run_id
    state_store.finish_run(own, **incompatible)
    assert operator._own_refusal(since).run_id == own
    assert operator._own_refusal(operator._epoch()) is None, "a later start's own is another run"
