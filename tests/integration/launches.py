"""A submit task and the launch of its driver on another host, as the operators keep a launch: the flows
under test read the run's row only, never the process."""

from __future__ import annotations

import time

from airflow_stream_provider.operators.submit import SubmitStreamingJobOperator


def submit_operator(tmp_path, topic) -> SubmitStreamingJobOperator:
    spec = {"job_id": "job", "version": "1.0", "checkpoint_root": str(tmp_path), "kafka": {"topics": [topic]}}
    return SubmitStreamingJobOperator(task_id="submit", spec=spec, application="/jobs/v1.py")


def launch_on_another_host(store, operator: SubmitStreamingJobOperator) -> dict:
    """The launch of ``operator``'s driver, whose run registered on another host (generation 1)."""
    run = store.begin_run("job", 1, "1.0", host="another-host", pid=4242)
    return {"job_id": "job", "run_id": run.run_id, "pid": 4242, "host": "another-host", "log_path": None,
            "submission_id": None, "submitted_at": time.time(), "generation": 1, "version": "1.0",
            "application": "/jobs/v1.py", "spec": operator.job.to_json(),
            "checkpoint_path": operator.job.with_generation(1).checkpoint_path}
