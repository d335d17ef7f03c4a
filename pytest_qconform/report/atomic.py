"""Writing files atomically: a reader sees the old content or all of the new, never half.

Run reports, the matrix Markdown, the README section and the heatmap all go through here,
so a run killed mid-write leaves nothing a ``*.json`` scan would take for a report.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"  # never "*.json": a temp file left by a SIGKILL is not scanned as a report


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either its old content or all of the new one.

    Temp file in the same folder (same filesystem, so ``os.replace`` is atomic), fsync,
    replace; on any error the temp file is removed and the error propagates. The temp
    name starts with a dot and ends in ``.tmp``, so a SIGKILL mid-write leaves nothing
    that a ``*.json`` scan would take for a report. The file gets the mode a plain ``open``
    would give it (an existing file's own), not the temp file's private 0600.
    """
    path = Path(path)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        os.chmod(tmp, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def write_text_atomically(path: Path, text: str) -> None:
    """``write_bytes_atomically`` for text, encoded as UTF-8 (no newline translation)."""
    write_bytes_atomically(path, text.encode("utf-8"))


def _mode_for(path: Path) -> int:
    """The permission bits ``path`` has, or, for a new file, 0666 less the process's umask."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)  # the only way to read it: set and restore at once
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable where the OS allows it (POSIX); elsewhere a no-op."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
