"""A reset task's retry, after its earlier try began the reset and ended before its launch: it carries the
reset on while it is owed, and leaves the job alone once another task carried it on or a stop someone asked
for closed it (``ResetStreamingJobOperator._finished_by_another``).  The whole path, a retry after
``stream_health`` finished the reset, is ``e2e/test_provider_dags.py``."""

from __future__ import annotations

import pytest

from airflow_stream_provider.operators.reset import ResetStreamingJobOperator

MINE = "ops_reset/manual__1/reset/-1"
HEALTH = "stream_health/asset_triggered__1/recover/-1"


@pytest.fixture
def retry(state_store, tmp_path) -> ResetStreamingJobOperator:
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": ["events"]}}
    operator = ResetStreamingJobOperator(task_id="reset", spec=spec)
    operator._lease_owner = MINE  # as execute sets it: the same task instance as the earlier try
    return operator


def test_a_reset_still_owed_or_launched_by_this_task_is_this_tasks_to_do(state_store, retry):
    assert retry._finished_by_another() is None, "no reset begun by this task"
    failed = state_store.begin_run("job", 1, "1.0").run_id
    state_store.record_restart("job", "reset", "manual reset", failed, None, MINE)
    assert retry._finished_by_another() is None, "owed: the retry finishes it"
    state_store.record_restart("job", "reset", "manual reset", failed, "r2", MINE)
    assert retry._finished_by_another() is None, "launched by this task: a clear of it resets anew"


def test_a_reset_another_task_carried_on_is_left_alone(state_store, retry):
    failed = state_store.begin_run("job", 1, "1.0").run_id
    state_store.record_restart("job", "reset", "manual reset", failed, None, MINE)
    state_store.record_restart("job", "reset", "manual reset", failed, "r2", HEALTH)
    done = retry._finished_by_another()
    assert (done["action"], done["run_id"]) == ("none", "r2"), done
    assert f"was carried on by task {HEALTH}, which launched run r2" in done["why"]


def test_a_reset_a_stop_closed_is_not_undone(state_store, retry):
    live = state_store.begin_run("job", 1, "1.0").run_id
    state_store.record_restart("job", "reset", "manual reset", live, None, MINE)
    state_store.cancel_begun_restarts("job")  # a person's stop since
    done = retry._finished_by_another()
    assert done["action"] == "none" and "was closed by a stop asked for at" in done["why"], done


def test_a_reset_lost_between_its_archive_and_its_record_is_recorded_by_the_next(state_store, database_url, topic,
                                                                                  tmp_path):
    """A reset renamed generation 1 into the archive, then its task died, or the state database failed, before
    recording it.  The next reset reported no archive and left generation 1 current in the database: once
    generation 2 was archived in turn, a reset started generation 2 again, on its incompatible checkpoint.
    Now the next reset records the archive it finds and reports it, and numbers go on from there."""
    from airflow_stream_provider.hooks.driver import StreamDriverHook
    from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
    from airflow_stream_provider.hooks.state import StreamStateHook
    from airflow_stream_provider.lifecycle.controller import StreamJobController
    from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec

    root = tmp_path / "checkpoints"
    spec = StreamJobSpec("orders", "1.0", KafkaSpec("127.0.0.1:9092", (topic,)), str(root), database_url)
    controller = StreamJobController(spec, state=StreamStateHook(), kafka=KafkaOffsetsHook(), driver=StreamDriverHook())

    def runs(generation: int) -> None:  # what a driver's start records for its generation
        path = root / "orders" / f"gen-{generation}"
        (path / "offsets").mkdir(parents=True)
        state_store.ensure_generation("orders", generation, str(path), f'{{"{topic}": {{"0": 0}}}}')

    runs(1)
    archived = controller.checkpoints.archive_generation("orders", 1)  # the reset's rename, and no more
    reset = controller.before_reset(spec, "checkpoint incompatible", allow_data_loss=False)
    assert (reset["generation"], reset["archived_generation"], reset["archive_path"]) == (2, 1, archived)
    assert state_store.get_generation("orders", 1)["archive_path"] == archived

    runs(2)
    again = controller.before_reset(spec, "checkpoint incompatible again", allow_data_loss=False)
    assert (again["generation"], again["archived_generation"]) == (3, 2), again
    assert not (root / "orders" / "gen-2").exists(), "generation 2 archived, not started again"


def test_a_run_judged_dead_by_its_silence_alone_is_not_recorded_dead(state_store, database_url, topic):
    """A driver on another host, silent past the heartbeat timeout (a long pause): the verdict is DEAD, but
    only the restart acting on it records that.  Recorded at once, the run stayed DEAD when it heartbeat and
    committed again, and a stop found "nothing to stop" while it ran."""
    from sqlalchemy import update

    from airflow_stream_provider.hooks.driver import StreamDriverHook
    from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
    from airflow_stream_provider.hooks.state import StreamStateHook
    from airflow_stream_provider.lifecycle.controller import StreamJobController
    from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec
    from airflow_stream_provider.state import schema

    spec = StreamJobSpec("orders", "1.0", KafkaSpec("127.0.0.1:9092", (topic,)), "/tmp/ckpt", database_url)
    controller = StreamJobController(spec, state=StreamStateHook(), kafka=KafkaOffsetsHook(), driver=StreamDriverHook())
    run_id = state_store.begin_run("orders", 1, "1.0", host="another-host", pid=4242).run_id
    state_store.mark_query_started(run_id)
    with state_store.engine.begin() as conn:  # silent for two minutes
        conn.execute(update(schema.runs).where(schema.runs.c.run_id == run_id)
                     .values(heartbeat_at=state_store.now() - 120))
    run, found = controller.probe.observe()
    assert found.health.value == "DEAD", found
    state_store.heartbeat(run_id)  # the pause is over
    assert state_store.get_run(run_id).status == "RUNNING"
    assert controller.probe.check().health.value == "HEALTHY"
    assert controller.live_run().run_id == run_id, "a stop finds the run to stop"


def test_a_start_after_a_reset_lost_before_its_launch_resumes_from_the_stored_offsets(
        state_store, database_url, broker, topic, tmp_path, monkeypatch):
    """An upgrade's reset archived generation 1, then its task was killed before the new version started:
    the recovery restarts the old code, on generation 2, which no driver registered.  That launch started
    generation 2 at the spec's ``latest`` (a gap the sink refuses as lost records, the job down as DATA_LOSS)
    or ``earliest`` (the whole topic again).  It now starts where the results end, as the reset would have."""
    import json
    import time

    from airflow_stream_provider.hooks.driver import StreamDriverHook
    from airflow_stream_provider.hooks.kafka import KafkaOffsetsHook
    from airflow_stream_provider.hooks.state import StreamStateHook
    from airflow_stream_provider.lifecycle.controller import StreamJobController
    from airflow_stream_provider.spec import KafkaSpec, StreamJobSpec
    from airflow_stream_provider.state import schema

    with broker.producer() as producer:
        for i in range(10):
            producer.send(topic, b'{"n": %d}' % i, partition=0)
    root = tmp_path / "checkpoints"
    spec = StreamJobSpec("orders", "1.0", KafkaSpec(broker.bootstrap, (topic,), starting_offsets="latest"),
                         str(root), database_url)
    controller = StreamJobController(spec, state=StreamStateHook(), kafka=KafkaOffsetsHook(), driver=StreamDriverHook())
    state_store.ensure_generation("orders", 1, str(root / "orders" / "gen-1"), f'{{"{topic}": {{"0": 0, "1": 0, "2": 0}}}}')
    with state_store.engine.begin() as conn:  # generation 1 applied the first 4 records of partition 0
        conn.execute(schema.offsets.insert().values(job_id="orders", topic=topic, partition=0, next_offset=4,
                                                    generation=1, batch_id=2, updated_at=time.time()))
    state_store.mark_archived("orders", 1, str(root / "orders" / "archive" / "gen-1-x"), "upgrade: incompatible")
    # Where the launch starts is the question; a driver is not needed to answer it.
    launched = []
    monkeypatch.setattr(controller, "_submitted", lambda application, spec, run_id: launched.append(spec) or {})

    controller.submit("job.py", spec)
    (started,) = launched
    assert started.generation == 2
    assert json.loads(started.kafka.starting_offsets) == {topic: {"0": 4, "1": 0, "2": 0}}
