"""Where a driver JVM's task time goes: Java Flight Recorder samples of Spark's task threads, by what
they were evaluating.

The drain's breakdown says that reading and parsing a batch takes most of its time, and that in local
mode the JVM's task thread is what limits it (the read task's Python decoding runs beside it, on the
other core).  This names the JVM's share inside that phase: each sample of an ``Executor task launch
worker`` thread goes to the first category whose code is on its stack, expressions first (they run
inside the generated code that builds the batch's cache), then the hand-over from Python, then the
cache's own column building.  Python time is not sampled here.

``jfr`` is the JDK's own tool; where only a JRE is installed the section says so and measures nothing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

TASK_THREAD = "Executor task launch worker"

#: (category, code that marks it), in the order they are tried against a whole stack.
EXPRESSIONS = (
    ("variant_get: a typed value out of the parsed JSON", ("VariantGet$",)),
    ("schema_of_variant: JSON types for the checks", ("SchemaOfVariant",)),
    ("try_parse_json: text to variant", ("VariantBuilder", "ParseJson")),
    ("from_json / get_json_object", ("JacksonParser", "GetJsonObject", "JsonToStructs")),
    ("timestamps from text", ("stringToTimestamp", "ToTimestamp", "DateTimeUtils")),
    ("UTF-8 checks", ("UTF8String.isValid", "UTF8String.getIsValid", "IsValidUTF8")),
    ("regular expressions", ("java.util.regex.",)),
)
HAND_OVER = ("Arrow records from the Python source", ("Arrow", "ColumnarBatchRow", "PythonRunner", "MapInBatch"))
#: the cache's column builders and accessors, not the iterator that drives them: every sample of the batch's
#: first evaluation has that on its stack
CACHE = ("the batch's cache: building and reading its columns",
         ("ColumnBuilder", "compression.", "ColumnAccessor"))
GENERATED = ("other generated code (projections, rows, the checks' CASE WHEN)", ("GeneratedClass",))
OTHER = "other"


def available() -> bool:
    return shutil.which("jfr") is not None


def recording_option(path: Path) -> str:
    """The Java option that records the driver's whole life into ``path`` (written when it exits)."""
    return f"-XX:StartFlightRecording=filename={path},settings=profile,dumponexit=true"


def category(frames: list[str]) -> str:
    """The category of one sample, ``frames`` from the leaf up, each ``package.Class.method``."""
    for name, marks in EXPRESSIONS:
        if any(mark in frame for frame in frames for mark in marks):
            return name
    for name, marks in (HAND_OVER, CACHE, GENERATED):
        if any(mark in frame for frame in frames for mark in marks):
            return name
    return OTHER


def task_samples(recording: Path) -> list[list[str]]:
    """The stacks of the task threads' execution samples in a recording."""
    printed = subprocess.run(
        ["jfr", "print", "--json", "--stack-depth", "64", "--events", "jdk.ExecutionSample", str(recording)],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    stacks = []
    for event in json.loads(printed)["recording"]["events"]:
        values = event["values"]
        thread = (values.get("sampledThread") or {}).get("javaName") or ""
        if not thread.startswith(TASK_THREAD):
            continue
        stacks.append([
            f"{frame['method']['type']['name'].replace('/', '.')}.{frame['method']['name']}"
            for frame in (values.get("stackTrace") or {}).get("frames", [])
        ])
    return stacks


def shares(stacks: list[list[str]]) -> dict[str, float]:
    """Each category's share of the samples, largest first."""
    counts = Counter(category(frames) for frames in stacks)
    total = sum(counts.values()) or 1
    return {name: round(n / total, 3) for name, n in counts.most_common()}
