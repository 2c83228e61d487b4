"""The API server's and the client's CPU costs for :class:`servetune.sim.perf.PerfModel`.

Contract: :class:`ApiServerCosts` is the part of ``PerfModel`` that sets what the API server loop
(:mod:`servetune.sim.frontend`) and the load generator's client pay per request, prompt token,
streamed token and SSE chunk (``perf``'s docstring, "The API server"), each at the host's
``api_cpu_factor``; a chat request adds its template's parse where vLLM parses it per request
(:mod:`servetune.sim.chat_templates`). Pure arithmetic, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.planner.vllm_rules import memory_rules
from servetune.sim.chat_templates import chat_template_parse_share

if TYPE_CHECKING:
    from servetune.planner.engine_config import EngineConfig
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim._calibration import Calibration

__all__ = ["HARMONY_ARCHITECTURES", "ApiServerCosts", "replicas_per_api_server"]

#: Models whose chat vLLM renders with Harmony (``OpenAIServingChat.use_harmony``: model type
#: gpt_oss), never with a Jinja chat template.
HARMONY_ARCHITECTURES: frozenset[str] = frozenset({"GptOssForCausalLM"})


def replicas_per_api_server(config: EngineConfig) -> float:
    """How many DP replicas' requests and streams one API server process handles: ``data_parallel_size`` over the
    API servers, ``api_server_count`` where the flag is set, else vLLM's default: one per DP rank from 0.15.0
    (``VllmMemoryRules.api_server_per_dp_rank``), one for all of them through 0.14.1. Under 1 where several API
    servers share one engine's load (each takes its share of the requests).

    Example:
        >>> from servetune.planner.gpus import get_gpu
        >>> from servetune.planner.memory import resolve_engine_config
        >>> from servetune.planner.modelinfo import load_model
        >>> m, g = load_model("servetune-test-850m"), get_gpu("H100-80GB")
        >>> [replicas_per_api_server(resolve_engine_config({"data_parallel_size": 2}, m, g, v)) for v in ("0.14.1", "0.15.0")]
        [2.0, 1.0]
        >>> replicas_per_api_server(resolve_engine_config({"api_server_count": 2}, m, g, "0.26.0"))
        0.5
    """
    dp = config.data_parallel_size
    servers = config.api_server_count
    if servers is None:
        servers = dp if memory_rules(config.version).api_server_per_dp_rank else 1
    return dp / servers


class ApiServerCosts:
    """The API server's and the client's CPU (a mixin of :class:`servetune.sim.perf.PerfModel`):
    :meth:`_init_api_server` sets the public costs the scheduler hands to ``sim.frontend.ApiServer``."""

    def _init_api_server(self, model: ModelProfile, config: EngineConfig, cal: Calibration) -> None:
        """The API server's and the client's CPU costs (sim/frontend.py), at the host's ``api_cpu_factor``."""
        self.api_cpu_factor = cal.api_cpu_factor
        # A simulated replica's loop pays its own work once per replica that loop serves (the other replicas'
        # share of it), or that fraction of it where several API servers split one replica's requests.
        host = cal.api_cpu_factor * replicas_per_api_server(config)
        self.request_overhead_s = cal.request_overhead_s * host
        #: Loop CPU a chat request adds to :attr:`request_overhead_s` (0 where vLLM's chat endpoint
        #: does not parse the template per request, or the model chats through Harmony), scaled to
        #: the model's own template where it is known (sim.chat_templates).
        self.chat_request_overhead_s = (cal.chat_template_parse_s * host * chat_template_parse_share(model)
                                        if memory_rules(config.version).chat_template_parsed_per_request
                                        and model.architecture not in HARMONY_ARCHITECTURES else 0.0)
        self.prompt_token_overhead_s = cal.prompt_token_overhead_s * host
        self.token_overhead_s = cal.token_overhead_s * host
        self.stream_prompt_token_s = cal.stream_prompt_token_s * host
        self.api_chunk_share = cal.api_chunk_share
        self.api_intake_passes = int(cal.api_intake_passes)  # a whole number >= 1 (Calibration.with_overrides)
        self.client_chunk_s = cal.client_chunk_s * cal.api_cpu_factor
        self.api_output_slice = int(cal.api_output_slice)
