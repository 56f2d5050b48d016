"""Manual: upgrade the stream job to a new version of its code.

Params: ``application`` (the new job file), ``version`` (its label), ``reset_policy`` (empty: the
Variable ``stream_reset_policy``), ``prewarm`` (warm the new version up while the old one runs, so it
starts within seconds of the stop). Preflight on a copy of the checkpoint, graceful stop, start on the
checkpoint or reset to a new generation from the stored offsets, verify, roll back on failure. On
success the Variables point at the new version, so ``stream_deploy`` and ``stream_health`` use it.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param, Variable, task
from stream_job import DAG_ARGS, JOB, RESET_POLICY

from airflow_stream_provider.operators.upgrade import UpgradeStreamingJobOperator

with DAG("stream_upgrade", schedule=None, doc_md=__doc__, **DAG_ARGS,
         params={"application": Param(type="string", minLength=1, description="the new job file"),
                 "version": Param(type="string", minLength=1, description="the new version label"),
                 "reset_policy": Param("", enum=["", "auto", "after_preflight", "never"]),
                 "prewarm": Param(False, type="boolean",
                                  description="warm the new version up beside the old one (a third driver "
                                              "during the preflight): seconds of downtime instead of a cold "
                                              "start")}):
    upgrade = UpgradeStreamingJobOperator(
        # tojson: rendered as native objects, a bare "1.10" would become the float 1.1
        task_id="upgrade", **{**JOB, "application": "{{ params.application }}"}, version="{{ params.version | tojson }}",
        reset_policy=f"{{{{ params.reset_policy or {RESET_POLICY} }}}}", prewarm="{{ params.prewarm }}")

    @task
    def remember_version(upgraded: dict, params: dict | None = None) -> None:
        """Point the shared Variables at the version that now runs."""
        spec = Variable.get("stream_job_spec", deserialize_json=True)
        Variable.set("stream_job_spec", {**spec, "version": upgraded["to_version"]}, serialize_json=True)
        Variable.set("stream_job_application", params["application"])

    remember_version(upgrade.output)
