"""Infrastructure failures: the machine's fault, not the flags'. Pure logic, no I/O.

A trial that could not run for a reason outside its flag set (the port the launcher picked was
taken, another process held the GPU's memory, the GPU was unusable, the Ray node running it died)
says nothing about the configuration. Such a trial becomes :attr:`TrialStatus.INFRA_ERROR` with
its kind and evidence; the Ray pool runs the same flag set again on another slot (bounded), a slot
that keeps failing is quarantined, and Optuna is never told the flag set is infeasible for it (an
exhausted retry is told FAIL, which Optuna's samplers ignore).

The verdict uses only evidence a real run has: vLLM's log (its classification,
:mod:`servetune.engines.vllm.logs`, marks the candidates ``infrastructure``) and the GPU memory read
through NVML / nvidia-smi before launch. The log alone cannot tell "Free memory on device ... is
less than desired GPU memory utilization" caused by another process from a utilization too high
for an empty GPU; the pre-launch reading can: memory in use before the server started belongs to
someone else.

Example:
    >>> v = confirm_launch_failure("infrastructure failure: another process holds GPU memory: Free memory ...",
    ...                            before_mib={"0": 102400}, free_gib=39.5, total_gib=139.8, requested_gib=125.8)
    >>> v.kind, v.status.value
    ('gpu_memory_held', 'infra_error')
    >>> confirm_launch_failure("infrastructure failure: another process holds GPU memory: Free memory ...",
    ...                        before_mib={"0": 512}, free_gib=139.0, total_gib=139.8, requested_gib=139.5).kind is None
    True
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from servetune.result import TrialStatus

__all__ = ["KINDS", "SLOT_KINDS", "HELD_BY_OTHERS_MIB", "InfraVerdict", "confirm_launch_failure",
           "classify_actor_error", "actor_death_unsettled", "node_death_window_s", "infra_kind_of_cause"]

#: The kinds of infrastructure failure (``TrialResult.infrastructure``).
KINDS = ("port_in_use", "gpu_memory_held", "gpu_unusable", "node_lost")
#: Kinds that belong to the GPU slot the trial ran on: they count towards its quarantine. A taken
#: port or a lost node says nothing about the slot (the next launch picks a new port; a dead node's
#: GPUs leave the cluster with it).
SLOT_KINDS = ("gpu_memory_held", "gpu_unusable")
#: Memory in use on a GPU before launch above this is another process's allocation: more than an
#: idle GPU (a few hundred MiB of driver reservations) or a stray CUDA context.
HELD_BY_OTHERS_MIB = 1024
#: What vLLM's own process needs on an empty GPU before its budget (CUDA context, NCCL buffers):
#: a budget within this of the total fails on an empty GPU too, so it is the flags' fault.
_CONTEXT_GIB = 1.0

_PREFIX_RE = re.compile(r"^infrastructure failure: [^:]+: ")
#: Ray's health-check settings (``src/ray/common/ray_config_def.h``, each read from ``RAY_<name>``) and their
#: defaults: the first check after this delay, then one every period, each failing after the timeout; a node
#: failing ``failure_threshold`` checks in a row is marked dead.
_HEALTH_CHECK_DEFAULTS_MS = {"period_ms": 3000, "timeout_ms": 10000, "failure_threshold": 5}
#: Ray's own words for an actor that someone killed on purpose (``ray.kill``): never a node's loss.
_KILLED_RE = re.compile(r"ray\.kill|killed by .?ray\.kill", re.IGNORECASE)
_NODE_LOST_RE = re.compile(r"node (?:has )?died|node (?:is|was) (?:dead|marked dead)|NodeDiedError|raylet (?:has )?died|"
                           r"node .{0,40}unreachable|preempted", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class InfraVerdict:
    """The launch's final verdict: an infrastructure kind (None: the flags' own failure)."""

    status: TrialStatus
    cause: str | None
    kind: str | None
    evidence: list[str]


def infra_kind_of_cause(cause: str) -> str | None:
    """The kind a :mod:`servetune.engines.vllm.logs` infrastructure cause names, from its prefix.

    Example:
        >>> infra_kind_of_cause("infrastructure failure: port in use: OSError: [Errno 98] Address already in use")
        'port_in_use'
    """
    if "port in use" in cause:
        return "port_in_use"
    if "holds GPU memory" in cause or "changed GPU memory" in cause:
        return "gpu_memory_held"
    if "no usable GPU" in cause:
        return "gpu_unusable"
    return None


def confirm_launch_failure(cause: str, *, before_mib: Mapping[str, int], free_gib: float | None,
                           total_gib: float | None, requested_gib: float | None,
                           status: TrialStatus = TrialStatus.STARTUP_OOM) -> InfraVerdict:
    """Confirm (or refute) a launch failure the log classifier marked ``infrastructure``.

    ``cause`` is the classifier's cause, ``status`` its status; ``before_mib`` the memory in use
    per GPU of the trial before the server started ({} where NVML / nvidia-smi do not exist);
    ``free_gib`` / ``total_gib`` / ``requested_gib`` what vLLM's "Free memory on device" line says.

    A taken port and an unusable GPU are infrastructure from the log alone. "Free memory on device
    ... less than desired" is infrastructure only when another process held memory: the pre-launch
    reading shows more than :data:`HELD_BY_OTHERS_MIB` in use (or, without a reading, the log's own
    free figure is that far below the total) and the budget would fit the GPU empty. Otherwise it
    is the flags' ``startup_oom`` (a utilization no empty GPU of this size can give), and the
    sampler must learn it.
    """
    kind = infra_kind_of_cause(cause)
    if kind is None:
        return InfraVerdict(status, cause, None, [])
    if kind != "gpu_memory_held" or "changed GPU memory" in cause:
        return InfraVerdict(TrialStatus.INFRA_ERROR, cause, kind, [f"infrastructure: {kind}, from the server log"])
    fits_empty = requested_gib is None or total_gib is None or requested_gib <= total_gib - _CONTEXT_GIB
    if before_mib:
        held = {gpu: mib for gpu, mib in before_mib.items() if mib > HELD_BY_OTHERS_MIB}
        reading = ", ".join(f"GPU {g}: {m} MiB" for g, m in sorted(before_mib.items()))
        line = f"GPU memory in use before launch (NVML / nvidia-smi): {reading}"
    else:
        others = None if free_gib is None or total_gib is None else total_gib - free_gib
        held = {"?": int(others * 1024)} if others is not None and others * 1024 > HELD_BY_OTHERS_MIB + 1024 else {}
        line = ("no pre-launch GPU memory reading; the log says "
                f"{free_gib if free_gib is not None else '?'} of {total_gib if total_gib is not None else '?'} GiB free")
    if held and fits_empty:
        return InfraVerdict(TrialStatus.INFRA_ERROR, cause, kind, [
            line, f"infrastructure: another process held {sum(held.values())} MiB on the trial's GPU(s) before "
                  f"launch; the requested {requested_gib} GiB fits an empty {total_gib} GiB GPU"])
    why = ("the budget does not fit an empty GPU" if not fits_empty
           else "no other process held memory before launch")
    return InfraVerdict(status, _PREFIX_RE.sub("", cause), None,
                        [line, f"not an infrastructure failure: {why}; the flags ask for more than the GPU has"])


def classify_actor_error(exc_type: str, text: str, node_alive: bool | None) -> str | None:
    """``node_lost`` when a trial's Ray actor died with its node, else None (the trial's own crash).

    ``exc_type`` / ``text`` are the Ray exception's class name and message; ``node_alive`` is
    whether the node the actor ran on is still alive in ``ray.nodes()`` (None: unknown).

    Example:
        >>> classify_actor_error("ActorDiedError", "The actor died because its node has died.", None)
        'node_lost'
        >>> classify_actor_error("ActorDiedError", "The actor died unexpectedly: worker exit code 1", True) is None
        True
    """
    if node_alive is False:
        return "node_lost"
    if exc_type in ("NodeDiedError", "ActorUnavailableError"):
        return "node_lost"
    if exc_type in ("ActorDiedError", "RayActorError") and _NODE_LOST_RE.search(text):
        return "node_lost"  # Ray names the node's death (its node table may not show it yet)
    return None


def actor_death_unsettled(exc_type: str, text: str, node_alive: bool | None) -> bool:
    """Whether an actor's death cannot be told yet: :func:`classify_actor_error` calls it the trial's
    own crash only because Ray still lists its node alive, and nobody killed it on purpose. A machine
    that dies takes the actor's worker and its raylet down together, and Ray may report the worker's
    death before its health check has missed enough beats to mark the node dead: the caller asks
    again until :func:`node_death_window_s` has passed, and only then calls it a crash.

    Example:
        >>> actor_death_unsettled("ActorDiedError", "The actor died unexpectedly before finishing this task.", True)
        True
        >>> actor_death_unsettled("ActorDiedError", "The actor is dead because it was killed by `ray.kill`.", True)
        False
        >>> actor_death_unsettled("ActorDiedError", "The actor died unexpectedly before finishing this task.", None)
        False
    """
    return (node_alive is True and classify_actor_error(exc_type, text, node_alive) is None
            and not _KILLED_RE.search(text))


def node_death_window_s(env: Mapping[str, str]) -> float:
    """The longest Ray takes to mark dead a node that stopped answering: ``failure_threshold`` checks
    ``period`` apart, the last failing after its ``timeout``, as the ``RAY_health_check_*`` variables
    in ``env`` set them (Ray's defaults: 5 x 3 s + 10 s = 25 s). A value that is not a finite positive number
    keeps Ray's default, as Ray would not start with it.

    Example:
        >>> node_death_window_s({})
        25.0
        >>> node_death_window_s({"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
        ...                      "RAY_health_check_failure_threshold": "3"})
        4.0
    """
    values = {}
    for name, default in _HEALTH_CHECK_DEFAULTS_MS.items():
        raw = env.get(f"RAY_health_check_{name}", "")
        try:
            value = float(raw)
        except ValueError:
            value = float(default)
        values[name] = value if math.isfinite(value) and value > 0 else float(default)
    return (values["failure_threshold"] * values["period_ms"] + values["timeout_ms"]) / 1000.0
