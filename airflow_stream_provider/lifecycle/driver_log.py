"""The driver's log, read from where a local or client-mode driver writes it (the worker host's disk).

While a lifecycle step waits on a driver, its new lines go into the task log (from the triggerer for a
deferred step, from the worker otherwise), so the Airflow UI shows why a driver did not start or stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

#: A line longer than this is cut: a JVM stack frame list or a JSON spec fits; a runaway line does not.
MAX_LINE_CHARS = 2000
#: At most this many lines per read: a driver logging in a loop must not flood the task log.
MAX_LINES_PER_READ = 400


class DriverLogFollower:
    """Hands out the complete lines added to ``path`` since the last read, with ``secrets`` masked.

    :param path: the driver's log file; a file that does not exist (yet, or on this host) reads as empty.
    :param from_start: begin at the file's start (a driver being launched: its first lines say the most);
        otherwise at its current end.
    :param secrets: strings never to show (the state database's password), replaced by ``***``.
    """

    def __init__(self, path: str, *, from_start: bool, secrets: Sequence[str] = ()):
        self.path = Path(path)
        self.secrets = [s for s in secrets if s]
        self.offset = 0 if from_start else self._size()

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as log:
                log.seek(self.offset)
                data = log.read()
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:  # no complete line yet: the rest comes with the next read
            return []
        self.offset += end + 1
        lines = data[:end].decode(errors="replace").splitlines()
        skipped = len(lines) - MAX_LINES_PER_READ
        if skipped > 0:
            lines = [f"... {skipped} driver log lines skipped (all are in {self.path})", *lines[-MAX_LINES_PER_READ:]]
        return [masked(line[:MAX_LINE_CHARS], self.secrets) for line in lines]


def masked(text: str, secrets: Sequence[str | None]) -> str:
    """``text`` with every non-empty secret replaced by ``***``."""
    for secret in (s for s in secrets if s):
        text = text.replace(secret, "***")
    return text


def read_end(path: str, max_bytes: int) -> str | None:
    """The end of a driver log, at most ``max_bytes`` and from a line start (not masked: the caller
    knows the secrets); None when the file cannot be read on this host."""
    try:
        with Path(path).open("rb") as log:
            size = log.seek(0, 2)
            log.seek(max(0, size - max_bytes))
            data = log.read()
    except OSError:
        return None
    if size > max_bytes:  # drop the cut first line and say what is left out
        data = data[data.find(b"\n") + 1:]
        data = f"... the first {size - len(data)} bytes are left out; all are in {path}\n".encode() + data
    return data.decode(errors="replace")


def log_tail(path: str | None, lines: int = 25, secrets: Sequence[str] = ()) -> str:
    """The last lines of a driver log, for an error message, with ``secrets`` masked."""
    if not path or not Path(path).exists():
        return "(no local driver log)"
    content = Path(path).read_text(errors="replace").splitlines()
    return masked("\n".join(line[:300] for line in content[-lines:]), secrets)
