"""The benchmark's outputs: ``latest.json`` (medians with their run counts and every sample), a Markdown
table with the targets, and PNG plots.  Pure: takes the collected samples, touches no stack."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.cold_before import BEFORE
from benchmarks.stack import JVM_THREAD_KINDS


def median(samples: list[float]) -> float | None:
    return round(statistics.median(samples), 3) if samples else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarise(samples: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Samples in, the JSON document out: medians under the issue's key names, ``runs`` with counts."""
    times = {key: samples.get(key, []) for key in
             ("mttr_kill9_s", "detect_kill9_s", "baseline_mttr_kill9_s", "cold_start_s",
              "cold_start_default_jit_s", "cold_start_no_archive_s", "cold_start_uncut_s", "cold_start_before_s",
              "upgrade_incompatible_s")}
    result: dict[str, Any] = {key: median(values) for key, values in times.items()}
    runs = {key: len(values) for key, values in times.items()}
    raw = median(samples.get("raw_consume_msgs_s", []))
    result["raw_consume_msgs_s"] = raw
    runs["raw_consume_msgs_s"] = len(samples.get("raw_consume_msgs_s", []))
    by_database = {}
    for database in ("postgresql", "sqlite"):
        eos = median(samples.get(f"eos_msgs_s/{database}", []))
        alo = median(samples.get(f"alo_msgs_s/{database}", []))
        by_database[database] = {"eos_msgs_s": eos, "alo_msgs_s": alo, "eos_vs_raw": ratio(eos, raw),
                                 "eos_vs_alo": ratio(eos, alo)}
        suffix = "" if database == "postgresql" else "_sqlite"
        for key, value in by_database[database].items():
            result[f"{key}{suffix}"] = value
        runs[f"eos_msgs_s/{database}"] = len(samples.get(f"eos_msgs_s/{database}", []))
        runs[f"alo_msgs_s/{database}"] = len(samples.get(f"alo_msgs_s/{database}", []))
    result["by_database"] = by_database
    result["eos_confluent_msgs_s"] = median(samples.get("eos_confluent_msgs_s", []))
    result["eos_confluent_vs_raw"] = ratio(result["eos_confluent_msgs_s"], raw)
    runs["eos_confluent_msgs_s/postgresql"] = len(samples.get("eos_confluent_msgs_s", []))
    result["eos_warm_msgs_s"] = median(samples.get("eos_warm_msgs_s", []))
    result["eos_warm_vs_raw"] = ratio(result["eos_warm_msgs_s"], raw)
    runs["eos_warm_msgs_s/postgresql"] = len(samples.get("eos_warm_msgs_s", []))
    # a job that has run for a while, against raw kafka-python read in the same section
    result["eos_running_msgs_s"] = median(samples.get("eos_running_msgs_s", []))
    result["eos_running_vs_raw"] = ratio(result["eos_running_msgs_s"], median(samples.get("raw_running_msgs_s", [])))
    runs["eos_running_msgs_s/postgresql"] = len(samples.get("eos_running_msgs_s", []))
    result["mttr_real_airflow"] = {
        variant: {"runs": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
                  "max": percentile(values, 100), "measured": samples.get("mttr_real_airflow_measured", {}).get(variant),
                  "minutes": samples.get("mttr_real_airflow_minutes", {}).get(variant)}
        for variant in REAL_AIRFLOW_VARIANTS if (values := samples.get(f"mttr_real_airflow/{variant}"))}
    result["standby"] = _standby(samples, result["cold_start_s"])
    result["upgrade_downtime"] = {
        key: {"median": median(values), "runs": len(values)}
        for key in ("upgrade_downtime_s/compatible", "upgrade_downtime_s/incompatible",
                    "upgrade_incompatible_prewarmed_s") if (values := samples.get(key))}
    result["baseline_upgrade_incompatible"] = samples.get("baseline_upgrade_incompatible", "not measured")
    result["lost"] = samples.get("lost", 0)
    result["duplicated"] = samples.get("duplicated", 0)
    result["audited_records"] = samples.get("audited_records", 0)
    result["scaling"] = samples.get("scaling", {})
    result["runs"] = runs
    result["samples"] = {k: v for k, v in samples.items() if isinstance(v, list)}
    result["meta"] = meta
    result["targets"] = targets(result)
    return result


def _standby(samples: dict[str, Any], cold_start_s: float | None) -> dict[str, Any] | None:
    """The warm standby's takeover times and its memory while waiting, against an idle active driver's."""
    seconds = samples.get("mttr_standby_kill9_s")
    if not seconds:
        return None
    memory = {key: median(samples.get(key, [])) for key in
              ("standby_rss_mb", "idle_driver_rss_mb", "standby_pss_mb", "idle_driver_pss_mb")}
    p50 = percentile(seconds, 50)
    return {"runs": len(seconds), "p50": p50, "p95": percentile(seconds, 95), "max": percentile(seconds, 100),
            "vs_cold_start": ratio(p50, cold_start_s), **memory,
            "rss_vs_idle_driver": ratio(memory["standby_rss_mb"], memory["idle_driver_rss_mb"]),
            "pss_vs_idle_driver": ratio(memory["standby_pss_mb"], memory["idle_driver_pss_mb"])}


#: The example job's peak driver memory (summed RSS of the JVM and every Python process), in MB.
RSS_LIMIT_MB = 1200
#: ``make bench`` must finish within this on a 2-core machine; judged only on a run of every section
#: (``SECTIONS``, in the order they run).
BUDGET_MINUTES = 30
SECTIONS = ("cold", "mttr", "baseline", "upgrade", "throughput", "rss", "batch", "history", "partitions")
#: Run only when named (``--only``): ``cold_cuts`` (about 4 minutes) starts every kind of driver of the cold
#: start's cuts in turn, where ``cold`` starts the two its target compares; ``standby`` (about 15 minutes:
#: ten standbys warm up and wait one after the other; name ``cold`` with it for its ratio) would take the
#: default profile past its budget; ``profile`` (about a minute) records a drain with Java Flight Recorder,
#: which slows it, so it stays apart from ``throughput``; ``mttr_real_airflow`` takes about an hour, most of
#: it waiting for the 5-minute polling DAG; ``running`` (3-5 minutes: producing and draining 1,200,000
#: events, then reading them raw) measures a job that has run for a while, apart from ``throughput``'s drains.
OPTIONAL_SECTIONS = ("cold_cuts", "standby", "profile", "mttr_real_airflow", "running")
REAL_AIRFLOW_VARIANTS = ("watcher", "polling", "spark_submit")


def percentile(samples: list[float], q: float) -> float | None:
    """Nearest rank: with 10 samples, p95 is the largest (no interpolation past what was measured)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 2)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    def check(name: str, value, limit, met) -> dict[str, Any]:
        return {"target": name, "value": value, "limit": limit, "met": bool(met) if value is not None else None}

    found = []
    if r["cold_start_s"] is not None and r.get("cold_start_before_s") is not None:
        limit = round(r["cold_start_before_s"] / 2, 3)
        found.append(check("cold_start_s <= cold_start_before_s / 2", r["cold_start_s"], limit,
                           r["cold_start_s"] <= limit))
    if r["mttr_kill9_s"] is not None and r["cold_start_s"] is not None:
        limit = round(r["cold_start_s"] + 10, 3)
        found.append(check("mttr_kill9_s <= cold_start_s + 10", r["mttr_kill9_s"], limit, r["mttr_kill9_s"] <= limit))
    if r["mttr_kill9_s"] is not None and r["baseline_mttr_kill9_s"] is not None:
        found.append(check("mttr_kill9_s < baseline_mttr_kill9_s", r["mttr_kill9_s"], r["baseline_mttr_kill9_s"],
                           r["mttr_kill9_s"] < r["baseline_mttr_kill9_s"]))
    if r["eos_vs_raw"] is not None:
        found.append(check("eos_vs_raw >= 0.5 (PostgreSQL)", r["eos_vs_raw"], 0.5, r["eos_vs_raw"] >= 0.5))
    if r["eos_vs_alo"] is not None:
        found.append(check("eos_vs_alo >= 0.9 (PostgreSQL)", r["eos_vs_alo"], 0.9, r["eos_vs_alo"] >= 0.9))
    for column in ("recovery_s", "reset_s"):
        values = r["scaling"].get("history", {}).get(column) or []
        if len(values) >= 2:
            spread = flatness(values)
            found.append(check(f"{column} flat across checkpoint history (largest / smallest)", spread, 1.5,
                               spread <= 1.5))
    watcher = r.get("mttr_real_airflow", {}).get("watcher")
    if watcher and r["cold_start_s"] is not None:
        limit = round(r["cold_start_s"] + 5, 3)
        found.append(check("mttr_real_airflow watcher p95 <= cold_start_s + 5", watcher["p95"], limit,
                           watcher["p95"] <= limit))
    standby = r.get("standby")
    if standby:
        found.append(check("mttr_standby_kill9_s median <= 3", standby["p50"], 3, standby["p50"] <= 3))
        found.append(check("mttr_standby_kill9_s p95 <= 5", standby["p95"], 5, standby["p95"] <= 5))
        if standby["rss_vs_idle_driver"] is not None:
            found.append(check("waiting standby RSS / idle driver RSS <= 1.2", standby["rss_vs_idle_driver"], 1.2,
                               standby["rss_vs_idle_driver"] <= 1.2))
    for kind, limit in (("compatible", 5), ("incompatible", 10)):
        downtime = (r.get("upgrade_downtime") or {}).get(f"upgrade_downtime_s/{kind}")
        if downtime:
            found.append(check(f"upgrade_downtime_s {kind} (prewarmed) <= {limit}", downtime["median"], limit,
                               downtime["median"] <= limit))
    # the throughput section's longer drain is one more backlog: memory must not grow with a drain's length
    warm = r["scaling"].get("warm")
    rss = [*(r["scaling"].get("rss_vs_backlog", {}).get("peak_rss_mb") or []), *([warm["peak_rss_mb"]] if warm else [])]
    if len(rss) >= 2:
        spread = flatness(rss)
        found.append(check("peak driver RSS flat across backlog sizes (largest / smallest)", spread, 1.25,
                           spread <= 1.25))
    by_batch = r["scaling"].get("batch_size", {}).get("peak_rss_mb") or []
    if len(by_batch) >= 2:
        spread = flatness(by_batch)
        found.append(check("peak driver RSS flat across batch sizes (largest / smallest)", spread, 1.25,
                           spread <= 1.25))
    if rss or by_batch:
        peak = max(rss + by_batch)
        found.append(check(f"peak driver RSS <= {RSS_LIMIT_MB} MB, a driver started on a backlog", peak, RSS_LIMIT_MB,
                           peak <= RSS_LIMIT_MB))
    burst = r["scaling"].get("rss_vs_backlog", {}).get("running_burst")
    if burst:
        found.append(check(f"peak driver RSS <= {RSS_LIMIT_MB} MB, a running job's burst", burst["peak_rss_mb"],
                           RSS_LIMIT_MB, burst["peak_rss_mb"] <= RSS_LIMIT_MB))
    life = r["scaling"].get("rss_over_life")
    if life and life["peak_rss_mb"]:
        peak = max(life["peak_rss_mb"])
        found.append(check(f"peak driver RSS <= {RSS_LIMIT_MB} MB, a job running {life['minutes'][-1]} min",
                           peak, RSS_LIMIT_MB, peak <= RSS_LIMIT_MB))
    found.append(check("lost == 0 and duplicated == 0", r["lost"] + r["duplicated"], 0,
                       r["lost"] == 0 and r["duplicated"] == 0))
    meta = r.get("meta") or {}
    whole = set(meta.get("sections", ())) >= set(SECTIONS)
    if meta.get("profile") == "default" and whole and meta.get("minutes") is not None:
        # The sections run only when named are no part of the default profile's budget.
        optional = sum((meta.get("section_minutes") or {}).get(name, 0.0) for name in OPTIONAL_SECTIONS)
        minutes = round(meta["minutes"] - optional, 1)
        found.append(check(f"whole default profile under {BUDGET_MINUTES} min", minutes, BUDGET_MINUTES,
                           minutes < BUDGET_MINUTES))
    return found


def _section_line(meta: dict[str, Any]) -> list[str]:
    minutes = meta.get("section_minutes") or {}
    if not minutes:
        return []
    parts = ", ".join(f"{name} {value:.1f}" for name, value in minutes.items())
    return [f"Minutes per section: {parts}.", ""]


def flatness(values: list[float]) -> float:
    return round(max(values) / min(values), 3) if min(values) > 0 else float("inf")


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


def _startup_lines(found: dict[str, dict[str, float]]) -> list[str]:
    """Where a cold start goes, per kind of driver (medians of each driver's own startup line)."""
    if not found:
        return []
    kinds = [k for k in ("shipped", "default_jit", "no_archive", "uncut") if found.get(k)]
    phases = [p for p in next(iter(found.values())) if p != "total"] + ["total"]
    lines = ["## Where a cold start goes (seconds, medians)", "",
             "| phase | " + " | ".join(f"`{k}`" for k in kinds) + " |", "|---|" + "---:|" * len(kinds)]
    lines += [f"| {p} | " + " | ".join(_fmt(found[k].get(p)) for k in kinds) + " |" for p in phases]
    return lines + ["", "Each driver logs its own phases once its first batch committed (`runtime.startup`): launch "
                    "(spark-submit and the JVM up to the Python driver), python (imports), state_database, "
                    "spark_session, source (the generation's start, the source, the job's transform), query_start, "
                    "first_batch.  `shipped`: the class archive mapped, C2 kept to hot code, Spark's Python zips "
                    "compiled; `default_jit`: HotSpot's JIT thresholds; `no_archive`: without the archive; `uncut`: "
                    "without the archive and the compiled zips (these three from the optional `cold_cuts` section, "
                    "`--only cold_cuts`).  The code of `cold_start_before_s` logs no phases.", ""]


def _warm_lines(r: dict[str, Any], warm: dict[str, Any]) -> list[str]:
    """The longer drain: its rate from the start and once warm, against raw, and its peak memory."""
    if not r.get("eos_warm_msgs_s"):
        return []
    return ["", f"A running job, exactly-once on PostgreSQL: a {warm['backlog']:,}-event drain runs at "
            f"{_fmt(warm['msgs_s'])} msgs/s from its first batch and {_fmt(r['eos_warm_msgs_s'])} msgs/s over the "
            f"batches after the first {warm['warm_up_batches']}, once the JVM has compiled the per-record code "
            f"({_fmt(r['eos_warm_vs_raw'])} of raw kafka-python); its peak driver RSS {_fmt(warm['peak_rss_mb'])} MB "
            f"(JVM {_fmt(warm['peak_rss_jvm_mb'])}, Python {_fmt(warm['peak_rss_python_mb'])}; PSS "
            f"{_fmt(warm['peak_pss_mb'])}). The shorter drains above are mostly the JVM's warm-up."]


def _running_lines(r: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """The ``running`` section: a job's bursts once it drained a warm-up, against raw on the same topic."""
    if not r.get("eos_running_msgs_s"):
        return []
    rates = " / ".join(_fmt(rate) for rate in found["msgs_s"])
    lines = ["", f"A job that has run for a while (`running`), exactly-once on PostgreSQL: after draining "
             f"{found['warm_up']:,} events, bursts of {found['burst']:,} run at {rates} msgs/s "
             f"({_fmt(r['eos_running_vs_raw'])} of raw kafka-python's {_fmt(found['raw_consume_msgs_s'][0])} on "
             f"the same topic, in the same section); peak driver RSS "
             f"{' / '.join(_fmt(mb) for mb in found['peak_rss_mb'])} MB."]
    cpu = next((c for c in reversed(found["cpu_per_100k"]) if c), None)
    if cpu and cpu.get("wall"):
        spent = {kind: value for kind, value in cpu.items() if kind != "wall"}
        lines[-1] += (" Its last burst's CPU s per 100,000 records: " +
                      ", ".join(f"{kind} {value:.2f}" for kind, value in spent.items()) +
                      f"; {sum(spent.values()) / cpu['wall']:.2f} cores busy.")
    return lines


#: Who spends CPU (``benchmarks.stack.tree_cpu`` and the raw consumer), in the table's order.
CPU_KINDS = ("jvm", "python_driver", "python_workers", "postgresql", "consumer", "broker")


def _cpu_lines(r: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """CPU seconds per 100,000 records, the running job's (and, where measured, a new driver's over the window
    its drain's rate is timed in) against raw kafka-python's, and the rate that CPU per record allows on this
    machine's cores."""
    eos, new, raw = (found.get(k) for k in ("eos/postgresql, warm", "eos/postgresql, new driver", "raw kafka-python"))
    if not eos or not raw:
        return []
    cores = found["cores"]
    columns = [("eos", eos), *([("new", new)] if new else []), ("raw", raw)]
    lines = ["", "## Where the cores go (CPU seconds per 100,000 records)", "",
             "| who | exactly-once, a running job (PostgreSQL) | "
             + ("exactly-once, a new driver's drain (PostgreSQL) | " if new else "") + "raw kafka-python |",
             "|---|" + "---:|" * len(columns)]

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    for kind in CPU_KINDS:
        if any(kind in d for _, d in columns):
            lines.append(row(kind, [_fmt(d.get(kind)) for _, d in columns]))
    spent = {name: sum(v for k, v in d.items() if k != "wall") for name, d in columns}
    lines += [row("**all**", [_fmt(spent[name]) for name, _ in columns]),
              row("wall seconds", [_fmt(d["wall"]) for _, d in columns]),
              row("cores busy", [_fmt(spent[name] / d["wall"]) for name, d in columns])]
    raw_rate = r.get("raw_consume_msgs_s")
    ceiling = cores * 100_000 / spent["eos"]
    lines += ["", f"Over the running job's warm batches (the rate above) and one raw read. At this CPU per record "
              f"the job cannot pass {_fmt(ceiling)} msgs/s on {cores} cores with every core busy"
              + (f", {_fmt(ceiling / raw_rate)} of raw kafka-python; `eos_vs_raw` 0.5 asks for at most "
                 f"{_fmt(cores * 100_000 / (0.5 * raw_rate))} CPU s per 100,000 records" if raw_rate else "")
              + ". The raw consumer decodes in one Python thread and the broker serves it; the job reads, "
              "parses, aggregates and commits, and its database and broker share the same cores."]
    if new:
        new_ceiling = cores * 100_000 / spent["new"]
        lines += ["", "A new driver's drain: the median drain of the throughput section, over the window its rate "
                  "(`eos_vs_raw`) is timed in, from its first batch's commit to its last (the JVM's compilers "
                  f"included). Its CPU per record allows at most {_fmt(new_ceiling)} msgs/s on {cores} cores"
                  + (f", {_fmt(new_ceiling / raw_rate)} of raw kafka-python" if raw_rate else "") + "."]
    return lines


#: The JVM table's rows, in order: the kinds of thread ``jvm_thread_cpu`` names, then the rest.
JVM_THREAD_ROWS = (*(kind for kind, _ in JVM_THREAD_KINDS), "other")


def _jvm_thread_lines(found: dict[str, Any]) -> list[str]:
    """The JVM's CPU by kind of thread: a new driver over its whole life (and, where measured, over the window
    its drain's rate is timed in), and a running job per 100,000 records; how much of a new driver's drain
    is the JIT's warm-up."""
    new, window, running = (found.get(k) for k in ("new_driver", "new_driver_window_per_100k", "running_per_100k"))
    if not new or not running:
        return []
    backlog = found["backlog"]
    per_100k = {kind: seconds * 100_000 / backlog for kind, seconds in new.items()}
    columns = [new, per_100k, *([window] if window else []), running]
    lines = ["", "## Where the JVM spends its CPU (seconds)", "",
             f"| thread | a new driver, its start and a {backlog:,}-event drain | the same per 100,000 records | "
             + ("a new driver, over its rate's window, per 100,000 records | " if window else "")
             + "a running job, per 100,000 records |", "|---|" + "---:|" * len(columns)]
    for kind in JVM_THREAD_ROWS:
        lines.append(f"| {kind} | " + " | ".join(_fmt(d.get(kind)) for d in columns) + " |")
    totals = [sum(v for k, v in d.items() if k != "wall") for d in columns]
    lines += ["| **all** | " + " | ".join(_fmt(t) for t in totals) + " |",
              "", "Exactly-once on PostgreSQL: the throughput section's median new driver from its spawn to its "
              "graceful stop"
              + (" and over the window its rate is timed in (from its first batch's commit to its last)"
                 if window else "")
              + ", and the longer drain's batches after its warm-up (the running job's rate above). "
              "`jit`: HotSpot's C1 and C2 compiler threads; `tasks`: Spark's task threads (reading, parsing, "
              "caching, aggregating); `python_calls`: py4j's threads, which run the Python driver's calls "
              "(collects, plans); `stream`: the query's micro-batch loop; `gc`: the serial collector; `other`: the "
              "rest, threads that ended included. A new driver's records pay for its start and for the JIT's "
              "warm-up, and its per-record code runs interpreted or from C1 until C2 has compiled it."]
    return lines


def _breakdown_lines(found: dict[str, dict[str, float]]) -> list[str]:
    """Seconds per steady batch and phase, per drain: Spark's phases, the sink's, and the rest."""
    if not found:
        return []
    drains = sorted(found)
    phases = sorted({p for d in drains for p in found[d] if p != "batches"},
                    key=lambda p: -max(found[d].get(p, 0) for d in drains))
    lines = ["## Where a steady batch's time goes (seconds per batch)", "",
             "| phase | " + " | ".join(f"`{d}`" for d in drains) + " |", "|---|" + "---:|" * len(drains)]
    per_batch = {d: max(found[d].get("batches", 0), 1) for d in drains}
    for phase in phases:
        lines.append(f"| {phase} | " + " | ".join(_fmt(found[d].get(phase, 0) / per_batch[d]) for d in drains) + " |")
    lines += ["", "From each driver's progress lines: Spark's own phases (`spark_*`, StreamingQueryProgress.durationMs), "
              "the transactional sink's (`sink_*`: read_parse runs the job's transform on the batch; results "
              "computes and collects the result tables; write is the rows' INSERTs; commit the rest of the "
              "transaction), and `other`, the trigger's remaining time (for the append sink, its whole "
              "batch).", ""]
    return lines


def _profile_lines(found: dict[str, Any]) -> list[str]:
    """The ``profile`` section: the example job against the minimal parse, and the JVM task threads' split."""
    if not found:
        return []
    example, minimal = found["example"], found["minimal_parse"]
    lines = ["## Where reading and parsing goes (`profile`)", "",
             "| exactly-once on PostgreSQL | msgs/s | read_parse s per batch |", "|---|---:|---:|"]
    for name, drained in (("the example job", example), ("the minimal parse (`benchmarks/jobs/events_minimal_parse.py`)",
                                                          minimal)):
        steady = drained["breakdown_s"]
        per_batch = steady.get("sink_read_parse", 0) / max(steady.get("batches", 0), 1)
        lines.append(f"| {name} | {_fmt(drained['msgs_s'])} | {_fmt(per_batch)} |")
    lines += ["", f"The minimal parse runs at {_fmt(ratio(minimal['msgs_s'], example['msgs_s']))} of the example "
              "job's rate, one new driver each: the gap is what the example job's validation costs, within the "
              "spread of one drain's rate (a new driver's 300,000-event drain varies by a quarter or more between "
              "runs on a shared 2-core host; the throughput section's three drains show it). The JVM's samples "
              "below say where the time goes more steadily.", ""]
    if example.get("jvm_task_shares"):
        names = list(example["jvm_task_shares"]) + [n for n in minimal.get("jvm_task_shares", {})
                                                    if n not in example["jvm_task_shares"]]
        lines += [f"Both drains recorded by Java Flight Recorder: what their JVM task threads were evaluating "
                  f"({example['jvm_task_samples']} and {minimal.get('jvm_task_samples', 0)} samples; Python time is "
                  "not sampled):", "", "| evaluating | example job | minimal parse |", "|---|---:|---:|"]
        lines += [f"| {name} | {_share(example['jvm_task_shares'].get(name))} | "
                  f"{_share(minimal.get('jvm_task_shares', {}).get(name))} |" for name in names]
        lines.append("")
    return lines


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _upgrade_lines(found: dict[str, Any], cold_s: float | None) -> list[str]:
    if not found:
        return []
    labels = {"upgrade_downtime_s/compatible": "compatible version (same generation): the old run's last "
                                               "committed batch -> the new run's first",
              "upgrade_downtime_s/incompatible": "incompatible version (reset to generation 2): the same",
              "upgrade_incompatible_prewarmed_s": "incompatible version: `stream_upgrade` triggered -> the new "
                                                  f"run's first batch (without prewarm: `upgrade_incompatible_s` "
                                                  f"{_fmt(cold_s)})"}
    return ["## Upgrades with a pre-warmed successor (`stream_upgrade`, `prewarm`)", "",
            "| measure | seconds | runs |", "|---|---:|---:|",
            *[f"| {labels[k]} | {_fmt(v['median'])} | {v['runs']} |" for k, v in found.items()], ""]


def _standby_lines(standby: dict[str, Any] | None) -> list[str]:
    if not standby:
        return []
    return [
        "## `mttr_standby_kill9_s`: SIGKILL of the active driver -> the warm standby's first committed batch", "",
        "A job with `standby` on, events arriving all the time; after each takeover a new standby warms up "
        "before the next kill, as the health DAG starts one.", "",
        "| p50 s | p95 s | max s | kills | p50 / `cold_start_s` |", "|---:|---:|---:|---:|---:|",
        f"| {_fmt(standby['p50'])} | {_fmt(standby['p95'])} | {_fmt(standby['max'])} | {standby['runs']} | "
        f"{_fmt(standby['vs_cold_start'])} |", "",
        "| memory | waiting standby MB | idle active driver MB | ratio |", "|---|---:|---:|---:|",
        f"| RSS | {_fmt(standby['standby_rss_mb'])} | {_fmt(standby['idle_driver_rss_mb'])} | "
        f"{_fmt(standby['rss_vs_idle_driver'])} |",
        f"| PSS | {_fmt(standby['standby_pss_mb'])} | {_fmt(standby['idle_driver_pss_mb'])} | "
        f"{_fmt(standby['pss_vs_idle_driver'])} |", "",
        "Each standby waited a random 0-90 s once warm before its kill (Spark retires Python workers idle "
        "for a minute). Memory: both trees (JVM, Python driver, Python workers) measured at the same moment, "
        "the active run caught up and nothing arriving. p95 is the nearest rank.", ""]


def markdown(r: dict[str, Any]) -> str:
    runs = r["runs"]
    lines = [
        "# Benchmark results",
        "",
        f"{r['meta'].get('finished', '')} · {r['meta'].get('machine', '')} · profile `{r['meta'].get('profile')}` "
        f"· {r['meta'].get('minutes', '?')} min",
        "",
        *_section_line(r["meta"]),
        "## Recovery (medians)",
        "",
        "| measure | seconds | runs | what it is |",
        "|---|---:|---:|---|",
        f"| `cold_start_s` | {_fmt(r['cold_start_s'])} | {runs['cold_start_s']} | spawn of a driver on an existing "
        "checkpoint -> first committed batch: the floor for any restart |",
        f"| `cold_start_default_jit_s` | {_fmt(r['cold_start_default_jit_s'])} | {runs['cold_start_default_jit_s']} | "
        "the same with HotSpot's own JIT thresholds (C2 compiling the start's code) |",
        f"| `cold_start_no_archive_s` | {_fmt(r['cold_start_no_archive_s'])} | {runs['cold_start_no_archive_s']} | "
        "the same as shipped without the JVM class archive |",
        f"| `cold_start_uncut_s` | {_fmt(r['cold_start_uncut_s'])} | {runs['cold_start_uncut_s']} | the same, "
        "also with Spark's Python zips as Spark ships them (sources only) |",
        f"| `cold_start_before_s` | {_fmt(r['cold_start_before_s'])} | {runs['cold_start_before_s']} | the code "
        f"the cold-start work started from ({BEFORE}, whose own run measured 26.1 s), run here in turn with the "
        "others, on the same Spark as `uncut`: the start the target halves |",
        f"| `detect_kill9_s` | {_fmt(r['detect_kill9_s'])} | {runs['detect_kill9_s']} | SIGKILL -> the polling health "
        "DAG's deferred sensor diagnoses DEAD (looks every 2 s; `dag.test()`, so the sensor is always watching) |",
        f"| `mttr_kill9_s` | {_fmt(r['mttr_kill9_s'])} | {runs['mttr_kill9_s']} | SIGKILL -> first batch committed by "
        "the run `RecoverStreamingJobOperator` started |",
        f"| `baseline_mttr_kill9_s` | {_fmt(r['baseline_mttr_kill9_s'])} | {runs['baseline_mttr_kill9_s']} | the "
        "same with `SparkSubmitOperator` + task retries, `retry_delay` 5 s (Airflow's default is 300 s, which "
        "adds about 295 s) |",
        f"| `upgrade_incompatible_s` | {_fmt(r['upgrade_incompatible_s'])} | {runs['upgrade_incompatible_s']} | "
        "`stream_upgrade` to a version with a new stateful operator -> its first committed batch (preflight, "
        "stop, archive, new generation from stored offsets) |",
        f"| `baseline_upgrade_incompatible` | – | – | {r['baseline_upgrade_incompatible']} |",
        "",
        "## Throughput (steady state, messages/s)",
        "",
        "| database | exactly-once | at-least-once | raw kafka-python | eos / raw | eos / alo |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for database, values in r["by_database"].items():
        lines.append(f"| {database} | {_fmt(values['eos_msgs_s'])} | {_fmt(values['alo_msgs_s'])} | "
                     f"{_fmt(r['raw_consume_msgs_s'])} | {_fmt(values['eos_vs_raw'])} | {_fmt(values['eos_vs_alo'])} |")
    if r.get("eos_confluent_msgs_s"):
        lines += ["", f"With the optional confluent-kafka reader (`kafka.reader`), exactly-once on PostgreSQL: "
                  f"{_fmt(r['eos_confluent_msgs_s'])} msgs/s, {_fmt(r['eos_confluent_vs_raw'])} of raw kafka-python."]
    lines += _warm_lines(r, r["scaling"].get("warm") or {})
    lines += _running_lines(r, r["scaling"].get("running") or {})
    lines += _cpu_lines(r, r["scaling"].get("cpu_per_100k") or {})
    lines += _jvm_thread_lines(r["scaling"].get("jvm_thread_cpu_s") or {})
    lines += ["", f"Runs: {', '.join(f'{k} {v}' for k, v in runs.items() if '/' in k or k.startswith('raw'))}.", ""]
    lines += _startup_lines({**(r["scaling"].get("startup_cuts_s") or {}), **(r["scaling"].get("startup_s") or {})})
    lines += _breakdown_lines(r["scaling"].get("breakdown_s") or {})
    lines += _profile_lines(r["scaling"].get("profile") or {})
    scaling = r["scaling"]
    for name, axis in (("history", "batches"), ("partitions", "partitions")):
        series = scaling.get(name)
        if series:
            lines += [f"## Recovery and reset against {axis}", "", f"| {axis} | recovery s | reset s |",
                      "|---:|---:|---:|"]
            resets = dict(_reset_points(series, axis))
            lines += [f"| {x} | {_fmt(a)} | {_fmt(resets.get(x))} |"
                      for x, a in zip(series[axis], series["recovery_s"], strict=True)]
            if series.get("backoff_s"):
                lines += ["", "Recovery excludes the recover operator's deliberate crash-loop backoff on one job's "
                          f"consecutive restarts ({', '.join(f'{b:.0f}' for b in series['backoff_s'])} s); "
                          "the reset is measured once, on the longest history."]
            lines.append("")
    rss = scaling.get("rss_vs_backlog")
    if rss:
        none = [None] * len(rss["backlog"])
        split = [rss.get("jvm_mb") or none, rss.get("python_mb") or none, rss.get("pss_mb") or none]
        ceiling = rss.get("max_offsets_per_trigger")
        lines += [f"## Peak driver RSS against backlog (maxOffsetsPerTrigger {ceiling:,})" if ceiling else
                  "## Peak driver RSS against backlog", "",
                  "| backlog | peak RSS MB | of which JVM | of which Python | peak PSS MB | msgs/s |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {b:,} | {_fmt(m)} | {_fmt(j)} | {_fmt(p)} | {_fmt(q)} | {_fmt(s)} |"
                  for b, m, j, p, q, s in zip(rss["backlog"], rss["peak_rss_mb"], *split, rss["msgs_s"], strict=True)]
        burst = rss.get("running_burst")
        if burst:
            lines += [f"| {burst['backlog']:,}, a burst {burst['after_s']} s into a run | {_fmt(burst['peak_rss_mb'])} "
                      f"| {_fmt(burst['jvm_mb'])} | {_fmt(burst['python_mb'])} | {_fmt(burst['pss_mb'])} "
                      f"| {_fmt(burst['msgs_s'])} |",
                      "", "A driver started on a backlog drains it with a JVM that is still compiling the per-record "
                      "code; the Python daemons and workers that looked up, created and planned the source are gone "
                      "once its first batch starts (`runtime.planner_workers`). The burst row is a running job: the driver "
                      "starts on an empty topic and is paused while the burst is produced, so it reads it in the "
                      "same batches."]
        lines += ["", "The Python share is the driver's interpreter and Spark's Python workers (one per running "
                  "task, reused); the JVM's heap is capped by spark.driver.memory. RSS is summed over the "
                  "processes, so the pages Spark's forked Python workers share with their daemon count once "
                  "per process; PSS divides each shared page among its sharers: what the tree really holds.", ""]
    life = scaling.get("rss_over_life")
    if life and life["minutes"]:
        lines += [f"## A running job's memory over {life['minutes'][-1]} minutes of a steady feed", "",
                  "| minute | peak RSS MB | of which JVM | of which Python | JVM threads | batches committed |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {m} | {_fmt(p)} | {_fmt(j)} | {_fmt(y)} | {t} | {b:,} |"
                  for m, p, j, y, t, b in zip(life["minutes"], life["peak_rss_mb"], life["jvm_mb"], life["python_mb"],
                                              life["jvm_threads"], life["batches"], strict=True)]
        lines += ["", f"Exactly-once on PostgreSQL, {life['events']:,} events sent in chunks of a few hundred while the "
                  "job runs, so it commits a batch or more a second; then it catches up, stops gracefully and is "
                  "audited. A drain is a few large batches; what a driver keeps per batch (Spark's records of its "
                  "jobs, stages and SQL executions, the threads of its query pools, compiled code) shows only "
                  "here.", ""]
    batch = scaling.get("batch_size")
    if batch:
        lines += [f"## Exactly-once on PostgreSQL against the batch size ({batch['backlog']:,}-event backlog)", "",
                  "| maxOffsetsPerTrigger | msgs/s | s per steady batch | peak RSS MB | of which JVM | of which Python "
                  "| peak PSS MB |", "|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {n:,} | {_fmt(m)} | {_fmt(s)} | {_fmt(p)} | {_fmt(j)} | {_fmt(y)} | {_fmt(q)} |"
                  for n, m, s, p, j, y, q in zip(batch["max_offsets_per_trigger"], batch["msgs_s"],
                                                 batch["seconds_per_batch"], batch["peak_rss_mb"], batch["jvm_mb"],
                                                 batch["python_mb"], batch.get("pss_mb") or [None] * len(batch["msgs_s"]),
                                                 strict=True)]
        lines += ["", "Most of a batch's time is fixed (planning and scheduling its Spark jobs, the Python data "
                  "source's per-batch workers): larger batches spread it over more records. maxOffsetsPerTrigger is "
                  "the ceiling: each run's first batch reads at most 10,000 records, the batches after it up to the "
                  "ceiling.", ""]
    real = r.get("mttr_real_airflow")
    if real:
        labels = {"watcher": "always-on watcher -> `stream_health` on the asset event (as shipped)",
                  "polling": "the old `stream_health`: every 5 min, a 4-min deferred sensor (`bench_polling_health`)",
                  "spark_submit": "`SparkSubmitOperator` + task retries (`retry_delay` 5 s)"}
        lines += ["## `mttr_real_airflow`: SIGKILL -> processing again under a real Airflow", "",
                  "Scheduler, triggerer, dag-processor and api-server as separate processes (LocalExecutor); "
                  "kills at uniformly random moments, one fresh deployment per way.", "",
                  "| how the job is watched | p50 s | p95 s | max s | kills | measured |",
                  "|---|---:|---:|---:|---:|---|"]
        lines += [f"| {labels[v]} | {_fmt(x['p50'])} | {_fmt(x['p95'])} | {_fmt(x['max'])} | {x['runs']} | "
                  f"{x.get('measured') or 'an earlier run'} |" for v, x in real.items()]
        lines += ["", "p95 is the nearest rank: with 10 kills, the largest.", ""]
    lines += _standby_lines(r.get("standby"))
    lines += _upgrade_lines(r.get("upgrade_downtime") or {}, r.get("upgrade_incompatible_s"))
    lines += ["## Exactly-once over every run", "",
              f"{r['audited_records']:,} records audited: lost **{r['lost']}**, duplicated **{r['duplicated']}**.", "",
              "## Targets", "", "| target | value | limit | met |", "|---|---:|---:|:-:|"]
    lines += [f"| {t['target']} | {_fmt(t['value'])} | {_fmt(t['limit'])} | "
              f"{'yes' if t['met'] else ('no' if t['met'] is False else '–')} |" for t in r["targets"]]
    return "\n".join(lines) + "\n"


def plots(r: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    names = ["cold start", "provider kill -9", "baseline kill -9", "incompatible upgrade"]
    keys = ["cold_start_s", "mttr_kill9_s", "baseline_mttr_kill9_s", "upgrade_incompatible_s"]
    samples = r["samples"]
    if any(r[key] is not None for key in keys):
        recovery_plot(r, names, keys, samples, save)
    if any(v["eos_msgs_s"] or v["alo_msgs_s"] for v in r["by_database"].values()):
        throughput_plot(r, save)
    scaling_plots(r, save)
    return written


def recovery_plot(r, names, keys, samples, save) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, key in enumerate(keys):
        values = samples.get(key, [])
        ax.scatter([i] * len(values), values, color="grey", s=12, zorder=3)
        if r[key] is not None:
            ax.bar(i, r[key], color=["#9ecae1", "#3182bd", "#e6550d", "#31a354"][i], alpha=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds until a batch commits")
    ax.set_title("Time to processing again (median bars, runs as dots)")
    save(fig, "recovery.png")


def throughput_plot(r, save) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    databases = list(r["by_database"])
    width = 0.25
    for j, (label, key) in enumerate((("exactly-once", "eos_msgs_s"), ("at-least-once", "alo_msgs_s"))):
        ax.bar([i + j * width for i in range(len(databases))],
               [r["by_database"][d][key] or 0 for d in databases], width, label=label)
    if r["raw_consume_msgs_s"]:
        ax.axhline(r["raw_consume_msgs_s"], color="black", linestyle="--", label="raw kafka-python")
    ax.set_xticks([i + width / 2 for i in range(len(databases))], databases)
    ax.set_ylabel("messages / s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Steady-state throughput on a backlog")
    save(fig, "throughput.png")


def _reset_points(series: dict[str, list], axis: str) -> list[tuple[Any, float]]:
    """(x, reset seconds): a series may time the reset on its last levels only (the history series, once
    on the longest history)."""
    xs = series[axis][len(series[axis]) - len(series["reset_s"]):]
    return list(zip(xs, series["reset_s"], strict=True))


def scaling_plots(r, save) -> None:
    import matplotlib.pyplot as plt

    for name, axis, log_x in (("history", "batches", True), ("partitions", "partitions", True)):
        series = r["scaling"].get(name)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(series[axis], series["recovery_s"], marker="o", label="kill -9 -> processing")
        ax.plot(*zip(*_reset_points(series, axis), strict=True), marker="s", label="reset -> processing")
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel("committed batches in the checkpoint" if name == "history" else "partitions")
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.set_title(f"Recovery and reset against {axis}")
        save(fig, f"scaling_{name}.png")

    rss = r["scaling"].get("rss_vs_backlog")
    if rss:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(rss["backlog"], rss["peak_rss_mb"], marker="o", label="total")
        for key, label in (("jvm_mb", "JVM"), ("python_mb", "Python")):
            if rss.get(key):
                ax.plot(rss["backlog"], rss[key], marker=".", linestyle="--", label=label)
        ax.legend()
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("backlog (events)")
        ax.set_ylabel("peak driver RSS (MB)")
        ax.set_title("Driver memory against backlog (batches bounded)")
        save(fig, "rss_vs_backlog.png")


def write(r: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(r, indent=2, sort_keys=False) + "\n")
    (out / "latest.md").write_text(markdown(r))
    return [out / "latest.json", out / "latest.md", *plots(r, out)]
