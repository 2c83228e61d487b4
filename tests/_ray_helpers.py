"""Small helpers the pool tests share (imported as ``_ray_helpers``, like ``_postgres``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from servetune.cluster.base import Pool
from servetune.result import TrialResult


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so the OS cannot hand one out twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


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
