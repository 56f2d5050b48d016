"""Checkpoint generations of a stream job: list, inspect, archive, copy for preflight, prune.

A job's checkpoints live under ``<checkpoint_root>/<job_id>/gen-<n>``, one directory per generation (a
checkpoint lineage); a reset archives generation n to ``<job_root>/archive/gen-<n>-<UTC time>`` and
starts n+1.  Recovery never deletes a checkpoint (DESIGN.md, invariant 4): the only deletions this hook
makes are an explicit retention policy over the archive and the newest commit of a *preflight copy*.

The hook is the one place on the Airflow side that writes into checkpoint storage, so every path it
writes, renames or deletes is normalised first and must stay inside the configured root: a templated
job id or a symlink must not be able to turn "archive the checkpoint" into "rename /etc".

Storage is a local directory (``/path`` or ``file:///path``) or HDFS (``hdfs://host:port/path``) reached
through WebHDFS with the ``hdfs`` package.  Both sit behind :class:`_FileSystem`, so the checkpoint
logic is written once.  No pyspark here: the files are read in Spark's on-disk format directly.
"""

from __future__ import annotations

import calendar
import math
import os
import posixpath
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

from airflow.sdk import BaseHook

from airflow_stream_provider import kafka_offsets, spec
from airflow_stream_provider.get_provider_info import ui_field_behaviour

if TYPE_CHECKING:
    from hdfs import InsecureClient

#: Same rule as the spec's job_id: the id names a folder, so it must never carry path syntax.
_JOB_ID = spec._JOB_ID
_JOB_ID_RULE = (
    "use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit, without '/' or '..'"
)
_ACTIVE = re.compile(r"^gen-(\d+)$")
_ARCHIVED = re.compile(r"^gen-(\d+)-(\d{8}T\d{6}Z)$")
_ARCHIVE_TIME = "%Y%m%dT%H%M%SZ"
ARCHIVE_DIR = "archive"
PREFLIGHT_DIR = "preflight"
DEFAULT_WEBHDFS_PORT = 9870
#: Seconds a WebHDFS request may wait for an answer (the connection's extra ``timeout``).
DEFAULT_WEBHDFS_TIMEOUT_S = 120.0


# -- results -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchInfo:
    """One entry of a checkpoint's write-ahead log: what Spark planned, and whether the sink finished it."""

    batch_id: int
    #: The Kafka position at the end of the batch, parsed from ``offsets/<batch_id>``; None if unparseable.
    offsets: dict[tuple[str, int], int] | None
    #: ``commits/<batch_id>`` exists: the batch completed.  False means a restart replays it.
    committed: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "offsets": None if self.offsets is None else kafka_offsets.to_spark_dict(self.offsets),
            "committed": self.committed,
        }


@dataclass(frozen=True)
class GenerationInfo:
    """What an operator needs to know about one generation at a glance (and to put in an XCom)."""

    generation: int
    path: str
    archived: bool
    #: Highest batch id in ``offsets/``.
    latest_batch: BatchInfo | None
    #: Highest batch id in ``commits/``.
    latest_committed: int | None
    #: Unix seconds: the newest file time seen in the generation (directory, offsets, commits).
    modified_at: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "path": self.path,
            "archived": self.archived,
            "latest_batch": None if self.latest_batch is None else self.latest_batch.to_dict(),
            "latest_committed": self.latest_committed,
            "modified_at": self.modified_at,
        }


# -- storage -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    name: str
    is_dir: bool
    mtime: float | None


class _FileSystem(Protocol):
    """The few operations the hook needs.  Paths are *resolved* paths (see ``resolve``), never URIs."""

    #: The checkpoint root, resolved.
    root: str

    def resolve(self, path: str) -> str:
        """Turn a path or URI as users write it into a normalised absolute path (no containment check)."""

    def list(self, path: str) -> list[_Entry]:
        """Entries of a directory; empty when the path is missing or not a directory."""

    def exists(self, path: str) -> bool: ...

    def mtime(self, path: str) -> float | None: ...

    def read_text(self, path: str) -> str: ...

    def makedirs(self, path: str) -> None: ...

    def rename(self, src: str, dst: str) -> None:
        """Move src to dst; the caller has checked that dst does not exist and its parent does."""

    def delete(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""

    def copy_tree(self, src: str, dst: str) -> None:
        """Copy a directory recursively to dst (which must not exist), empty directories included."""


class _LocalFileSystem:
    """A local directory.  ``os.path.realpath`` resolves symlinks, so a link leading out of the root is
    seen for what it is before anything is written."""

    def __init__(self, root: str):
        self.root = self.resolve(root)

    def resolve(self, path: str) -> str:
        parts = urlsplit(path)
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ValueError(
                    f"path {path!r} names host {parts.netloc!r}; a local checkpoint root only accepts "
                    "file:///absolute/path or a plain path"
                )
            path = unquote(parts.path)
        elif parts.scheme and len(parts.scheme) > 1:
            raise ValueError(
                f"path {path!r} uses scheme {parts.scheme!r} but the checkpoint root is local; "
                "give a plain path or a file:// URI"
            )
        return os.path.realpath(path)

    def list(self, path: str) -> list[_Entry]:
        try:
            with os.scandir(path) as scan:
                entries = []
                for entry in scan:
                    try:
                        mtime: float | None = entry.stat(follow_symlinks=False).st_mtime
                    except OSError:  # vanished while listing (Spark renames .tmp files into place)
                        mtime = None
                    entries.append(_Entry(entry.name, entry.is_dir(), mtime))
                return entries
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def mtime(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except OSError:
            return None

    def read_text(self, path: str) -> str:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def delete(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)

    def copy_tree(self, src: str, dst: str) -> None:
        # Links are copied as links; the hook has already refused any that lead out of the root.
        os.makedirs(dst, exist_ok=True)
        for name in _copy_order(os.listdir(src)):
            source, target = os.path.join(src, name), os.path.join(dst, name)
            try:
                if os.path.islink(source):
                    os.symlink(os.readlink(source), target)
                elif os.path.isdir(source):
                    self.copy_tree(source, target)
                else:
                    shutil.copy2(source, target)
            except FileNotFoundError:  # removed by the live query while we copied (retention, a .tmp renamed)
                continue


class _WebHdfsFileSystem:
    """HDFS through WebHDFS.  HDFS has no symlinks to follow over WebHDFS, so ``posixpath.normpath``
    is the whole normalisation; the URI's authority must match the root's (or be omitted)."""

    def __init__(self, root: str, client: InsecureClient):
        self._authority = urlsplit(root).netloc
        self._client = client
        self.root = self.resolve(root)

    def resolve(self, path: str) -> str:
        parts = urlsplit(path)
        if parts.scheme == "hdfs":
            if parts.netloc not in ("", self._authority):
                raise ValueError(
                    f"path {path!r} is on HDFS {parts.netloc!r}, not on the checkpoint root's "
                    f"{self._authority!r}; the hook only works inside its own checkpoint root"
                )
            raw = parts.path
        elif not parts.scheme:
            raw = path
        else:
            raise ValueError(
                f"path {path!r} uses scheme {parts.scheme!r} but the checkpoint root is on HDFS; "
                "give an hdfs:// URI or an absolute HDFS path"
            )
        if not raw.startswith("/"):
            raise ValueError(
                f"HDFS path {path!r} is not absolute; give hdfs://host:port/abs/path or /abs/path"
            )
        return "/" + posixpath.normpath(raw).lstrip("/")

    def _status(self, path: str) -> dict | None:
        """The path's status; None only where the NameNode says it does not exist (``strict=False`` would
        say so of a path the WebHDFS user may not read, too: a checkpoint it cannot see is no lost one)."""
        from hdfs.util import HdfsError

        try:
            return self._client.status(path)
        except HdfsError as err:
            if err.exception == "FileNotFoundException":
                return None
            raise _os_error(err, path) from err

    def list(self, path: str) -> list[_Entry]:
        status = self._status(path)
        if not status or status.get("type") != "DIRECTORY":
            return []
        return [
            _Entry(name, info.get("type") == "DIRECTORY", _hdfs_time(info))
            for name, info in self._client.list(path, status=True)
        ]

    def exists(self, path: str) -> bool:
        return self._status(path) is not None

    def mtime(self, path: str) -> float | None:
        status = self._status(path)
        return _hdfs_time(status) if status else None

    def read_text(self, path: str) -> str:
        from hdfs.util import HdfsError

        try:
            with self._client.read(path) as reader:
                return reader.read().decode("utf-8", errors="replace")
        except HdfsError as err:  # as the local file system's errors: an OSError
            raise _os_error(err, path) from err

    def makedirs(self, path: str) -> None:
        self._client.makedirs(path)

    def rename(self, src: str, dst: str) -> None:
        # WebHDFS moves src *into* dst when dst is an existing directory: the caller checked it is not.
        self._client.rename(src, dst)

    def delete(self, path: str) -> None:
        self._client.delete(path, recursive=True)

    def copy_tree(self, src: str, dst: str) -> None:
        # A walk, not download()/upload(): those skip empty directories, and a checkpoint's empty
        # commits/ or state/ folders are part of what the copy must reproduce.
        from hdfs.util import HdfsError

        self._client.makedirs(dst)
        for entry in sorted(self.list(src), key=lambda e: (_COPY_FIRST.get(e.name, 2), e.name)):
            source, target = posixpath.join(src, entry.name), posixpath.join(dst, entry.name)
            if entry.is_dir:
                self.copy_tree(source, target)
                continue
            # Spool through a local temporary file: state-store files can be large, and a real file
            # gives requests a Content-Length for the datanode upload.
            with tempfile.TemporaryFile() as spool:
                try:
                    with self._client.read(source) as reader:
                        shutil.copyfileobj(reader, spool, 1 << 20)
                except HdfsError as err:
                    if "FileNotFoundException" in str(err) or "does not exist" in str(err):
                        continue  # removed by the live query while we copied
                    raise
                spool.seek(0)
                self._client.write(target, data=spool, overwrite=False)


#: A live checkpoint is copied commits first, then offsets: Spark writes offsets/N before commits/N,
#: so every commit in the copy has its offsets (newer offsets without a commit are replayed).
_COPY_FIRST = {"commits": 0, "offsets": 1}


def _copy_order(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: (_COPY_FIRST.get(name, 2), name))


def _os_error(err, path: str) -> OSError:
    """A WebHDFS error as the local file system would raise it."""
    if err.exception == "FileNotFoundException":
        return FileNotFoundError(f"{path}: {err}")
    if err.exception in ("AccessControlException", "SecurityException"):
        return PermissionError(f"{path}: {err}. Give the WebHDFS user of the checkpoint connection read "
                               "access to the job's checkpoints")
    return OSError(f"{path}: {err}")


def _hdfs_time(status: dict) -> float | None:
    millis = status.get("modificationTime")
    return None if millis is None else millis / 1000.0


# -- the hook ------------------------------------------------------------------------------------------
class CheckpointHook(BaseHook):
    """Reads and manages a stream job's checkpoint generations under one checkpoint root.

    For ``hdfs://`` roots the WebHDFS endpoint comes from the connection (host, port, default 9870;
    login is the HDFS user; extra ``{"use_ssl": true}`` for https): the root's own authority is the
    NameNode's RPC address Spark uses, which is not where WebHDFS listens.  Local roots need no
    connection.

    Nothing here knows whether a driver is running: archive a generation only after the job stopped
    (the operators do that), or Spark may write into a directory while it moves.  A copy may be taken
    of a live generation (the upgrade preflight does): files Spark removes meanwhile are skipped, and
    commits are copied before offsets so that the copy is a checkpoint Spark can restart from.
    """

    conn_name_attr = "checkpoint_conn_id"
    default_conn_name = "checkpoint_default"
    conn_type = "stream_checkpoint"
    hook_name = "Stream checkpoints"

    def __init__(self, checkpoint_root: str, checkpoint_conn_id: str | None = None) -> None:
        super().__init__()
        if not isinstance(checkpoint_root, str) or not checkpoint_root.strip():
            raise ValueError(
                f"checkpoint_root {checkpoint_root!r} is empty; give a local path, a file:// URI "
                "or an hdfs://host:port/path URI"
            )
        scheme = urlsplit(checkpoint_root).scheme
        if scheme not in ("", "file", "hdfs"):
            raise ValueError(
                f"checkpoint_root {checkpoint_root!r} uses scheme {scheme!r}; supported are local paths, "
                "file:// and hdfs://"
            )
        if scheme == "hdfs" and not urlsplit(checkpoint_root).path.startswith("/"):
            raise ValueError(
                f"checkpoint_root {checkpoint_root!r} has no absolute path; write hdfs://host:port/path"
            )
        self.checkpoint_root = checkpoint_root
        self.checkpoint_conn_id = checkpoint_conn_id or self.default_conn_name
        self.is_hdfs = scheme == "hdfs"
        # Paths handed back to callers keep the root's spelling, so they equal StreamJobSpec's paths.
        self._root_text = checkpoint_root.rstrip("/")

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The form declared in provider info (Airflow 3.2+ reads it from there, without FAB)."""
        return ui_field_behaviour(cls.conn_type)

    # -- connection ----------------------------------------------------------------------------------
    @cached_property
    def webhdfs_client(self) -> InsecureClient:
        """The WebHDFS client, built on first use so that a hook for a local root never needs a connection."""
        if not self.is_hdfs:
            raise ValueError(f"checkpoint_root {self.checkpoint_root!r} is local; there is no WebHDFS client")
        from hdfs import InsecureClient

        conn = self.get_connection(self.checkpoint_conn_id)
        host = conn.host or urlsplit(self.checkpoint_root).hostname
        if not host:
            raise ValueError(
                f"connection {self.checkpoint_conn_id!r} has no host and checkpoint_root "
                f"{self.checkpoint_root!r} names none; set the WebHDFS host on the connection"
            )
        scheme = "https" if _truthy(conn.extra_dejson.get("use_ssl", False)) else "http"
        url = f"{scheme}://{host}:{conn.port or DEFAULT_WEBHDFS_PORT}"
        self.log.info(
            "Using WebHDFS at %s as user %s for %s", url, conn.login or "(current)", self._root_text
        )
        # requests waits for ever by default: a half-open NameNode connection would hold a reset or an
        # upgrade, and the job's lease, with no end
        given = conn.extra_dejson.get("timeout")
        timeout = DEFAULT_WEBHDFS_TIMEOUT_S if given in (None, "") else float(given)
        if timeout <= 0:
            raise ValueError(f"connection {self.checkpoint_conn_id!r}: extra timeout={given!r} is not a positive "
                             "number of seconds")
        return InsecureClient(url, user=conn.login or None, timeout=(min(timeout, 10.0), timeout))

    def get_conn(self) -> InsecureClient:
        return self.webhdfs_client

    @cached_property
    def _fs(self) -> _FileSystem:
        if self.is_hdfs:
            return _WebHdfsFileSystem(self.checkpoint_root, self.webhdfs_client)
        return _LocalFileSystem(self.checkpoint_root)

    # -- paths ---------------------------------------------------------------------------------------
    def job_root(self, job_id: str) -> str:
        return f"{self._root_text}/{_check_job_id(job_id)}"

    def generation_path(self, job_id: str, generation: int) -> str:
        return spec.generation_path(self.job_root(job_id), _check_generation(generation))

    def _resolve(self, path: str, *, what: str, strict: bool = True) -> str:
        """Normalise ``path`` and insist it lies inside the checkpoint root (strictly below it if strict).

        This is the guard every write goes through: ``..``, absolute paths elsewhere, another HDFS
        cluster and (locally) symlinks that lead out of the root all end here with a ValueError.
        """
        if not isinstance(path, str) or not path:
            raise ValueError(f"{what} {path!r} is not a path; give a path inside {self._root_text!r}")
        resolved = self._fs.resolve(path)
        root = self._fs.root
        inside = resolved.startswith(root.rstrip("/") + "/") or (resolved == root and not strict)
        if not inside:
            raise ValueError(
                f"{what} {path!r} resolves to {resolved!r}, which is outside the checkpoint root "
                f"{self._root_text!r} ({root!r}); the hook only reads and writes below that root: "
                "no '..', no absolute paths elsewhere, no symlinks leading out"
            )
        return resolved

    def _resolve_child(self, parent: str, name: str, *, what: str) -> str:
        """Resolve ``parent/name`` and insist it *is* that entry, not a link to somewhere else in the root:
        renaming or deleting a link's target would hit a directory the caller never named."""
        resolved = self._resolve(self._join(parent, name), what=what)
        if self._dirname(resolved) != parent or self._basename(resolved) != name:
            raise ValueError(
                f"{what} {self._external(self._join(parent, name))!r} is a link to "
                f"{self._external(resolved)!r}; the hook does not rename or delete through links"
            )
        return resolved

    def _join(self, *parts: str) -> str:
        return os.path.join(*parts) if not self.is_hdfs else posixpath.join(*parts)

    def _dirname(self, path: str) -> str:
        return posixpath.dirname(path) if self.is_hdfs else os.path.dirname(path)

    def _basename(self, path: str) -> str:
        return posixpath.basename(path) if self.is_hdfs else os.path.basename(path)

    def _parts(self, resolved: str) -> list[str]:
        """Components of a resolved path below the root: ``[job_id, gen-1, ...]``."""
        if self.is_hdfs:
            relative = posixpath.relpath(resolved, self._fs.root)
            return [] if relative == "." else relative.split("/")
        relative = os.path.relpath(resolved, self._fs.root)
        return [] if relative == "." else relative.split(os.sep)

    def _external(self, resolved: str) -> str:
        parts = self._parts(resolved)
        return "/".join([self._root_text, *parts]) if parts else self.checkpoint_root

    def _area(self, resolved: str) -> str:
        """``active`` (inside some job's gen-<n>), ``archive`` (inside some job's archive/) or ``other``."""
        parts = self._parts(resolved)
        if len(parts) >= 2 and _ACTIVE.match(parts[1]):
            return "active"
        if len(parts) >= 2 and parts[1] == ARCHIVE_DIR:
            return "archive"
        return "other"

    def _job_dir(self, job_id: str) -> str:
        return self._resolve(self.job_root(job_id), what="job root")

    # -- reading -------------------------------------------------------------------------------------
    def list_generations(self, job_id: str) -> list[GenerationInfo]:
        """Active ``gen-*`` directories and archived ones, sorted by (generation, archived)."""
        job_dir = self._job_dir(job_id)
        found: list[GenerationInfo] = []
        for entry in self._fs.list(job_dir):
            match = _ACTIVE.match(entry.name)
            if match and entry.is_dir:
                found.append(self._generation(job_dir, entry.name, int(match.group(1)), archived=False))
        archive_dir = self._resolve(self._join(job_dir, ARCHIVE_DIR), what="archive directory")
        for entry in self._fs.list(archive_dir):
            match = _ARCHIVED.match(entry.name)
            if match and entry.is_dir:
                found.append(self._generation(archive_dir, entry.name, int(match.group(1)), archived=True))
        return sorted(found, key=lambda g: (g.generation, g.archived, g.path))

    def _generation(self, parent: str, name: str, generation: int, *, archived: bool) -> GenerationInfo:
        entry = self._join(parent, name)
        latest, committed, modified = self._scan(self._resolve(entry, what="generation directory"))
        return GenerationInfo(
            generation=generation,
            path=self._external(entry),
            archived=archived,
            latest_batch=latest,
            latest_committed=committed,
            modified_at=modified,
        )

    def latest_batch(self, path: str) -> BatchInfo | None:
        """The newest batch in a checkpoint's offsets log, or None if Spark never planned one there."""
        return self._scan(self._resolve(path, what="checkpoint path", strict=False))[0]

    def latest_committed(self, path: str) -> int | None:
        """The newest batch in a checkpoint's commit log, or None if none was committed there."""
        return self._scan(self._resolve(path, what="checkpoint path", strict=False))[1]

    def has_checkpoint(self, path: str) -> bool:
        """True once Spark planned a batch there, i.e. ``startingOffsets`` would be ignored for it."""
        resolved = self._resolve(path, what="checkpoint path", strict=False)
        return bool(_batch_ids(self._fs.list(self._join(resolved, "offsets"))))

    def _scan(self, path: str) -> tuple[BatchInfo | None, int | None, float | None]:
        offsets = self._fs.list(self._join(path, "offsets"))
        commits = self._fs.list(self._join(path, "commits"))
        times = [e.mtime for e in offsets + commits if e.mtime is not None]
        own = self._fs.mtime(path)
        if own is not None:
            times.append(own)
        offset_ids, commit_ids = _batch_ids(offsets), _batch_ids(commits)
        latest = None
        if offset_ids:
            batch_id = max(offset_ids)
            latest = BatchInfo(
                batch_id=batch_id,
                offsets=self._read_offsets(self._join(path, "offsets", str(batch_id))),
                committed=batch_id in commit_ids,
            )
        return latest, max(commit_ids) if commit_ids else None, max(times) if times else None

    def _read_offsets(self, path: str) -> dict[tuple[str, int], int] | None:
        """Parse one offsets-log file: ``v1``, the batch metadata JSON, then the Kafka source's offsets.

        A file we cannot parse is reported as None, not raised: listing must still work on a checkpoint
        that is corrupt, because that is exactly when an operator needs to look at it.
        """
        try:
            text = self._fs.read_text(self._resolve(path, what="offsets file"))
            lines = [line for line in text.splitlines() if line.strip()]
            if len(lines) < 3 or not lines[0].startswith("v"):
                raise ValueError("expected a version line, batch metadata and one line per source")
            return kafka_offsets.from_offset_log(lines[2:])
        except (OSError, ValueError) as err:  # JSONDecodeError is a ValueError
            self.log.warning("Cannot parse offsets log entry %s: %s", self._external(path), err)
            return None

    # -- writing -------------------------------------------------------------------------------------
    def archive_generation(self, job_id: str, generation: int, *, now: float | None = None) -> str:
        """Move ``gen-<n>`` to ``archive/gen-<n>-<UTC yyyymmddTHHMMSSZ>`` in one rename; return the new path.

        A rename, never a copy-and-delete: it is atomic on both HDFS and a local filesystem, so a crash
        leaves either the generation or its archive, never half of each, and nothing is deleted.
        """
        job_dir = self._job_dir(job_id)
        name = f"gen-{_check_generation(generation)}"
        source = self._resolve_child(job_dir, name, what="generation directory")
        if not self._fs.exists(source):
            existing = sorted(e.name for e in self._fs.list(job_dir) if _ACTIVE.match(e.name))
            raise FileNotFoundError(
                f"cannot archive generation {generation} of job {job_id!r}: {self._external(source)} does "
                f"not exist (active generations: {existing or 'none'}). Nothing was moved; check the "
                "generation number with list_generations()"
            )
        stamp = time.strftime(_ARCHIVE_TIME, time.gmtime(time.time() if now is None else now))
        archive_dir = self._resolve(self._join(job_dir, ARCHIVE_DIR), what="archive directory")
        target = self._resolve(self._join(archive_dir, f"{name}-{stamp}"), what="archive target")
        if self._area(source) != "active" or self._area(target) != "archive":
            raise ValueError(f"refusing to archive {self._external(source)} to {self._external(target)}")
        if self._fs.exists(target):
            raise FileExistsError(
                f"cannot archive generation {generation} of job {job_id!r}: the target "
                f"{self._external(target)} already exists. Nothing was moved; retry in a second (archive "
                "names carry the time to the second) or inspect the existing archive"
            )
        self._fs.makedirs(archive_dir)
        self._fs.rename(source, target)
        archived = self._external(target)
        self.log.info(
            "Archived generation %s of job %s: %s -> %s", generation, job_id, self._external(source), archived
        )
        return archived

    def copy_generation(self, job_id: str, generation: int, target: str) -> str:
        """Copy ``gen-<n>`` recursively to ``target`` (inside the root, e.g. ``<job_root>/preflight/x``).

        The upgrade preflight runs new code on such a copy so the real checkpoint is never touched by
        code that might not understand it.  The copy is written next to the target and renamed into
        place at the end, so a failed copy never looks like a complete checkpoint.
        """
        job_dir = self._job_dir(job_id)
        source = self._resolve_child(job_dir, f"gen-{_check_generation(generation)}", what="generation")
        if not self._fs.exists(source):
            raise FileNotFoundError(
                f"cannot copy generation {generation} of job {job_id!r}: {self._external(source)} does not "
                "exist; check the generation number with list_generations()"
            )
        destination = self._resolve(target, what="copy target")
        if self._area(destination) != "other":
            raise ValueError(
                f"copy target {target!r} is inside an active gen-* or archive directory; copy to a path "
                f"such as {self.job_root(job_id)}/{PREFLIGHT_DIR}/<name> instead"
            )
        if self._fs.exists(destination):
            raise FileExistsError(
                f"copy target {self._external(destination)} already exists; choose a new path (nothing "
                "is overwritten)"
            )
        if not self.is_hdfs:
            self._check_links(source)
        partial = self._resolve(f"{destination}.partial-{uuid.uuid4().hex[:8]}", what="copy target")
        self._fs.makedirs(self._dirname(partial))
        try:
            self._fs.copy_tree(source, partial)
            self._fs.rename(partial, destination)
        except BaseException:
            if self._fs.exists(partial):  # our own half-written copy, never the source
                self._fs.delete(partial)
            raise
        copied = self._external(destination)
        self.log.info("Copied generation %s of job %s to %s", generation, job_id, copied)
        return copied

    def _check_links(self, source: str) -> None:
        """A copy must not carry a link out of the root: Spark would later write through it."""
        for directory, dirs, files in os.walk(source):
            for name in dirs + files:
                path = os.path.join(directory, name)
                if os.path.islink(path):
                    self._resolve(path, what="link inside the generation")

    def new_preflight_root(self, job_id: str) -> str:
        """A fresh directory name under ``<job_root>/preflight/`` for one preflight's copy."""
        stamp = time.strftime(_ARCHIVE_TIME, time.gmtime())
        return f"{self.job_root(job_id)}/{PREFLIGHT_DIR}/{stamp}-{uuid.uuid4().hex[:8]}"

    def remove_preflight(self, job_id: str, path: str) -> None:
        """Delete one preflight copy made by :meth:`copy_generation`; nothing else can be removed here."""
        # The preflight dir itself, not a link to the job's dir or its archive: a copy's name would then
        # name a live generation or an archive
        preflight_dir = self._resolve_child(self._job_dir(job_id), PREFLIGHT_DIR, what="preflight dir")
        resolved = self._resolve(path, what="preflight copy")
        if self._dirname(resolved) != preflight_dir or self._area(resolved) != "other":
            raise ValueError(
                f"refusing to remove {path!r}: only direct children of {self._external(preflight_dir)} "
                "(preflight copies) are removed by remove_preflight()"
            )
        if self._fs.exists(resolved):
            self._fs.delete(resolved)
            self.log.info("Removed preflight copy %s", self._external(resolved))

    def drop_latest_commit(self, path: str) -> int | None:
        """Remove ``commits/<latest>`` (and its ``.crc``) from a copy so that Spark re-plans that batch.

        Spark checks a changed stateful operator only when a batch touches the state, so the preflight
        needs a batch to run even without new data (DESIGN.md, "Preflight").  Only copies may be edited:
        active ``gen-*`` directories and archives are refused.  Returns the batch id, None if nothing
        was committed yet.
        """
        resolved = self._resolve(path, what="checkpoint copy")
        area = self._area(resolved)
        if area != "other":
            raise ValueError(
                f"refusing to drop a commit in {path!r}: it is inside "
                f"{'an active gen-* directory' if area == 'active' else 'an archive'}; only a copy made by "
                f"copy_generation() (e.g. under <job_root>/{PREFLIGHT_DIR}/) may be edited"
            )
        commits = self._resolve(self._join(resolved, "commits"), what="commits directory")
        ids = _batch_ids(self._fs.list(commits))
        if not ids:
            self.log.info("No committed batch in %s; nothing to drop", self._external(resolved))
            return None
        batch_id = max(ids)
        planned = _batch_ids(self._fs.list(self._join(resolved, "offsets")))
        if planned and max(planned) > batch_id:
            self.log.warning(
                "Batch %s in %s is planned but not committed (Spark re-runs it anyway); dropping commit %s",
                max(planned),
                self._external(resolved),
                batch_id,
            )
        for name in (str(batch_id), f".{batch_id}.crc"):
            file = self._resolve_child(commits, name, what="commit file")
            if self._fs.exists(file):
                self._fs.delete(file)
        self.log.info("Dropped commit of batch %s in %s", batch_id, self._external(resolved))
        return batch_id

    def prune_archives(
        self,
        job_id: str,
        *,
        max_count: int | None = None,
        max_age_s: float | None = None,
        now: float | None = None,
    ) -> list[str]:
        """Apply an explicit retention policy to ``<job_root>/archive/``; return the removed paths.

        An archive is kept if *any* given rule keeps it: among the newest ``max_count``, or younger than
        ``max_age_s``.  Age counts from the time in the archive's name (when it was archived, which is
        what a rollback window is about), falling back to its newest file time.  With no rule, nothing
        is removed: deleting checkpoints is never a default.  Active generations are never candidates.
        """
        job_dir = self._job_dir(job_id)
        _check_policy(max_count, max_age_s)
        if max_count is None and max_age_s is None:
            self.log.info("No retention policy for job %s; no archive pruned", job_id)
            return []
        now = time.time() if now is None else now
        archives = [g for g in self.list_generations(job_id) if g.archived]
        newest_first = sorted(
            archives, key=lambda g: (_archived_at(g, now), g.generation, g.path), reverse=True
        )
        keep: set[str] = set()
        if max_count is not None:
            keep.update(g.path for g in newest_first[:max_count])
        if max_age_s is not None:
            keep.update(g.path for g in archives if now - _archived_at(g, now) < max_age_s)
        archive_dir = self._resolve(self._join(job_dir, ARCHIVE_DIR), what="archive directory")
        doomed = []
        for info in newest_first:
            if info.path in keep:
                continue
            # Check every candidate before deleting any, so a bad entry stops the prune untouched.
            resolved = self._resolve_child(archive_dir, info.path.rsplit("/", 1)[-1], what="archive")
            if self._area(resolved) != "archive" or not _ARCHIVED.match(self._basename(resolved)):
                raise ValueError(f"refusing to prune {info.path}: not an archived generation")
            doomed.append((resolved, info.path))
        for resolved, external in doomed:
            self._fs.delete(resolved)
            self.log.info("Pruned archive %s of job %s", external, job_id)
        return [external for _, external in doomed]


# -- helpers -------------------------------------------------------------------------------------------
def _check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id) or ".." in job_id:
        raise ValueError(f"job_id {job_id!r} is not a safe name: {_JOB_ID_RULE}; it names checkpoint folders")
    return job_id


def _check_generation(generation: int) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ValueError(f"generation {generation!r} is not a positive integer; generations start at 1")
    return generation


def _check_policy(max_count: int | None, max_age_s: float | None) -> None:
    if max_count is not None and (
        isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 0
    ):
        raise ValueError(f"max_count {max_count!r} must be an integer >= 0 or None (no count rule)")
    if max_age_s is not None and (
        isinstance(max_age_s, bool) or not isinstance(max_age_s, int | float) or not math.isfinite(max_age_s)
        or max_age_s < 0
    ):  # NaN compares false both ways: "younger than NaN" would keep nothing
        raise ValueError(f"max_age_s {max_age_s!r} must be a finite number of seconds >= 0 or None (no age rule)")


def _batch_ids(entries: list[_Entry]) -> set[int]:
    """Batch ids among a log directory's entries; ``.N.crc``, ``.tmp`` and other names are not batches."""
    return {int(e.name) for e in entries if e.name.isdigit() and e.name.isascii() and not e.is_dir}


def _archived_at(info: GenerationInfo, now: float) -> float:
    match = _ARCHIVED.match(info.path.rsplit("/", 1)[-1])
    if match:
        return float(calendar.timegm(time.strptime(match.group(2), _ARCHIVE_TIME)))
    # Unknown age counts as new: an archive is never pruned by age on a guess.
    return info.modified_at if info.modified_at is not None else now


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"))
