"""Drivers that open the same new SQLite study database at the same moment all open it.

Optuna's RDB storage creates the tables and then stamps the schema version (one ``alembic_version`` row);
two processes doing that at once both insert the row, and one lost with "UNIQUE constraint failed:
alembic_version.version_num" (5 to 8 of 30 opens, three at a time, before :func:`open_storage` opened again).
Real processes, a real file, released together by a barrier, ten new databases in turn.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

ROUNDS, DRIVERS = 10, 3


def _open_each(folder: str, barrier: Any, results: Any) -> None:
    from servetune.records._retry import retry_call
    from servetune.records._storage import open_storage

    for n in range(ROUNDS):
        barrier.wait(timeout=60)
        try:
            retry_call(lambda: open_storage(f"sqlite:///{folder}/optuna-{n}.db"), what="open the study storage")
            results.put("ok")
        except Exception as exc:  # noqa: BLE001 - the failure is the finding
            results.put(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def test_drivers_opening_one_new_database_at_once_all_open_it(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each, as separate drivers are
    barrier, results = ctx.Barrier(DRIVERS), ctx.Queue()
    procs = [ctx.Process(target=_open_each, args=(str(tmp_path), barrier, results)) for _ in range(DRIVERS)]
    for proc in procs:
        proc.start()
    try:
        outcomes = [results.get(timeout=120) for _ in range(ROUNDS * DRIVERS)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failures = [o for o in outcomes if o != "ok"]
    assert failures == [], failures
    assert all(proc.exitcode == 0 for proc in procs)
