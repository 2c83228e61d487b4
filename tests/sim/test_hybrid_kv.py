"""The simulated scheduler's KV blocks for sliding-window / full-attention hybrids (sim.blocks.KVGroups).

vLLM's hybrid KV cache manager gives each KV group its own blocks of the one pool: a request holds
a block per 16 tokens in the full-attention group and in the sliding group, and the sliding group
frees the blocks the window left, on the processed-token basis, before the request's allocation.
"""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.sim import SimScheduler
from servetune.sim.scheduler import kv_groups

GPU = get_gpu("H100-80GB")
LLAMA = load_model("llama-3.1-8b")
GEMMA2 = load_model("gemma-2-27b")  # 4,096-token window on every other layer: one full, one sliding group
GPT_OSS = load_model("gpt-oss-20b")  # 128-token window on half the layers


def scheduler(model, num_gpu_blocks: int, **flags: object) -> SimScheduler:
    base: dict[str, object] = {"max_model_len": 4096, "max_num_seqs": 16, "max_num_batched_tokens": 2048}
    base.update(flags)
    return SimScheduler(model, GPU, resolve_engine_config(base, model, GPU), num_gpu_blocks=num_gpu_blocks)


def held(s: SimScheduler) -> int:
    return s.pool.usable - s.num_free_blocks


def test_the_groups_read_off_the_model() -> None:
    cfg = resolve_engine_config({"max_model_len": 8192, "max_num_batched_tokens": 8192}, GEMMA2, GPU)
    g = kv_groups(GEMMA2, cfg)
    assert g is not None and (g.full, g.sliding, g.window) == (1, 1, 4096)
    # SlidingWindowSpec.max_admission_blocks_per_request: cdiv(min(4095 + 2 x 8192, 8192), 16) + 1
    assert g.admission_cap == 513
    assert kv_groups(LLAMA, resolve_engine_config({}, LLAMA, GPU)) is None


def test_a_request_inside_the_window_holds_a_block_per_group() -> None:
    s = scheduler(GEMMA2, 1000)
    s.add_request("a", 1024, 8, arrival_s=0.0)
    s.step()
    assert held(s) == 2 * 64
    s.step()  # the first decode token: position 1024 opens a 65th entry in both groups
    assert held(s) == 2 * 65
    single = scheduler(LLAMA, 1000)
    single.add_request("a", 1024, 8, arrival_s=0.0)
    single.step()
    assert held(single) == 64


@pytest.mark.parametrize("async_scheduling, freed_at", [(True, 2), (False, 1)])
def test_the_sliding_group_frees_what_left_the_window(async_scheduling: bool, freed_at: int) -> None:
    # gpt-oss: 128-token window. After a 1,024-token prefill the sliding group needs only the
    # blocks of the last 127 processed tokens; with async scheduling the prefill is still in flight
    # while the next batch forms, so its blocks go one step later.
    s = scheduler(GPT_OSS, 1000, async_scheduling=async_scheduling)
    s.add_request("a", 1024, 8, arrival_s=0.0)
    s.step()
    assert held(s) == 2 * 64
    counts = []
    for _ in range(3):
        s.step()
        counts.append(held(s))
    # Freed: (1024 - 128 + 1) // 16 = 56 blocks once 1,024 tokens are processed; then the window
    # moves one token a step and frees no other whole block in these steps.
    assert counts[freed_at - 1:] == [2 * 65 - 56] * (4 - freed_at)
    assert counts[:freed_at - 1] == [2 * 65] * (freed_at - 1)
    s.run_until_idle()
    assert s.num_free_blocks == s.pool.usable  # everything back: the slid-out blocks are not freed twice


def test_the_pool_binds_at_two_blocks_per_16_tokens() -> None:
    # 1,024-token prompts, 139 usable blocks: one-group accounting runs two at once (65 blocks
    # each); the hybrid's two groups fit one, and the second waits for it.
    def most_running(model) -> tuple[int, SimScheduler]:
        s = scheduler(model, 140, max_num_batched_tokens=4096)
        s.add_request("a", 1024, 4, arrival_s=0.0)
        s.add_request("b", 1024, 4, arrival_s=0.0)
        most = 0
        while s.has_work():
            s.step()
            most = max(most, s.num_running)
        return most, s

    most, s = most_running(GEMMA2)
    assert most == 1 and s.num_preemptions == 0 and s.num_free_blocks == s.pool.usable
    assert most_running(LLAMA)[0] == 2


def test_a_sequence_past_the_window_is_admitted_at_the_sliding_groups_cap() -> None:
    # gpt-oss, 256-token budget, sync: the admission gate reserves 125 full blocks and
    # cdiv(min(127 + 256, 4096), 16) + 1 = 25 sliding ones for a 2,000-token sequence (150 of 159
    # usable; two whole groups would be 250 and never fit), and the window keeps it within them.
    s = scheduler(GPT_OSS, 160, max_num_batched_tokens=256, async_scheduling=False)
    assert s.groups is not None and s.groups.admission_cap == 25
    s.add_request("a", 1900, 100, arrival_s=0.0)
    most = 0
    while s.has_work():
        s.step()
        most = max(most, held(s))
    assert s.num_preemptions == 0 and s.request_state("a").num_output_tokens == 100
    assert 125 < most <= 159


# -- Mamba2 hybrids: each Mamba group holds one block per running request --------------------------

GRANITE = load_model("granite-4.0-h-tiny")  # 4 attention + 36 Mamba layers: one full group, nine Mamba groups


def test_a_mamba_hybrids_groups_read_off_the_model() -> None:
    """granite-4.0-h-tiny at vLLM 0.26.0 without prefix caching: groups of 4 layers (the attention
    layers' count), so 1 full-attention group and 36 / 4 = 9 Mamba groups, the attention block raised
    to 400 tokens (``hybrid_block_size``)."""
    cfg = resolve_engine_config({"max_model_len": 8192}, GRANITE, GPU)
    g = kv_groups(GRANITE, cfg)
    assert cfg.mamba_cache_mode == "none" and cfg.block_size == 400
    assert g is not None and (g.full, g.sliding, g.mamba, g.total) == (1, 0, 9, 1)


def test_a_mamba_hybrids_request_holds_one_block_per_mamba_group_until_it_finishes() -> None:
    """A 1,000-token prompt: cdiv(1,000, 400) = 3 attention blocks + 9 Mamba blocks = 12 after its
    prefill, and still after 200 decode steps; the step that computes position 1,200 (its 201st
    output token, fed back) opens a 4th attention block and no Mamba one (a Mamba block spans
    ``max_model_len``); everything goes back when it finishes."""
    s = scheduler(GRANITE, 1000, max_model_len=8192)
    s.add_request("a", 1000, 210, arrival_s=0.0)
    s.step()
    assert held(s) == 3 + 9
    while s.request_state("a").num_output_tokens < 201:
        s.step()
    assert held(s) == 3 + 9
    s.step()
    assert held(s) == 4 + 9
    s.run_until_idle()
    assert s.num_free_blocks == s.pool.usable


def test_a_mamba_hybrids_pool_runs_out_where_an_attention_only_count_would_not() -> None:
    """granite-4.0-h-tiny, 100 usable blocks, four requests of 4,096 + 4,096 tokens (8,192 in all).

    Each admits with cdiv(4,096, 400) = 11 attention blocks + 9 Mamba blocks = 20 (the full-sequence
    gate of vLLM 0.19+ asks the same: 4 x 20 = 80 <= 100), and grows to cdiv(8,192, 400) = 21
    attention blocks, so 21 + 9 = 30 each: 4 x 30 = 120 > 100, and the decoders preempt. Counted
    attention-only (the Mamba groups zeroed) the four peak at 4 x 21 = 84 <= 100 and never preempt.
    """
    def run(mamba: bool) -> SimScheduler:
        s = scheduler(GRANITE, 101, max_model_len=8192, max_num_batched_tokens=8192)
        assert s.groups is not None
        if not mamba:
            s.groups.mamba = 0
        for i in range(4):
            s.add_request(f"r{i}", 4096, 4096, arrival_s=0.0)
        most = 0
        while s.has_work():
            s.step()
            most = max(most, held(s))
        assert s.num_free_blocks == s.pool.usable
        assert all(s.request_state(f"r{i}").num_output_tokens == 4096 for i in range(4))
        s.most_held = most  # type: ignore[attr-defined]
        return s

    hybrid, attention_only = run(True), run(False)
    assert attention_only.num_preemptions == 0 and attention_only.most_held == 84  # type: ignore[attr-defined]
    assert hybrid.num_preemptions > 0 and hybrid.most_held <= 100  # type: ignore[attr-defined]
