"""The real engine (``vllm serve`` per trial) and the vLLM I/O helpers beside it.

* :mod:`~servetune.engines.vllm.engine`: launch, measure, classify, stop (:class:`VllmEngine`);
* :mod:`~servetune.engines.vllm.logs`: a vLLM server log (0.11-0.33 and V0) parsed into a memory
  breakdown, timings and a failure classification, text in and data out;
* :mod:`~servetune.engines.vllm.metrics`: Prometheus ``/metrics`` text with vLLM's names;
* :mod:`~servetune.engines.vllm.loadgen` and :mod:`~servetune.engines.vllm.bench_client`: the two
  load generators (servetune's streaming client, ``vllm bench serve``);
* :mod:`~servetune.engines.vllm.serve_cli`: the installed ``vllm serve --help=all`` as a flag check;
* :mod:`~servetune.engines.vllm.infra`: infrastructure failures, confirmed from evidence;
* :mod:`~servetune.engines.vllm.diagnose`: a failed start explained, for ``servetune diagnose``;
* :mod:`~servetune.engines.vllm.workload_fit`: the workload a server saw, fitted to its ``/metrics``
  histograms or a request log, for ``servetune workload``.

The names load on first use, so importing one helper (the log parser, say) stays cheap.
"""

from typing import TYPE_CHECKING

from servetune.lazy import lazy_face

if TYPE_CHECKING:
    from servetune.engines.vllm.engine import VllmEngine, VllmLaunch, read_serve_help, run_vllm_trial
    from servetune.engines.vllm.logs import ParsedLog, classify, parse_log

__all__ = ["VllmEngine", "VllmLaunch", "run_vllm_trial", "read_serve_help", "ParsedLog", "parse_log", "classify"]


#: Where each public name is defined: imported on first use (PEP 562), so a command that needs
#: one helper does not pay for every engine's imports (pandas, aiohttp, the load generators).
_DEFINED_IN = {
    "VllmEngine": "servetune.engines.vllm.engine",
    "VllmLaunch": "servetune.engines.vllm.engine",
    "read_serve_help": "servetune.engines.vllm.engine",
    "run_vllm_trial": "servetune.engines.vllm.engine",
    "ParsedLog": "servetune.engines.vllm.logs",
    "classify": "servetune.engines.vllm.logs",
    "parse_log": "servetune.engines.vllm.logs",
}


__getattr__, __dir__ = lazy_face(__name__, _DEFINED_IN, __all__)
