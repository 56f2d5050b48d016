"""JIT settings for a driver JVM: the optimising compiler (C2) takes only code that is really hot.

A driver's start is CPU-bound on a small host.  For its first seconds the JVM runs Spark's startup code
(the context, the analyzer's rules, the first plans and their code generation) thousands of times each,
and the tiered JIT's default thresholds send much of it to C2, whose compiler threads then take the
cores the start is waiting for.  Code that runs only while a driver starts gains nothing from C2.
Raising the counts at which a method goes to C2 (tier 4) thirtyfold leaves the startup code with C1,
while the per-record code of a running stream, called millions of times a batch, still reaches C2 in
its first large batches.

Measured on 2 cores: a cold start 7.6 -> 6.4 s in interleaved runs (7.8 -> 6.7 s in ``make bench``'s
cold section); three interleaved pairs of 300,000-event drains showed no throughput loss beyond noise.
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

#: Tier-4 (C2) thresholds, 30 times HotSpot's defaults (5,000 / 600 / 15,000 / 40,000).
LAZY_C2 = (
    "-XX:Tier4InvocationThreshold=150000",
    "-XX:Tier4MinInvocationThreshold=18000",
    "-XX:Tier4CompileThreshold=450000",
    "-XX:Tier4BackEdgeThreshold=1200000",
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
