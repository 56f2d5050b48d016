"""The Spark driver of a stream job: submit it detached, tell whether it lives, stop it, kill it.

Built on the Spark provider's SparkSubmitHook, so the ``spark`` connection (master, deploy mode,
queue, spark-binary, Kerberos) means what it means everywhere else in Airflow.  The difference is
that a stream driver must outlive the Airflow task that started it:

* local and client deploy mode: spark-submit runs in a new session (its own process group) with its
  output in a log file; the run row records host and pid, so the driver can be checked and killed;
* cluster deploy mode (YARN, Kubernetes): spark-submit returns once the application is accepted
  (``waitAppCompletion=false``) and the submission handle is recorded for status and kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_stream_provider import jvm_archive, jvm_heap, jvm_jit, local_driver
from airflow_stream_provider.spec import DATABASE_PASSWORD_ENV, KAFKA_SECRETS_ENV, StreamJobSpec
from airflow_stream_provider.state.records import RunRecord

if TYPE_CHECKING:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

#: spark-submit ends its JVM once the Python driver exits.  Without it, a driver that exits 0 leaves the JVM
#: running for as long as one non-daemon thread lives (a library's timer, a stop that hangs on a batch):
#: seen with a ``java.util.Timer`` left behind, spark-submit still running 40 s after its driver exited 0.
#: A non-zero exit ends it either way.
EXIT_ON_MAIN_EXIT = "spark.submit.callSystemExitOnMainExit"


@dataclass(frozen=True)
class Kill:
    """What a kill did.  ``done`` only where the driver is known ended (killed here, or by a cluster manager
    that said so): a refused or unreachable kill leaves a driver that may live on, and must not be recorded
    DEAD, or a recovery would start a second driver beside it."""

    done: bool
    message: str

    def __str__(self) -> str:
        return self.message


_NO_WAIT = {
    "spark.yarn.submit.waitAppCompletion": "false",
    "spark.kubernetes.submission.waitAppCompletion": "false",
    "spark.standalone.submit.waitAppCompletion": "false",
}


@dataclass(frozen=True)
class SubmittedDriver:
    run_id: str
    deploy_mode: str
    master: str
    pid: int | None = None
    log_path: str | None = None
    submission_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_conf(conf: Any) -> dict[str, str]:
    """``conf`` as spark-submit takes it: Spark properties named by text, each with a text, number or bool
    value.  Anything else would reach spark-submit as its Python repr (a nested mapping as ``{'a': 1}``), or
    fail inside it after the lease is taken."""
    if conf is None:
        return {}
    if not isinstance(conf, Mapping):
        raise ValueError(f"conf is a {type(conf).__name__}, not a mapping of Spark properties to values (a "
                         "templated conf renders to text unless its DAG sets render_template_as_native_obj=True)")
    wrong = [f"{key!r}: {value!r}" for key, value in conf.items()
             if not isinstance(key, str) or not key.strip() or not isinstance(value, str | int | float | bool)]
    if wrong:
        raise ValueError(f"conf holds {', '.join(wrong)}: give each Spark property's name as text and its value "
                         "as text or a number, e.g. {'spark.driver.memory': '1g'}")
    return dict(conf)


class StreamDriverHook(BaseHook):
    conn_name_attr = "spark_conn_id"
    default_conn_name = "spark_default"
    conn_type = "spark"
    hook_name = "Stream driver (Spark)"

    def __init__(self, spark_conn_id: str = default_conn_name, *, conf: dict[str, str] | None = None,
                 py_files: str | None = None, env_vars: dict[str, str] | None = None,
                 log_dir: str | None = None, archive_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.spark_conn_id = spark_conn_id
        self.conf = check_conf(conf)
        self.py_files = py_files
        self.env_vars = dict(env_vars or {})
        self.log_dir = log_dir or os.path.join(os.environ.get("AIRFLOW_HOME", os.path.expanduser("~/airflow")),
                                               "logs", "stream_drivers")
        #: where the drivers' class-data-sharing archives live (``jvm_archive``; its default when None)
        self.archive_dir = archive_dir

    def _spark_submit(self, application_args: list[str], conf: dict[str, str], name: str) -> SparkSubmitHook:
        # Imported here, not with the module: it brings requests and urllib3, about 50 ms that every parse of
        # a DAG file using these operators would pay, where only a submit needs them.
        from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

        return SparkSubmitHook(conn_id=self.spark_conn_id, conf=conf, py_files=self.py_files, name=name,
                               application_args=application_args, env_vars=self.env_vars or None)

    def log_path(self, job_id: str, run_id: str) -> str:
        return str(Path(self.log_dir) / job_id / f"{run_id}.log")

    @staticmethod
    def driver_arguments(spec: StreamJobSpec, run_id: str, log_path: str, *, standby: bool = False,
                         successor: bool = False) -> list[str]:
        """What the harness reads from its command line.  A serialized spec holds no secret."""
        return ["--spec", spec.to_json(), "--run-id", run_id, "--log-path", log_path, *(["--standby"] * standby),
                *(["--successor"] * successor)]

    def submit_command(self, application: str, spec: StreamJobSpec, run_id: str, log_path: str, *,
                       standby: bool = False, successor: bool = False,
                       env: Mapping[str, str] | None = None) -> list[str]:
        """The spark-submit command of a local or client-mode driver, as ``submit`` builds it: the test
        stack starts its drivers with it, so tests run the command production runs.  ``env`` is the
        driver's environment (where spark-submit and java are found)."""
        args = self.driver_arguments(spec, run_id, log_path, standby=standby, successor=successor)
        hook = self._spark_submit(args, self.conf, f"stream-{spec.job_id}")
        return self._local_command(hook, application, spec, os.environ if env is None else env)

    def _local_command(self, hook: SparkSubmitHook, application: str, spec: StreamJobSpec,
                       env: Mapping[str, str]) -> list[str]:
        """``hook``'s spark-submit command, its conf given the installation's class archive; the hook's
        resolved connection serves both (each resolution is a lookup of the Spark connection)."""
        hook._conf = self._driver_jvm(application, spec, env, hook._connection)
        return hook._build_spark_submit_command(application)

    def _driver_jvm(self, application: str, spec: StreamJobSpec, env: Mapping[str, str],
                    connection: Mapping[str, Any]) -> dict[str, str]:
        """The driver's Spark conf with what shortens its JVM's start and bounds its memory: C2 kept to
        really hot code (``jvm_jit``), the serial collector on a heap that grows as needed (``jvm_heap``),
        and the installation's class-data-sharing archive (``jvm_archive``), mapped in when it exists,
        started in the background when it does not.  The JVM ends when the Python driver does
        (``EXIT_ON_MAIN_EXIT``) unless the deployment's conf says otherwise."""
        conf = {EXIT_ON_MAIN_EXIT: "true", **self.conf}
        options = conf[jvm_archive.JAVA_OPTIONS] = jvm_heap.startup_options(
            jvm_jit.startup_options(conf.get(jvm_archive.JAVA_OPTIONS, "")), conf.get("spark.driver.memory"))
        if jvm_archive.chosen_by_user(options):
            return conf
        if (connection["deploy_mode"] or "client") == "cluster":  # the driver's host is the cluster's choice
            return conf
        binary = connection["spark_binary"] or "spark-submit"
        archive = jvm_archive.ClassArchive.of(env, binary, conf, self.archive_dir)
        if archive is None:
            return conf
        try:
            if archive.ready():
                conf[jvm_archive.JAVA_OPTIONS] = archive.java_options(options)
            elif (written := archive.claim()) is not None:
                self._start_archive_run(archive, written, application, spec, conf, env)
        except OSError as err:  # e.g. a read-only home: the driver starts as it would without the archive
            self.log.warning("No JVM class archive in %s (%s): drivers start without one", archive.path.parent, err)
        return conf

    def _start_archive_run(self, archive: jvm_archive.ClassArchive, written: Path, application: str,
                           spec: StreamJobSpec, conf: dict[str, str], env: Mapping[str, str]) -> None:
        """Start the warm-up-only run of the job's code whose JVM writes ``archive`` as it exits."""
        run_id = f"warm-up-{uuid.uuid4().hex[:12]}"
        log_path = self.log_path(spec.job_id, run_id)
        args = [*self.driver_arguments(spec, run_id, log_path), "--warm-up-only"]
        options = f"{conf.get(jvm_archive.JAVA_OPTIONS, '')} -XX:ArchiveClassesAtExit={written}".strip()
        command = self._spark_submit(args, {**conf, jvm_archive.JAVA_OPTIONS: options, "spark.ui.enabled": "false"},
                                     f"stream-{spec.job_id}-warm-up")
        pid = archive.start_run(command._build_spark_submit_command(application), written, env, log_path)
        self.log.info("No JVM class archive for this Spark installation yet: a warm-up-only run of job %s (pid %s, "
                      "log %s) writes %s for the drivers started after it", spec.job_id, pid, log_path, archive.path)

    def check_standby(self) -> None:
        """A standby must watch the active driver's process and start as fast as a local process does:
        cluster deploy mode gives neither (the cluster manager places and restarts drivers).  Raises a
        ValueError that says so, before anything is started."""
        connection = self._spark_submit([], self.conf, "stream-standby-check")._connection
        if (connection["deploy_mode"] or "client") == "cluster":
            raise ValueError(
                f"job spec field 'standby': a warm standby needs local or client deploy mode, and Spark "
                f"connection {self.spark_conn_id!r} uses cluster deploy mode on {connection['master']}: there "
                "the driver's process cannot be watched and the standby could not start beside it. Use client "
                "deploy mode for this job, or set standby to false (the cluster manager's own restart applies)")

    def submit(self, application: str, spec: StreamJobSpec, run_id: str, password: str | None, *,
               standby: bool = False, successor: bool = False,
               kafka_secrets: Mapping[str, object] | None = None) -> SubmittedDriver:
        """Start a driver for ``spec`` and return at once; the run row appears when the driver is up (a
        standby's or successor's standby row)."""
        log_path = self.log_path(spec.job_id, run_id)
        args = self.driver_arguments(spec, run_id, log_path, standby=standby, successor=successor)
        name = f"stream-{spec.job_id}"
        hook = self._spark_submit(args, self.conf, name)
        master, deploy_mode = hook._connection["master"], hook._connection["deploy_mode"] or "client"
        if standby or successor:
            self.check_standby()
        if deploy_mode == "cluster":
            return self._submit_cluster(application, args, name, run_id, master, password, kafka_secrets)
        env = {**os.environ, **self.env_vars}
        if kafka_secrets:  # the spec on the command line leaves them out
            env[KAFKA_SECRETS_ENV] = json.dumps(kafka_secrets)
        cmd = self._local_command(hook, application, spec, env)
        popen = local_driver.start_detached(cmd, log_path, env=env, password=password)
        self.log.info("Started %s for job %s run %s: pid %s, master %s, log %s",
                      "a successor driver" if successor else "a standby driver" if standby else "driver", spec.job_id,
                      run_id, popen.pid, master, log_path)
        return SubmittedDriver(run_id, deploy_mode, master, pid=popen.pid, log_path=log_path)

    def _submit_cluster(self, application: str, args: list[str], name: str, run_id: str, master: str,
                        password: str | None, kafka_secrets: Mapping[str, object] | None) -> SubmittedDriver:
        for secret, env_name, what in ((password, DATABASE_PASSWORD_ENV, "database password"),
                                       (kafka_secrets, KAFKA_SECRETS_ENV, "Kafka client secrets, as JSON,")):
            if secret and not any(k.endswith(env_name) for k in self.conf):
                raise ValueError(
                    f"cluster deploy mode: the driver's {what} must come from the cluster manager "
                    f"(e.g. spark.kubernetes.driver.secretKeyRef.{env_name}=secret:key); they are never put on "
                    "a spark-submit command line")
        hook = self._spark_submit(args, {**self.conf, **_NO_WAIT}, name)
        hook.submit(application)
        handle = hook._driver_id or hook._yarn_application_id or hook._kubernetes_driver_pod
        self.log.info("Submitted driver for run %s to %s in cluster mode: %s", run_id, master, handle)
        return SubmittedDriver(run_id, "cluster", master, submission_id=handle)

    # -- the life of a recorded run --------------------------------------------------------------------
    @staticmethod
    def is_local(run: RunRecord) -> bool:
        return local_driver.on_this_host(run.pid, run.host, run.submission_id)

    @staticmethod
    def is_alive(run: RunRecord) -> bool | None:
        """True/False where the process can be checked from here, None where only heartbeats can tell."""
        return local_driver.run_alive(run)

    def terminate(self, run: RunRecord) -> bool:
        """SIGTERM to the Python driver only: its harness stops the query between batches.  Sent to the
        whole group it would also reach the JVM, whose shutdown hooks stop Spark under the query."""
        if not self._still_its_process(run):
            return False
        try:
            os.kill(run.pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        return True

    def kill(self, run: RunRecord) -> Kill:
        """Kill the driver outright: its process group locally, the application on a cluster."""
        if self.is_local(run):
            if not self._signal(run, signal.SIGKILL):
                return Kill(True, f"pid {run.pid} on {run.host} is gone, or is another process's now: nothing "
                            "to kill")
            return Kill(True, f"killed process group of pid {run.pid} on {run.host}")
        if run.submission_id:
            return self.kill_submission(run.job_id, run.submission_id)
        return Kill(False, f"cannot kill run {run.run_id} from {local_driver.this_host()}: it runs on {run.host}")

    def kill_submission(self, job_id: str, submission_id: str) -> Kill:
        """Kill a cluster-mode driver by the handle its submission returned, through its cluster manager.
        ``SparkSubmitHook.on_kill`` cannot: it kills a YARN application or a driver pod only while its own
        spark-submit process runs (or with tracking options this provider's submissions do not set), and a
        kill comes from another task, long after the submission."""
        hook = self._spark_submit([], self.conf, f"stream-{job_id}")
        if submission_id.startswith("application_"):  # YARN
            command = ["yarn", "application", "-kill", submission_id]
        elif hook._is_kubernetes:
            return _delete_driver_pod(hook, submission_id)
        else:  # a standalone master's driver id
            hook._driver_id = submission_id
            command = hook._build_spark_driver_kill_command()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                  env={**os.environ, **(self.env_vars or {})})
        except (OSError, subprocess.TimeoutExpired) as err:
            return Kill(False, f"could not kill {submission_id}: {' '.join(command[:3])} failed: {err}; "
                        "kill it with its cluster manager")
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip().splitlines()
            return Kill(False, f"could not kill {submission_id}: {' '.join(command[:3])} exited {done.returncode}"
                        f"{': ' + output[-1] if output else ''}; kill it with its cluster manager")
        return Kill(True, f"killed {submission_id} through its cluster manager")

    @staticmethod
    def _still_its_process(run: RunRecord) -> bool:
        """The run's pid on this host still belongs to its driver: a driver gone long ago (its row left
        active by a lost task, a host restarted) may have left its pid to an unrelated process, which a
        signal to the pid, or to its group, would reach."""
        return StreamDriverHook.is_local(run) and local_driver.process_alive(run.pid, run.started_at)

    @staticmethod
    def _signal(run: RunRecord, sig: int) -> bool:
        """Signal the driver's process group; False when it is not this host's, or is gone."""
        if not StreamDriverHook._still_its_process(run):
            return False
        try:
            local_driver.signal_group(os.getpgid(run.pid), sig)
        except ProcessLookupError:
            return False
        return True


def _delete_driver_pod(hook: SparkSubmitHook, pod: str) -> Kill:
    """``SparkSubmitHook._delete_driver_pod``, with its outcome: the hook logs the API's refusal only.  A pod
    already gone (404) counts as killed."""
    import kubernetes
    from airflow.providers.cncf.kubernetes import kube_client  # as the hook itself: present for k8s masters

    try:
        kube_client.get_kube_client().delete_namespaced_pod(pod, hook._connection["namespace"],
                                                            body=kubernetes.client.V1DeleteOptions())
    except kube_client.ApiException as err:
        if err.status == 404:
            return Kill(True, f"driver pod {pod} is gone already")
        return Kill(False, f"could not delete driver pod {pod}: Kubernetes answered {err.status} {err.reason}; "
                    "kill it with kubectl")
    except Exception as err:  # no kube config, the API server unreachable: the pod may well live on
        return Kill(False, f"could not reach Kubernetes to delete driver pod {pod}: {err!r}; kill it with kubectl")
    return Kill(True, f"deleted driver pod {pod} through Kubernetes")
