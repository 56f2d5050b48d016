"""``python -m airflow_stream_provider``: a job's state at a glance, for on-call, without a running Airflow.

``status`` reads the state database (the password, if any, from STREAM_DATABASE_PASSWORD): the latest
runs with their health inputs, a restart the job is owed (one that stopped its run and started none), the
latest upgrade's phase, the task acting on the job, the generations and the stored offsets; with
``--checkpoint-root`` also what each generation's checkpoint holds (last batch, committed or not, its
offsets).  ``prune`` applies a retention policy to a job's archived generations (never to active ones).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Sequence

from airflow_stream_provider import diagnosis, kafka_offsets, recovery
from airflow_stream_provider.state import schema
from airflow_stream_provider.state.leases import LeaseLog
from airflow_stream_provider.state.standbys import StandbyLog
from airflow_stream_provider.state.store import StateStore
from airflow_stream_provider.state.upgrades import (
    LEAVES_THE_JOB_DOWN,
    UpgradeLog,
    UpgradePhase,
    UpgradeRecord,
)


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
    run_rows = store.recent_runs(job_id, runs)
    generations = store.generations(job_id)
    latest = next((r for r in run_rows if not r.dry_run), None)
    found = diagnosis.diagnose(job_id, latest, driver_alive=None, lag=None)
    last_restart = store.latest_restart(job_id)
    if found.health in recovery.INTERRUPTIBLE:  # down because a restart stopped it and launched nothing
        found = recovery.with_interrupted_restart(found, last_restart)
    out = [f"job {job_id}: {found.health.value}"
           + (f"/{found.failure_kind.value}" if found.failure_kind else ""),
           *(f"  {line}" for line in found.evidence),
           *([f"  {found.advice}"] if found.restart_owed else [])]
    if not found.restart_owed and found.run_id and recovery.begun(last_restart) and (
            last_restart["failed_run_id"] == found.run_id and last_restart.get("task")):
        # whether its task has ended is Airflow's to say, which this command does not ask
        out.append(f"{last_restart['action']} of this run begun at {_when(last_restart['at'])} by task "
                   f"{last_restart['task']}, nothing launched yet; if that task has ended without launching, "
                   "stream_health's recover finishes it")
    upgrade = UpgradeLog(store).latest(job_id)
    if upgrade is not None:
        out.append(_upgrade_line(upgrade))
    lease = LeaseLog(store).get(job_id)
    now = time.time()
    if lease is not None and lease.until >= now:
        out.append(f"acting on the job: {lease.describe(now)}")
    standbys = StandbyLog(store)
    for standby in standbys.live(job_id) or standbys.recent(job_id, 1):
        out.append(standby.describe())
    out.append("")
    out.append(_table([[r.run_id[:12], r.status, r.generation, r.epoch, r.version,
                        _when(r.started_at), _when(r.heartbeat_at), r.last_batch_id,
                        r.exit_code if r.exit_code is not None else "-", r.failure_kind or "-"]
                       for r in run_rows],
                      ["run", "status", "gen", "epoch", "version", "started", "heartbeat", "batch", "exit",
                       "failure"]))
    out += ["", _table([[g["generation"], "archived" if g["archived_at"] else "active", _when(g["created_at"]),
                         g["archive_path"] or g["checkpoint_path"]] for g in generations],
                       ["gen", "state", "created", "path"])]
    stored = store.stored_offsets(job_id)
    out += ["", f"stored offsets: {kafka_offsets.to_spark_json(stored) if stored else '(none yet)'}"]
    return "\n".join(out)


def _upgrade_line(upgrade: UpgradeRecord) -> str:
    """The latest upgrade: where it stands if unfinished (a retry of its task resumes or rolls back from
    there), how it ended otherwise."""
    versions = f"{upgrade.from_version or '?'} -> {upgrade.to_version or '?'}"
    if upgrade.phase == UpgradePhase.DONE:
        return f"last upgrade {versions}: {upgrade.result or 'done'} at {_when(upgrade.updated_at)}"
    line = (f"upgrade {versions} in progress: {upgrade.phase.value} since {_when(upgrade.updated_at)} "
            f"(started {_when(upgrade.started_at)}); a retry of the upgrade task resumes or rolls it back")
    if upgrade.phase in LEAVES_THE_JOB_DOWN and upgrade.detail.get("live_run_id"):
        # whether its task has ended is Airflow's to say, which this command does not ask
        task = f"its task {upgrade.task}" if upgrade.task else "its task"
        line += (f"; if {task} has ended without resuming or rolling it back, stream_health's recover ends the "
                 "upgrade and restarts the version that ran before")
    return line


def checkpoint_history(checkpoint_root: str, job_id: str, checkpoint_conn_id: str | None = None) -> str:
    """Every generation on checkpoint storage: state, newest file time, last batch and its offsets."""
    from airflow_stream_provider.hooks.checkpoint import CheckpointHook  # needs Airflow's SDK, not a server

    rows = []
    for info in CheckpointHook(checkpoint_root, checkpoint_conn_id).list_generations(job_id):
        batch = info.latest_batch
        offsets = "-" if batch is None or batch.offsets is None else kafka_offsets.to_spark_json(batch.offsets)
        rows.append([info.generation, "archived" if info.archived else "active", _when(info.modified_at),
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
    prune.add_argument("--keep", type=int, help="keep the newest N archives")
    prune.add_argument("--max-age-days", type=float, help="keep archives younger than this")
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
