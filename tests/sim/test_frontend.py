"""The simulated API server loop (servetune.sim.frontend): intake, drains, merged chunks, the horizon."""

from __future__ import annotations

import pytest

from servetune.sim.frontend import ApiServer

US = 1e-6


def make(chunk_share: float = 0.5, passes: int = 1, request_s: float = 1000 * US, output_slice: int = 0) -> ApiServer:
    # 100 us per token, half of it per chunk; 1 ms per request; no prompt-dependent costs.
    return ApiServer(request_s=request_s, prompt_token_s=0.0, token_s=100 * US, stream_prompt_token_s=0.0,
                     chunk_share=chunk_share, intake_passes=passes, output_slice=output_slice)


def deliveries(api: ApiServer, horizon: float) -> list[tuple[int, float, list]]:
    out: list[tuple[int, float, list]] = []
    api.advance(horizon, lambda step, t, done: out.append((step, t, done)))
    return out


def test_a_loop_that_keeps_up_delivers_each_step_alone_at_the_per_token_cost() -> None:
    api = make()
    for step in range(3):  # 10 ms steps, 4 tokens each: 0.4 ms of loop work per step
        api.step_output(step, end_s=0.010 * (step + 1), sampled=[(k, 0) for k in "abcd"])
    got = deliveries(api, horizon=0.031)
    assert [step for step, _, _ in got] == [0, 1, 2]
    assert [t for _, t, _ in got] == pytest.approx([0.0104, 0.0204, 0.0304])
    assert api.busy_s == pytest.approx(12 * 100 * US)  # one chunk per token: exactly the per-token cost


def test_a_loop_behind_drains_every_queued_step_and_writes_one_chunk_per_request() -> None:
    """Three steps queued before the loop is free: one drain, one merged chunk per request."""
    api = make()
    api.submit("x", send_s=0.0, prompt_tokens=0)
    api.advance(horizon_s=0.0)  # the intake holds the loop until 1 ms
    for step in range(3):
        api.step_output(step, end_s=0.0002 * (step + 1), sampled=[(k, 0) for k in "ab"])
    got = deliveries(api, horizon=1.0)
    assert [step for step, _, _ in got] == [0, 1, 2]
    t = 0.001 + 6 * 50 * US + 2 * 50 * US  # drain: 6 tokens x the token share; then 2 chunks x the chunk share
    assert all(when == pytest.approx(t) for _, when, _ in got)
    assert api.busy_s == pytest.approx(0.001 + 6 * 50 * US + 2 * 50 * US)  # less than 6 x 100 us: merged


def test_a_drain_takes_the_steps_ended_when_it_starts_and_waits_for_the_engine_to_know_them() -> None:
    """The loop is busy until 1 ms: steps 0 and 1 ended before, so one drain takes both; step 2 ends
    during that drain and waits for the next pass. A drain starting past the horizon waits."""
    api = make()
    api.submit("x", send_s=0.0, prompt_tokens=0)
    api.step_output(0, end_s=0.0002, sampled=[("a", 0), ("b", 0)])
    api.step_output(1, end_s=0.0004, sampled=[("a", 0), ("b", 0)])
    assert deliveries(api, horizon=0.0005) == []  # the drain starts at 1 ms: a later step may join it
    api.step_output(2, end_s=0.0012, sampled=[("a", 0)])
    got = deliveries(api, horizon=0.01)
    first = 0.001 + 4 * 50 * US + 2 * 50 * US
    assert [(step, round(t, 9)) for step, t, _ in got] == [
        (0, round(first, 9)), (1, round(first, 9)), (2, round(first + 50 * US + 50 * US, 9))]


def test_intake_passes_wait_behind_the_output_work_that_became_ready_in_between() -> None:
    """With two passes a request sent just before a step's tokens waits for their drain and chunks
    between its halves; with one it enters first. The same CPU either way."""
    entries = []
    for api in (make(passes=1), make(passes=2)):
        api.submit("new", send_s=0.0, prompt_tokens=0)
        api.step_output(0, end_s=0.0001, sampled=[(k, 0) for k in range(20)])  # 1 ms drain + 1 ms chunks
        deliveries(api, horizon=1.0)
        entries.append(api.next_entry_s())
        assert api.busy_s == pytest.approx(0.001 + 20 * 100 * US)
    assert entries == pytest.approx([0.001, 0.0005 + 0.002 + 0.0005])


def test_entries_come_in_order_and_only_up_to_the_time_asked() -> None:
    api = make()
    api.submit("a", send_s=0.0, prompt_tokens=0)
    api.submit("b", send_s=0.0, prompt_tokens=0)
    api.advance(horizon_s=1.0)
    assert api.next_entry_s() == pytest.approx(0.001)
    assert api.pop_entered(0.0015) == ["a"]
    assert api.pop_entered(1.0) == ["b"]
    assert not api.has_work()


def test_until_entry_runs_past_the_horizon_and_stops_at_the_first_entry() -> None:
    api = make()
    api.submit("a", send_s=5.0, prompt_tokens=0)
    api.submit("b", send_s=6.0, prompt_tokens=0)
    api.advance(horizon_s=0.0)
    assert api.next_entry_s() == float("inf")  # both sends are past the horizon
    api.advance(horizon_s=0.0, until_entry=True)
    assert api.next_entry_s() == pytest.approx(5.001) and api.has_work()  # "b" still waits


def test_finished_requests_are_reported_with_the_step_that_carried_their_last_token() -> None:
    api = make()
    api.step_output(0, end_s=0.01, sampled=[("a", 0), ("b", 0)], finished=["a"])
    api.step_output(1, end_s=0.02, sampled=[("b", 0)], finished=["b"])
    got = deliveries(api, horizon=1.0)
    assert [(step, done) for step, _, done in got] == [(0, ["a"]), (1, ["b"])]


def test_a_step_of_more_outputs_than_a_slice_lets_ready_intake_in_at_the_slice_boundary() -> None:
    """vLLM's output handler processes a step's outputs in slices (VLLM_V1_OUTPUT_PROC_CHUNK_SIZE)
    and yields between them: a pass ready before a boundary runs there, not after the drain.
    A step of 20 outputs, slices of 8: boundaries after 8 and 16 outputs (0.4 and 0.8 ms of drain)."""
    entries, delivered = [], []
    for output_slice in (0, 8, 20, 32):
        api = make(passes=2, output_slice=output_slice)
        api.step_output(0, end_s=0.0, sampled=[(k, 0) for k in range(20)])  # 1 ms drain + 1 ms chunks
        api.submit("new", send_s=0.0001, prompt_tokens=0)  # ready during the drain
        got = deliveries(api, horizon=1.0)
        entries.append(api.next_entry_s())
        delivered.append(got[0][1])
        assert api.busy_s == pytest.approx(0.001 + 20 * 100 * US)  # the same CPU whatever the slices
    # Whole drain (0, or a slice as large as the step): both 0.5 ms passes wait for the 1 ms drain
    # and the 1 ms of chunks: entry at 3 ms. Slices of 8: the first pass runs at the 0.4 ms boundary
    # (to 0.9), the handler takes the next slice (to 1.3), and the second pass, ready since 0.9,
    # runs at that boundary: entry at 1.8 ms; the chunks wait for both passes.
    assert entries == pytest.approx([0.003, 0.0018, 0.003, 0.003])
    assert delivered == pytest.approx([0.002, 0.003, 0.002, 0.002])


def test_slices_are_cut_within_one_step_not_across_the_steps_of_a_drain() -> None:
    """Two steps of 6 outputs drained together, slices of 8: no step holds more than a slice, so
    nothing yields (vLLM slices each step's outputs as it takes them off the queue)."""
    api = make(output_slice=8)
    api.submit("x", send_s=0.0, prompt_tokens=0)
    api.advance(horizon_s=0.0)  # the loop is busy until 1 ms
    api.step_output(0, end_s=0.0002, sampled=[(k, 0) for k in range(6)])
    api.step_output(1, end_s=0.0004, sampled=[(k, 0) for k in range(6)])
    api.submit("y", send_s=0.0011, prompt_tokens=0)
    deliveries(api, horizon=1.0)
    assert api.pop_entered(0.0015) == ["x"]
    # y waits for the whole drain (12 x 50 us) and its 6 chunks (6 x 50 us): 1.0 + 0.9 + 1.0 ms.
    assert api.next_entry_s() == pytest.approx(0.0029)
    assert api.busy_s == pytest.approx(0.002 + 12 * 50 * US + 6 * 50 * US)


@pytest.mark.parametrize("kwargs", [{"chunk_share": 1.5}, {"chunk_share": -0.1}, {"passes": 0},
                                    {"output_slice": -1}])
def test_bad_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make(**kwargs)


def test_a_slow_client_reads_every_chunk_after_the_loop_wrote_it_at_its_own_pace() -> None:
    """The load generator reads chunks one at a time: behind, the clients see tokens at its pace,
    while the API server's loop (and its CPU) keeps up and merges nothing."""
    api = ApiServer(request_s=0.0, prompt_token_s=0.0, token_s=10 * US, stream_prompt_token_s=0.0,
                    chunk_share=0.5, client_chunk_s=100 * US)
    for step in range(3):  # 4 chunks a step every 0.2 ms: 0.4 ms of client reading per step
        api.step_output(step, end_s=0.0002 * (step + 1), sampled=[(k, 0) for k in "abcd"])
    got = deliveries(api, horizon=1.0)
    assert [t for _, t, _ in got] == pytest.approx([0.0002 + 40 * US + 400 * US, 0.0002 + 40 * US + 800 * US,
                                                    0.0002 + 40 * US + 1200 * US])
    assert api.busy_s == pytest.approx(12 * 10 * US)  # the loop's CPU: one chunk per token, no merging
