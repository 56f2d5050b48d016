"""``python -m airflow_stream_provider status``: a job's state at a glance, for on-call, without Airflow.

Reads only the state database (the password, if any, from STREAM_DATABASE_PASSWORD): the latest runs
with their health inputs, the checkpoint generations, and the stored offsets.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence

from sqlalchemy import inspect, select

from airflow_stream_provider import diagnosis, kafka_offsets
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import StateStore


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def status(store: StateStore, job_id: str, runs: int = 5) -> str:
    with store.engine.connect() as conn:
        run_rows = conn.execute(select(schema.runs).where(schema.runs.c.job_id == job_id)
                                .order_by(schema.runs.c.started_at.desc()).limit(runs)).mappings().all()
        generations = conn.execute(select(schema.generations).where(schema.generations.c.job_id == job_id)
                                   .order_by(schema.generations.c.generation)).mappings().all()
    latest = next((dict(r) for r in run_rows if not r["dry_run"]), None)
    found = diagnosis.diagnose(job_id, latest, driver_alive=None, lag=None)
    out = [f"job {job_id}: {found.health.value}"
           + (f"/{found.failure_kind.value}" if found.failure_kind else ""),
           *(f"  {line}" for line in found.evidence), ""]
    out.append(_table([[r["run_id"][:12], r["status"], r["generation"], r["epoch"], r["version"],
                        _when(r["started_at"]), _when(r["heartbeat_at"]), r["last_batch_id"],
                        r["exit_code"] if r["exit_code"] is not None else "-", r["failure_kind"] or "-"]
                       for r in run_rows],
                      ["run", "status", "gen", "epoch", "version", "started", "heartbeat", "batch", "exit",
                       "failure"]))
    out += ["", _table([[g["generation"], "archived" if g["archived_at"] else "active", _when(g["created_at"]),
                         g["archive_path"] or g["checkpoint_path"]] for g in generations],
                       ["gen", "state", "created", "path"])]
    stored = store.stored_offsets(job_id)
    out += ["", f"stored offsets: {kafka_offsets.to_spark_json(stored) if stored else '(none yet)'}"]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_stream_provider")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("status", help="runs, generations and stored offsets of a job")
    show.add_argument("--database-url", required=True, help="SQLAlchemy URL of the state database")
    show.add_argument("--job-id", required=True)
    show.add_argument("--runs", type=int, default=5, help="how many recent runs to list")
    args = parser.parse_args(argv)
    store = StateStore.from_url(args.database_url)
    try:
        if not inspect(store.engine).has_table(schema.runs.name):
            print(f"no stream state in {args.database_url}: the table {schema.runs.name} does not exist. "
                  f"Is this the job's state database?", file=sys.stderr)
            return 2
        print(status(store, args.job_id, args.runs))
    finally:
        store.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
