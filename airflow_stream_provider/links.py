"""Extra links of every stream-job operator and sensor: the run's driver log and its Spark UI.

Airflow computes an operator's links on the worker whenever a task try ends or defers, and keeps them as
XComs that the UI shows.  So a link names the run the task dealt with at that moment: the job's latest run
(the one it launched, stopped or watched).  A link without a target (no log file, no UI) is empty, and the
UI leaves it out.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from airflow_stream_provider.plugins.status import URL_PREFIX
from airflow_stream_provider.state.records import RunRecord

log = logging.getLogger(__name__)
_CACHE = "_stream_linked_run"


def linked_run(operator: Any) -> RunRecord | None:
    """The job's latest run, read once for both links: Airflow computes them together as the task's
    process ends (it ends at each deferral), so nothing can launch in between.  None when it cannot be
    read."""
    if _CACHE not in operator.__dict__:
        from airflow_stream_provider.hooks.state import StreamStateHook

        try:
            found = StreamStateHook(operator.state_conn_id).latest_run(operator.job_id)
        except Exception as err:  # a link must never fail the task, nor hide why it is missing
            log.warning("No stream links: the state database of %r cannot be read: %s",
                        operator.state_conn_id, err)
            found = None
        operator.__dict__[_CACHE] = found
    return operator.__dict__[_CACHE]


def status_url(path: str) -> str:
    """``path`` on the status page, under Airflow's own address (``[api] base_url``)."""
    from airflow.sdk.configuration import conf

    base = conf.get("api", "base_url", fallback="") or ""
    return f"{base.rstrip('/')}{URL_PREFIX}/{path}"


class StreamDriverLogLink(BaseOperatorLink):
    """The run's driver log, served masked by the status page (where the api-server can read the file)."""

    name = "Driver log"

    def get_link(self, operator, *, ti_key) -> str:
        run = linked_run(operator)
        return status_url(f"api/runs/{quote(run.run_id)}/log") if run and run.log_path else ""


class SparkUILink(BaseOperatorLink):
    """The run's Spark UI, while its driver runs (the driver records its address at start)."""

    name = "Spark UI"

    def get_link(self, operator, *, ti_key) -> str:
        run = linked_run(operator)
        return run.ui_url if run and run.active and run.ui_url else ""


#: What every operator and sensor of the provider shows.
STREAM_LINKS = (StreamDriverLogLink(), SparkUILink())
