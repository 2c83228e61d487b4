"""A disk that fills mid-study: told apart from other errors, and room kept to close the records.

Contract:

* :func:`is_disk_full` (pure) says whether an error, or any error it wraps, is a full disk or an
  exhausted quota: ``OSError`` with ``ENOSPC`` / ``EDQUOT``, SQLite's "database or disk is full",
  or a library's message carrying "No space left on device" (MLflow and pyarrow re-raise it as
  their own types). Waiting does not fix it: the storage retries never wait one out.
* :class:`Reserve` holds a small file (:data:`RESERVE_BYTES`) in the runs folder while a study
  runs. When the disk fills, the driver deletes it first, so that ending its MLflow runs and its
  Optuna trials has room to write (SQLite needs journal pages even to mark a run ended); then the
  study stops with :class:`DiskFull`, which the CLI prints as one line naming ``--resume``.

Example:
    >>> import errno
    >>> is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    True
    >>> is_disk_full(RuntimeError("could not log: (sqlite3.OperationalError) database or disk is full"))
    True
    >>> is_disk_full(ValueError("bad value"))
    False
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["is_disk_full", "full_disk_reason", "Reserve", "DiskFull", "RESERVE_BYTES", "RESERVE_NAME"]

#: Bytes kept free for the records' last writes (a few SQLite pages and journals, the runs' ends).
RESERVE_BYTES = 512 * 1024
RESERVE_NAME = ".servetune-reserve"
_MESSAGES = ("no space left on device", "database or disk is full", "disk quota exceeded")


class DiskFull(RuntimeError):
    """The study stopped because its disk is full; every finished trial is kept."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it wraps (cause or context) is a full disk (pure)."""
    return full_disk_reason(exc) is not None


def full_disk_reason(exc: BaseException) -> str | None:
    """What the system said when the disk filled ("No space left on device", SQLite's "database or
    disk is full"), from ``exc`` or an error it wraps; None when it is not a full disk (pure).

    Example:
        >>> full_disk_reason(RuntimeError("x")) is None
        True
        >>> full_disk_reason(RuntimeError("MLflow: (sqlite3.OperationalError) database or disk is full [SQL: ...]"))
        'database or disk is full'
    """
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not s for s in seen):
        seen.append(current)
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(current.errno)
        text = str(current).lower()
        for message in _MESSAGES:
            if message in text:
                return message
        current = current.__cause__ or current.__context__
    return None


class Reserve:
    """A file of :data:`RESERVE_BYTES` in ``folder`` for study ``owner``, released when the disk fills
    (and at the end of the study)."""

    def __init__(self, folder: Path, owner: str, size: int = RESERVE_BYTES) -> None:
        # One file per study (studies may share a runs folder); a killed driver's is reused by its resume.
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in owner)[:100]
        self.path: Path | None = Path(folder) / f"{RESERVE_NAME}-{safe}"
        try:
            with open(self.path, "wb") as fh:
                fh.write(b"\0" * size)  # written, not sparse: the blocks are really taken
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:  # already full: nothing to keep, nothing to release
            self.release()

    def release(self) -> bool:
        """Free the reserved space; True if there was some."""
        path, self.path = self.path, None
        if path is None:
            return False
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
