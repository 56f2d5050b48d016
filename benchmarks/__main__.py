"""``make bench``: recovery time, throughput and scaling, side by side with the baseline.

    python -m benchmarks [--profile default|quick] [--jvm defaults|quick] [--only SECTION ...] [--out DIR]
                         [--workdir DIR] [--update]

Sections run one after the other on one stack (Tansu, PostgreSQL, local Spark, Airflow with the example
DAGs), print what they are doing, and end in ``<out>/latest.json``, ``latest.md`` and PNG plots.  The
default profile takes about 25 minutes on a 2-core machine; ``quick`` checks the whole path in a few.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from benchmarks import cold_start, jvm_profile, life, real_airflow, recovery, report, throughput
from benchmarks.audit import Audit
from benchmarks.report import OPTIONAL_SECTIONS, REAL_AIRFLOW_VARIANTS, SECTIONS
from benchmarks.stack import REPO, Stack, say

#: The default profile takes about 25 minutes on a 2-core machine (budget: 30): about 30 driver starts
#: (10-25 s each) and the 1000-batch checkpoint history (about 0.3 s a micro-batch of this job here,
#: whatever its size: Spark planning and scheduling its two small jobs, and writing two checkpoint logs).
PROFILES = {
    "default": {"cold": 3, "mttr": 3, "baseline": 3, "upgrade": 2, "throughput_repeats": 1, "eos_repeats": 3,
                "backlog": 300_000,
                "max_offsets": 100_000, "raw_repeats": 3, "rss_backlogs": [30_000, 150_000, 300_000],
                "history": [10, 100, 1000], "partitions": [1, 8, 32], "real_airflow_kills": 10,
                "batch_sizes": [10_000, 30_000, 100_000], "batch_backlog": 300_000, "standby_kills": 10,
                "warm_backlog": 600_000, "life_minutes": 5,
                "running_warm_up": 600_000, "running_burst": 300_000, "running_bursts": 2},
    "quick": {"cold": 1, "mttr": 1, "baseline": 1, "upgrade": 1, "throughput_repeats": 1, "eos_repeats": 1,
              "backlog": 6_000,
              "max_offsets": 2_000, "raw_repeats": 1, "rss_backlogs": [4_000, 6_000],
              "history": [5, 20], "partitions": [1, 4], "real_airflow_kills": 1,
              "batch_sizes": [1_000, 4_000], "batch_backlog": 12_000, "standby_kills": 2,
              "warm_backlog": 12_000, "life_minutes": 1,
              "running_warm_up": 12_000, "running_burst": 6_000, "running_bursts": 1},
}


def _median_drain(drains: list[dict]) -> dict:
    """The drain of median rate (the upper one of an even count)."""
    return sorted(drains, key=lambda d: d["msgs_s"] or 0)[len(drains) // 2]


def run(stack: Stack, profile: dict, sections: list[str], minutes: dict[str, float],
        real_airflow_variants: tuple[str, ...] = REAL_AIRFLOW_VARIANTS) -> dict:
    """Run ``sections`` in order; ``minutes`` receives how long each took (where the budget goes)."""
    samples: dict = {"scaling": {}}
    total = Audit(0, 0, 0)
    current: list = []  # (name, started) of the section running now

    def close_section() -> None:
        if current:
            name, started = current.pop()
            minutes[name] = round((time.monotonic() - started) / 60, 2)
            say(f"== {name} took {minutes[name]:.1f} min")

    def section(name: str, what: str) -> bool:
        close_section()
        if name in sections:
            say(f"== {name}: {what}")
            current.append((name, time.monotonic()))
        return name in sections

    if section("cold", f"driver spawn -> first committed batch, as shipped and the code before, {profile['cold']} "
                       "runs of each"):
        found = cold_start.measure(stack, profile["cold"], total, cold_start.TARGET_KINDS)
        samples["scaling"]["startup_s"] = found.pop("startup_s")
        samples.update(found)
    if section("cold_cuts", f"what each cut of the cold start saves: {', '.join(cold_start.VARIANTS)}, "
                            f"{profile['cold']} runs of each"):
        found = cold_start.measure(stack, profile["cold"], total)
        samples["scaling"]["startup_cuts_s"] = found.pop("startup_s")
        samples.update(found)
    if section("mttr", f"kill -9 under the polling health DAG + recover (dag.test), {profile['mttr']} runs"):
        samples["detect_kill9_s"], samples["mttr_kill9_s"] = recovery.mttr_provider(stack, profile["mttr"], total)
    if section("baseline", f"kill -9 under SparkSubmitOperator + retries, {profile['baseline']} runs"):
        samples["baseline_mttr_kill9_s"] = recovery.mttr_baseline(stack, profile["baseline"], total)
    if section("upgrade", f"incompatible upgrade with stream_upgrade, {profile['upgrade']} runs"):
        samples["upgrade_incompatible_s"], samples["baseline_upgrade_incompatible"] = \
            recovery.upgrade_incompatible(stack, profile["upgrade"], total)
    drained_eos_sqlite: dict[int, dict] = {}  # backlog -> drain; the RSS series reuses the throughput run's
    # the batch series' point at max_offsets on the throughput backlog is the same drain: it reuses the median one
    drained_eos_postgresql: list[dict] = []
    if section("throughput", f"{profile['backlog']:,}-event backlog: exactly-once vs at-least-once vs raw"):
        topic = None
        for _ in range(profile["throughput_repeats"]):
            for database in ("postgresql", "sqlite"):
                for exactly_once in (True, False):
                    drained = throughput.drain(stack, exactly_once=exactly_once, database=database,
                                               backlog=profile["backlog"], max_offsets=profile["max_offsets"],
                                               total=total)
                    key = f"{'eos' if exactly_once else 'alo'}_msgs_s/{database}"
                    samples.setdefault(key, []).append(drained["msgs_s"])
                    if drained["breakdown_s"]["batches"]:
                        samples["scaling"].setdefault("breakdown_s", {})[key.replace("_msgs_s", "")] = \
                            drained["breakdown_s"]
                    topic = drained["topic"]
                    if exactly_once and database == "sqlite":
                        drained_eos_sqlite[profile["backlog"]] = drained
                    elif exactly_once:
                        drained_eos_postgresql.append(drained)
        # eos_vs_raw is judged on PostgreSQL: its drain is repeated, so a single drain's noise (about 10% here)
        # does not decide it; the median goes into the ratio, as raw's does
        for _ in range(profile["eos_repeats"] - 1):
            drained = throughput.drain(stack, exactly_once=True, database="postgresql", backlog=profile["backlog"],
                                       max_offsets=profile["max_offsets"], total=total)
            samples["eos_msgs_s/postgresql"].append(drained["msgs_s"])
            drained_eos_postgresql.append(drained)
        median_eos = _median_drain(drained_eos_postgresql)
        # the optional fast reader (kafka.reader: confluent-kafka), exactly-once on PostgreSQL
        drained = throughput.drain(stack, exactly_once=True, database="postgresql", backlog=profile["backlog"],
                                   max_offsets=profile["max_offsets"], total=total, reader="confluent-kafka")
        samples.setdefault("eos_confluent_msgs_s", []).append(drained["msgs_s"])
        # what a running job sustains: a longer drain, timed once the JVM compiled the per-record code
        drained = throughput.drain(stack, exactly_once=True, database="postgresql", backlog=profile["warm_backlog"],
                                   max_offsets=profile["max_offsets"], total=total, warm=True)
        samples["eos_warm_msgs_s"] = [drained["warm_msgs_s"]] if drained["warm_msgs_s"] else []
        samples["scaling"]["warm"] = {"backlog": profile["warm_backlog"], "msgs_s": drained["msgs_s"],
                                      "warm_up_batches": throughput.WARM_UP_BATCHES,
                                      **{k: drained[k] for k in ("peak_rss_mb", "peak_rss_jvm_mb", "peak_rss_python_mb",
                                                                 "peak_pss_mb")}}
        if drained["warm_breakdown_s"]:
            samples["scaling"].setdefault("breakdown_s", {})["eos/postgresql, warm"] = drained["warm_breakdown_s"]
        # where the JVM spends its CPU: a new driver's whole life (the median drain) against a running job's
        samples["scaling"]["jvm_thread_cpu_s"] = {
            "backlog": profile["backlog"], "new_driver": median_eos["jvm_thread_cpu_s"],
            "new_driver_window_per_100k": median_eos["steady_jvm_thread_cpu_s"],
            "running_per_100k": drained["warm_jvm_thread_cpu_s"]}
        samples["raw_consume_msgs_s"] = []
        raw_cpu: dict[str, float] = {}
        for _ in range(profile["raw_repeats"]):
            samples["raw_consume_msgs_s"].append(throughput.raw_consume(stack, topic, profile["backlog"], raw_cpu))
            say(f"  raw kafka-python: {samples['raw_consume_msgs_s'][-1]:.0f} msgs/s")
        throughput.say_cpu("raw kafka-python (the last read)", raw_cpu)
        if drained["warm_cpu_s"]:  # where the 2 cores go, per record, in the running job and in raw
            samples["scaling"]["cpu_per_100k"] = {"cores": len(os.sched_getaffinity(0)),
                                                  "eos/postgresql, warm": drained["warm_cpu_s"],
                                                  "eos/postgresql, new driver": median_eos["steady_cpu_s"],
                                                  "raw kafka-python": raw_cpu}
    if section("running", f"a running job: {profile['running_warm_up']:,} events drained, then "
                          f"{profile['running_bursts']} bursts of {profile['running_burst']:,}, against raw kafka-python"):
        samples["scaling"]["running"] = found = throughput.running_bursts(
            stack, warm_up=profile["running_warm_up"], burst=profile["running_burst"],
            bursts=profile["running_bursts"], max_offsets=profile["max_offsets"], total=total)
        samples["eos_running_msgs_s"] = [rate for rate in found["msgs_s"] if rate]
        samples["raw_running_msgs_s"] = found["raw_consume_msgs_s"]
    if section("rss", f"peak driver RSS for backlogs {profile['rss_backlogs']} (batches up to {profile['max_offsets']:,})"):
        rss = {"backlog": [], "peak_rss_mb": [], "jvm_mb": [], "python_mb": [], "pss_mb": [], "msgs_s": [],
               "max_offsets_per_trigger": profile["max_offsets"]}
        for backlog in profile["rss_backlogs"]:
            drained = drained_eos_sqlite.get(backlog)
            if drained is None:
                drained = throughput.drain(stack, exactly_once=True, database="sqlite", backlog=backlog,
                                           max_offsets=profile["max_offsets"], total=total)
            else:
                say(f"  {backlog:,}: the exactly-once SQLite drain of the throughput section")
            rss["backlog"].append(backlog)
            rss["peak_rss_mb"].append(round(drained["peak_rss_mb"], 1))
            rss["jvm_mb"].append(round(drained["peak_rss_jvm_mb"], 1))
            rss["python_mb"].append(round(drained["peak_rss_python_mb"], 1))
            rss["pss_mb"].append(round(drained["peak_pss_mb"], 1))
            rss["msgs_s"].append(drained["msgs_s"])
        # the largest backlog again as a burst that a running job receives, long after its start
        burst = throughput.drain(stack, exactly_once=True, database="sqlite", backlog=profile["rss_backlogs"][-1],
                                 max_offsets=profile["max_offsets"], total=total,
                                 burst_after=throughput.START_WORKERS_REAPED_S)
        rss["running_burst"] = {"backlog": profile["rss_backlogs"][-1], "after_s": throughput.START_WORKERS_REAPED_S,
                                "peak_rss_mb": round(burst["peak_rss_mb"], 1), "jvm_mb": round(burst["peak_rss_jvm_mb"], 1),
                                "python_mb": round(burst["peak_rss_python_mb"], 1),
                                "pss_mb": round(burst["peak_pss_mb"], 1), "msgs_s": burst["msgs_s"]}
        samples["scaling"]["rss_vs_backlog"] = rss
        say(f"  a running job fed steadily for {profile['life_minutes']} min: its memory minute by minute")
        samples["scaling"]["rss_over_life"] = life.running_life(stack, minutes=profile["life_minutes"], total=total)
    if section("batch", f"exactly-once on PostgreSQL against the batch size (maxOffsetsPerTrigger "
                        f"{profile['batch_sizes']}), a {profile['batch_backlog']:,}-event backlog"):
        series = {"max_offsets_per_trigger": [], "msgs_s": [], "peak_rss_mb": [], "jvm_mb": [], "python_mb": [],
                  "pss_mb": [],
                  "seconds_per_batch": [], "backlog": profile["batch_backlog"]}
        for size in profile["batch_sizes"]:
            if drained_eos_postgresql and (size, profile["batch_backlog"]) == (profile["max_offsets"], profile["backlog"]):
                drained = _median_drain(drained_eos_postgresql)
                say(f"  {size:,}: the throughput section's median exactly-once PostgreSQL drain")
            else:
                drained = throughput.drain(stack, exactly_once=True, database="postgresql",
                                           backlog=profile["batch_backlog"], max_offsets=size, total=total)
            steady = drained["breakdown_s"]
            series["max_offsets_per_trigger"].append(size)
            series["msgs_s"].append(drained["msgs_s"])
            series["peak_rss_mb"].append(round(drained["peak_rss_mb"], 1))
            series["jvm_mb"].append(round(drained["peak_rss_jvm_mb"], 1))
            series["python_mb"].append(round(drained["peak_rss_python_mb"], 1))
            series["pss_mb"].append(round(drained["peak_pss_mb"], 1))
            series["seconds_per_batch"].append(
                round(sum(v for k, v in steady.items() if k != "batches") / steady["batches"], 3)
                if steady["batches"] else None)
        samples["scaling"]["batch_size"] = series
    if section("history", f"recovery and reset with {profile['history']} committed batches"):
        samples["scaling"]["history"] = recovery.by_history(stack, profile["history"], total)
    if section("partitions", f"recovery and reset with {profile['partitions']} partitions"):
        samples["scaling"]["partitions"] = recovery.by_partitions(stack, profile["partitions"], total)
    if section("standby", f"kill -9 of the active driver with a warm standby, {profile['standby_kills']} kills; "
                          f"upgrades with a pre-warmed successor, {profile['upgrade']} runs"):
        samples.update(recovery.standby_takeover(stack, profile["standby_kills"], total))
        samples.update(recovery.upgrade_prewarmed(stack, profile["upgrade"], total))
    if section("profile", f"where a {profile['backlog']:,}-event exactly-once drain's JVM task time goes (Java Flight "
                          "Recorder), and the same drain with the least parsing an event needs"):
        samples["scaling"]["profile"] = _profile(stack, profile, total)
    if section("mttr_real_airflow", f"kill -9 under a real Airflow, {profile['real_airflow_kills']} kills each: "
                                    f"{', '.join(real_airflow_variants)}"):
        for variant in real_airflow_variants:  # each way's own date and minutes: an update may run some ways only
            began = time.monotonic()
            samples.setdefault("mttr_real_airflow_measured", {})[variant] = time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime())
            samples[f"mttr_real_airflow/{variant}"] = real_airflow.measure(stack, variant, profile["real_airflow_kills"],
                                                                           total)
            samples.setdefault("mttr_real_airflow_minutes", {})[variant] = round((time.monotonic() - began) / 60, 2)
    close_section()
    samples.update(lost=total.lost, duplicated=total.duplicated, audited_records=total.produced)
    return samples


def _profile(stack: Stack, profile: dict, total: Audit) -> dict:
    """The example job's drain, then the same backlog through the minimal parse, so the example job's
    validation and the JVM's share of reading are measured in one run.  Both are recorded by JFR (when the
    JDK's ``jfr`` is here), so its overhead is on both sides of the ratio."""
    found: dict = {}
    jobs = {"example": None, "minimal_parse": str(REPO / "benchmarks" / "jobs" / "events_minimal_parse.py")}
    recorded = jvm_profile.available()
    if not recorded:
        say("  no jfr (the JDK's tool) here: the drains run without a JVM profile")
    for name, application in jobs.items():
        recording = stack.workdir / f"{name}.jfr" if recorded else None
        drained = throughput.drain(stack, exactly_once=True, database="postgresql", backlog=profile["backlog"],
                                   max_offsets=profile["max_offsets"], total=total, application=application,
                                   java_options=jvm_profile.recording_option(recording) if recording else "")
        found[name] = {"msgs_s": drained["msgs_s"], "breakdown_s": drained["breakdown_s"]}
        if recording is not None:
            stacks = jvm_profile.task_samples(recording)
            found[name].update(jvm_task_shares=jvm_profile.shares(stacks), jvm_task_samples=len(stacks))
            say(f"  JVM task threads, {len(stacks)} samples: " +
                ", ".join(f"{what} {share:.0%}" for what, share in found[name]["jvm_task_shares"].items()))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--only", nargs="+", choices=SECTIONS + OPTIONAL_SECTIONS,
                        help=f"run these sections only ({', '.join(OPTIONAL_SECTIONS)} runs only when named: "
                             "about an hour)")
    parser.add_argument("--out", type=Path, help="results directory (default benchmarks/results; quick: "
                                                 "<workdir>/results)")
    parser.add_argument("--workdir", type=Path, default=REPO / ".bench", help="scratch directory (emptied)")
    parser.add_argument("--jvm", choices=("defaults", "quick"), default="defaults",
                        help="driver JVM flags: the JVM's defaults, as a deployment runs (default), or the tests' "
                             "quick JIT and serial GC")
    parser.add_argument("--real-airflow-variants", nargs="+", choices=REAL_AIRFLOW_VARIANTS,
                        default=list(REAL_AIRFLOW_VARIANTS),
                        help="the ways mttr_real_airflow measures (default all; polling takes most of its hour)")
    parser.add_argument("--update", action="store_true",
                        help="keep the other sections' results in <out>/latest.json and replace these")
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    out = args.out or (REPO / "benchmarks" / "results" if args.profile == "default" and (args.update or not args.only)
                       else workdir / "results")
    sections = list(args.only or SECTIONS)
    started = time.monotonic()
    stack = Stack(workdir, jvm=args.jvm)
    section_minutes: dict[str, float] = {}
    try:
        stack.start()
        section_minutes["stack"] = round((time.monotonic() - started) / 60, 2)
        samples = run(stack, PROFILES[args.profile], sections, section_minutes, tuple(args.real_airflow_variants))
    finally:
        stack.stop()
    minutes = round((time.monotonic() - started) / 60, 1)
    if args.update:
        samples, minutes, section_minutes, sections = _updated(out / "latest.json", samples, minutes,
                                                               section_minutes, sections)
    meta = {"profile": args.profile, "sections": sections, "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "minutes": minutes, "section_minutes": section_minutes,
            "machine": f"{platform.machine()}, {_cores()} cores, Python {platform.python_version()}, "
                       f"driver JVM {args.jvm}"}
    result = report.summarise(samples, meta)
    for path in report.write(result, out):
        say(f"wrote {path}")
    print(report.markdown(result))
    return 0 if result["lost"] == 0 and result["duplicated"] == 0 else 1


def _updated(previous: Path, samples: dict, minutes: float, section_minutes: dict[str, float],
             sections: list[str]) -> tuple[dict, float, dict[str, float], list[str]]:
    """The previous run's samples with this run's sections replacing theirs; audits add up (every run
    that wrote results was audited).  The minutes are the previous run's with these sections' replaced,
    so the total still reads as one whole run's."""
    import json

    before = json.loads(previous.read_text())

    def per_way(field: str) -> dict:
        """A run of some of mttr_real_airflow's ways keeps the others' ``field`` (when measured, minutes)."""
        return {**{v: x.get(field) for v, x in before.get("mttr_real_airflow", {}).items()},
                **samples.pop(f"mttr_real_airflow_{field}", {})}

    ways = per_way("minutes")
    merged = {**before["samples"], "baseline_upgrade_incompatible": before["baseline_upgrade_incompatible"],
              "scaling": {**before["scaling"], **samples.pop("scaling")},
              "mttr_real_airflow_measured": per_way("measured"), "mttr_real_airflow_minutes": ways}
    old_sections = before["meta"].get("section_minutes") or {}
    if "mttr_real_airflow" in section_minutes:
        # the section as a whole run would take it: its ways' minutes, this run's and the kept ones'; a kept way
        # whose minutes an older run did not record leaves the older run's figure for the section
        section_minutes = {**section_minutes, "mttr_real_airflow": round(sum(ways.values()), 2)
                           if None not in ways.values() else old_sections.get("mttr_real_airflow",
                                                                              section_minutes["mttr_real_airflow"])}
    for key in ("lost", "duplicated", "audited_records"):
        samples[key] += before[key]
    merged.update(samples)
    replaced = sum(old_sections.get(name, 0.0) for name in section_minutes)
    total = before["meta"]["minutes"] - replaced + sum(section_minutes.values()) if old_sections else \
        before["meta"]["minutes"] + minutes
    all_sections = [s for s in SECTIONS + OPTIONAL_SECTIONS
                    if s in set(before["meta"].get("sections", [])) | set(sections)]
    return merged, round(total, 1), {**old_sections, **section_minutes}, all_sections


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
