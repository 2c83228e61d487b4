"""What a simulated figure says about the host's CPU: the API server's share, the engine thread's, and the host's factor.

vLLM's API server is one process; from half busy the modelled CPU bounds the figure, so the
result says so (:func:`frontend_bound_note`), and one real window gives the host's own factor
(:func:`host_api_cpu_factor`) to simulate the rest with. Where the engine thread's launches of a
forward outlast its kernels (``PerfModel.forward_floor_s``) for a good share of the steps' time, the
result says that too (:func:`forward_bound_note`).
"""

from __future__ import annotations

from servetune.result import TrialResult

__all__ = ["FORWARD_BOUND_SHARE", "FORWARD_CPU_LAUNCHES", "FRONTEND_BOUND_SHARE", "GDN_MIXERS", "SHARED_MOE_PIECES",
           "forward_bound_note", "frontend_bound_note", "host_api_cpu_factor", "api_cpu_factor_for_token_cost"]

#: The modelled API server's busy share of the measured window from which a simulated figure is
#: flagged as hostage to the host's CPU. Real H200 hosts paid 1.0-2.1x the modelled CPU per streamed
#: token (56-116 us against 54; the 2.1x in five decode-heavy 8B windows of 2026-12-02, in no fit,
#: which ran the API server 97-100% busy), so from half busy here a slow host's API server bounds it.
FRONTEND_BOUND_SHARE = 0.5


#: The share of the engine's step time spent in steps its forward's CPU paced (``SimScheduler.forward_bound_share``)
#: from which a simulated figure says it depends on the host's CPU: from a quarter, a host whose cores run the
#: forward's Python 10% slower or faster than the traced one moves the figure by a few percent.
FORWARD_BOUND_SHARE = 0.25


#: The parts of a forward whose CPU the simulator prices (``PerfModel.forward_cpu_parts`` names them), and how
#: :func:`forward_bound_note` says what the engine thread launches for each.
GDN_MIXERS = "gated-delta-net mixers"
SHARED_MOE_PIECES = "shared-expert MoE pieces"
FORWARD_CPU_LAUNCHES: dict[str, str] = {
    GDN_MIXERS: "its gated-delta-net mixers eagerly",
    SHARED_MOE_PIECES: "its shared-expert MoE blocks' compiled pieces from Python above the largest CUDA-graph capture size",
}


def forward_bound_note(share: float, parts: tuple[str, ...] = tuple(FORWARD_CPU_LAUNCHES)) -> str:
    """What a simulated result whose forward's CPU paced ``share`` of its engine's step time says about itself;
    ``parts``: what that CPU launches for the model (``PerfModel.forward_cpu_parts``, keys of :data:`FORWARD_CPU_LAUNCHES`).

    Example:
        >>> forward_bound_note(0.6, (SHARED_MOE_PIECES,))[:48]
        "The forward's CPU paced 60% of the engine's step"
        >>> "eagerly" in forward_bound_note(0.6, (SHARED_MOE_PIECES,))
        False
    """
    what = " and ".join(FORWARD_CPU_LAUNCHES[p] for p in parts)
    return (f"The forward's CPU paced {100 * share:.0f}% of the engine's step time: on those steps the GPU waited "
            f"for the engine thread, which launches {what}. That CPU was read off one H100 SXM host at vLLM 0.26.0 "
            "(docs/accuracy.md): a host with faster cores serves this load faster, a slower one slower; decode "
            "steps within the capture sizes replay as graphs and pay none of it")


def frontend_bound_note(busy: float, api_cpu_factor: float = 1.0) -> str:
    """What a simulated result whose API server is busy ``busy`` of the window says about itself
    (``api_cpu_factor``: the host factor it ran with, 1.0 for the calibration's hosts)."""
    head = f"vLLM's API server (one process) was busy {100 * busy:.0f}% of the window: this figure depends "
    if api_cpu_factor != 1.0:
        return (head + f"on the host's CPU as much as on the GPU; it was simulated at this host's measured "
                f"API CPU (--api-cpu-factor {api_cpu_factor:g}) and holds for hosts like it")
    return (head + "on the host's CPU as much as on the GPU. Measured H200 hosts paid 1.1-2.2x the API CPU "
            "modelled here over the same windows; on the slowest, decode-heavy 8B loads served up to 30% "
            "below the simulated figure. Measure yours on one real window (host_api_cpu_factor) and pass "
            "it as --api-cpu-factor")


def host_api_cpu_factor(real: TrialResult, simulated: TrialResult, base: float = 1.0) -> float | None:
    """The host's ``api_cpu_factor``: ``base`` x the real API server's CPU over the simulated one's.

    ``real`` and ``simulated`` are the same flags and workload on the real engine and on the
    simulator run with ``api_cpu_factor`` ``base``; both count ``api_server_cpu_s`` over their
    measured window. vLLM's API server does the same work per request and per streamed token
    whatever the host, so the ratio is what this host's CPU charges for it against the calibration:
    a slower core, another Python build, a busier machine. None when either side lacks the figure.
    A simulation with the factor then predicts the host's other loads (held out on the H200 hosts of
    ``benchmarks/sim_fidelity.py --unseen``: read off one prefill-heavy window, it took the other
    windows' throughput error from 12.5% to 8.3% on one host and from 6.1% to 5.5% on another). It
    carries the host's level, not every load's: one host's windows ranged 1.25-2.06 around 1.39.

    Example:
        >>> from servetune.result import TrialStatus
        >>> real = TrialResult(TrialStatus.OK, api_server_cpu_s=15.0)
        >>> host_api_cpu_factor(real, TrialResult(TrialStatus.OK, api_server_cpu_s=10.0))
        1.5
    """
    if not real.api_server_cpu_s or not simulated.api_server_cpu_s:
        return None
    return base * real.api_server_cpu_s / simulated.api_server_cpu_s


def api_cpu_factor_for_token_cost(us_per_token: float, simulated: TrialResult, base: float = 1.0) -> float | None:
    """The ``api_cpu_factor`` at which the simulated API server spends ``us_per_token`` per generated token.

    ``us_per_token`` is a real server's API-server CPU per generated token, read off two ``/metrics``
    readings (``process_cpu_seconds_total`` over ``vllm:generation_tokens_total``; ``servetune
    workload from-metrics`` prints it); ``simulated`` is the same workload simulated at factor
    ``base``. The simulated API server's CPU per generated token scales with the factor, so the
    ratio carries the host's level as :func:`host_api_cpu_factor` does, without a real trial of the
    same flags: the cost per token is the host's, the tokens' pacing the simulation's. None when the
    simulation served nothing or counted no API-server CPU.

    Example:
        >>> from servetune.result import TrialStatus
        >>> sim = TrialResult(TrialStatus.OK, api_server_cpu_s=6.0, output_throughput=10_000.0, duration_s=10.0)
        >>> api_cpu_factor_for_token_cost(90.0, sim)  # 60 us a token simulated, 90 measured
        1.5
    """
    tokens = (simulated.output_throughput or 0.0) * (simulated.duration_s or 0.0)
    if not simulated.api_server_cpu_s or tokens <= 0:
        return None
    return base * us_per_token * 1e-6 * tokens / simulated.api_server_cpu_s
