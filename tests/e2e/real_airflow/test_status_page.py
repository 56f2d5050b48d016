"""The stream status page inside a real Airflow's UI, in a real headless Chromium: it shows what the
state database and Kafka hold, only to a signed-in user, and never a database URL.

The browser is Debian's ``chromium`` (``make test`` installs it), driven through Playwright's Python API
with ``executable_path``: Playwright's own browser download cannot work on these machines.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from stack.deployment import kill_driver
from stack.events import EventProducer
from stack.jobs import REPO, TEST_SPARK_CONF

#: Kept after the run, for a person to look at (CI keeps the workspace's artifacts).
ARTIFACTS = REPO / "test-artifacts"


@pytest.fixture
def lineage_file(tmp_path) -> Path:
    return tmp_path / "openlineage.jsonl"


@pytest.fixture
def deployment_options(lineage_file) -> dict:
    """The Spark UI on (the stack turns it off to save each driver a second): the links lead to it.
    OpenLineage's file transport: the events the operators emit, as any OpenLineage backend gets them."""
    transport = {"type": "file", "log_file_path": str(lineage_file), "append": True}
    return {"spark_conf": {**TEST_SPARK_CONF, "spark.ui.enabled": "true"},
            "airflow_env": {"AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(transport),
                            "AIRFLOW__OPENLINEAGE__NAMESPACE": "stream-tests"}}


@pytest.fixture
def chromium():
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    assert executable, "no chromium on PATH: `make test` installs Debian's chromium (apt-get install chromium)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def test_the_status_page_shows_the_job_to_a_signed_in_user_only(deployment, broker, topic, chromium,
                                                                lineage_file):
    producer = EventProducer(broker, topic, seed=11)
    producer.send(300)
    tasks = deployment.trigger("stream_deploy")
    assert tasks["_run"][0] == "success", deployment.explain("stream_deploy", tasks["_run"][1])
    deployment.wait_caught_up(producer.produced)
    _the_submit_task_links_to_its_run(deployment, tasks["_run"][1])
    # A death the health DAG repaired, then a few batches: the page has a story to tell.
    victim = deployment.processing()
    killed_at = time.time()
    kill_driver(victim["pid"])
    producer.send(150)  # the new run proves itself with a batch
    deployment.processing(240, other_than=victim["run_id"], after=killed_at)
    for _ in range(3):
        producer.send(150)
        deployment.wait_caught_up(producer.produced)
    run = deployment.latest_run()
    airflow = deployment.airflow
    _the_launches_emitted_lineage(deployment, lineage_file, f"kafka://127.0.0.1:{broker.port}", topic)

    # No anonymous access, to the page or its data.
    for path in ("/stream-status/", "/stream-status/api/jobs", f"/stream-status/api/jobs/{deployment.job_id}"):
        assert httpx.get(airflow.url + path, trust_env=False).status_code == 401, path

    context = chromium.new_context(viewport={"width": 1280, "height": 1400})
    context.add_cookies([{"name": "_token", "value": airflow.token(), "url": airflow.url}])
    page = context.new_page()
    # Through the UI's own menu entry: the page is an external view, in an iframe of Airflow's UI.
    page.goto(f"{airflow.url}/plugin/streams")
    frame = page.frame_locator("iframe").first
    job = frame.locator(f'section[data-job="{deployment.job_id}"]')
    job.wait_for(timeout=60_000)

    assert job.locator('[data-field="health"]').inner_text().startswith("HEALTHY")
    text = job.inner_text()
    assert run.run_id[:12] in text and f"pid {run.pid}" in text, text
    assert victim["run_id"][:12] in text and "DEAD" in text, "the killed run, with its diagnosis"
    assert job.locator("svg rect").count() >= 5, "a bar per recent batch"
    assert job.locator('svg polyline[data-series="latency"]').count() == 1, "the batches' latency"
    assert job.locator('[data-link="log"]').get_attribute("href") == f"api/runs/{run.run_id}/log"
    assert job.locator('[data-link="spark-ui"]').get_attribute("href") == run.ui_url
    dead = deployment.store.count(_dead_letters(), job_id=deployment.job_id)
    assert dead > 0 and f"DEAD LETTERS ({dead})" in text.upper(), text
    partitions = dict(producer.produced.end_offsets)
    for partition, end in partitions.items():
        assert f"{topic}\t{partition}\t{end}\t{end}\t0" in text, text  # stored = Kafka's end, lag 0
    assert "sqlite:" not in page.content() + text and "database_url" not in text

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "status-page.png"), full_page=True)
    context.close()


def _the_submit_task_links_to_its_run(deployment, dag_run_id: str) -> None:
    """The task's extra links, as the UI gets them: the driver log through the status page (signed-in
    users only) and the live driver's own Spark UI."""
    airflow, run = deployment.airflow, deployment.latest_run()
    links = airflow.links("stream_deploy", dag_run_id, "submit")
    assert links["Driver log"] == f"{airflow.url}/stream-status/api/runs/{run.run_id}/log", links
    assert run.ui_url and links["Spark UI"] == run.ui_url, links
    assert "Spark" in httpx.get(run.ui_url, trust_env=False, follow_redirects=True, timeout=30).text
    assert httpx.get(links["Driver log"], trust_env=False).status_code == 401
    log = httpx.get(links["Driver log"], headers={"Authorization": f"Bearer {airflow.token()}"},
                    trust_env=False, timeout=30)
    assert log.status_code == 200 and f"run {run.run_id} holds epoch {run.epoch}" in log.text, log.text[-2000:]


def _the_launches_emitted_lineage(deployment, lineage_file: Path, kafka: str, topic: str) -> None:
    """OpenLineage events of the submit (stream_deploy) and the recovery (stream_health): the topic in;
    the result tables the job's sink wrote and the dead-letter table out, in the state database's
    namespace.  The job's very first launch may end before its first batch named them: its event
    names no other table."""
    database = f"sqlite://{deployment.workdir / 'stream.db'}"
    wanted = {(database, table) for table in ("events", "kpi_minute", "dead_letters")}
    deadline = time.monotonic() + 60  # the recovery's COMPLETE may still be on its way
    while True:
        events = [json.loads(line) for line in lineage_file.read_text().splitlines()] if lineage_file.exists() else []
        done = {e["job"]["name"]: e for e in events if e["eventType"] == "COMPLETE"}
        if {"stream_deploy.submit", "stream_health.recover"} <= set(done) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {"stream_deploy.submit", "stream_health.recover"} <= set(done), sorted(done)
    for name in ("stream_deploy.submit", "stream_health.recover"):
        event = done[name]
        assert event["job"]["namespace"] == "stream-tests"
        assert [(d["namespace"], d["name"]) for d in event["inputs"]] == [(kafka, topic)], event["inputs"]
        outputs = {(d["namespace"], d["name"]) for d in event["outputs"]}
        assert outputs == wanted or (name == "stream_deploy.submit" and outputs <= wanted), event["outputs"]
    assert "database_url" not in lineage_file.read_text()


def _dead_letters():
    from airflow_stream_provider.state import schema

    return schema.dead_letters
