"""The simulated vLLM V1 engine, in virtual time, and its ``vllm serve`` stand-in.

One trial: :func:`simulate` (:mod:`.engine`) plans the startup memory, runs the engine core
(:class:`SimScheduler`, :mod:`.scheduler`: schedule -> :class:`SchedulerOutput` -> step time ->
update) with its KV block pool (:mod:`.blocks`) and per-request state (:mod:`.request`), behind
vLLM's API server loop (:mod:`.frontend`), driven by the load generator's clients
(:mod:`.client`), with step times from the roofline model (:mod:`.perf`, its terms priced in the
private ``_perf_*`` modules and its knobs in ``_calibration``; a Mamba / gated-delta-net
hybrid's recurrent layers from :mod:`.perf_hybrid`, whose :func:`hybrid_note` ``simulate`` prints) and vLLM's log lines
(:mod:`.vllm_log`); :mod:`.chat_templates` prices a model's own chat template where vLLM parses it
per request. :mod:`.host_cpu` says what the API server's load means for a figure. The
stand-in server (``python -m servetune.sim.server``) and simulated device memory
(:mod:`.devices`) are run as programs and are not imported here.
"""

from servetune.sim._calibration import (FA2_KNOBS, GPU_CALIBRATION, GPU_FAMILY_OVERRIDES, Calibration, calibration_for,
                                        runs_flash_attention_2, with_calibration)
from servetune.sim.chat_templates import CHAT_TEMPLATE_PARSE_SHARE, chat_template_parse_share
from servetune.sim.client import LoadClient
from servetune.sim.engine import simulate
from servetune.sim.host_cpu import (FORWARD_BOUND_SHARE, FRONTEND_BOUND_SHARE, api_cpu_factor_for_token_cost, forward_bound_note,
                                    frontend_bound_note, host_api_cpu_factor)
from servetune.sim.perf import PerfModel, StepCost
from servetune.sim.perf_hybrid import hybrid_note
from servetune.sim.request import RequestState
from servetune.sim.scheduler import SchedulerOutput, SimScheduler, StepResult

__all__ = ["simulate", "SimScheduler", "SchedulerOutput", "StepResult", "RequestState", "LoadClient",
           "PerfModel", "Calibration", "FA2_KNOBS", "GPU_CALIBRATION", "GPU_FAMILY_OVERRIDES", "StepCost", "calibration_for", "runs_flash_attention_2", "with_calibration",
           "FORWARD_BOUND_SHARE", "forward_bound_note", "FRONTEND_BOUND_SHARE", "frontend_bound_note", "CHAT_TEMPLATE_PARSE_SHARE", "chat_template_parse_share", "host_api_cpu_factor", "api_cpu_factor_for_token_cost",
           "hybrid_note"]
