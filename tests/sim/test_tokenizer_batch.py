"""The API server's micro-batching tokenizer (vLLM 0.10.0-0.23.0, ``servetune.sim.tokenizer_batch``).

The rule: a prompt reaching the tokenizer opens a batch whose deadline is one window (2 ms) ahead,
unless a batch is open and not full, which it joins; it is tokenized at its batch's deadline. The
wait is latency (the loop runs other work meanwhile), not loop CPU. Releases from 0.24.0 have no
window, so the calibration's vLLM 0.26.0 is untouched.
"""

from __future__ import annotations

import pytest

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.planner.vllm_rules import parse_vllm_version
from servetune.sim import simulate
from servetune.sim import scheduler as sim_scheduler
from servetune.sim.frontend import ApiServer
from servetune.sim.tokenizer_batch import tokenizer_batch_wait_s
from servetune.workload import Workload

MS = 1e-3


@pytest.mark.parametrize(("version", "window_ms"), [("0.9.2", 0.0), ("0.10.0", 2.0), ("0.10.1.1", 2.0),
                                                    ("0.11.0", 2.0), ("0.15.1", 2.0), ("0.23.0", 2.0),
                                                    ("0.24.0", 0.0), ("0.26.0", 0.0), ("0.28.0", 0.0)])
def test_the_window_is_2_ms_from_vllm_0_10_0_to_0_23_0_and_none_after(version: str, window_ms: float) -> None:
    v = tuple(int(p) for p in version.split(".")[:3])
    assert len(v) == 3
    assert tokenizer_batch_wait_s(v) == pytest.approx(window_ms * MS)  # type: ignore[arg-type]
    if v >= (0, 10, 0):
        assert tokenizer_batch_wait_s(parse_vllm_version(version)) == pytest.approx(window_ms * MS)


def _api(window_s: float, passes: int = 1, request_s: float = 1 * MS, batch: int = 32) -> ApiServer:
    return ApiServer(request_s=request_s, prompt_token_s=0.0, token_s=0.0, stream_prompt_token_s=0.0,
                     chunk_share=0.0, intake_passes=passes, tokenize_wait_s=window_s, tokenize_batch=batch)


def _entries(api: ApiServer, sends: list[tuple[str, float]]) -> dict[str, float]:
    """When each send reached the engine core (the loop run to its end)."""
    for key, t in sends:
        api.submit(key, send_s=t, prompt_tokens=0)
    entered: dict[str, float] = {}
    horizon = 0.0
    while api.has_work():
        horizon += 0.1 * MS
        api.advance(horizon)
        for key in api.pop_entered(horizon):
            entered[key] = horizon
    return entered


@pytest.mark.parametrize("passes", [1, 6])
def test_a_lone_request_reaches_the_engine_one_window_later_and_the_loop_pays_no_cpu_for_it(passes: int) -> None:
    plain, batched = _api(0.0, passes), _api(2 * MS, passes)
    t_plain = _entries(plain, [("r", 0.0)])["r"]
    t_batched = _entries(batched, [("r", 0.0)])["r"]
    assert t_batched - t_plain == pytest.approx(2 * MS, abs=0.11 * MS)
    assert batched.busy_s == pytest.approx(plain.busy_s)


def test_prompts_reaching_the_tokenizer_within_one_window_share_it() -> None:
    """r0's first pass ends at 1 ms and opens a batch until 3 ms; r1's ends at 2 ms and joins it,
    so r1 waits 1 ms, not a window of its own; r2's ends at 3.5 ms, after the deadline: a new batch."""
    got = _entries(_api(2 * MS), [("r0", 0.0), ("r1", 1 * MS), ("r2", 2.5 * MS)])
    assert got["r0"] == pytest.approx(3 * MS, abs=0.11 * MS)
    assert got["r1"] == pytest.approx(got["r0"], abs=0.11 * MS)
    assert got["r2"] == pytest.approx(5.5 * MS, abs=0.11 * MS)


def test_a_full_batch_takes_no_more_prompts() -> None:
    """Four prompts sent together, at most two a batch, first passes ending at 0.5, 1, 1.5 and 2 ms:
    r0 opens a batch until 2.5 ms and r1 joins it; r2, though inside that window, finds it full and
    opens the next, until 3.5 ms, which r3 joins."""
    got = _entries(_api(2 * MS, request_s=0.5 * MS, batch=2), [(f"r{i}", 0.0) for i in range(4)])
    assert [got[f"r{i}"] for i in range(4)] == pytest.approx([2.5 * MS, 2.5 * MS, 3.5 * MS, 3.5 * MS], abs=0.11 * MS)
    # with room for all four, one batch: every prompt at r0's deadline
    got = _entries(_api(2 * MS, request_s=0.5 * MS, batch=4), [(f"r{i}", 0.0) for i in range(4)])
    assert [got[f"r{i}"] for i in range(4)] == pytest.approx([2.5 * MS] * 4, abs=0.11 * MS)


def test_the_loop_streams_other_requests_tokens_while_a_prompt_waits_for_its_batch() -> None:
    api = _api(2 * MS)
    api.submit("new", send_s=0.0, prompt_tokens=0)
    api.advance(horizon_s=1.0 * MS)  # the intake's pass ends at 1 ms; the prompt then waits to 3 ms
    api.step_output(0, end_s=1.5 * MS, sampled=[("old", 0)])
    delivered: list[float] = []
    api.advance(horizon_s=1.6 * MS, on_delivered=lambda step, t, done: delivered.append(t))
    assert delivered == [pytest.approx(1.5 * MS)]
    assert api.pop_entered(1.6 * MS) == []


def _ttft_ms(version: str, monkeypatch: pytest.MonkeyPatch | None = None) -> float:
    model, gpu = load_model("servetune-test-850m"), get_gpu("H100-80GB")
    config = resolve_engine_config({"max_model_len": 4096}, model, gpu, version)
    if monkeypatch is not None:  # the same version's rules, the window taken away
        monkeypatch.setattr(sim_scheduler, "tokenizer_batch_wait_s", lambda v: 0.0)
    load = Workload.from_dict({"input_len": 256, "output_len": 16, "num_requests": 4, "concurrency": 1})
    result = simulate(model, gpu, config, load)
    assert result.ok and result.ttft_ms is not None
    return result.ttft_ms.mean


def test_one_stream_on_vllm_0_23_0_waits_the_window_more_for_its_first_token(monkeypatch: pytest.MonkeyPatch) -> None:
    with_window = _ttft_ms("0.23.0")
    without = _ttft_ms("0.23.0", monkeypatch)
    assert with_window - without == pytest.approx(2.0, abs=0.1)


def test_vllm_0_26_0_the_calibrations_release_has_no_window(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _ttft_ms("0.26.0") == pytest.approx(_ttft_ms("0.26.0", monkeypatch))


def test_a_negative_window_or_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="tokenize"):
        _api(-1 * MS)
    with pytest.raises(ValueError, match="tokenize"):
        _api(2 * MS, batch=0)
