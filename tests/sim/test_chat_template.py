"""vLLM 0.11.0's chat endpoint parses the chat template on every request (``Workload.chat``).

The rule: only 0.11.0 (``VllmMemoryRules.chat_template_parsed_per_request``, read in the released
source), only chat requests, never gpt-oss's Harmony chat; the cost is one more API-server intake
cost per request (``Calibration.chat_template_parse_s``), so it delays every first token by it at
one request in flight and queues a burst's intakes behind each other.
"""

from __future__ import annotations

import dataclasses

import published_runs
import pytest
from published_runs import FIXTURES, Judged, fit_knob, judge, load_runs, resolve_model, workload_of

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.modelinfo import load_model
from servetune.planner.vllm_rules import memory_rules, parse_vllm_version
from servetune.sim import CHAT_TEMPLATE_PARSE_SHARE, chat_template_parse_share, simulate
from servetune.sim.frontend import ApiServer
from servetune.sim.perf import Calibration, PerfModel
from servetune.workload import Workload

H100 = get_gpu("H100-80GB")
TINY = load_model("servetune-test-850m")


@pytest.mark.parametrize(("version", "parses"), [("0.11.0", True), ("0.11.1", False), ("0.12.0", False),
                                                 ("0.26.0", False)])
def test_only_vllm_0_11_0_parses_the_chat_template_per_request(version: str, parses: bool) -> None:
    assert memory_rules(parse_vllm_version(version)).chat_template_parsed_per_request is parses


def _perf(model_name: str, version: str) -> PerfModel:
    model = load_model(model_name)
    return PerfModel(model, H100, resolve_engine_config({"max_model_len": 4096}, model, H100, version))


def test_the_per_request_chat_cost_is_priced_on_0_11_0_jinja_templates_only() -> None:
    parse = Calibration().chat_template_parse_s
    assert parse > 0
    assert _perf("servetune-test-850m", "0.11.0").chat_request_overhead_s == pytest.approx(parse)
    assert _perf("servetune-test-850m", "0.26.0").chat_request_overhead_s == 0.0
    assert _perf("gpt-oss-20b", "0.11.0").chat_request_overhead_s == 0.0  # Harmony: no Jinja template


def _ttft_ms(version: str, chat: bool, concurrency: int, n: int) -> float:
    config = resolve_engine_config({"max_model_len": 4096}, TINY, H100, version)
    load = dataclasses.replace(Workload.from_dict({"input_len": 256, "output_len": 16, "num_requests": n,
                                                   "concurrency": concurrency}), chat=chat)
    result = simulate(TINY, H100, config, load)
    assert result.ok and result.ttft_ms is not None
    return result.ttft_ms.mean


def test_a_chat_request_on_0_11_0_waits_the_parse_more_for_its_first_token_and_a_burst_queues_them() -> None:
    parse_ms = 1e3 * Calibration().chat_template_parse_s
    alone = _ttft_ms("0.11.0", True, 1, 4) - _ttft_ms("0.11.0", False, 1, 4)
    assert alone == pytest.approx(parse_ms, rel=0.1)
    # 32 sent at once: the loop takes their intakes one after another, so the mean first token
    # waits about half the burst's parses more (not one parse)
    burst = _ttft_ms("0.11.0", True, 32, 32) - _ttft_ms("0.11.0", False, 32, 32)
    assert burst > 8 * parse_ms
    assert _ttft_ms("0.26.0", True, 1, 4) == pytest.approx(_ttft_ms("0.26.0", False, 1, 4))


def test_a_negative_intake_cost_is_refused() -> None:
    api = ApiServer(request_s=0.001, prompt_token_s=0.0, token_s=0.0, stream_prompt_token_s=0.0, chunk_share=0.0)
    with pytest.raises(ValueError, match="seconds"):
        api.add_request_cost(-1e-3)


RUNS = load_runs([FIXTURES / "dense.yaml"])


def test_published_runs_send_chat_requests_where_their_client_used_the_chat_endpoint() -> None:
    chat = {r.id for r in RUNS if r.chat}
    assert chat and all(r.client["endpoint"] == "/v1/chat/completions" for r in RUNS if r.id in chat)
    assert all(workload_of(r).chat is (r.id in chat) for r in RUNS)
    sharegpt = next(r for r in RUNS if r.id == "h100-qwen3-8b-tp1-sharegpt-c1")
    now, without = judge(sharegpt), judge(sharegpt, {"chat_template_parse_s": 0.0})
    assert now.sim_ttft_ms is not None and without.sim_ttft_ms is not None
    assert now.sim_ttft_ms - without.sim_ttft_ms == pytest.approx(1e3 * Calibration().chat_template_parse_s, rel=0.1)
    completions = next(r for r in RUNS if r.id == "a100-qwen2-7b-tp2-u025-rand1024x1024-burst1")
    assert not completions.chat
    unpriced = judge(completions, {"chat_template_parse_s": 0.0})
    assert judge(completions).sim_ttft_ms == pytest.approx(unpriced.sim_ttft_ms)


def test_fitting_on_several_gpus_reads_their_fit_runs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--fit A100-80GB,H100-80GB`` (how chat_template_parse_s was fitted) simulates both GPUs'
    fit runs and never a held-out one."""
    seen: set[str] = set()

    def record(run, calibration=None):  # type: ignore[no-untyped-def]
        seen.add(run.id)
        return Judged(run, 1.0, 1.0, 1.0)

    monkeypatch.setattr(published_runs, "judge", record)
    fit_knob(RUNS, "A100-80GB,H100-80GB", "chat_template_parse_s", (0.0, 0.06))
    assert seen == {r.id for r in RUNS if r.split == "fit" and r.gpu in ("A100-80GB", "H100-80GB")}


def test_a_model_whose_template_is_known_pays_its_share_of_the_fitted_parse_and_others_the_fitted_cost() -> None:
    # Qwen3 2507 Instruct's template (no thinking branch) parses in 0.52 of the Qwen3 template's time,
    # the one the fit runs parsed; a model whose template is not known here pays the fitted cost.
    parse = Calibration().chat_template_parse_s
    fp8 = load_model("qwen3-235b-a22b-2507-fp8")
    config = resolve_engine_config({"max_model_len": 4096, "tensor_parallel_size": 4}, fp8, H100, "0.11.0")
    assert chat_template_parse_share(fp8) == CHAT_TEMPLATE_PARSE_SHARE["qwen3-235b-a22b-2507-fp8"] < 1.0
    assert PerfModel(fp8, H100, config).chat_request_overhead_s == pytest.approx(parse * chat_template_parse_share(fp8))
    assert _perf("servetune-test-850m", "0.11.0").chat_request_overhead_s == pytest.approx(parse)


def test_the_runs_the_parse_cost_was_fitted_on_parse_the_reference_template() -> None:
    # chat_template_parse_s is the cost of the fit runs' own template: every fit run it touches
    # (0.11.0, chat, Jinja) is a model at share 1.0, so scaling by the share leaves the fit as it was.
    touched = [r for r in RUNS if r.split == "fit" and r.chat
               and memory_rules(parse_vllm_version(r.sim_vllm_version)).chat_template_parsed_per_request]
    assert touched
    assert {chat_template_parse_share(resolve_model(r.model)) for r in touched} == {1.0}
