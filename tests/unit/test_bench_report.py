"""The benchmark report's arithmetic: medians, ratios, run counts and target verdicts (pure; the
measurements themselves run with ``make bench``)."""

from __future__ import annotations

import json

import pytest

from benchmarks import report
from benchmarks.stack import jvm_spawns, thread_kind
from benchmarks.throughput import WARM_UP_BATCHES, cpu_per_records, steady_rate, warm_rate

SAMPLES = {
    "cold_start_s": [12.0, 14.0, 13.0],
    "mttr_kill9_s": [20.0, 26.0, 22.0],
    "detect_kill9_s": [0.5, 4.0, 2.0],
    "baseline_mttr_kill9_s": [30.0, 31.0, 33.0],
    "upgrade_incompatible_s": [60.0, 70.0],
    "raw_consume_msgs_s": [40_000.0, 50_000.0, 45_000.0],
    "eos_msgs_s/postgresql": [9_000.0, 11_000.0],
    "alo_msgs_s/postgresql": [10_000.0, 12_000.0],
    "eos_msgs_s/sqlite": [8_000.0],
    "alo_msgs_s/sqlite": [8_800.0],
    "baseline_upgrade_incompatible": "no automatic recovery",
    "lost": 0,
    "duplicated": 0,
    "audited_records": 1000,
    "scaling": {"history": {"batches": [10, 100, 1000], "recovery_s": [20.0, 21.0, 35.0], "reset_s": [30.0, 31.0, 32.0]},
                "rss_vs_backlog": {"backlog": [1, 2], "peak_rss_mb": [900.0, 950.0], "msgs_s": [1.0, 1.0]}},
}


def test_medians_ratios_and_run_counts():
    r = report.summarise(SAMPLES, {"profile": "test"})
    assert r["mttr_kill9_s"] == 22.0 and r["runs"]["mttr_kill9_s"] == 3
    assert r["upgrade_incompatible_s"] == 65.0 and r["runs"]["upgrade_incompatible_s"] == 2
    assert r["raw_consume_msgs_s"] == 45_000.0
    assert r["eos_msgs_s"] == 10_000.0 and r["alo_msgs_s"] == 11_000.0  # PostgreSQL under the plain names
    assert r["eos_vs_raw"] == round(10_000 / 45_000, 3) and r["eos_vs_alo"] == round(10_000 / 11_000, 3)
    assert r["eos_msgs_s_sqlite"] == 8_000.0 and r["eos_vs_alo_sqlite"] == round(8_000 / 8_800, 3)
    assert r["baseline_upgrade_incompatible"] == "no automatic recovery"


def test_targets_say_which_are_met():
    verdicts = {t["target"]: t["met"] for t in report.summarise(SAMPLES, {})["targets"]}
    assert verdicts["mttr_kill9_s <= cold_start_s + 10"] is True  # 22 <= 23
    assert verdicts["mttr_kill9_s < baseline_mttr_kill9_s"] is True
    assert verdicts["eos_vs_raw >= 0.5 (PostgreSQL)"] is False
    assert verdicts["eos_vs_alo >= 0.9 (PostgreSQL)"] is True
    assert verdicts["recovery_s flat across checkpoint history (largest / smallest)"] is False  # 35 / 20
    assert verdicts["reset_s flat across checkpoint history (largest / smallest)"] is True
    assert verdicts["peak driver RSS flat across backlog sizes (largest / smallest)"] is True
    assert verdicts["peak driver RSS <= 1200 MB, a driver started on a backlog"] is True  # 950
    assert verdicts["lost == 0 and duplicated == 0"] is True
    lossy = report.summarise({**SAMPLES, "duplicated": 2}, {})["targets"]
    assert [t["met"] for t in lossy if t["target"].startswith("lost")] == [False]


def test_missing_sections_give_no_number_and_no_verdict():
    r = report.summarise({"lost": 0, "duplicated": 0}, {})
    assert r["mttr_kill9_s"] is None and r["eos_vs_raw"] is None and r["runs"]["mttr_kill9_s"] == 0
    assert [t["target"] for t in r["targets"]] == ["lost == 0 and duplicated == 0"]
    assert "| `mttr_kill9_s` | – | 0 |" in report.markdown({**r, "meta": {}})


def test_steady_rate_leaves_out_the_first_batch():
    assert steady_rate([(500, 10.0), (1000, 11.0), (1000, 12.0)]) == 1000.0
    assert steady_rate([(500, 10.0)]) is None


def test_the_warm_rate_leaves_out_the_jit_warm_up_batches():
    batches = [(10_000, 10.0), (100_000, 15.0), (100_000, 18.0), (100_000, 20.0), (100_000, 22.0)]
    assert WARM_UP_BATCHES == 3
    assert warm_rate(batches) == 50_000.0  # timed from the third batch's commit: 200,000 records in 4 s
    assert steady_rate(batches) == 400_000 / 12.0
    assert warm_rate(batches[:3]) is None  # a drain too short to get past the warm-up gives no warm rate


def test_the_longer_drain_reports_its_warm_rate_and_counts_in_the_memory_targets():
    warm = {"backlog": 1_000_000, "msgs_s": 20_000.0, "warm_up_batches": 3, "peak_rss_mb": 1_300.0,
            "peak_rss_jvm_mb": 600.0, "peak_rss_python_mb": 700.0, "peak_pss_mb": 1_100.0}
    samples = {**SAMPLES, "eos_warm_msgs_s": [27_000.0], "scaling": {**SAMPLES["scaling"], "warm": warm}}
    r = report.summarise(samples, {})
    assert r["eos_warm_vs_raw"] == round(27_000 / 45_000, 3)
    text = report.markdown({**r, "meta": {}})
    assert "a 1,000,000-event drain runs at 20,000 msgs/s from its first batch and 27,000 msgs/s" in text
    verdicts = {t["target"]: (t["value"], t["met"]) for t in r["targets"]}
    assert verdicts["peak driver RSS <= 1200 MB, a driver started on a backlog"] == (1_300.0, False)
    assert verdicts["peak driver RSS flat across backlog sizes (largest / smallest)"][0] == round(1_300 / 900, 3)


def test_a_running_job_is_judged_against_raw_read_in_its_own_section():
    running = {"warm_up": 600_000, "burst": 300_000, "msgs_s": [30_000.0, 32_000.0], "peak_rss_mb": [1_050.0, 1_060.0],
               "cpu_per_100k": [None, {"jvm": 1.0, "postgresql": 0.5, "wall": 1.0}],
               "raw_consume_msgs_s": [60_000.0]}
    samples = {**SAMPLES, "eos_running_msgs_s": running["msgs_s"], "raw_running_msgs_s": [60_000.0],
               "scaling": {**SAMPLES["scaling"], "running": running}}
    r = report.summarise(samples, {})
    assert r["eos_running_msgs_s"] == 31_000.0
    assert r["eos_running_vs_raw"] == round(31_000 / 60_000, 3)  # not the throughput section's raw (45,000)
    text = report.markdown({**r, "meta": {}})
    assert "bursts of 300,000 run at 30,000 / 32,000 msgs/s (0.52 of raw kafka-python's 60,000" in text
    assert "jvm 1.00, postgresql 0.50; 1.50 cores busy." in text
    assert "A job that has run for a while" not in report.markdown({**report.summarise(SAMPLES, {}), "meta": {}})


def test_cpu_per_record_over_a_whole_burst_keeps_its_first_batch_as_the_start():
    batches = [(100_000, 10.0), (100_000, 12.0), (100_000, 14.0)]
    samples = [(t, {"jvm": 2.0 * t}) for t in (10.0, 12.0, 14.0)]
    assert cpu_per_records(samples, batches, skip=0) == pytest.approx({"jvm": 2.0 * 4 / 2, "wall": 4 / 2})


def test_cpu_per_record_is_taken_over_the_warm_rates_window():
    batches = [(10_000, 10.0), (100_000, 15.0), (100_000, 18.0), (100_000, 20.0), (100_000, 22.0)]
    samples = [(t, {"jvm": 2.0 * t, "postgresql": 0.5 * t}) for t in (9.9, 14.0, 18.1, 19.0, 21.9, 23.0)]
    found = cpu_per_records(samples, batches)
    # samples nearest the window's ends: 18.1 and 21.9 (3.8 s); 200,000 records after the third batch
    assert found == pytest.approx({"jvm": 2.0 * 3.8 / 2, "postgresql": 0.5 * 3.8 / 2, "wall": 3.8 / 2})
    assert cpu_per_records(samples, batches[:3]) is None
    assert cpu_per_records(samples[:1], batches) is None


def test_the_cpu_table_sets_the_running_job_beside_raw_and_gives_the_ceiling_it_allows():
    cpu = {"cores": 2, "eos/postgresql, warm": {"jvm": 4.0, "python_workers": 2.0, "postgresql": 1.0, "wall": 4.0},
           "raw kafka-python": {"consumer": 1.8, "broker": 0.4, "wall": 2.0}}
    samples = {**SAMPLES, "scaling": {**SAMPLES["scaling"], "cpu_per_100k": cpu}}
    text = report.markdown({**report.summarise(samples, {}), "meta": {}})
    assert "| jvm | 4.00 | – |" in text and "| consumer | – | 1.80 |" in text
    assert "| **all** | 7.00 | 2.20 |" in text and "| cores busy | 1.75 | 1.10 |" in text
    # 2 cores / 7 CPU s per 100,000 records: 28,571 msgs/s at most, 0.63 of raw's median 45,000;
    # half of raw (22,500 msgs/s) on 2 cores leaves 8.89 CPU s per 100,000 records
    assert "cannot pass 28,571 msgs/s on 2 cores" in text and "0.63 of raw" in text and "at most 8.89 CPU s" in text


def test_the_cpu_table_sets_a_new_drivers_drain_between_the_running_job_and_raw():
    cpu = {"cores": 2, "eos/postgresql, warm": {"jvm": 4.0, "python_workers": 2.0, "postgresql": 1.0, "wall": 4.0},
           "eos/postgresql, new driver": {"jvm": 8.0, "python_workers": 1.5, "postgresql": 0.5, "wall": 5.0},
           "raw kafka-python": {"consumer": 1.8, "broker": 0.4, "wall": 2.0}}
    samples = {**SAMPLES, "scaling": {**SAMPLES["scaling"], "cpu_per_100k": cpu}}
    text = report.markdown({**report.summarise(samples, {}), "meta": {}})
    assert "| who | exactly-once, a running job (PostgreSQL) | exactly-once, a new driver's drain (PostgreSQL) " \
           "| raw kafka-python |" in text
    assert "| jvm | 4.00 | 8.00 | – |" in text and "| **all** | 7.00 | 10.00 | 2.20 |" in text
    assert "| cores busy | 1.75 | 2.00 | 1.10 |" in text
    # 2 cores / 10 CPU s per 100,000 records: 20,000 msgs/s at most, 0.44 of raw's median 45,000
    assert "allows at most 20,000 msgs/s on 2 cores, 0.44 of raw" in text


def test_a_process_the_jvm_is_starting_is_not_counted_twice():
    # pid -> (parent, runs java): the JVM (1) under the bench, a child it has not exec'd yet (2), the
    # Python driver (3) and a worker (4); a java process whose parent is not a JVM is a JVM itself (5)
    tree = {1: (100, True), 2: (1, True), 3: (1, False), 4: (3, False), 5: (3, True)}
    assert jvm_spawns(tree) == {2}


def test_jvm_threads_are_told_apart_by_their_names():
    # Linux keeps a thread's first 15 characters (comm)
    assert thread_kind("C2 CompilerThre") == thread_kind("C1 CompilerThre") == "jit"
    assert thread_kind("Executor task l") == thread_kind("Executor task i") == "tasks"
    assert thread_kind("Thread-12") == "python_calls"
    assert thread_kind("stream executio") == "stream"
    assert thread_kind("VM Thread") == "gc"
    assert thread_kind("dag-scheduler-e") is None and thread_kind("Signal Dispatch") is None


def test_the_jvm_thread_table_sets_a_new_drivers_life_beside_a_running_jobs_records():
    found = {"backlog": 300_000,
             "new_driver": {"jit": 9.0, "tasks": 4.5, "python_calls": 2.0, "stream": 1.5, "gc": 1.0, "other": 3.0},
             "running_per_100k": {"jit": 0.1, "tasks": 0.6, "python_calls": 0.05, "stream": 0.1, "gc": 0.1,
                                  "other": 0.05, "wall": 2.0}}
    samples = {**SAMPLES, "scaling": {**SAMPLES["scaling"], "jvm_thread_cpu_s": found}}
    text = report.markdown({**report.summarise(samples, {}), "meta": {}})
    assert "| thread | a new driver, its start and a 300,000-event drain |" in text
    # per 100,000 records: a third of the new driver's whole life
    assert "| jit | 9.00 | 3.00 | 0.10 |" in text and "| tasks | 4.50 | 1.50 | 0.60 |" in text
    assert "| **all** | 21.00 | 7.00 | 1.00 |" in text  # the window's wall seconds are not CPU
    # a drain without the running job's window says nothing about the warm-up
    samples["scaling"]["jvm_thread_cpu_s"] = {**found, "running_per_100k": None}
    assert "Where the JVM spends" not in report.markdown({**report.summarise(samples, {}), "meta": {}})


def test_the_jvm_thread_table_adds_a_new_drivers_rate_window_where_measured():
    found = {"backlog": 300_000,
             "new_driver": {"jit": 9.0, "tasks": 4.5, "python_calls": 2.0, "stream": 1.5, "gc": 1.0, "other": 3.0},
             "new_driver_window_per_100k": {"jit": 2.5, "tasks": 2.0, "python_calls": 0.5, "stream": 0.2,
                                            "gc": 0.3, "other": 0.5, "wall": 3.0},
             "running_per_100k": {"jit": 0.1, "tasks": 0.6, "python_calls": 0.05, "stream": 0.1, "gc": 0.1,
                                  "other": 0.05, "wall": 2.0}}
    samples = {**SAMPLES, "scaling": {**SAMPLES["scaling"], "jvm_thread_cpu_s": found}}
    text = report.markdown({**report.summarise(samples, {}), "meta": {}})
    assert "| the same per 100,000 records | a new driver, over its rate's window, per 100,000 records |" in text
    assert "| jit | 9.00 | 3.00 | 2.50 | 0.10 |" in text and "| **all** | 21.00 | 7.00 | 6.00 | 1.00 |" in text


def test_rss_table_splits_jvm_and_python_when_measured():
    split = {**SAMPLES["scaling"]["rss_vs_backlog"], "jvm_mb": [500.0, 510.0], "python_mb": [400.0, 440.0],
             "pss_mb": [700.0, 720.0]}
    measured = report.markdown(report.summarise({**SAMPLES, "scaling": {"rss_vs_backlog": split}}, {}))
    assert "| 2 | 950 | 510 | 440 | 720 | 1.00 |" in measured
    older = report.markdown(report.summarise(SAMPLES, {}))  # results written before the split: no numbers made up
    assert "| 2 | 950 | – | – | – | 1.00 |" in older


def test_the_breakdown_reads_the_drivers_progress_lines_and_leaves_out_the_first_batch(tmp_path):
    from benchmarks.throughput import breakdown

    def line(batch_id, rows, trigger_ms, sink):
        progress = {"batch_id": batch_id, "input_rows": rows, "sink_s": sink,
                    "duration_ms": {"triggerExecution": trigger_ms, "queryPlanning": 100, "addBatch": 900}}
        return f"2026-11-24 10:00:00,000 INFO airflow_stream_provider.runtime.listener: progress {json.dumps(progress)}"

    log = tmp_path / "driver.log"
    log.write_text("\n".join([
        "2026-11-24 10:00:00,000 INFO something else",
        line(0, 100, 9000, {"read_parse": 5.0, "results": 3.0}),  # the first batch: cold, left out
        line(1, 0, 50, None),  # an idle trigger: no records, left out
        line(2, 100, 1200, {"read_parse": 0.6, "results": 0.3}),
        line(3, 100, 1000, {"read_parse": 0.5, "results": 0.2}),
    ]) + "\n")
    found = breakdown(str(log))
    assert found["batches"] == 2
    assert round(found["sink_read_parse"], 3) == 1.1 and round(found["sink_results"], 3) == 0.5
    assert round(found["spark_plan"], 3) == 0.2
    assert round(found["other"], 3) == round(2.2 - 1.1 - 0.5 - 0.2, 3), "the trigger's time beyond the phases"
    table = "\n".join(report._breakdown_lines({"eos/postgresql": found}))
    assert "| sink_read_parse | 0.55 |" in table


def test_the_batch_size_table_shows_rate_time_and_memory_per_size():
    series = {"max_offsets_per_trigger": [5000, 50000], "msgs_s": [5000.0, 12000.0], "seconds_per_batch": [0.9, 2.4],
              "peak_rss_mb": [1900.0, 2000.0], "jvm_mb": [800.0, 850.0], "python_mb": [1100.0, 1150.0],
              "pss_mb": [1600.0, 1700.0], "backlog": 150000}
    text = report.markdown(report.summarise({**SAMPLES, "scaling": {"batch_size": series}}, {}))
    assert "against the batch size (150,000-event backlog)" in text
    assert "| 50,000 | 12,000 | 2.40 | 2,000 | 850 | 1,150 | 1,700 |" in text


def test_the_time_budget_is_judged_on_a_whole_default_run_only():
    every = list(report.SECTIONS)
    budget = f"whole default profile under {report.BUDGET_MINUTES} min"

    def verdict(meta):
        verdicts = {t["target"]: t["met"] for t in report.summarise(SAMPLES, meta)["targets"]}
        return verdicts.get(budget, "absent")

    assert verdict({"profile": "default", "sections": every, "minutes": 27.5}) is True
    assert verdict({"profile": "default", "sections": every, "minutes": 31.6}) is False
    assert verdict({"profile": "default", "sections": ["history"], "minutes": 9.0}) == "absent"
    assert verdict({"profile": "quick", "sections": every, "minutes": 4.0}) == "absent"


def test_optional_sections_are_outside_the_budget():
    meta = {"profile": "default", "sections": list(report.SECTIONS) + ["cold_cuts"], "minutes": 33.0,
            "section_minutes": {"cold": 2.0, "cold_cuts": 5.0}}
    budget = next(t for t in report.summarise(SAMPLES, meta)["targets"] if t["target"].startswith("whole default"))
    assert (budget["value"], budget["met"]) == (28.0, True)


def test_the_startup_table_takes_the_cuts_from_their_section_and_shipped_from_the_latest_cold_run():
    cuts = {kind: {"launch": 1.0, "total": 12.0} for kind in ("shipped", "default_jit", "no_archive", "uncut")}
    scaling = {"startup_cuts_s": cuts, "startup_s": {"shipped": {"launch": 0.9, "total": 9.5}}}
    text = report.markdown(report.summarise({**SAMPLES, "scaling": scaling}, {}))
    assert "| phase | `shipped` | `default_jit` | `no_archive` | `uncut` |" in text
    assert "| total | 9.50 | 12.00 | 12.00 | 12.00 |" in text


def test_minutes_per_section_are_reported():
    meta = {"profile": "default", "minutes": 3.5,
            "section_minutes": {"stack": 0.4, "cold": 1.25, "history": 1.85}}
    markdown = report.markdown(report.summarise(SAMPLES, meta))
    assert "Minutes per section: stack 0.4, cold 1.2, history 1.9." in markdown


def test_real_airflow_percentiles_table_and_target():
    watcher = [30.0, 28.0, 31.0, 29.0, 27.0, 33.0, 30.5, 29.5, 28.5, 32.0]
    samples = {**SAMPLES, "mttr_real_airflow/watcher": watcher,
               "mttr_real_airflow/polling": [40.0, 260.0, 35.0], "mttr_real_airflow/spark_submit": [31.0],
               "mttr_real_airflow_measured": {"watcher": "2026-11-27 19:30 UTC"},
               "mttr_real_airflow_minutes": {"watcher": 9.5}}
    r = report.summarise(samples, {"profile": "test"})
    assert r["mttr_real_airflow"]["watcher"] == {"runs": 10, "p50": 29.5, "p95": 33.0, "max": 33.0,
                                                 "measured": "2026-11-27 19:30 UTC", "minutes": 9.5}
    assert r["mttr_real_airflow"]["polling"]["p50"] == 40.0 and r["mttr_real_airflow"]["polling"]["max"] == 260.0
    verdict = {t["target"]: t for t in r["targets"]}["mttr_real_airflow watcher p95 <= cold_start_s + 5"]
    assert verdict["limit"] == 18.0 and verdict["met"] is False  # cold start median 13 s
    text = report.markdown(r)
    assert "## `mttr_real_airflow`" in text and "| 29.50 | 33.00 | 33.00 | 10 | 2026-11-27 19:30 UTC |" in text
    assert "| 40.00 | 260 | 260 | 3 | an earlier run |" in text
    assert "mttr_real_airflow" not in report.markdown(report.summarise(SAMPLES, {"profile": "test"}))


def test_the_memory_ceiling_is_judged_on_every_drain_and_on_a_running_jobs_burst():
    rss = {"backlog": [1, 2], "peak_rss_mb": [1100.0, 1150.0], "msgs_s": [1.0, 1.0],
           "running_burst": {"backlog": 2, "after_s": 75, "peak_rss_mb": 1120.0, "jvm_mb": 560.0, "python_mb": 560.0,
                             "pss_mb": 990.0, "msgs_s": 1.0}}
    batch = {"max_offsets_per_trigger": [10, 100], "msgs_s": [1.0, 2.0], "seconds_per_batch": [1.0, 2.0],
             "peak_rss_mb": [1150.0, 1250.0], "jvm_mb": [1.0, 1.0], "python_mb": [1.0, 1.0], "backlog": 300}
    r = report.summarise({**SAMPLES, "scaling": {"rss_vs_backlog": rss, "batch_size": batch}}, {})
    targets = {t["target"]: t for t in r["targets"]}
    started = targets["peak driver RSS <= 1200 MB, a driver started on a backlog"]
    assert started["value"] == 1250.0 and started["met"] is False  # the largest of both series
    assert targets["peak driver RSS <= 1200 MB, a running job's burst"]["met"] is True
    assert targets["peak driver RSS flat across batch sizes (largest / smallest)"]["met"] is True
    assert "| 2, a burst 75 s into a run | 1,120 | 560 | 560 | 990 |" in report.markdown({**r, "meta": {}})


def test_a_running_jobs_life_is_judged_on_its_highest_minute_and_tabled_minute_by_minute():
    life = {"minutes": [1, 2, 3], "peak_rss_mb": [1010.0, 1190.0, 1230.0], "jvm_mb": [600.0, 700.0, 740.0],
            "python_mb": [410.0, 490.0, 490.0], "jvm_threads": [280, 290, 286], "batches": [90, 250, 1400],
            "events": 450_000}
    r = report.summarise({**SAMPLES, "scaling": {"rss_over_life": life}}, {})
    target = {t["target"]: t for t in r["targets"]}["peak driver RSS <= 1200 MB, a job running 3 min"]
    assert target["value"] == 1230.0 and target["met"] is False
    text = report.markdown({**r, "meta": {}})
    assert "## A running job's memory over 3 minutes of a steady feed" in text
    assert "| 3 | 1,230 | 740 | 490 | 286 | 1,400 |" in text and "450,000 events" in text


def test_the_profile_section_compares_the_parses_and_splits_the_jvm_task_time():
    profile = {"example": {"msgs_s": 30_000.0, "breakdown_s": {"batches": 3, "sink_read_parse": 6.0},
                           "jvm_task_shares": {"variant_get: a typed value out of the parsed JSON": 0.26, "other": 0.74},
                           "jvm_task_samples": 255},
               "minimal_parse": {"msgs_s": 39_000.0, "breakdown_s": {"batches": 3, "sink_read_parse": 4.5},
                                 "jvm_task_shares": {"from_json / get_json_object": 0.2, "other": 0.8},
                                 "jvm_task_samples": 200}}
    text = report.markdown(report.summarise({**SAMPLES, "scaling": {"profile": profile}}, {}))
    assert "| the example job | 30,000 | 2.00 |" in text
    assert "The minimal parse runs at 1.30 of the example job's rate" in text
    assert "(255 and 200 samples; Python time is not sampled)" in text
    assert "| variant_get: a typed value out of the parsed JSON | 26% | – |" in text
    assert "| from_json / get_json_object | – | 20% |" in text


def test_jvm_samples_go_to_the_expression_on_their_stack_before_the_cache_around_it():
    from benchmarks import jvm_profile

    cache = "org.apache.spark.sql.execution.columnar.compression.DictionaryEncoding$Encoder.gatherCompressibilityStats"
    cast = ["org.apache.spark.sql.catalyst.expressions.Literal$.validateLiteralValue",
            "org.apache.spark.sql.catalyst.expressions.variant.VariantGet$.cast",
            "org.apache.spark.sql.catalyst.expressions.GeneratedClass$GeneratedIteratorForCodegenStage1.processNext",
            "org.apache.spark.sql.execution.columnar.DefaultCachedBatchSerializer$$anon$1.next"]
    assert jvm_profile.category(cast).startswith("variant_get")
    assert jvm_profile.category([cache, *cast[2:]]).startswith("the batch's cache")
    assert jvm_profile.category(cast[2:3]).startswith("other generated code")
    assert jvm_profile.category(["java.lang.Thread.run"]) == "other"
    assert jvm_profile.shares([cast, cast, ["java.lang.Thread.run"]]) == {
        "variant_get: a typed value out of the parsed JSON": 0.667, "other": 0.333}


def test_an_update_of_some_real_airflow_ways_keeps_the_others_and_when_each_was_measured(tmp_path):
    from benchmarks.__main__ import _updated

    before = report.summarise({**SAMPLES, "mttr_real_airflow/watcher": [20.0], "mttr_real_airflow/polling": [185.0],
                               "mttr_real_airflow_measured": {"polling": "2026-11-25 16:37 UTC"}},
                              {"profile": "default", "minutes": 60.0, "section_minutes": {"mttr_real_airflow": 60.0}})
    (tmp_path / "latest.json").write_text(json.dumps(before))
    now = {"scaling": {}, "mttr_real_airflow/watcher": [11.0, 12.0],
           "mttr_real_airflow_measured": {"watcher": "2026-11-27 19:30 UTC"},
           "lost": 0, "duplicated": 0, "audited_records": 5}
    merged, total, sections, _ = _updated(tmp_path / "latest.json", dict(now, scaling={}), 15.0,
                                          {"mttr_real_airflow": 15.0}, ["mttr_real_airflow"])
    real = report.summarise(merged, {})["mttr_real_airflow"]
    assert real["watcher"]["runs"] == 2 and real["watcher"]["measured"] == "2026-11-27 19:30 UTC"
    assert real["polling"]["p50"] == 185.0 and real["polling"]["measured"] == "2026-11-25 16:37 UTC"
    assert merged["audited_records"] == before["audited_records"] + 5
    # the kept way's minutes were not recorded: the section keeps the older run's whole figure
    assert sections["mttr_real_airflow"] == 60.0 and total == 60.0

    # once each way's minutes are known, the section is their sum: the kept way's and this run's
    before = report.summarise({**SAMPLES, "mttr_real_airflow/watcher": [20.0], "mttr_real_airflow/polling": [185.0],
                               "mttr_real_airflow_minutes": {"watcher": 9.0, "polling": 41.0}},
                              {"profile": "default", "minutes": 70.0,
                               "section_minutes": {"cold": 10.0, "mttr_real_airflow": 60.0}})
    (tmp_path / "latest.json").write_text(json.dumps(before))
    merged, total, sections, _ = _updated(tmp_path / "latest.json",
                                          dict(now, scaling={}, mttr_real_airflow_minutes={"watcher": 7.5}), 7.6,
                                          {"mttr_real_airflow": 7.6}, ["mttr_real_airflow"])
    assert report.summarise(merged, {})["mttr_real_airflow"]["polling"]["minutes"] == 41.0
    assert sections == {"cold": 10.0, "mttr_real_airflow": 48.5} and total == 58.5
