"""Upgrades end to end: the corpus of real incompatible and compatible job versions, through real DAG
runs of ``UpgradeStreamingJobOperator`` against real drivers, a real broker and a real state database.

Every pair is a pair of job files in ``tests/fixtures/jobs`` that Spark 4.3 really rejects (or really
accepts); nothing about the verdict is simulated.  Exactly-once is checked across every seam.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_stream_provider import failures, kafka_offsets
from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator
from stack.events import EventProducer, Trickle
from stack.jobs import EVENTS_JOB, JOB_DEPS, check_exactly_once, wait_until
from tests.dags import provider_scenarios as dags
from tests.dagtest.dagruns import FIXTURE_JOBS, caught_up, run_dag, runs

#: Job versions whose own code needs pandas (applyInPandasWithState), which the runtime's environment
#: does not hold: their drivers get the jobs' packages on PYTHONPATH, as a job ships its own.
PANDAS_JOBS = ("running_count_by_user.py", "running_count_by_user_kind.py")


def _version(params: dict, application: str, version: str, **kafka) -> dict:
    """The DAG params of another version of the job: its file, its label, optional Kafka spec changes."""
    spec = {**params["spec"], "version": version, "kafka": {**params["spec"]["kafka"], **kafka}}
    path = application if application.startswith("/") else str(FIXTURE_JOBS / application)
    env = {k: v for k, v in params["env_vars"].items() if k != "PYTHONPATH"}
    if Path(path).name in PANDAS_JOBS:
        env["PYTHONPATH"] = str(JOB_DEPS)
    return {**params, "application": path, "spec": spec, "env_vars": env}


def _deploy(stream, producer, application: str = EVENTS_JOB, records: int = 1500) -> dict:
    params = _version(stream["params"], application, "1.0")
    producer.send(records)
    status, tasks = run_dag(dags.deploy, params)
    assert status == "success", tasks
    caught_up(stream["state"], stream["job_id"], producer)
    producer.send(300)  # a second batch: state written by batch 0 is read from batch 1 on
    caught_up(stream["state"], stream["job_id"], producer)
    return params


def _upgrade(params: dict, producer) -> dict:
    """Trigger the upgrade DAG while events keep arriving, as they do on a live topic."""
    with Trickle(producer):
        status, tasks = run_dag(dags.upgrade, params)
    assert status == "success", tasks
    return tasks["upgrade"][1]


def _assert_reset(outcome: dict, error_class: str, generation: int) -> None:
    preflight = outcome["preflight"]
    assert preflight["verdict"] == "incompatible", preflight
    assert preflight["error_class"] == error_class, preflight
    assert outcome["decision"] == "reset" and outcome["action"] == "reset", outcome
    assert outcome["generation"] == generation and outcome["archived_generation"] == generation - 1, outcome
    archive = Path(outcome["archive_path"])
    assert (archive / "offsets").is_dir(), f"generation {generation - 1} must be archived, not deleted"
    assert outcome["verified"]["batch_id"] is not None, outcome


def _finish(stream, params: dict, producer, records: int = 700) -> dict:
    producer.send(records)
    caught_up(stream["state"], stream["job_id"], producer)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success" and tasks["stop"][1]["outcome"] == "stopped", tasks
    return check_exactly_once(stream["state"].store, stream["job_id"], producer.produced)


def _no_preflight_left(stream) -> None:
    preflight = Path(stream["params"]["spec"]["checkpoint_root"]) / stream["job_id"] / "preflight"
    assert not preflight.exists() or not any(preflight.iterdir()), "preflight copies must be removed"


def _prewarmed(stream, outcome: dict, before: set[str]) -> float:
    """Check that the upgrade started its warm successor (not a cold driver) on the generation it decided;
    return the downtime: the old run's last committed batch -> the new run's first."""
    from airflow_stream_provider.state.standbys import StandbyLog, StandbyStatus

    assert outcome.get("prewarmed") is True, f"the successor started, not a cold driver: {outcome}"
    store = stream["state"].store
    successor = StandbyLog(store).get(outcome["run_id"])
    assert successor.successor and successor.status == StandbyStatus.TOOK_OVER, successor
    assert successor.release_generation == outcome["generation"], successor
    old = store.get_run(outcome["stopped"]["run_id"])
    assert old.run_id in before and old.status == "STOPPED", old
    first = wait_until(lambda: store.first_commit(stream["job_id"], outcome["run_id"], 0.0), 120,
                       "the new run's first commit")
    return round(first - old.last_batch_at, 2)


def _run_ids(stream) -> set[str]:
    return {r.run_id for r in stream["state"].store.runs(stream["job_id"])}


# -- incompatible pairs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("old", "new", "error_class", "prewarm"),
    [
        # prewarm: the new version warmed up beside the old run, released onto generation 2
        pytest.param("running_count_by_user.py", "running_count_by_user_kind.py",
                     "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE", True, id="aggregation-keys-changed-prewarmed"),
        # in ``make soak``: the same preflight, verdict and reset as the pair above, for another error class
        # (its classification is proven against Spark's text in ``tests/unit/test_failures.py``)
        pytest.param(EVENTS_JOB, "with_control_topic.py", "STREAM_FAILED", False, id="second-source-added",
                     marks=pytest.mark.soak),
    ],
)
def test_incompatible_upgrade_resets_from_stored_offsets(stream, broker, figures, old, new, error_class, prewarm):
    broker.create_topic(f"{stream['topic']}-control", 1)
    producer = EventProducer(broker, stream["topic"])
    params = _deploy(stream, producer, old)
    producer.send(500)  # arrives while the upgrade runs

    before = _run_ids(stream)
    outcome = _upgrade({**_version(params, new, "2.0"), "prewarm": prewarm}, producer)
    _assert_reset(outcome, error_class, generation=2)
    downtime = _prewarmed(stream, outcome, before) if prewarm else None
    counts = _finish(stream, _version(params, new, "2.0"), producer)
    _no_preflight_left(stream)
    figures.record(f"upgrade {Path(old).stem} -> {Path(new).stem}{' (prewarmed)' * prewarm}",
                   preflight_s=outcome["preflight"]["seconds"], verify_s=outcome["verified"]["seconds"],
                   **({"downtime_s": downtime} if prewarm else {}), **counts)


def test_policy_never_then_stateful_upgrades(stream, broker, figures):
    """Policy 'never' refuses before anything stops; then a stateful operator added, then its columns
    changed: two resets, two archives, exactly-once across both seams."""
    producer = EventProducer(broker, stream["topic"])
    params = _deploy(stream, producer)
    state, job_id = stream["state"], stream["job_id"]
    running = state.latest_run(job_id)
    stored = state.stored_offsets(job_id)

    dedup = _version(params, "dedup_by_position.py", "2.0")
    # Run in this process without a triggerer: deferrable=False takes the blocking path.
    refusing = UpgradeStreamingJobOperator(task_id="upgrade", reset_policy="never", preflight_timeout=240,
                                           deferrable=False,
                                           **{k: dedup[k] for k in ("spec", "application", "conf", "env_vars",
                                                                     "driver_log_dir", "ready_timeout")})
    with Trickle(producer), pytest.raises(AirflowFailException) as refused:
        refusing.execute(context={})
    message = str(refused.value)
    assert "STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY" in message, message
    assert f"{job_id}/archive/gen-1-<UTC time>" in message and "generation 2" in message, message
    resume = kafka_offsets.from_spark_json(message.split("from the stored offsets ", 1)[1].split(". To do", 1)[0])
    assert resume.keys() == stored.keys() and all(resume[tp] >= stored[tp] for tp in stored), message
    assert f"run {running.run_id} (version 1.0) keeps running" in message, message
    assert state.latest_run(job_id).run_id == running.run_id
    assert state.latest_run(job_id).status == "RUNNING" and state.current_generation(job_id) == 1
    producer.send(400)
    caught_up(state, job_id, producer)  # the old version kept processing through the refusal

    outcome = _upgrade(dedup, producer)
    _assert_reset(outcome, "STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY", generation=2)
    producer.send(500)
    caught_up(state, job_id, producer)
    changed = _version(params, "dedup_by_position_and_time.py", "3.0")
    outcome = _upgrade(changed, producer)
    _assert_reset(outcome, "STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE", generation=3)
    counts = _finish(stream, changed, producer)
    figures.record("upgrade: never, then dedup added, then dedup columns changed", **counts)


def test_damaged_checkpoints_are_reset(stream, broker, figures):
    """An offsets log written by a newer Spark (v99), then a truncated offsets file: both refused by
    Spark; each upgrade archives the damaged generation and resumes from the stored offsets."""
    producer = EventProducer(broker, stream["topic"])
    params = _deploy(stream, producer)
    state, job_id = stream["state"], stream["job_id"]
    generations = Path(params["spec"]["checkpoint_root"]) / job_id

    for generation, damage, application, error_class in [
        (1, lambda lines: ["v99", *lines[1:]], "filter_added.py", "INVALID_LOG_VERSION.MAX_SUPPORTED_VERSION"),
        (2, lambda lines: lines[:1], "projection_changed.py", "STREAM_FAILED"),
    ]:
        assert run_dag(dags.stop, params)[0] == "success"
        latest = max((p for p in (generations / f"gen-{generation}" / "offsets").iterdir() if p.name.isdigit()),
                     key=lambda p: int(p.name))
        latest.write_text("\n".join(damage(latest.read_text().split("\n"))))
        latest.with_name(f".{latest.name}.crc").unlink(missing_ok=True)
        producer.send(400)
        params = _version(params, application, f"1.{generation}")
        outcome = _upgrade(params, producer)
        _assert_reset(outcome, error_class, generation=generation + 1)
        assert "stopped" not in outcome  # nothing was running
        caught_up(state, job_id, producer)
    counts = _finish(stream, params, producer)
    figures.record("upgrade: damaged checkpoints (future log version, truncated offsets)", **counts)


# -- compatible upgrades, then a broken one ------------------------------------------------------------
def test_compatible_upgrades_keep_the_checkpoint_and_a_broken_one_is_rolled_back(stream, broker, figures):
    """A filter added; a projection changed together with maxOffsetsPerTrigger: each reuses generation 1.
    Then a version that passes its preflight (which writes nothing) but fails its first commit: the
    upgrade rolls back to the version before it on the untouched generation, which keeps processing."""
    producer = EventProducer(broker, stream["topic"])
    params = _deploy(stream, producer)
    state, job_id = stream["state"], stream["job_id"]
    seconds, downtime = [], None
    for application, version, kafka, prewarm in [
        ("filter_added.py", "1.1", {}, False),
        # the new version warmed up beside the old run, released onto the same generation
        ("projection_changed.py", "1.2", {"max_offsets_per_trigger": 400}, True),
    ]:
        producer.send(600)
        params = _version(params, application, version, **kafka)
        before = _run_ids(stream)
        outcome = _upgrade({**params, "prewarm": prewarm}, producer)
        assert outcome["preflight"]["verdict"] == "compatible", outcome
        assert outcome["decision"] == "reuse" and outcome["action"] == "reuse", outcome
        assert outcome["generation"] == 1 and outcome["stopped"]["outcome"] == "stopped", outcome
        seconds.append(outcome["preflight"]["seconds"])
        if prewarm:
            downtime = _prewarmed(stream, outcome, before)
    root = Path(params["spec"]["checkpoint_root"]) / job_id
    assert not (root / "archive").exists() and not (root / "gen-2").exists()

    with Trickle(producer):  # prewarmed too: the successor's run fails its first commit, then the rollback
        status, tasks = run_dag(dags.upgrade, {**_version(params, "new_result_column.py", "2.0"), "prewarm": True})
    assert status == "failed" and tasks["upgrade"][0] == "failed", tasks
    tried = [r for r in runs(state, job_id) if r.version == "2.0"]
    assert [r.dry_run for r in tried] == [True, False], tried
    assert tried[0].status == "STOPPED" and tried[1].status == "FAILED", tried
    # named for what it is, with what to do: the table an earlier version made lacks the new column
    assert tried[1].failure_kind == "USER_CODE", tried[1]
    assert failures.classify(tried[1].termination_message or "", tried[1].error_class).signature == \
        "result-table-mismatch", tried[1].termination_message
    current = state.latest_run(job_id)
    assert current.version == "1.2" and current.status == "RUNNING", current
    assert current.generation == 1 and current.application == params["application"]
    assert json.loads(current.spec)["kafka"]["max_offsets_per_trigger"] == 400, "the spec that ran, too"
    assert [r["action"] for r in state.restarts_since(job_id, 0)] == ["rollback"]

    counts = _finish(stream, params, producer)
    assert state.current_generation(job_id) == 1 and not (root / "gen-2").exists()
    _no_preflight_left(stream)
    figures.record("upgrade: 2 compatible versions on one checkpoint, then a rollback", preflight_s=seconds,
                   prewarmed_downtime_s=downtime, **counts)


def test_an_idle_stream_upgrades_without_waiting_for_data(stream, broker, figures):
    """A caught-up stream whose generation holds only batch 0: no record is coming, so neither the
    preflight nor the verification may wait for one (each has a 240 s timeout here).  The preflight
    re-runs batch 0 and says why that cannot prove state compatibility; the new run is verified as
    running as soon as it is clear the stream is caught up."""
    producer = EventProducer(broker, stream["topic"])
    producer.send(500)  # one batch (maxOffsetsPerTrigger 1500): generation 1 holds batch 0 only
    params = _version(stream["params"], "running_count_by_user.py", "1.0")
    assert run_dag(dags.deploy, params)[0] == "success"
    caught_up(stream["state"], stream["job_id"], producer)

    status, tasks = run_dag(dags.upgrade, _version(params, "running_count_by_user.py", "1.1"))
    assert status == "success", tasks
    outcome = tasks["upgrade"][1]
    preflight, verified = outcome["preflight"], outcome["verified"]
    assert preflight["verdict"] == "inconclusive" and "no committed batch whose state" in preflight["detail"], \
        preflight
    assert outcome["decision"] == "reuse" and outcome["generation"] == 1, outcome
    assert verified["idle"] is True and verified["batch_id"] is None, verified
    timeout = params["ready_timeout"]
    assert preflight["seconds"] < timeout and verified["seconds"] < timeout, outcome
    figures.record("upgrade of an idle stream", preflight_s=preflight["seconds"], verify_s=verified["seconds"])

    producer.send(300)  # the upgraded version goes on from where version 1.0 stopped
    caught_up(stream["state"], stream["job_id"], producer)
    status, tasks = run_dag(dags.stop, params)
    assert status == "success", tasks
