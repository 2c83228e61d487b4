"""The API server's micro-batching tokenizer: the wait a prompt spends before it is tokenized.

From vLLM 0.10.0 to 0.23.0 the OpenAI server tokenizes every text prompt of the completions and
chat endpoints through ``AsyncMicrobatchTokenizer``: the handler puts the prompt in a queue and
awaits its future; one batcher task takes the first prompt, sets a deadline
``batch_wait_timeout_s`` (2 ms) ahead and keeps taking prompts until the deadline passes or it
holds ``max_batch_size`` (32); only then does one executor thread tokenize the batch. The wait is
``asyncio.wait_for`` on the queue, so the event loop runs other work meanwhile: it is latency, not
loop CPU. A lone request (one stream, light load) therefore reaches the engine core 2 ms later
than the tokenizer's own work needs; requests whose prompts reach the tokenizer within one window
share it. Neither figure is a flag or an environment variable: both are the constructor's defaults,
and every caller builds it with none given.

Read in the released wheels (``file:line@version``):

* 0.9.2 has no window: ``entrypoints/openai/serving_engine.py:225-231`` runs the tokenizer through
  ``make_async`` on a one-thread executor;
* 0.10.0 ``vllm/utils/__init__.py:520-521`` (``max_batch_size: int = 32``,
  ``batch_wait_timeout_s: float = 0.002``), the deadline at ``:580``;
* 0.10.1.1 ``vllm/utils/__init__.py:527-528``, deadline ``:587``; built by
  ``entrypoints/openai/serving_engine.py:233`` (``_tokenize_prompt_input_async``);
* 0.11.0 ``vllm/utils/__init__.py:476-477``, deadline ``:536``; built by
  ``entrypoints/renderer.py:367-371`` (completions) and ``entrypoints/openai/serving_engine.py:272``
  (chat: ``_preprocess_chat`` -> ``_tokenize_prompt_input_async``);
* 0.15.1 ``vllm/utils/async_utils.py:35-36``, deadline ``:92``; built by
  ``entrypoints/renderer.py:380-384`` and ``entrypoints/openai/engine/serving.py:580``;
* 0.23.0 ``vllm/utils/async_utils.py:35-36``, deadline ``:97``; built by
  ``renderers/base.py:151`` (``get_async_tokenizer``, used by ``_tokenize_prompt_async`` ``:439``,
  which ``render_cmpl_async`` and ``render_chat_async`` both reach);
* 0.24.0 has no such class: ``renderers/base.py:93`` runs the tokenizer through ``make_async`` on
  the renderer's executor, with no batching window (the same in 0.25.0 and 0.26.0, whose servetune
  windows the simulator is calibrated on: so the calibration holds no such wait).

The simulator's oldest step rules are 0.11.0's; 0.10.x published runs run them, and have the wait
too. Where in the intake the prompt is tokenized: after the request is parsed and validated and
before the engine request is built, so after the first of the intake's loop passes
(:class:`servetune.sim.frontend.ApiServer`).

Example:
    >>> tokenizer_batch_wait_s((0, 23, 0)), tokenizer_batch_wait_s((0, 26, 0))
    (0.002, 0.0)
"""

from __future__ import annotations

from servetune.vllm_version import Version

__all__ = ["MICROBATCH_WAIT_S", "MICROBATCH_MAX_PROMPTS", "MICROBATCH_SINCE", "MICROBATCH_UNTIL",
           "tokenizer_batch_wait_s"]

#: ``AsyncMicrobatchTokenizer(batch_wait_timeout_s=0.002)``: how long the batcher waits, from the
#: first prompt of a batch, for more (0.23.0 ``vllm/utils/async_utils.py:36``).
MICROBATCH_WAIT_S = 0.002
#: ``max_batch_size=32``: a batch that holds this many prompts stops taking more
#: (0.23.0 ``vllm/utils/async_utils.py:35``).
MICROBATCH_MAX_PROMPTS = 32
#: The first release that has it (0.10.0 ``vllm/utils/__init__.py:521``; 0.9.2 has none).
MICROBATCH_SINCE: Version = (0, 10, 0)
#: The first release without it (0.24.0 ``renderers/base.py:93``: ``make_async``, no window).
MICROBATCH_UNTIL: Version = (0, 24, 0)


def tokenizer_batch_wait_s(version: Version) -> float:
    """The micro-batching tokenizer's window at vLLM ``version``: :data:`MICROBATCH_WAIT_S` from
    :data:`MICROBATCH_SINCE` up to (not including) :data:`MICROBATCH_UNTIL`, else 0 (no window)."""
    return MICROBATCH_WAIT_S if MICROBATCH_SINCE <= version < MICROBATCH_UNTIL else 0.0
