"""Compile the Python that Spark ships as zip files (``pyspark.zip``, py4j's), once, after installing Spark.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on the path of every Python process it starts:
the driver, the workers' daemon, and the processes a Python data source needs (the lookup of data sources,
their creation, the streaming source's runner, the read planning).  The zip holds only sources, and
Python cannot cache what it compiles from a zip: each of those processes compiles pyspark again, about
0.6 s of CPU each, six times or more in a driver's cold start.  This adds the compiled modules beside the
sources, in the zip itself::

    python -m airflow_stream_provider.runtime.precompile [ZIP ...]

Without arguments it finds the zips of the pyspark this Python imports (and of ``$SPARK_HOME``).  The
compiled modules are for this Python's version (the one ``PYSPARK_PYTHON`` names): another version
ignores them and compiles the sources as before.  They are unchecked-hash ``.pyc`` files (PEP 552), valid
for exactly the source they were compiled from; running it again on a compiled zip changes nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import py_compile
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path


def spark_zips() -> list[Path]:
    """The zips Spark puts on its Python processes' path, for this Python's pyspark and ``$SPARK_HOME``."""
    homes = []
    if os.environ.get("SPARK_HOME"):
        homes.append(Path(os.environ["SPARK_HOME"]))
    try:
        import pyspark  # the Spark side's own environment: pyspark is installed there

        homes.append(Path(pyspark.__file__).parent)
    except ImportError:
        pass
    found: list[Path] = []
    for home in homes:
        for path in sorted((home / "python" / "lib").glob("*.zip")):
            if path.resolve() not in [p.resolve() for p in found]:
                found.append(path)
    return found


def precompile(path: Path) -> int:
    """Add a ``.pyc`` beside each ``.py`` of the zip at ``path`` that has none; return how many were added.
    The zip is replaced atomically: a process starting meanwhile reads the old one or the new one."""
    with zipfile.ZipFile(path) as source, tempfile.TemporaryDirectory() as scratch:
        entries = source.infolist()
        names = {entry.filename for entry in entries}
        todo = [e for e in entries if e.filename.endswith(".py") and f"{e.filename}c" not in names
                and "/tests/" not in e.filename]  # Spark's own test suites: never imported by a job
        if not todo:
            return 0
        written = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        added = 0
        with zipfile.ZipFile(written, "w", zipfile.ZIP_DEFLATED) as target:
            for entry in entries:  # a copy: writing sets the entry's offset, which the reads below use
                target.writestr(copy.copy(entry), source.read(entry))
            for entry in todo:
                module = Path(scratch) / entry.filename
                module.parent.mkdir(parents=True, exist_ok=True)
                module.write_bytes(source.read(entry))
                try:  # tracebacks name the module where zipimport would: inside the zip
                    with warnings.catch_warnings():  # the compiler's style warnings are Spark's business
                        warnings.simplefilter("ignore")
                        py_compile.compile(str(module), cfile=f"{module}c", dfile=f"{path}/{entry.filename}",
                                           doraise=True,
                                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
                except py_compile.PyCompileError:
                    continue  # a module for another Python version: left to compile where it is imported
                target.writestr(zipfile.ZipInfo(f"{entry.filename}c", date_time=entry.date_time),
                                Path(f"{module}c").read_bytes(), zipfile.ZIP_DEFLATED)
                added += 1
        os.chmod(written, os.stat(path).st_mode)
        os.replace(written, path)
    return added


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile the Python modules in Spark's zips (pyspark.zip, py4j)")
    parser.add_argument("zips", nargs="*", type=Path, help="the zips; those of this Python's pyspark by default")
    args = parser.parse_args(argv)
    zips = args.zips or spark_zips()
    if not zips:
        print("no Spark Python zips found: install pyspark in this Python or set SPARK_HOME", file=sys.stderr)
        return 2
    for path in zips:
        print(f"{path}: {precompile(path)} modules compiled for Python {sys.version_info[0]}.{sys.version_info[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
