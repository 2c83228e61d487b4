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

__all__ = ["HARMONY_ARCHITECTURES", "ApiServerCosts"]

#: Models whose chat vLLM renders with Harmony (``OpenAIServingChat.use_harmony``: model type
#: gpt_oss), never with a Jinja chat template.
HARMONY_ARCHITECTURES: frozenset[str] = frozenset({"GptOssForCausalLM"})


class ApiServerCosts:
    """The API server's and the client's CPU (a mixin of :class:`servetune.sim.perf.PerfModel`):
    :meth:`_init_api_server` sets the public costs the scheduler hands to ``sim.frontend.ApiServer``."""

    def _init_api_server(self, model: ModelProfile, config: EngineConfig, cal: Calibration) -> None:
        """The API server's and the client's CPU costs (sim/frontend.py), at the host's ``api_cpu_factor``."""
        self.api_cpu_factor = host = cal.api_cpu_factor
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
        self.client_chunk_s = cal.client_chunk_s * host
        self.api_output_slice = int(cal.api_output_slice)
