"""What vLLM 0.11.0's per-request chat-template parse costs for a model's own template.

vLLM 0.11.0's chat endpoint parses the model's whole Jinja chat template again for every request
(``VllmMemoryRules.chat_template_parsed_per_request``: ``entrypoints/chat_utils.py:
_resolve_chat_template_kwargs`` builds a new ``ImmutableSandboxedEnvironment``, ``env.parse``-s the
template and walks it with ``jinja2.meta.find_undeclared_variables``, uncached). That work is the
template's: Jinja lexes and parses it token by token, so a template with half the expressions
costs about half. ``Calibration.chat_template_parse_s`` was fitted on the published dense runs
that parsed one template, the Qwen3 hybrid-thinking models' (Qwen3-14B on an H100 and an A100
host); a model whose template is known here pays that cost times its template's parse time
against that one (:data:`CHAT_TEMPLATE_PARSE_SHARE`), every other model the fitted cost as it is.

The shares are the parse itself, timed: ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)``, ``parse`` and ``find_undeclared_variables``, as vLLM 0.11.0 calls them, with
jinja2 3.1.6 on one 2-core machine, the least of 30 rounds of 20 parses each, interleaved, on three
runs (the reference: 10.8-11.6 ms a parse there). Character counts would mislead: the templates
share long string literals that lex as one token each (the Qwen3-2507 Instruct template has 63% of
the Qwen3 one's characters and 59% of its lexer tokens, and parses in 51-54% of its time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servetune.planner.modelinfo import ModelProfile

__all__ = ["CHAT_TEMPLATE_PARSE_SHARE", "REFERENCE_CHAT_TEMPLATE", "chat_template_parse_share"]

#: The template ``Calibration.chat_template_parse_s`` was fitted on: the Qwen3 hybrid-thinking
#: models' chat template (Qwen3-0.6B to Qwen3-32B and Qwen3-30B-A3B ship one template; 4,168
#: characters in the official Qwen3-8B revision 895c8d1, whose assistant branch reads
#: ``message.reasoning_content is string``; 4,116 in the first release, as llama.cpp's
#: ``models/templates/Qwen-Qwen3-0.6B.jinja`` copies it; both parse in the same time, within 1%).
REFERENCE_CHAT_TEMPLATE = "Qwen3 (hybrid thinking)"

#: A shipped or fixture model's chat-template parse time over :data:`REFERENCE_CHAT_TEMPLATE`'s, by
#: model name. The Qwen3 2507 Instruct models ship one template without the thinking branch (2,630
#: characters; no ``<think>``, no ``reasoning_content``, no reverse scan for the last user query):
#: 0.52 (0.51-0.54 over three timings). Source of its text: a verbatim copy of Qwen3-4B-Instruct-2507's
#: in a public test file (the Hugging Face hub is not reachable here); the 235B and 30B Instruct 2507
#: models are taken to ship the same one.
#: GLM-4.5-Air's (3,805 characters: tools, a ``visible_text`` macro, ``<think>`` splitting, tool calls as
#: ``<arg_key>`` / ``<arg_value>`` pairs): 0.89 (0.887-0.902 over three timings, 2026-12-07, against the
#: first-release Qwen3 template at 10.8 ms a parse). Source of its text: llama.cpp's
#: ``models/templates/glm_4_5.jinja`` at 623f3dd (two of its comments name llama.cpp's polyfills; comments
#: lex as one token each).
CHAT_TEMPLATE_PARSE_SHARE: dict[str, float] = {
    "qwen3-235b-a22b-2507": 0.52,
    "qwen3-235b-a22b-2507-fp8": 0.52,
    "qwen3-30b-a3b-instruct-2507": 0.52,
    "glm-4.5-air": 0.89,
}


def chat_template_parse_share(model: ModelProfile) -> float:
    """The share of the fitted per-request parse cost ``model``'s own chat template costs: its
    entry in :data:`CHAT_TEMPLATE_PARSE_SHARE`, else 1.0 (the template is not known here, so the
    fitted template's cost stands).

    Example:
        >>> from servetune.planner.modelinfo import load_model
        >>> [chat_template_parse_share(load_model(m)) for m in ("qwen3-235b-a22b-2507-fp8", "llama-3.1-8b")]
        [0.52, 1.0]
    """
    return CHAT_TEMPLATE_PARSE_SHARE.get(model.name, 1.0)
