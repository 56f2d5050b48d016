"""A class-data-sharing archive for driver JVMs: a cold start maps Spark's classes instead of loading them.

A driver's cold start loads, parses and verifies some fifteen thousand classes: Spark's core, SQL,
streaming, its Python bridges.  The JVM can write the classes one run loaded into an archive when it
exits (``-XX:ArchiveClassesAtExit``, JDK 13 and later) and map that archive into later JVMs
(``-XX:SharedArchiveFile``).  The launcher keeps one archive per Spark and Java installation:

* when it exists, every local or client-mode driver starts with it.  The JVM checks that the archive
  matches its own build and classpath and, when not, says so in the driver log and starts as before;
* when it is missing, the launcher starts one warm-up-only run of the job's own code in the background
  (``StreamHarness --warm-up-only``: Spark, the source, the job's parse and results on a throw-away
  query; it records nothing and writes no result), whose JVM writes the archive as it exits.  A lock
  file keeps it to one such run at a time, and a failed one is not retried for an hour.  Drivers
  launched meanwhile start as before.

Each launch that maps an archive marks it used (its modification time).  An archive is written for every
new Spark or Java installation (an upgrade, a virtualenv built again), about 170 MB each: once a new one
is in place, the others that no launch has used for ``UNUSED_FOR_S`` are removed.

Java options that name class-data sharing themselves (``-Xshare``, ``SharedArchiveFile``,
``ArchiveClassesAtExit``) are left alone: ``-Xshare:off`` turns this off.  Cluster deploy mode has no
archive (the driver runs on a host the launcher does not know).

Pure (no airflow, no pyspark): the driver hook uses it, and ``python -m airflow_stream_provider.jvm_archive``
is the background run's wrapper, which moves the written archive into place.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from airflow_stream_provider import local_driver

JAVA_OPTIONS = "spark.driver.extraJavaOptions"
#: Java options by which a deployment chose its own class-data sharing: left alone.
OWN_CHOICE = ("-Xshare", "SharedArchiveFile", "ArchiveClassesAtExit")
#: Where the archives live unless the hook is told otherwise.
DIRECTORY_ENV = "STREAM_JVM_ARCHIVE_DIR"
#: A failed or unfinished archive run blocks another for this long.
RETRY_AFTER_S = 3600.0
#: The warm-up-only run gives up after this.
TRAIN_TIMEOUT_S = 600.0
#: Another installation's archive that no launch has mapped for this long is removed when a new one is
#: written: that installation is most likely gone.
UNUSED_FOR_S = 14 * 86400.0


def default_directory() -> Path:
    if os.environ.get(DIRECTORY_ENV):
        return Path(os.environ[DIRECTORY_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "airflow-stream-provider" / "jvm"


def chosen_by_user(java_options: str) -> bool:
    return any(flag in java_options for flag in OWN_CHOICE)


def _fingerprint(path: str | None) -> str:
    if not path:
        return "-"
    real = os.path.realpath(path)
    try:
        status = os.stat(real)
    except OSError:
        return real
    return f"{real}:{status.st_size}:{int(status.st_mtime)}"


@dataclass(frozen=True)
class ClassArchive:
    """The archive of one Spark and Java installation (the file may not exist yet)."""

    path: Path

    @classmethod
    def of(cls, env: Mapping[str, str], spark_binary: str, conf: Mapping[str, str],
           directory: str | Path | None = None) -> ClassArchive | None:
        """The archive for the spark-submit ``spark_binary`` and the ``java`` that ``env`` gives the driver;
        None when either cannot be found there (no archive: the driver starts as before)."""
        spark_submit = shutil.which(spark_binary, path=env.get("PATH"))
        java_home = env.get("JAVA_HOME")
        java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java", path=env.get("PATH"))
        if not spark_submit or not java or not os.path.exists(java):
            return None
        # A new Spark or Java (or another classpath) gets its own archive; the JVM checks the rest.
        identity = "|".join([_fingerprint(spark_submit), _fingerprint(java), env.get("SPARK_HOME", ""),
                             conf.get("spark.driver.extraClassPath", "")])
        key = hashlib.sha256(identity.encode()).hexdigest()[:16]
        return cls(Path(directory or default_directory()) / f"driver-{key}.jsa")

    @property
    def lock(self) -> Path:
        return self.path.with_suffix(".lock")

    def ready(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def java_options(self, options: str) -> str:
        """``options`` with this archive mapped in, the archive marked used (unless it is another user's,
        whose time this user may not set: it maps all the same)."""
        try:
            os.utime(self.path)
        except OSError:
            pass
        return f"{options} -XX:SharedArchiveFile={self.path}".strip()

    def remove_unused_others(self) -> list[Path]:
        """Remove the directory's other archives that no launch has mapped for ``UNUSED_FOR_S``; return them.
        One that cannot be removed (another user's) is left."""
        now, removed = time.time(), []
        for other in self.path.parent.glob("driver-*.jsa"):
            if other == self.path or ".tmp." in other.name:
                continue
            try:
                if now - other.stat().st_mtime > UNUSED_FOR_S:
                    other.unlink()
                    removed.append(other)
            except OSError:
                continue
        return removed

    def claim(self) -> Path | None:
        """The file a new archive run is to write, once this caller holds the lock; None when another run
        holds it (or failed less than ``RETRY_AFTER_S`` ago)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if time.time() - self.lock.stat().st_mtime < RETRY_AFTER_S:
                return None
            self.lock.unlink(missing_ok=True)  # a stale lock: that run ended long ago
        except FileNotFoundError:
            pass
        try:
            descriptor = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return None
        os.close(descriptor)
        return self.path.with_name(f"{self.path.stem}.{uuid.uuid4().hex[:8]}.tmp.jsa")

    def start_run(self, command: Sequence[str], written: Path, env: Mapping[str, str], log_path: str) -> int:
        """Start the wrapper of an archive run in the background (its own session, output in
        ``log_path``); return its pid.  ``command`` is the warm-up-only spark-submit whose JVM writes
        ``written`` (from :meth:`claim`) as it exits."""
        wrapper = [sys.executable, "-m", "airflow_stream_provider.jvm_archive", "--archive", str(self.path),
                   "--written", str(written), "--", *command]
        return local_driver.start_detached(wrapper, log_path, env=env).pid

    def finish_run(self, command: Sequence[str], written: Path) -> str:
        """Run ``command`` to its end and move the archive its JVM wrote into place; say what happened.
        The lock goes only with success: a failed run is not repeated within ``RETRY_AFTER_S``."""
        try:
            code = subprocess.run(list(command), stdin=subprocess.DEVNULL, timeout=TRAIN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = None
        if code == 0 and written.is_file() and written.stat().st_size > 0:
            os.replace(written, self.path)  # atomic: a driver maps a whole archive or none
            self.lock.unlink(missing_ok=True)
            removed = self.remove_unused_others()
            return f"archive written: {self.path}" + (
                f"; removed {len(removed)} unused for {UNUSED_FOR_S / 86400:.0f} days: "
                f"{', '.join(p.name for p in removed)}" if removed else "")
        written.unlink(missing_ok=True)
        return (f"no archive: the warm-up-only run ended with exit code {code} and wrote "
                f"{'an empty file' if code == 0 else 'nothing usable'}; drivers start without one, and another "
                f"run is tried after {RETRY_AFTER_S / 60:.0f} min (remove {self.lock} to try at once)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a warm-up-only driver and keep the JVM archive it writes")
    parser.add_argument("--archive", required=True)
    parser.add_argument("--written", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    outcome = ClassArchive(Path(args.archive)).finish_run(command, Path(args.written))
    print(outcome, flush=True)
    return 0 if outcome.startswith("archive written") else 1


if __name__ == "__main__":
    sys.exit(main())
