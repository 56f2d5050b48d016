"""JIT settings for a driver JVM: the optimising compiler (C2) takes only code that is really hot.

A driver's start is CPU-bound on a small host.  For its first seconds the JVM runs Spark's startup code
(the context, the analyzer's rules, the first plans and their code generation) thousands of times each,
and the tiered JIT's default thresholds send much of it to C2, whose compiler threads then take the
cores the start is waiting for.  Code that runs only while a driver starts gains nothing from C2.
Raising the counts at which a method goes to C2 (tier 4) fivefold leaves most of the startup code with
C1, while the per-record code of a running stream, called millions of times a batch, reaches C2 in a new
driver's first large batch.

The factor trades a new driver's start against its first batches, and a restarted driver has both: it
starts, then drains what arrived while it was down.  Against thirtyfold (the setting before), on 2 cores
in interleaved runs:

* a cold start about 0.3 s slower (median of 14 paired starts of 9-11 s; the pairs ranged from -1.0 to
  +1.9 s);
* a new driver draining 300,000 events on PostgreSQL about 17% faster (9 pairs over three sessions, 8
  faster; medians 41,200 against 34,900 msgs/s), 30,000 events about a third faster: C2 takes the
  per-record code during the first 100,000-record batch instead of the third;
* 600,000 events, where the warm batches weigh more: rate and peak RSS within noise.

HotSpot's own thresholds started slowest of the three and drained no faster than fivefold.
``-XX:TieredStopAtLevel=1`` (C1 only) starts faster still but leaves a long run without C2.

HotSpot never compiles a method of more than 8,000 bytes of bytecode (``DontCompileHugeMethods``), and the
code Spark generates for a job's transform passes that once its checks are many (the example job's chain
of CASE WHEN that names what is wrong with a record): that method then runs interpreted for the driver's
whole life.  ``-XX:-DontCompileHugeMethods`` lets the JIT take it like any hot method: the example job's
parse took 9-10% less of the JVM's CPU in three runs (200,000 records, warm rounds, medians).

Java options that shape the JIT themselves (any ``Tier*``, ``CompileThreshold`` or ``HugeMethods``
setting, ``-Xint``, ``-Xcomp``, another compiler) are left alone.

Pure (no airflow, no pyspark): the driver hook adds these to the driver's Java options.
"""

from __future__ import annotations

#: Tier-4 (C2) thresholds, 5 times HotSpot's defaults (5,000 / 600 / 15,000 / 40,000).
LAZY_C2 = (
    "-XX:Tier4InvocationThreshold=25000",
    "-XX:Tier4MinInvocationThreshold=3000",
    "-XX:Tier4CompileThreshold=75000",
    "-XX:Tier4BackEdgeThreshold=200000",
)
#: Spark's generated code for a transform with many checks is larger than HotSpot compiles by default.
COMPILE_HUGE_METHODS = "-XX:-DontCompileHugeMethods"
OPTIONS = (*LAZY_C2, COMPILE_HUGE_METHODS)
#: Java options by which a deployment chose its own JIT behaviour: left alone.
OWN_CHOICE = ("Tier", "CompileThreshold", "HugeMethods", "-Xint", "-Xcomp", "JVMCI")


def chosen_by_user(java_options: str) -> bool:
    return any(flag in java_options for flag in OWN_CHOICE)


def startup_options(java_options: str) -> str:
    """``java_options`` with C2's thresholds raised and huge methods compiled, unless they set the JIT's
    behaviour themselves."""
    if chosen_by_user(java_options):
        return java_options
    return " ".join([java_options, *OPTIONS]).strip()
