"""What the tests that start, kill and resume real ``servetune tune`` processes share: the study they run
and how far its SQLite storage has got."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

__all__ = ["completed_trials", "a100_sim_study"]


def completed_trials(db: Path) -> int:
    """COMPLETE trials in the Optuna SQLite file ``db``, read-only (0 while it is not created yet)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return int(conn.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0])
    except sqlite3.Error:
        return 0


def a100_sim_study(name: str, trials: int, runs: Path, tracking: dict[str, Any]) -> dict[str, Any]:
    """A simulated 8B study on two A100-40GBs, two trials at a time (several seconds a trial on 2 cores)."""
    return {
        "name": name, "model": "llama-3.1-8b", "gpu": {"type": "A100-40GB", "count": 2},
        "workload": {"input_len": 512, "output_len": 1024, "num_requests": 96, "concurrency": 96, "seed": 1},
        "objective": {"metric": "output_throughput"}, "constraints": {"max_preemptions": 0},
        "search_space": {"params": {
            "gpu_memory_utilization": {"type": "float", "low": 0.2, "high": 0.95, "step": 0.05},
            "max_num_seqs": {"type": "categorical", "choices": [16, 32, 64, 128, 256]}}},
        "fixed_flags": {"max_model_len": 4096}, "budget": {"trials": trials, "parallel": 2},
        "backend": "sim", "sampler": "tpe", "seed": 3, "tracking": tracking,
        "output": {"runs_dir": str(runs), "dataset_dir": str(runs / "dataset")},
    }
