"""How much of a decided trial's measured window early stopping saves, on the real-engine path.

Runs the vllm backend's trial path (:func:`servetune.engines.vllm.engine.run_vllm_trial`) against the
``vllm serve`` stand-in (``python -m servetune.sim.server``, a real subprocess and real HTTP) for
two trials whose outcome is decided early, each with and without early stopping
(:mod:`servetune.engines.early_stop`):

* ``preempting``: servetune-test-850m on an H200 with 64 KV blocks of 16 tokens and 64 sequences
  for 256 + 256-token requests, 32 in flight: it preempts from the first batch
  (``max_preemptions: 0``);
* ``below best``: ``max_num_seqs: 8`` against a best-so-far 3x its full-window throughput.

It prints, per trial, the measured window, the requests sent and answered, the throughput told
and the preemptions counted. The stand-in runs at ``--sim-speedup`` (virtual seconds per wall
second), so windows are short; the shares carry over, the seconds do not. Only the window is
saved: the server's startup (~75 s for an 8B model on vLLM 0.26) and servetune's per-trial
overhead (~22 s) are paid either way.

Usage::

    PYTHONPATH=platform .venv/bin/python benchmarks/early_stopping.py [--speedup 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

from servetune.engines.early_stop import EarlyStop  # noqa: E402
from servetune.engines.vllm.engine import VllmLaunch, run_vllm_trial  # noqa: E402
from servetune.workload import Workload  # noqa: E402

WORKLOAD = {"input_len": 256, "output_len": 256, "num_requests": 192, "concurrency": 32}
PREEMPTING = {"max_num_seqs": 64, "max_model_len": 2048, "num_gpu_blocks_override": 64}
SMALL_BATCH = {"gpu_memory_utilization": 0.5, "max_num_seqs": 8}


def _run(flags: dict, rule: EarlyStop | None, speedup: float) -> tuple[object, int]:
    launch = VllmLaunch(model="servetune-test-850m", flags=flags,
                        serve_command=(sys.executable, "-m", "servetune.sim.server"),
                        extra_args=("--sim-gpu", "H200", "--sim-speedup", str(speedup)),
                        env={"PYTHONPATH": str(ROOT / "platform"), "SERVETUNE_SIM_STARTUP_S": "0.2"},
                        stop_grace_s=3.0, log_dir=Path(tempfile.mkdtemp(prefix="servetune-es-")),
                        sample_interval_s=0.1, early_stop=rule)
    result = run_vllm_trial(launch, Workload.from_dict(WORKLOAD))
    note = next((e for e in result.evidence if e.startswith("early stop after")), None)
    sent = int(note.split()[3]) if note else WORKLOAD["num_requests"]
    return result, sent


def table(speedup: float = 5.0) -> str:
    """The Markdown table of the four runs (see the module docstring)."""
    lines = ["| trial | early stopping | window (s) | sent / answered | throughput told (tok/s) | preemptions | "
             "early_stopped |", "|---|---|---|---|---|---|---|"]
    full_small = None
    for name, flags in (("preempting", PREEMPTING), ("below best", SMALL_BATCH)):
        for on in (False, True):
            if not on:
                rule = None
            elif name == "preempting":
                rule = EarlyStop(max_preemptions=0)
            else:
                rule = EarlyStop(max_preemptions=0, best_throughput=3 * (full_small or 0.0))
            r, sent = _run(flags, rule, speedup)
            if name == "below best" and not on:
                full_small = r.output_throughput
            lines.append(f"| {name} | {'on' if on else 'off'} | {r.duration_s or 0:.2f} | {sent} / {r.completed} | "
                         f"{r.output_throughput or 0:,.0f} | {r.preemptions} | {r.early_stopped or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speedup", type=float, default=5.0, help="the stand-in's virtual seconds per wall second")
    args = parser.parse_args(argv)
    print(table(args.speedup))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
