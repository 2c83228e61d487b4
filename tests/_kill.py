"""Ending what a SIGKILLed ``servetune tune`` leaves: every process started under its process group
leader's id (the driver, its local Ray's raylet, GCS, agents and workers), as a node's OOM killer or
a scheduler's ``kill -9`` of the whole job would."""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["kill_all_started_by"]


def kill_all_started_by(leader: int) -> int:
    """SIGKILL every process whose SID (field 6 of /proc/PID/stat) is ``leader`` (a child started with
    ``start_new_session=True``, and all it started); returns how many were signalled."""
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3]) == leader:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        except (OSError, IndexError, ValueError):
            pass
    return killed
