"""gpustack's Qwen3-14B runs not already in dense.yaml (tests/fixtures/published_runs/gpustack_qwen3_14b.yaml):
vLLM 0.11.0 ShareGPT bursts of 1,000 prompts on one H100 (bf16) and one A100 (bf16 and the AWQ checkpoint), the
pages' vLLM runs with their configuration stated that dense.yaml does not hold. Judged blind: nothing was fitted
or changed on seeing them. The split rule holds out the H100 run and the A100 AWQ run and puts the A100 bf16 run
(a sweep of its own) in the fit half. The recorded errors are
benchmarks/results/published_runs_gpustack_qwen3_14b.json (``published_runs.py --file ... --compare --json``);
recorded 2026-12-07: H100 bf16 +37.9% output throughput (TTFT -8.6%); A100 bf16 +24.5% (TTFT +7.4%, fit
split); A100 AWQ +24.9% (TTFT -0.9%). None within 10%; every TTFT within 25%.
Re-recorded 2026-12-07 with ShareGPT's own per-request lengths (``published_runs.sharegpt_requests``, in
place of every request at the stated means; docs/accuracy.md, "ShareGPT's own request lengths"): H100 bf16
+37.9% -> +35.9% (TTFT -8.6% -> -9.5%); A100 bf16 +24.5% -> +5.5% (TTFT +7.4% -> +0.8%, fit split, nothing
refitted); A100 AWQ +24.9% -> +11.4% (TTFT -0.9% -> -6.4%).
"""

from __future__ import annotations

from pathlib import Path

from _recorded import all_as_recorded
from published_runs import FIXTURES, load_runs, split_of

FILE = FIXTURES / "gpustack_qwen3_14b.yaml"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "published_runs_gpustack_qwen3_14b.json"
RUNS = load_runs([FILE])


def test_the_file_loads_and_splits_by_the_rule() -> None:
    """Three runs: the H100's one held out; the A100's two are two sweeps (two checkpoints), one fit, one held out."""
    assert len(RUNS) == 3 and {r.gpu for r in RUNS} == {"H100-80GB", "A100-80GB"}
    assert {r.model for r in RUNS} == {"qwen3-14b", "qwen3-14b-awq"} and {r.vllm_version for r in RUNS} == {"0.11.0"}
    assert split_of(RUNS) == {r.id: r.split for r in RUNS}
    assert {r.id: r.split for r in RUNS} == {"h100-qwen3-14b-tp1-sharegpt-burst1000": "held_out",
                                             "a100-qwen3-14b-tp1-sharegpt-burst1000": "fit",
                                             "a100-qwen3-14b-awq-tp1-sharegpt-burst1000": "held_out"}


def test_the_recorded_errors_still_hold() -> None:
    """Every run simulates in under a second: each recorded headline and TTFT error (within a point), none
    called impossible, and the default max_model_len (40,960) served on both GPUs, so none assumed."""
    judged_runs = all_as_recorded(RUNS, RESULTS)
    for run in RUNS:
        judged, rec = judged_runs[run.id]
        assert judged.default_refused is None and judged.assumed_max_model_len is None, run.id
        assert rec.get("assumed_max_model_len") is None and "max_model_len" not in run.flags, run.id
