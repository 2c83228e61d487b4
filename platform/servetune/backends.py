"""The backends a study runs its trials on, and what each one's trials are.

Code that treats trials differently by where they ran asks :func:`capabilities` a question
(``real_gpus``, ``virtual_time``, ``reads_landscape``, ``costly``), never compares backend names:
each engine declares its row (``Engine.capabilities``), and a new backend is one new row. Pure, and
importing nothing of servetune, so every layer can ask.

Example:
    >>> capabilities("sim").virtual_time, capabilities("vllm").real_gpus, capabilities("replay").reads_landscape
    (True, True, True)
    >>> capabilities("auto").real_gpus  # not resolved yet (engines.resolve_backend): nothing claimed
    False
"""

from __future__ import annotations

import dataclasses

__all__ = ["Capabilities", "CAPABILITIES", "BACKENDS", "capabilities"]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend's trials are."""

    #: Trials start real ``vllm serve`` servers on GPUs: the pool asks Ray for the GPUs, wall-clock
    #: overheads and server artifacts are recorded, confirmation repeats, early stopping over time
    #: and the headroom's edge window are measured.
    real_gpus: bool
    #: A trial's seconds are simulated, not measured (the report says "simulated").
    virtual_time: bool
    #: Trials are answered from a recorded landscape (``replay_file``).
    reads_landscape: bool
    #: A trial costs more than a simulation, so screening proposals on the simulator pays off
    #: (``multi_fidelity: auto``).
    costly: bool


#: One row per backend a spec may name (besides ``auto``).
CAPABILITIES: dict[str, Capabilities] = {
    "vllm": Capabilities(real_gpus=True, virtual_time=False, reads_landscape=False, costly=True),
    "sim": Capabilities(real_gpus=False, virtual_time=True, reads_landscape=False, costly=False),
    "replay": Capabilities(real_gpus=False, virtual_time=False, reads_landscape=True, costly=True),
}

#: The backends a spec may name; ``auto`` is vllm where a GPU is visible, else sim.
BACKENDS: tuple[str, ...] = ("auto", *CAPABILITIES)

_NOTHING = Capabilities(real_gpus=False, virtual_time=False, reads_landscape=False, costly=False)


def capabilities(backend: str | None) -> Capabilities:
    """The row of ``backend``; for ``auto`` (not resolved yet) or a name from elsewhere (an old
    dataset's row), a row that claims nothing."""
    return CAPABILITIES.get(backend or "", _NOTHING)
