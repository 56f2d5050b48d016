"""The drivers' class-data-sharing archive with real drivers: the first driver without an archive gets a
warm-up-only run beside it that writes one, records nothing and fences nothing; the next driver's JVM maps
it, and the job's results stay exact.  On SQLite only: the archive is the JVM's business, and the state
database's part (no epoch, no run) reads the same on both."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_stream_provider import failures
from stack.events import EventProducer
from stack.jobs import check_exactly_once, wait_until


def _end(producer) -> dict[int, int]:
    return dict(producer.produced.end_offsets)


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_first_driver_gets_an_archive_written_and_the_next_one_maps_it(broker, topic, runner, tmp_path):
    runner.driver_hook.archive_dir = str(tmp_path / "archives")
    producer = EventProducer(broker, topic)
    producer.send(1500)
    first = runner.start()
    archives = tmp_path / "archives"
    assert list(archives.glob("*.lock")), "a driver without an archive starts the run that writes one"
    assert "SharedArchiveFile" not in Path(first.log_path).read_text().splitlines()[0]
    runner.wait_caught_up(_end(producer), first)
    epoch = runner.run_row(first).epoch
    # the run's wrapper moves the written archive into place, then removes its lock: wait for both
    archive = wait_until(lambda: not list(archives.glob("*.lock"))
                         and [p for p in archives.glob("driver-*.jsa") if ".tmp." not in p.name], 300,
                         "the warm-up-only run to write the archive and let go of its lock",
                         on_timeout=lambda: "\n".join(p.read_text()[-3000:] for p in tmp_path.rglob("warm-up-*.log")))[0]
    assert not list(archives.glob("*.tmp.jsa"))
    # the warm-up-only run took no epoch, registered no run, committed nothing
    assert runner.store.current_epoch(runner.spec.job_id) == epoch
    assert {r.run_id for r in runner.store.runs(runner.spec.job_id)} == {first.run_id}
    assert runner.stop(first) == failures.EXIT_STOPPED

    producer.send(700)
    second = runner.start()
    assert f"-XX:SharedArchiveFile={archive}" in Path(second.log_path).read_text().splitlines()[0]
    mapped = wait_until(lambda: str(archive) in _maps(second.pid), 60, "the driver JVM to map the archive",
                        on_timeout=lambda: runner.log_tail(second))
    assert mapped
    runner.wait_caught_up(_end(producer), second)
    # the line comes just after the first commit that made the run caught up: wait for it, not race it
    logged = wait_until(lambda: "startup {" in Path(second.log_path).read_text(), 30,
                        "the driver to log where its start went", on_timeout=lambda: runner.log_tail(second))
    assert logged
    assert runner.stop(second) == failures.EXIT_STOPPED
    check_exactly_once(runner.store, runner.spec.job_id, producer.produced)
