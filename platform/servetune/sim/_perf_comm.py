"""Communication's prices for :class:`servetune.sim.perf.PerfModel`: TP all-reduces, the logits' gather, PP sends,
and a MoE's DP gather and scatter.

Contract: :class:`CommTerms` is the part of ``PerfModel`` that sets a step's communication terms
(``perf``'s docstring, "TP adds two all-reduces per layer", "PP splits the layers" and "DP replicas of
a MoE model"), each priced
by the host's interconnect through :mod:`servetune.planner.comm` (the one model the planner and the
simulator share); ``PerfModel.gpu_cost`` adds them per micro-batch and per token. Pure arithmetic,
no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servetune.planner.comm import SERVETUNE_LAUNCH_ENV, AllReduceTable, allreduce_cost, allreduce_table, sendrecv_cost

if TYPE_CHECKING:
    from servetune.planner.comm import CommEnv
    from servetune.planner.gpus import GpuSpec
    from servetune.planner.modelinfo import ModelProfile
    from servetune.sim._calibration import Calibration

__all__ = ["CommTerms"]


class CommTerms:
    """Communication of one step (a mixin of :class:`servetune.sim.perf.PerfModel`): :meth:`_init_comm`
    sets the fixed and per-token seconds of the all-reduces (``_t_ar_*``), of the logits' all-gather
    without GPU P2P (``_t_gather_*``), of the pipeline's sends (``_t_pp_*``) and of a MoE's DP all-gather
    and reduce-scatter (``_t_dp_*``), and :attr:`allreduce_path`; where vLLM picks the all-reduce's backend by
    message size and published timings cover the layout (:func:`servetune.planner.comm.allreduce_table`), the
    all-reduces are priced per micro-batch by :meth:`allreduce_table_seconds` instead of ``_t_ar_*``."""

    _ar_table: AllReduceTable | None
    _ar_count: int
    _ar_bytes_token: float
    _ar_small_fixed: float
    _ar_small_token: float

    def _init_comm(self, model: ModelProfile, gpu: GpuSpec, tp: int, pp: int, layers: int,
                   cal: Calibration, allreduces: int = 0, custom_all_reduce: bool = True, dp: int = 1,
                   moe_layers: int = 0, comm_env: CommEnv | None = None,
                   version: tuple[int, int, int] = (0, 26, 0)) -> None:
        """The per-step communication terms: TP all-reduces and PP sends, priced by the interconnect.

        ``allreduces``: the stage's all-reduces a step (0: two a layer; a hybrid's one per mixer and MLP,
        Nemotron-H's layers holding one of them). ``custom_all_reduce``: not ``disable_custom_all_reduce``
        (the path changes, the calibrated cost does not: :func:`servetune.planner.comm.nccl_small_message_note`).
        ``dp`` DP replicas of a model with ``moe_layers`` routed-expert layers on the stage: :meth:`_init_dp_moe`.
        ``comm_env``: the environment the server runs with (None: servetune's launch environment, multicast off);
        with ``version`` it decides :func:`~servetune.planner.comm.allreduce_table`.
        Sets :attr:`allreduce_path`, the implementation priced, in words ("" at TP=1)."""
        # Two all-reduces per layer of [tokens, hidden] activations (bf16) under TP, priced by the
        # host's interconnect (planner.comm.allreduce_cost: NVLink / PCIe P2P at the calibrated
        # knobs, no P2P at NCCL's published SHM figures, a fixed cost per step of NCCL's ring:
        # 2 (tp-1) an all-reduce, tp-1 the all-gather below).
        # Once a step, the LM head's vocab-parallel logits (one row per sampled request, the
        # model's dtype) are all-gathered to every rank: vLLM's LogitsProcessor._gather_logits takes
        # tensor_model_parallel_all_gather wherever Platform.use_all_gather() holds, every V1
        # engine (0.10-0.26); each rank receives (tp-1)/tp of the [rows, vocab] tensor. Priced
        # where the all-reduce is priced from NCCL's published SHM figures (no GPU P2P): there
        # it is 0.03 ms a request a step for a 152k vocabulary at TP=2, under 1 us over NVLink,
        # where it stays inside the calibrated all-reduce terms the NVLink windows judged (and the
        # recorded NVLink runs are not moved by it).
        self.allreduce_path = ""
        self._ar_table, self._ar_count, self._ar_bytes_token = None, 0, 0.0
        self._ar_small_fixed = self._ar_small_token = 0.0
        if tp > 1:
            ar = allreduce_cost(gpu, tp, latency_s=cal.allreduce_latency_s, efficiency=cal.interconnect_efficiency,
                                custom_all_reduce=custom_all_reduce)
            self.allreduce_path = ar.path
            n_ar = allreduces or 2 * layers
            self._t_ar_fixed = n_ar * ar.fixed_s(tp)
            self._t_ar_token = n_ar * (ar.seconds(tp, model.hidden_size * 2) - ar.fixed_s(tp))
            table = allreduce_table(gpu, tp, env=comm_env or SERVETUNE_LAUNCH_ENV, version=version)
            if table is not None and custom_all_reduce:
                self._ar_table, self._ar_count, self._ar_bytes_token = table, n_ar, float(model.hidden_size * 2)
                self._ar_small_fixed, self._ar_small_token = self._t_ar_fixed, self._t_ar_token
                self._t_ar_fixed = self._t_ar_token = 0.0
                self.allreduce_path = ("custom all-reduce below 256 KiB, symmetric-memory multimem below 64 MiB, "
                                       "NCCL above (vLLM's TP=8 rule on SM 9.0; published timings)") if tp == 8 else (
                    f"custom / symmetric-memory all-reduce below {table.symm_max // (1 << 20)} MiB, NCCL from there "
                    f"(vLLM's TP={tp} rule on SM 9.0; NCCL at the published TP=8 timings' bus bandwidth)")
        else:
            self._t_ar_fixed = self._t_ar_token = 0.0
        self._t_gather_fixed = self._t_gather_row = 0.0
        if tp > 1 and gpu.link == "pcie-no-p2p":
            self._t_gather_fixed = ar.gather_fixed_s(tp)
            self._t_gather_row = ar.gather_seconds(tp, model.vocab_size * model.dtype_bytes) - self._t_gather_fixed
        # A pipeline boundary: the stage's hidden states and residual (each rank its 1/TP slice)
        # sent to the next stage (planner.comm.sendrecv_cost), pp - 1 sends per micro-batch: a lone
        # request pays all of them (the bubble), a full pipeline the stages' average (the last
        # stage sends nothing), as every other term is spread over equal stages.
        if pp > 1:
            p2p = sendrecv_cost(gpu, latency_s=cal.allreduce_latency_s, efficiency=cal.interconnect_efficiency)
            share = (pp - 1) / pp  # scaled back up by the step's pp / micro (gpu_cost)
            self._t_pp_fixed = p2p.latency_s * share
            self._t_pp_token = (p2p.sendrecv_seconds(2.0 * model.hidden_size * model.dtype_bytes / tp)
                                - p2p.latency_s) * share
        else:
            self._t_pp_fixed = self._t_pp_token = 0.0
        self._init_dp_moe(model, gpu, cal, dp, moe_layers)

    def allreduce_table_seconds(self, per_micro: int, micro: int) -> float:
        """The TP all-reduces of a step of ``micro`` micro-batches of ``per_micro`` tokens each where
        :attr:`_ar_table` prices them (0.0 elsewhere: ``_t_ar_*`` do): each micro-batch's ``_ar_count``
        all-reduces at the table's price for their message (``per_micro`` x hidden x 2 bytes), at the calibrated
        price (``_ar_small_*``) below the custom all-reduce's size."""
        if self._ar_table is None:
            return 0.0
        one = self._ar_table.seconds(per_micro * self._ar_bytes_token)
        if one is None:
            return (self._ar_small_fixed + self._ar_small_token * per_micro) * micro
        return self._ar_count * one * micro

    def _init_dp_moe(self, model: ModelProfile, gpu: GpuSpec, cal: Calibration, dp: int, moe_layers: int) -> None:
        """The DP group's collectives around each MoE layer (``_t_dp_fixed`` a step, ``_t_dp_token`` a
        replica's token; both 0 at ``dp`` 1 or without routed experts).

        vLLM 0.14.1 (``perf_classes.moe_step_tokens`` reads the lines): before the experts an
        ``all_gatherv`` over the ``dp`` ranks of the hidden states ``[tokens, hidden]`` and the router
        logits ``[tokens, experts]``, after them a ``reduce_scatterv`` of the output ``[tokens, hidden]``,
        both in the model's dtype through NCCL (pynccl), between the GPUs of the same TP rank in each
        replica. Each is priced by the host's interconnect as the TP all-reduce is
        (:func:`servetune.planner.comm.allreduce_cost` at ``dp`` ranks,
        :meth:`~servetune.planner.comm.AllReduceCost.gather_seconds`): first order, the replicas under the
        same load, so the gathered tensor holds ``dp`` times a replica's tokens. The TP all-reduce after
        the experts stays (``FusedMoE.maybe_all_reduce_tensor_model_parallel``,
        ``fused_moe/layer.py:1696-1703@0.14.1``, over the replica's TP group) and is priced with the others;
        the per-step all-reduce of the replicas' token counts (``v1/worker/dp_utils.py:38-56@0.14.1``)
        is not priced.

        Under ``--enable-expert-parallel`` the same two collectives are the dispatch and combine of vLLM's default
        all2all backend, ``allgather_reducescatter`` (``VLLM_ALL2ALL_BACKEND``'s default, ``envs.py:1240-1246@0.11.0``;
        ``ParallelConfig.all2all_backend``, ``config/parallel.py:186@0.26.0``, which reads the removed ``naive`` and
        ``pplx`` as it, ``:448-454``): ``AgRsAll2AllManager.dispatch`` all-gathers the hidden states and router
        logits over the DP group and ``combine`` reduce-scatters the output
        (``distributed/device_communicators/all2all.py:106-140@0.11.0``, ``:43-140@0.26.0``), so they are priced as
        above. With TP > 1 too vLLM runs them over the expert group on 1/TP of each replica's tokens (sequence
        parallel MoE, ``ParallelConfig.use_sequence_parallel_moe``): the bytes a rank receives are about the same,
        and that variant is not priced apart. At ``dp`` 1 expert parallelism moves no tokens
        (``FusedMoEParallelConfig.use_all2all_kernels`` needs ``dp_size > 1``: ``fused_moe/config.py:603-604@0.11.0``,
        ``:1052-1055@0.26.0``): every rank holds the batch and the experts' partial sums are all-reduced over TP
        as without it (``fused_moe/layer.py:2066-2068@0.11.0``), priced with the TP all-reduces."""
        self._t_dp_fixed = self._t_dp_token = 0.0
        if dp < 2 or moe_layers <= 0:
            return
        link = allreduce_cost(gpu, dp, latency_s=cal.allreduce_latency_s, efficiency=cal.interconnect_efficiency,
                              custom_all_reduce=False)
        width = model.dtype_bytes * dp  # a replica's token, gathered from every replica
        gather = link.gather_seconds(dp, width * (model.hidden_size + model.num_experts))
        scatter = link.gather_seconds(dp, width * model.hidden_size)
        fixed = 2.0 * link.gather_fixed_s(dp)
        self._t_dp_fixed = moe_layers * fixed
        self._t_dp_token = moe_layers * (gather + scatter - fixed)
