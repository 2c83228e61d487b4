"""Pre-launch flag checks against the real `vllm serve --help=all` of vLLM 0.26.0 (H200 host)."""

from __future__ import annotations

from pathlib import Path

from servetune.planner.flags import FLAGS, to_cli_args
from servetune.engines.vllm.serve_cli import check_argv, parse_serve_help

HELP = (Path(__file__).parents[2] / "fixtures" / "real_h200" / "examples" / "help_all.txt").read_text()


def test_every_flag_servetune_sets_is_spelled_as_vllm_0_26_spells_it() -> None:
    options = parse_serve_help(HELP)
    for name, spec in FLAGS.items():
        assert spec.cli in options, f"{spec.cli} is not a vllm serve 0.26 option"
        if spec.kind is bool:
            assert "--no-" + spec.cli[2:] in options, f"--no-{spec.cli[2:]} missing"


def test_kv_cache_dtype_choices_come_from_vllm() -> None:
    options = parse_serve_help(HELP)
    assert {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"} <= set(options["--kv-cache-dtype"] or ())
    for value in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert check_argv(to_cli_args({"kv_cache_dtype": value}), options) == []


def test_removed_flags_and_bad_choices_are_refused_before_launch() -> None:
    options = parse_serve_help(HELP)
    problems = check_argv(["--swap-space", "4", "--kv-cache-dtype", "fp16", "--max-num-seqs", "64"], options)
    assert any(p.startswith("--swap-space: unknown") for p in problems)
    assert any(p.startswith("--kv-cache-dtype: 'fp16'") for p in problems)
    assert len(problems) == 2
    assert check_argv(to_cli_args({"gpu_memory_utilization": 0.9, "enforce_eager": False,
                                   "cudagraph_capture_sizes": [1, 2, 4]}), options) == []
