"""The example DAGs in ``dags/``: they load, they are configured only through Airflow, and the demo runs
all four of them with ``dag.test()`` against the real local stack (``make demo``, in a subprocess)."""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys

import psutil
import pytest

from stack.jobs import REPO

DAGS = REPO / "dags"


def test_every_example_dag_loads_without_import_errors(monkeypatch):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    monkeypatch.syspath_prepend(str(DAGS))  # as Airflow's BundleDagBag does
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_JOB_SPEC", '{"job_id": "events", "kafka": {"topics": ["events"]}}')
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_WATCH", '{"heartbeat_timeout": 20, "stuck_after": 120}')

    bag = DagBag(str(DAGS))
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == {"stream_deploy", "stream_health", "stream_stop", "stream_upgrade"}
    health = bag.dags["stream_health"]
    assert health.max_active_runs == 1 and health.catchup is False
    # A lost or failed task is retried: the watcher reports a condition once, and nothing else would act
    assert {(t.retries, t.retry_delay.total_seconds()) for t in health.tasks} == {(2, 10.0)}
    # Event-driven on the job's asset, with an hourly sweep as the safety net.
    assert isinstance(health.schedule, AssetOrTimeSchedule)
    assert health.schedule.timetable == CronTriggerTimetable("17 * * * *", timezone="UTC")
    asset = health.schedule.asset_condition
    assert asset.uri == "stream://events"
    (watcher,) = asset.watchers
    classpath, kwargs = watcher.trigger.serialize()
    assert classpath == "airflow_stream_provider.triggers.watch.StreamJobWatchTrigger"
    assert (kwargs["job_id"], kwargs["heartbeat_timeout"], kwargs["stuck_after"]) == ("events", 20, 120)
    assert kwargs["poll_interval"] == 1.0  # the default: a kill waits half a second on average for a poll
    # One task diagnoses and branches; the diagnosis goes to needs_a_decision as the XCom "diagnosis".
    diagnose = health.get_task("diagnose")
    assert diagnose.inherits_from_skipmixin and diagnose.downstream_task_ids == {
        "healthy", "recover", "reset", "needs_a_decision"}
    assert set(health.task_ids) == {"diagnose"} | diagnose.downstream_task_ids
    (evidence,) = health.get_task("needs_a_decision").op_args
    assert (evidence.operator.task_id, evidence.key) == ("diagnose", "diagnosis")
    for dag_id in ("stream_deploy", "stream_stop", "stream_upgrade"):
        assert bag.dags[dag_id].schedule is None, f"{dag_id} is triggered by hand"
    upgrade = bag.dags["stream_upgrade"]
    assert {"application", "version", "reset_policy"} <= set(upgrade.params)


@pytest.mark.parametrize(("health", "kind", "standby", "policy", "step"), [
    ("HEALTHY", None, None, None, "healthy"),
    ("STARTING", None, None, None, "healthy"),
    ("STOPPED", None, None, None, "healthy"),
    ("HEALTHY", None, "missing", None, "recover"),  # a standby took over or died: recover starts one
    ("DEAD", None, None, None, "recover"),
    ("STUCK", None, None, None, "recover"),
    ("FAILED", "TRANSIENT", None, None, "recover"),
    ("FAILED", "USER_CODE", None, None, "recover"),
    ("FAILED", "DATA_LOSS", None, "auto", "needs_a_decision"),
    ("FAILED", "POISON", None, "auto", "needs_a_decision"),
    ("FAILED", "CHECKPOINT_INCOMPATIBLE", None, "auto", "reset"),
    ("FAILED", "CHECKPOINT_INCOMPATIBLE", None, "after_preflight", "needs_a_decision"),
    ("FAILED", "CHECKPOINT_INCOMPATIBLE", None, None, "needs_a_decision"),  # the default: after_preflight
])
def test_each_diagnosis_leads_to_one_step(monkeypatch, health, kind, standby, policy, step):
    """``stream_job.next_step``: the branch both health DAGs take on a diagnosis."""
    from airflow_stream_provider.diagnosis import MISSING_STANDBY

    monkeypatch.syspath_prepend(str(DAGS))
    if policy is None:
        monkeypatch.delenv("AIRFLOW_VAR_STREAM_RESET_POLICY", raising=False)
    else:
        monkeypatch.setenv("AIRFLOW_VAR_STREAM_RESET_POLICY", policy)
    from stream_job import next_step

    diagnosis = {"health": health, "failure_kind": kind, "standby": MISSING_STANDBY if standby else None}
    assert next_step(diagnosis) == step


@pytest.mark.parametrize("health", ["STOPPED", "DEAD"])
def test_a_run_a_restart_stopped_and_left_down_leads_to_recover(monkeypatch, health):
    """A restart that stopped the run and launched nothing (its launch failed, its task was lost) is owed:
    a STOPPED run is otherwise ``healthy``, and nothing would ever start the job again."""
    monkeypatch.syspath_prepend(str(DAGS))
    from stream_job import next_step

    owed = {"at": 1_800_000_000.0, "reason": "STUCK: no batch for 600s"}
    assert next_step({"health": health, "failure_kind": None, "interrupted_restart": owed}) == "recover"
    if health == "STOPPED":
        assert next_step({"health": health, "failure_kind": None, "interrupted_restart": None}) == "healthy"


@pytest.mark.parametrize("kind", ["TRANSIENT", "POISON", "CHECKPOINT_INCOMPATIBLE"])
def test_a_run_that_failed_while_being_stopped_leads_to_recover_which_leaves_it(monkeypatch, kind):
    """Not a reset (with ``stream_reset_policy`` ``auto``), which would start the job someone stopped."""
    monkeypatch.syspath_prepend(str(DAGS))
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_RESET_POLICY", "auto")
    from stream_job import next_step

    assert next_step({"health": "FAILED", "failure_kind": kind, "stop_requested_at": 1_800_000_000.0}) == "recover"


def test_a_live_driver_gone_silent_leads_to_recover(monkeypatch):
    """Hung or frozen, its process alive: a watcher on another host reported it DEAD once; here it is
    HEALTHY until its silence passes ``stuck_after``, and ``recover`` looks again then."""
    monkeypatch.syspath_prepend(str(DAGS))
    from stream_job import next_step

    assert next_step({"health": "HEALTHY", "failure_kind": None, "stuck_at": 1_800_000_000.0}) == "recover"
    assert next_step({"health": "HEALTHY", "failure_kind": None, "stuck_at": None}) == "healthy"


def test_parsing_the_dags_leaves_the_submit_machinery_unimported():
    """The dag-processor parses each file every 30 s by default and each task parses its DAG again, so the
    imports are paid often: the Spark provider's submit hook (with requests and urllib3, about 55 ms) is
    imported when a driver is submitted, not when a DAG file is parsed.  A fresh interpreter: this
    process may have imported it already."""
    code = ("import sys\n"
            "from airflow.dag_processing.dagbag import DagBag\n"
            "bag = DagBag(sys.argv[1])\n"
            "assert not bag.import_errors and len(bag.dag_ids) == 4, (bag.import_errors, bag.dag_ids)\n"
            "print(sorted(m for m in sys.modules if m.startswith('airflow.providers.apache.spark.hooks')))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DAGS), os.environ.get("PYTHONPATH", "")]),
           "AIRFLOW_VAR_STREAM_JOB_SPEC": '{"job_id": "events", "kafka": {"topics": ["events"]}}'}
    result = subprocess.run([sys.executable, "-c", code, str(DAGS)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_without_a_job_spec_the_health_dag_runs_only_the_hourly_sweep(monkeypatch):
    """The watcher needs the job id at parse time; until the Variable is set, the DAG still loads."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import CronTriggerTimetable

    monkeypatch.syspath_prepend(str(DAGS))
    monkeypatch.delenv("AIRFLOW_VAR_STREAM_JOB_SPEC", raising=False)
    bag = DagBag(str(DAGS / "stream_health.py"))
    assert bag.import_errors == {}
    assert bag.dags["stream_health"].schedule == CronTriggerTimetable("17 * * * *", timezone="UTC")


def test_the_sweep_takes_another_cron_or_is_turned_off(monkeypatch):
    """``stream_health_sweep``: another cron keeps the watcher beside it; ``off`` leaves the watcher alone,
    and without a job spec then nothing schedules the DAG (it runs when triggered)."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable

    monkeypatch.syspath_prepend(str(DAGS))
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_JOB_SPEC", '{"job_id": "events", "kafka": {"topics": ["events"]}}')
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_HEALTH_SWEEP", "*/15 * * * *")
    schedule = DagBag(str(DAGS / "stream_health.py")).dags["stream_health"].schedule
    assert isinstance(schedule, AssetOrTimeSchedule)
    assert schedule.timetable == CronTriggerTimetable("*/15 * * * *", timezone="UTC")

    monkeypatch.setenv("AIRFLOW_VAR_STREAM_HEALTH_SWEEP", "off")
    health = DagBag(str(DAGS / "stream_health.py")).dags["stream_health"]
    assert isinstance(health.schedule, Asset) and health.schedule.uri == "stream://events"
    assert health.schedule.watchers  # the watcher still wakes it

    monkeypatch.delenv("AIRFLOW_VAR_STREAM_JOB_SPEC")
    assert DagBag(str(DAGS / "stream_health.py")).dags["stream_health"].schedule is None


def test_the_health_dags_retries_are_a_variable(monkeypatch):
    """``stream_health_retries``: how often a lost or failed ``recover``, ``reset`` or ``diagnose`` is tried
    again; 0 leaves a lost task's restart to the watcher's INTERRUPTED_RESTART or the sweep."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.syspath_prepend(str(DAGS))
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_HEALTH_RETRIES", "0")
    health = DagBag(str(DAGS / "stream_health.py")).dags["stream_health"]
    assert {t.retries for t in health.tasks} == {0}


@pytest.mark.parametrize("path", sorted(DAGS.glob("*.py")), ids=lambda p: p.name)
def test_no_path_or_host_is_hard_coded_in_a_dag_file(path):
    """Everything about the job comes from connections, Variables and params."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.FunctionDef) and ast.get_docstring(node)}
    pieces = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
               and isinstance(node.value, str) and id(node) not in docstrings | pieces]
    for value in strings:
        assert not re.match(r"(/|[a-z]+://|localhost|127\.0\.0\.1)", value), f"hard-coded path or host {value!r}"
        assert not re.search(r":\d{4,5}\b", value), f"hard-coded port in {value!r}"


# In ``make soak`` (and ``make demo`` is the same run): every step of the demo is proven on a real Airflow
# by ``real_airflow/``, whose deployments are the demo's own ``stack/`` code.
@pytest.mark.soak
def test_demo_tells_the_whole_story_exactly_once(tmp_path):
    """``make demo``'s scenario on a real Airflow: deploy through the REST API, two SIGKILLs that Airflow
    notices and repairs by itself, an incompatible upgrade, a graceful stop; nothing left running."""
    workdir = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    done = subprocess.run([sys.executable, "-m", "demo", "--events", "4000", "--workdir", str(workdir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    output = done.stdout + done.stderr[-5000:]
    assert done.returncode == 0, output[-8000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    result = dict(pair.split("=") for pair in line.removeprefix("RESULT ").split())
    malformed = int(re.search(r"malformed records produced\s+(\d+)", done.stdout).group(1))
    assert result["duplicates"] == "0" and result["lost"] == "0", done.stdout[-3000:]
    assert int(result["produced"]) >= 4000 and int(result["dead_letters"]) == malformed > 0, result
    assert int(result["applied"]) + malformed == int(result["produced"]), result
    assert int(result["recoveries"]) >= 3, result  # two restarts after SIGKILL and the upgrade's reset
    assert done.stdout.count("stream_health ran on the watcher's event and saw DEAD; recover: restart") == 2
    assert len(re.findall(r"processing again [\d.]+s after the kill", done.stdout)) == 2
    assert "preflight: incompatible (STREAMING_STATEFUL_OPERATOR_MISSING_STATE_DIRECTORY)" in done.stdout

    # Nothing left: no process names the work directory or runs with an AIRFLOW_HOME in it, and neither
    # Airflow's API port nor the broker's port answers (the api-server's title hides its environment).
    leftovers = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            home = process.environ().get("AIRFLOW_HOME", "")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            home = ""
        if home.startswith(str(workdir)) or any(str(workdir) in part for part in process.info["cmdline"] or []):
            leftovers.append(process.info)
    assert leftovers == [], f"the demo left processes behind: {leftovers}"
    for port in (re.search(r"Airflow is up at http://127.0.0.1:(\d+)", done.stdout).group(1),
                 re.search(r"broker at 127.0.0.1:(\d+)", done.stdout).group(1)):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0, f"port {port} still answers"


def test_the_upgrades_version_label_renders_as_typed(monkeypatch):
    """The DAGs render templates as native objects: ``{{ params.version }}`` turned "1.10" into the float 1.1,
    recorded on the runs and the Variables as "1.1", and "2" into the int 2."""
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.syspath_prepend(str(DAGS))
    monkeypatch.setenv("AIRFLOW_VAR_STREAM_JOB_SPEC", '{"job_id": "events", "kafka": {"topics": ["events"]}}')
    dag = DagBag(str(DAGS)).dags["stream_upgrade"]
    upgrade = dag.get_task("upgrade")
    for label in ("1.10", "2", "1e3", "2.0-rc1"):
        context = {"params": {"version": label, "application": "/jobs/v2.py"}}
        assert upgrade.render_template(upgrade.version, context, dag.get_template_env()) == label
    import stream_job  # the DAGs' shared settings: the watch's job id renders as typed too

    for job_id in ("2024", "orders"):
        context = {"var": {"json": {"stream_job_spec": {"job_id": job_id}}}}
        assert upgrade.render_template(stream_job.WATCH["job_id"], context, dag.get_template_env()) == job_id
