"""Small helpers the pool tests share (imported as ``_ray_helpers``, like ``_postgres``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from servetune.cluster._ray_session import RAYLET_LATE
from servetune.cluster.base import Pool
from servetune.result import TrialResult
from _kill import kill_all_started_by


def free_ports(n: int, avoid: Collection[int] = ()) -> list[int]:
    """``n`` distinct free ports (held open together, so the OS cannot hand one out twice), none of
    ``avoid`` (ports picked earlier for a server that has not bound them yet)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            if s.getsockname()[1] in avoid:
                s.close()  # held ports are never handed out again, so this ends
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def start_ray_node(command: Callable[[], list[str]], env: Mapping[str, str], log: Path,
                   up: Callable[[], bool], timeout_s: float, attempts: int = 3) -> subprocess.Popen[bytes]:
    """Start one ``ray start ... --block`` node (the argv ``command()`` builds: fresh ports each call)
    as the leader of a new process group, output to ``log``, and return it once ``up()``. A start that Ray gave up
    on (``RAYLET_LATE``: its raylet not registered within Ray's fixed 30 s, which 2 cores shared with other
    test files can exceed) is ended with all it started and tried again, up to ``attempts`` times;
    any other failure, or ``timeout_s`` without ``up()``, raises with the log's tail."""
    tails: list[str] = []
    for attempt in range(1, attempts + 1):
        with open(log, "wb") as out:
            proc = subprocess.Popen(command(), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            if up():
                return proc
            time.sleep(0.5)
        text = log.read_text(errors="replace")
        tails.append(f"-- attempt {attempt} --\n{text[-2500:]}")
        kill_all_started_by(proc.pid)
        proc.wait(timeout=30)
        if RAYLET_LATE not in text:
            break
    raise RuntimeError("ray start did not come up:\n" + "\n".join(tails))


def wait_all(pool: Pool, n: int, timeout_s: float) -> dict[int, TrialResult]:
    """Collect ``n`` trial results from ``pool``; fails the test naming those that never finished."""
    done: dict[int, TrialResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < n and time.monotonic() < deadline:
        done.update(pool.wait(timeout_s=1.0))
    assert len(done) == n, f"only {sorted(done)} of {n} trials finished"
    return done


# A driver of its own (this process joins no cluster) that reads the alive nodes' resources, first
# waiting up to WAIT_S for WANT of them: one Ray start-up per node a cluster brings up, not one per poll.
_ALIVE = """
import json, sys, time, ray
address, want, wait_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, log_to_driver=False)
deadline = time.monotonic() + wait_s
while True:
    alive = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() >= deadline:
        print(json.dumps(alive))
        break
    time.sleep(0.2)
"""


def alive_nodes(address: str, env: Mapping[str, str], want: int = 0, wait_s: float = 20.0) -> list[dict[str, Any]]:
    """The resources of the alive nodes of the Ray cluster at ``address`` (empty where it cannot be
    reached); with ``want``, once that many are alive or after ``wait_s``."""
    out = subprocess.run([sys.executable, "-c", _ALIVE, address, str(want), str(wait_s)], env=dict(env),
                         capture_output=True, text=True, timeout=60 + wait_s)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []
