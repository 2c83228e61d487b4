"""ShareGPT's own per-request lengths for the published ``dataset: sharegpt`` runs
(``published_runs.sharegpt_requests``; the rows in tests/fixtures/published_runs/sharegpt_lengths.json, from
JonnyKong/vidur@941a76c: vLLM's ShareGPT sampler at seed 0 with the Llama-3.1-8B tokenizer). Written
2026-12-07 after the fixed mean lengths put the 1,000-request ShareGPT bursts' throughput 25-86% high;
nothing is fitted on the runs: the rows are the source's, rescaled to each run's stated means."""

from __future__ import annotations

import json

import numpy as np
import pytest
from published_runs import (SHAREGPT_LENGTHS, ReplayedLoad, assumed_max_model_len, judge, load_runs, rescaled,
                            sharegpt_lengths, sharegpt_rows, workload_of)

SHAREGPT = [r for r in load_runs() if r.workload.get("dataset") == "sharegpt"]


def test_the_rows_are_the_sourced_ones_within_vllms_filters() -> None:
    """16,384 rows, each kept by vLLM's is_valid_sequence (prompt and output >= 4, prompt <= 1024, prompt +
    output <= 2048), the source named at its commit; ShareGPT's tail is in them (the longest output 9x the mean)."""
    doc = json.loads(SHAREGPT_LENGTHS.read_text())
    assert "JonnyKong/vidur/blob/941a76c34cc3135db0dd13250252e4b23f7ea103/" in doc["source"]
    assert "Llama-3.1-8B" in doc["tokenizer"] and doc["rows"] == 16384
    prompts, outputs = (np.array(x) for x in sharegpt_rows())
    assert len(prompts) == len(outputs) == 16384
    assert prompts.min() >= 4 and outputs.min() >= 4 and prompts.max() <= 1024 and (prompts + outputs).max() <= 2048
    assert outputs.max() > 9 * outputs.mean() and np.percentile(outputs, 99) > 3.5 * outputs.mean()


def test_vllms_first_hundred_agree_with_what_a_published_run_printed_of_its_own() -> None:
    """The L40S run's source printed its first 100 ShareGPT prompts' lengths (Qwen3 tokenizer: 5-817 prompt,
    4-771 output, means 232.6 / 220.6); the rows' first 100 (Llama-3.1-8B) give 4-802, 4-770, 224.0 / 210.1:
    the same requests in the same order, another tokenizer's counts (a check of the order, fitted on nothing)."""
    prompts, outputs = sharegpt_rows()
    assert (min(prompts[:100]), max(prompts[:100]), min(outputs[:100]), max(outputs[:100])) == (4, 802, 4, 770)
    assert np.mean(prompts[:100]) == pytest.approx(232.6, rel=0.05) and np.mean(outputs[:100]) == pytest.approx(
        220.6, rel=0.06)


def test_rescaled_keeps_the_shape_and_hits_the_total() -> None:
    assert rescaled([10, 20, 70], 50) == [5, 10, 35]
    out = rescaled([1, 1, 998], 500)
    assert sum(out) == 500 and min(out) >= 1


@pytest.mark.parametrize("run", SHAREGPT, ids=[r.id for r in SHAREGPT])
def test_every_sharegpt_run_is_sent_sharegpts_lengths_at_its_stated_totals(run) -> None:
    """Replayed with one request per prompt; prompt and output tokens add up to the stated means times the
    prompts; lengths vary with ShareGPT's tail (the longest output over 3x the mean); the pacing is the run's."""
    load = workload_of(run)
    assert isinstance(load, ReplayedLoad)
    reqs = load.requests()
    w = run.workload
    assert len(reqs) == w["num_prompts"]
    assert sum(r.prompt_tokens for r in reqs) == w["num_prompts"] * w["input_len"]
    assert sum(r.output_tokens for r in reqs) == w["num_prompts"] * w["output_len"]
    assert max(r.output_tokens for r in reqs) > 3 * w["output_len"] and min(r.output_tokens for r in reqs) >= 1
    timed = w.get("request_rate") not in (None, float("inf"))
    assert all((r.arrival_s is not None) == timed for r in reqs)
    assert workload_of(run, as_sent=False).requests()[0].prompt_tokens == w["input_len"]  # --before: the means


def test_the_draw_is_deterministic_in_vllms_order_for_vllm_bench_serve_and_seeded_for_others() -> None:
    """``vllm bench serve`` at its default seed 0 sends the rows in order; another seed or client, a seeded
    draw of them (GPUStack's benchmark-runner reads ShareGPT in file order, not vLLM's shuffle)."""
    prompts, _ = sharegpt_rows()
    first = sharegpt_lengths(100, 233, 221)
    assert first == sharegpt_lengths(100, 233, 221)
    assert first[0] == rescaled(list(prompts[:100]), 23300)
    drawn = sharegpt_lengths(1000, 342, 281, None)
    assert drawn == sharegpt_lengths(1000, 342, 281, None) and drawn[0] != sharegpt_lengths(1000, 342, 281)[0]
    guidellm = next(r for r in SHAREGPT if r.client["tool"] != "vllm bench serve")
    assert [q.prompt_tokens for q in workload_of(guidellm).requests()] == drawn[0]


def test_a_run_stating_no_max_model_len_is_assumed_its_longest_request_as_sent() -> None:
    """The H100 Qwen3-32B burst (the default length refused by the planner, the run served): 2,048, the longest
    ShareGPT request as sent rounded up (512 at the means), and simulated there."""
    run = next(r for r in SHAREGPT if r.id == "h100-qwen3-32b-tp1-sharegpt-burst1000")
    longest = max(q.prompt_tokens + q.output_tokens for q in workload_of(run).requests())
    assert 1024 < longest <= 2048 and assumed_max_model_len(run) == 2048
    assert judge(run).assumed_max_model_len == 2048
