"""Every environment setting servetune reads, in one registry (as vLLM's ``envs.py`` does).

Example:
    >>> import os; os.environ["SERVETUNE_SERVE_COMMAND"] = "python -m servetune.sim.server"
    >>> serve_command()
    ('python', '-m', 'servetune.sim.server')
"""

from __future__ import annotations

import os
import shlex

__all__ = ["serve_command", "startup_timeout_s", "ENV_VARS"]

#: name -> what it does. Read only through the functions below.
ENV_VARS = {
    "SERVETUNE_SERVE_COMMAND": "argv before MODEL that starts a server (default: 'vllm serve'); split like a "
                               "shell would split it, but never run through a shell",
    "SERVETUNE_STARTUP_TIMEOUT_S": "seconds a server may take to answer /health (default 600)",
}


def serve_command() -> tuple[str, ...]:
    raw = os.environ.get("SERVETUNE_SERVE_COMMAND", "").strip()
    return tuple(shlex.split(raw)) if raw else ("vllm", "serve")


def startup_timeout_s() -> float:
    return float(os.environ.get("SERVETUNE_STARTUP_TIMEOUT_S", "600"))
