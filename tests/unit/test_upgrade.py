"""The upgrade decision table (pure) and the checkpoint pieces the preflight relies on."""

from __future__ import annotations

import pytest

from airflow_stream_provider import kafka_offsets
from airflow_stream_provider.state.records import RunRecord, RunStatus
from airflow_stream_provider.upgrade import Action, Preflight, Verdict, check_policy, decide

INCOMPATIBLE = Preflight(Verdict.INCOMPATIBLE, "refused", error_class="STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE")


@pytest.mark.parametrize(
    ("verdict", "policy", "action", "reset_later"),
    [
        (Verdict.COMPATIBLE, "never", Action.REUSE, False),
        (Verdict.COMPATIBLE, "auto", Action.REUSE, False),
        (Verdict.INCOMPATIBLE, "auto", Action.RESET, False),
        (Verdict.INCOMPATIBLE, "after_preflight", Action.RESET, False),
        (Verdict.INCOMPATIBLE, "never", Action.ABORT, False),
        (Verdict.FAILED, "auto", Action.ABORT, False),
        (Verdict.INCONCLUSIVE, "auto", Action.REUSE, True),
        (Verdict.INCONCLUSIVE, "after_preflight", Action.REUSE, False),
        (Verdict.SKIPPED, "auto", Action.REUSE, True),
        (Verdict.SKIPPED, "never", Action.REUSE, False),
    ],
)
def test_decision_table(verdict, policy, action, reset_later):
    found = decide(Preflight(verdict, "detail", error_class="X"), policy)
    assert (found.action, found.reset_on_start_failure) == (action, reset_later)


def test_never_names_the_incompatibility():
    assert "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE" in decide(INCOMPATIBLE, "never").why


@pytest.mark.parametrize("policy", ["Auto", "after-preflight", "", "always"])
def test_misspelt_policy_is_refused_with_the_choices(policy):
    with pytest.raises(ValueError, match="auto, after_preflight, never"):
        check_policy(policy)


def test_offset_log_merges_the_sources_of_one_query():
    lines = ['{"events":{"0":5,"1":7}}', "-", '{"events-control":{"0":2}}']
    assert kafka_offsets.from_offset_log(lines) == {("events", 0): 5, ("events", 1): 7, ("events-control", 0): 2}
    with pytest.raises(ValueError, match="two sources"):
        kafka_offsets.from_offset_log(['{"a":{"0":1}}', '{"a":{"0":2}}'])


@pytest.mark.parametrize(
    ("last_batch", "reads_old_state", "verdict"),
    [
        (3, 3, Verdict.COMPATIBLE),  # the re-run of the newest committed batch read the old code's state
        (1, 1, Verdict.COMPATIBLE),  # only batch 0 was committed: batch 1 read its state
        (1, None, Verdict.INCONCLUSIVE),  # nothing was committed: the dry run only read state it wrote itself
        (0, 1, Verdict.INCONCLUSIVE),
    ],
)
def test_a_dry_run_proves_compatibility_only_on_state_the_old_code_wrote(last_batch, reads_old_state, verdict):
    from airflow_stream_provider.operators.upgrade import _verdict

    run = RunRecord("r", "j", 1, 1, RunStatus.STOPPED, last_batch_id=last_batch)
    assert _verdict(run, "ended", None, reads_old_state).verdict == verdict


def test_a_dry_run_stopped_early_is_inconclusive_and_says_why():
    from airflow_stream_provider.operators.upgrade import _verdict

    stopped = RunRecord("r", "j", 1, 1, RunStatus.STOPPED)
    idle = _verdict(stopped, "idle", None, None)
    assert idle.verdict == Verdict.INCONCLUSIVE and "caught up" in idle.detail
    timed_out = _verdict(RunRecord("r", "j", 1, 1, RunStatus.STOPPED), "timeout", None, 1)
    assert timed_out.verdict == Verdict.INCONCLUSIVE and "ran no batch" in timed_out.detail


def test_a_dry_run_that_never_registered_is_no_verdict_on_the_code_and_stops_the_upgrade():
    """It was INCONCLUSIVE, so the upgrade went on to stop the old run and start a new version no driver had
    even started (a cluster's queue, a machine out of memory); its driver was left to come up later."""
    from airflow_stream_provider.operators.upgrade import _verdict

    never = _verdict(None, "timeout", None, 1)
    assert (never.verdict, never.failure_kind) == (Verdict.FAILED, "TRANSIENT"), never
    assert "did not register its run within the preflight's timeout" in never.detail
    decision = decide(never, "auto")
    assert decision.action == Action.ABORT and "could not judge the new version" in decision.why
    # registered between the wait's look and its kill: still the start that never came in time
    late = _verdict(RunRecord("r", "j", 1, 1, RunStatus.STARTING), "unregistered", None, 1)
    assert (late.verdict, late.failure_kind) == (Verdict.FAILED, "TRANSIENT"), late
