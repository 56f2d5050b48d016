"""``python -m airflow_stream_provider``: a job's state at a glance, for on-call, without a running Airflow.

``status`` reads the state database (the password, if any, from STREAM_DATABASE_PASSWORD): the latest
runs with their health inputs, a restart the job is owed (one that stopped its run and started none), the
latest upgrade's phase, the task acting on the job, the generations and the stored offsets; with
``--checkpoint-root`` also what each generation's checkpoint holds (last batch, committed or not, its
offsets).  ``prune`` applies a retention policy to a job's archived generations (never to active ones).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from airflow_stream_provider import diagnosis, kafka_offsets, standing
from airflow_stream_provider.standing import when
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.store import StateStore


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def status(store: StateStore, job_id: str, runs: int = 5) -> str:
    run_rows = store.recent_runs(job_id, runs)
    generations = store.generations(job_id)
    latest = next((r for r in run_rows if not r.dry_run), None)
    found, notes = standing.read(store, diagnosis.diagnose(job_id, latest, driver_alive=None, lag=None))
    out = [f"job {job_id}: {found.health.value}"
           + (f"/{found.failure_kind.value}" if found.failure_kind else ""),
           *(f"  {line}" for line in found.evidence),
           *([f"  {found.advice}"] if found.restart_owed else []),
           *notes]
    out.append("")
    out.append(_table([[r.run_id[:12], r.status, r.generation, r.epoch, r.version,
                        when(r.started_at), when(r.heartbeat_at), r.last_batch_id,
                        r.exit_code if r.exit_code is not None else "-", r.failure_kind or "-"]
                       for r in run_rows],
                      ["run", "status", "gen", "epoch", "version", "started", "heartbeat", "batch", "exit",
                       "failure"]))
    out += ["", _table([[g["generation"], "archived" if g["archived_at"] else "active", when(g["created_at"]),
                         g["archive_path"] or g["checkpoint_path"]] for g in generations],
                       ["gen", "state", "created", "path"])]
    stored = store.stored_offsets(job_id)
    out += ["", f"stored offsets: {kafka_offsets.to_spark_json(stored) if stored else '(none yet)'}"]
    return "\n".join(out)


def checkpoint_history(checkpoint_root: str, job_id: str, checkpoint_conn_id: str | None = None) -> str:
    """Every generation on checkpoint storage: state, newest file time, last batch and its offsets."""
    from airflow_stream_provider.hooks.checkpoint import CheckpointHook  # needs Airflow's SDK, not a server

    rows = []
    for info in CheckpointHook(checkpoint_root, checkpoint_conn_id).list_generations(job_id):
        batch = info.latest_batch
        offsets = "-" if batch is None or batch.offsets is None else kafka_offsets.to_spark_json(batch.offsets)
        rows.append([info.generation, "archived" if info.archived else "active", when(info.modified_at),
                     "-" if batch is None else batch.batch_id,
                     "-" if batch is None else ("yes" if batch.committed else "no (replayed on start)"),
                     offsets, info.path])
    if not rows:
        return f"no checkpoint generations of job {job_id} under {checkpoint_root}"
    return _table(rows, ["gen", "state", "modified", "last batch", "committed", "offsets", "path"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_stream_provider")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("status", help="runs, generations and stored offsets of a job")
    show.add_argument("--database-url", required=True, help="SQLAlchemy URL of the state database")
    show.add_argument("--job-id", required=True)
    show.add_argument("--runs", type=int, default=5, help="how many recent runs to list")
    show.add_argument("--checkpoint-root", help="also list what each generation's checkpoint holds")
    show.add_argument("--checkpoint-conn-id", help="Airflow connection for WebHDFS (hdfs:// roots)")
    prune = commands.add_parser("prune", help="remove archived generations outside a retention policy")
    prune.add_argument("--checkpoint-root", required=True)
    prune.add_argument("--job-id", required=True)
    prune.add_argument("--keep", type=_count, help="keep the newest N archives")
    prune.add_argument("--max-age-days", type=_days, help="keep archives younger than this")
    prune.add_argument("--checkpoint-conn-id", help="Airflow connection for WebHDFS (hdfs:// roots)")
    args = parser.parse_args(argv)
    if args.command == "prune":
        return _prune(args)
    store = StateStore.from_url(args.database_url)
    try:
        if not store.has_schema():
            print(f"no stream state in {args.database_url}: the table {schema.runs.name} does not exist. "
                  f"Is this the job's state database?", file=sys.stderr)
            return 2
        print(status(store, args.job_id, args.runs))
    finally:
        store.dispose()
    if args.checkpoint_root:
        print("\ncheckpoints:\n" + checkpoint_history(args.checkpoint_root, args.job_id, args.checkpoint_conn_id))
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give how many archives to keep") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give how many archives to keep (0 or more)")
    return value


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not math.isfinite(value) or value < 0:  # NaN would match no archive as young enough: all would go
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of days >= 0")
    return value


def _prune(args: argparse.Namespace) -> int:
    from airflow_stream_provider.hooks.checkpoint import CheckpointHook

    if args.keep is None and args.max_age_days is None:
        print("prune: give --keep N and/or --max-age-days D; nothing is deleted without a policy", file=sys.stderr)
        return 2
    hook = CheckpointHook(args.checkpoint_root, args.checkpoint_conn_id)
    removed = hook.prune_archives(args.job_id, max_count=args.keep,
                                  max_age_s=None if args.max_age_days is None else args.max_age_days * 86400)
    print("\n".join(f"removed {path}" for path in removed) or "nothing to remove")
    return 0


if __name__ == "__main__":
    sys.exit(main())
