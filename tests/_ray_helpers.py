"""Small helpers the pool tests share (imported as ``_ray_helpers``, like ``_postgres``)."""

from __future__ import annotations

import socket
import time

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
