"""Memory outside torch per TP/PP worker, by environment: the rule the planner, pre-screen and simulator apply."""

from __future__ import annotations

import dataclasses

import pytest

from servetune.engines.vllm.engine import SAFE_ENV
from servetune.errors import SpecError
from servetune.planner.comm import (CUSTOM_ALL_REDUCE_BUFFER_BYTES, FI_ALLREDUCE_FUSION_WORKSPACE_GIB, NO_P2P_BUS_GBPS,
                                    NO_P2P_LATENCY_S, NON_TORCH_GIB_MULTI, SERVETUNE_LAUNCH_ENV, VLLM_DEFAULT_ENV,
                                    AllReduceCost, CommEnv, allreduce_cost, comm_memory, custom_all_reduce_runs,
                                    fused_allreduce_runs, has_flashinfer, nvls_buffer_bytes, trial_env)
from servetune.planner.gpus import get_gpu, register_gpus_from_yaml, with_interconnect
from servetune.planner.memory import plan_memory, resolve_engine_config
from servetune.planner.modelinfo import load_model

GiB = 1 << 30


def test_servetune_launch_env_is_the_engine_env():
    """The planner's default environment has the variables every real servetune launch applies."""
    # The variables are the launch's; the FlashInfer fusion is a property of servetune's measured hosts (none usable):
    # a real trial is planned with trial_env, from its GPU workers' install (the tests below).
    assert SERVETUNE_LAUNCH_ENV == dataclasses.replace(CommEnv.from_mapping(SAFE_ENV, SERVETUNE_LAUNCH_ENV.source),
                                                       flashinfer_fusion=False)
    assert SERVETUNE_LAUNCH_ENV.nvls == "off" and not SERVETUNE_LAUNCH_ENV.symm_mem
    assert VLLM_DEFAULT_ENV.flashinfer_fusion and "FlashInfer" in SERVETUNE_LAUNCH_ENV.describe()


@pytest.mark.parametrize("gpu, tp, pp, live", [
    ("H100-80GB", 2, 1, True), ("H100-80GB", 4, 1, True), ("H200", 2, 1, True), ("B200", 8, 1, True),
    ("H100-80GB", 1, 2, False),  # PP stages use send/recv, never NVLS
    ("H100-80GB", 1, 1, False), ("H100-PCIe", 2, 1, False), ("H100-NVL", 2, 1, False), ("L40S", 4, 1, False),
    ("A100-80GB", 4, 1, False),  # NVSwitch, but NVLS needs compute capability 9.0
])
def test_multicast_is_live_only_on_nvswitch_hopper_tp_groups_in_the_default_env(gpu, tp, pp, live):
    c = comm_memory(get_gpu(gpu), tp=tp, pp=pp, env=VLLM_DEFAULT_ENV)
    assert c.multicast is live
    assert not comm_memory(get_gpu(gpu), tp=tp, pp=pp, env=SERVETUNE_LAUNCH_ENV).multicast


def test_multicast_off_keeps_the_real_h200x2_figure_and_on_adds_nccl_buffers_and_the_fusion_workspace():
    h200 = get_gpu("H200")
    off = comm_memory(h200, tp=2, pp=1, env=SERVETUNE_LAUNCH_ENV)
    on = comm_memory(h200, tp=2, pp=1, env=VLLM_DEFAULT_ENV)
    assert off.non_torch_bytes == int(NON_TORCH_GIB_MULTI * GiB)  # 0.06 GiB: the real NVLS-off 2 x H200 runs
    assert on.non_torch_bytes == (int(NON_TORCH_GIB_MULTI * GiB) + nvls_buffer_bytes(2, 9.0)
                                  + int(FI_ALLREDUCE_FUSION_WORKSPACE_GIB * GiB))
    four = comm_memory(h200, tp=4, pp=1, env=VLLM_DEFAULT_ENV)
    assert four.non_torch_bytes - on.non_torch_bytes == nvls_buffer_bytes(4, 9.0) - nvls_buffer_bytes(2, 9.0)
    assert not on.validated and off.validated and on.fused_allreduce and not off.fused_allreduce


@pytest.mark.parametrize("version, gib", [
    # vLLM 0.11-0.16: no fusion by default; 0.54 GiB of NCCL rings + 64 MiB of NVLS buffers where NVLS is live.
    ((0, 11, 0), 0.60), ((0, 12, 0), 0.60), ((0, 16, 0), 0.60),
    # 0.17+: the FlashInfer all-reduce fusion workspace joins (the 0.19 logs: 2.06-2.11 GiB at TP=2).
    ((0, 17, 0), 2.10), ((0, 19, 0), 2.10), ((0, 25, 0), 2.10),
    # 0.26+ (the V2 runner's 0.06 GiB rings): the same workspace, assumed.
    ((0, 26, 0), 1.62), ((0, 28, 0), 1.62),
])
def test_the_default_environment_charges_the_fusion_workspace_from_0_17(version, gib):
    c = comm_memory(get_gpu("H100-80GB"), tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=version)
    assert round(c.non_torch_bytes / GiB, 2) == gib
    assert c.fused_allreduce is (version >= (0, 17, 0))


@pytest.mark.parametrize("gpu, tp, pp, version, kw, runs", [
    ("H100-80GB", 2, 1, (0, 19, 0), {}, True),
    ("H100-80GB", 4, 1, (0, 19, 0), {}, True),
    ("H100-80GB", 8, 1, (0, 19, 0), {}, True),
    ("H100-80GB", 6, 1, (0, 19, 0), {}, False),  # FI_SUPPORTED_WORLD_SIZES: 2, 4, 8
    ("H100-80GB", 2, 1, (0, 19, 0), {"compiled": False}, False),  # enforce_eager: no compile pass
    ("H100-80GB", 2, 1, (0, 19, 0), {"flashinfer": False}, False),  # has_flashinfer() False
    ("H100-80GB", 2, 2, (0, 19, 0), {}, False),  # 0.17-0.20: pipeline_parallel_size == 1
    ("H100-80GB", 2, 2, (0, 21, 0), {}, True),  # 0.21, 0.22: no PP check
    ("H100-80GB", 2, 2, (0, 23, 0), {}, False),  # 0.23: the PP check back
    ("H100-80GB", 2, 2, (0, 26, 0), {}, True),
    ("H100-PCIe", 2, 1, (0, 19, 0), {}, False),  # no multicast: FlashInfer's SymmDeviceMemory refuses
    ("A100-80GB", 2, 1, (0, 19, 0), {}, False),  # compute capability 8.0
    ("B200", 8, 1, (0, 17, 0), {}, True),
])
def test_fused_allreduce_runs_by_release_layout_and_host(gpu, tp, pp, version, kw, runs):
    assert fused_allreduce_runs(get_gpu(gpu), tp=tp, pp=pp, version=version, **kw) is runs


def test_nvls_buffer_follows_ncclsource_formula_and_chunk_setting():
    # nChannels(16 on sm90) * 2 * chunk * NCCL_STEPS(8) * nHeads(tp), 2 MiB aligned.
    assert nvls_buffer_bytes(2, 9.0) == 16 * 2 * 128 * 1024 * 8 * 2
    assert nvls_buffer_bytes(2, 9.0, 256 * 1024) == 2 * nvls_buffer_bytes(2, 9.0)
    assert nvls_buffer_bytes(8, 10.0) == 24 * 2 * 128 * 1024 * 8 * 8
    env = CommEnv.from_mapping({"NCCL_NVLS_CHUNKSIZE": "262144"}, "test")
    h100 = get_gpu("H100-80GB")
    delta = comm_memory(h100, tp=2, pp=1, env=env).non_torch_bytes - comm_memory(h100, tp=2, pp=1,
                                                                              env=VLLM_DEFAULT_ENV).non_torch_bytes
    assert delta == nvls_buffer_bytes(2, 9.0)


@pytest.mark.parametrize("env, field", [
    ({"NCCL_NVLS_ENABLE": "yes"}, "NCCL_NVLS_ENABLE"), ({"VLLM_ALLREDUCE_USE_SYMM_MEM": "maybe"},
                                                        "VLLM_ALLREDUCE_USE_SYMM_MEM"),
    ({"NCCL_NVLS_CHUNKSIZE": "-5"}, "NCCL_NVLS_CHUNKSIZE"),
])
def test_bad_settings_name_the_variable(env, field):
    with pytest.raises(SpecError) as err:
        CommEnv.from_mapping(env, "test")
    assert err.value.field == field


def test_the_plan_loses_exactly_the_multicast_memory_in_kv_blocks():
    model, gpu = load_model("llama-3.1-70b"), get_gpu("H100-80GB")
    cfg = resolve_engine_config({"tensor_parallel_size": 4, "max_model_len": 8192}, model, gpu, "0.19.0")
    off = plan_memory(model, gpu, cfg, env=SERVETUNE_LAUNCH_ENV)
    on = plan_memory(model, gpu, cfg, env=VLLM_DEFAULT_ENV)
    assert off.comm is not None and on.comm is not None and on.comm.multicast and not off.comm.multicast
    extra = on.comm.non_torch_bytes - off.comm.non_torch_bytes
    per_block = 2 * 16 * model.kv_heads_per_gpu(4) * model.head_dim * 2 * model.num_layers
    assert off.num_gpu_blocks - on.num_gpu_blocks in (extra // per_block, extra // per_block + 1)
    assert any("NVLS live" in n for n in on.notes) and not any("NVLS" in n for n in off.notes)


def test_plan_default_is_the_servetune_launch_env():
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    cfg = resolve_engine_config({"tensor_parallel_size": 2}, model, gpu)
    assert plan_memory(model, gpu, cfg) == plan_memory(model, gpu, cfg, env=SERVETUNE_LAUNCH_ENV)


def test_v1_runner_tp_growth_over_pcie_is_ncclsource_two_channel_figure_not_the_nvlink_one():
    """V1 runner (0.11-0.25), TP=2, multicast off: NVLink parts keep the fitted 0.54 GiB, PCIe-only parts
    get NCCL's 2-channel figure (0.02); PP-only and the V2 runner (0.26+) are unchanged."""
    from servetune.planner.comm import NON_TORCH_GIB_MULTI_V1, NON_TORCH_GIB_MULTI_V1_PCIE, PCIE_MAX_GBPS
    off = SERVETUNE_LAUNCH_ENV.with_nvls(False)
    gib = lambda gpu, tp=2, pp=1, v=(0, 11, 2): comm_memory(get_gpu(gpu), tp=tp, pp=pp, env=off,  # noqa: E731
                                                            version=v).non_torch_bytes / 2**30
    assert get_gpu("L40S").interconnect_gbps <= PCIE_MAX_GBPS < get_gpu("A100-40GB").interconnect_gbps
    assert gib("H100-80GB") == pytest.approx(NON_TORCH_GIB_MULTI_V1, abs=1e-6)
    assert gib("A100-40GB") == pytest.approx(NON_TORCH_GIB_MULTI_V1, abs=1e-6)
    for pcie in ("L40S", "L4", "H100-PCIe", "A10G"):
        assert gib(pcie) == pytest.approx(NON_TORCH_GIB_MULTI_V1_PCIE, abs=1e-6), pcie
    assert gib("L40S", tp=1, pp=2) == gib("H100-80GB", tp=1, pp=2)  # PP only: no ring all-reduce
    assert gib("L40S", v=(0, 26, 0)) == gib("H100-80GB", v=(0, 26, 0))  # V2 runner: 0.06 everywhere


@pytest.mark.parametrize(("gpu", "link"), [("H200", "nvlink"), ("A100-80GB", "nvlink"), ("B200", "nvlink"),
                                           ("L40S", "pcie"), ("L4", "pcie"), ("H100-PCIe", "pcie"), ("RTX-4090", "pcie")])
def test_each_part_defaults_to_its_usual_host(gpu: str, link: str) -> None:
    assert get_gpu(gpu).link == link


def test_the_all_reduce_path_follows_the_interconnect_and_vllms_custom_all_reduce_rules() -> None:
    """NVLink and PCIe with P2P: the calibrated latency and efficiency of the link's rate (custom
    all-reduce at TP=2 on PCIe, NCCL above two PCIe GPUs); without P2P: NCCL's SHM figures,
    whatever the part's link rate."""
    a100, l40s = get_gpu("A100-80GB"), get_gpu("L40S")
    nv = allreduce_cost(a100, 2, latency_s=10e-6, efficiency=0.7)
    assert (nv.latency_s, nv.bus_bytes_per_s) == (10e-6, pytest.approx(300e9 * 0.7))
    assert "custom all-reduce" in allreduce_cost(l40s, 2, latency_s=10e-6, efficiency=0.7).path
    assert "custom all-reduce off" in allreduce_cost(l40s, 4, latency_s=10e-6, efficiency=0.7).path
    for gpu in (a100, l40s):
        shm = allreduce_cost(with_interconnect(gpu, "pcie-no-p2p"), 2, latency_s=10e-6, efficiency=0.7)
        assert (shm.latency_s, shm.bus_bytes_per_s) == (NO_P2P_LATENCY_S, NO_P2P_BUS_GBPS * 1e9)
    # 2 (tp-1)/tp of the message crosses at the bus rate: 8 MiB at TP=2 over SHM is ~1.6 ms; the
    # measured step's fixed cost is paid once per step of NCCL's ring, 2 (tp-1) of them, where the
    # calibrated NVLink / P2P latency is one whole collective
    shm = allreduce_cost(with_interconnect(a100, "pcie-no-p2p"), 2, latency_s=0.0, efficiency=1.0)
    assert shm.seconds(2, 8 << 20) == pytest.approx(2 * NO_P2P_LATENCY_S + (8 << 20) / 5.2e9)
    assert shm.seconds(1, 8 << 20) == 0.0
    assert shm.seconds(4, 8 << 20) == pytest.approx(6 * NO_P2P_LATENCY_S + 1.5 * (8 << 20) / 5.2e9)
    assert (shm.gather_fixed_s(2), shm.gather_fixed_s(4)) == pytest.approx((NO_P2P_LATENCY_S, 3 * NO_P2P_LATENCY_S))
    assert (nv.fixed_s(2), nv.fixed_s(4), nv.gather_fixed_s(4)) == (10e-6, 10e-6, 10e-6)


def test_the_shm_step_is_read_off_a_measured_tp2_decode_all_reduce_at_its_hosts_own_rate() -> None:
    """sgl-project/sglang#39605: a 10 KB TP=2 decode all-reduce through NCCL's SHM transport took 39 us on a host
    whose 20 MB all-reduce ran at 1.9 GB/s; the bytes at that rate (5.4 us) aside, two steps of NCCL's ring are
    the rest, 16.8 us each (11.7 us until 2026-12-07, an 8-64 B alltoall step, which put that all-reduce at
    25.4 us). With the host's own rate the simulator's price gives back the measured 39 us; at its 5.2 GB/s it
    prices that message at 35.6 us."""
    assert NO_P2P_LATENCY_S == pytest.approx((39e-6 - 10_240 / 1.9e9) / 2, abs=0.05e-6)
    there = AllReduceCost("SHM", NO_P2P_LATENCY_S, 1.9e9, per_step=True)
    assert there.seconds(2, 10_240) == pytest.approx(39e-6, abs=0.1e-6)
    shm = allreduce_cost(with_interconnect(get_gpu("A100-80GB"), "pcie-no-p2p"), 2, latency_s=0.0, efficiency=1.0)
    assert shm.seconds(2, 10_240) * 1e6 == pytest.approx(35.6, abs=0.05)
    # the logits' all-gather and a pipeline send are one step each
    assert shm.gather_fixed_s(2) == shm.sendrecv_seconds(0) == NO_P2P_LATENCY_S


def test_the_simulated_tp_step_slows_on_a_host_without_p2p_and_only_there() -> None:
    from servetune.sim.perf import PerfModel
    model = load_model("llama-3.1-8b")
    a100 = get_gpu("A100-80GB")
    config = resolve_engine_config({"tensor_parallel_size": 2}, model, a100)
    args = dict(num_reqs=64, num_tokens=64, kv_context=64 * 1000, attn_work=64 * 1000, decode_only=True)
    nvlink = PerfModel(model, a100, config).gpu_cost(**args)
    shm = PerfModel(model, with_interconnect(a100, "pcie-no-p2p"), config).gpu_cost(**args)
    p2p = PerfModel(model, with_interconnect(a100, "pcie"), config).gpu_cost(**args)
    assert shm.comm > 5 * nvlink.comm and shm.comm > p2p.comm
    assert (shm.gemm, shm.attention) == (p2p.gemm, p2p.attention)  # the same PCIe card either way
    single = resolve_engine_config({}, model, a100)
    assert PerfModel(model, with_interconnect(a100, "pcie-no-p2p"), single).gpu_cost(**args).comm == 0.0


def test_an_sxm_part_on_a_pcie_host_is_its_pcie_card() -> None:
    """An A100 80GB whose host links its GPUs by PCIe (with or without P2P) is the PCIe card: no SXM4
    module sits outside an NVLink board. The card's datasheet bandwidth (1,935 GB/s against 2,039)
    slows the simulated weight-streaming decode step by that ratio, its PCIe link prices the
    custom all-reduce, and NCCL's PCIe channels (not NVLink's) are what vLLM 0.11-0.25 sees grow
    outside torch: more KV blocks than on the SXM board."""
    from servetune.sim.perf import PerfModel
    a100 = get_gpu("A100-80GB")
    for link in ("pcie", "pcie-no-p2p"):
        card = with_interconnect(a100, link)
        assert (card.name, card.hbm_gbps, card.interconnect_gbps, card.bf16_tflops) == ("A100-80GB", 1935.0, 32.0, 312.0)
        assert card.link == link
    assert with_interconnect(a100, "nvlink").hbm_gbps == a100.hbm_gbps == 2039.0
    assert with_interconnect(get_gpu("A100-40GB"), "pcie").hbm_gbps == get_gpu("A100-40GB").hbm_gbps
    model = load_model("llama-3.1-8b")
    one = resolve_engine_config({}, model, a100)
    args = dict(num_reqs=1, num_tokens=1, kv_context=1000, attn_work=1000, decode_only=True)
    sxm = PerfModel(model, a100, one).gpu_cost(**args)
    pcie = PerfModel(model, with_interconnect(a100, "pcie-no-p2p"), one).gpu_cost(**args)
    assert pcie.gemm / sxm.gemm == pytest.approx(2039.0 / 1935.0, rel=1e-3)
    assert allreduce_cost(with_interconnect(a100, "pcie"), 2, latency_s=0.0, efficiency=1.0).bus_bytes_per_s == 32e9
    two = resolve_engine_config({"tensor_parallel_size": 2}, model, a100, "0.11.0")  # NCCL's lazy growth: 0.11-0.25
    kv = {link: plan_memory(model, with_interconnect(a100, link), two).num_gpu_blocks for link in ("nvlink", "pcie-no-p2p")}
    assert kv["pcie-no-p2p"] > kv["nvlink"]


def test_without_p2p_each_step_all_gathers_the_sampled_rows_logits_through_host_memory() -> None:
    """vLLM's LogitsProcessor all-gathers the vocab-parallel logits (one row per sampled request)
    every step; through NCCL's SHM path that is (tp-1)/tp of rows x vocab x 2 bytes at the SHM bus
    rate plus one collective's latency, on top of the layers' all-reduces. Over NVLink the step's
    communication is the all-reduces alone."""
    from servetune.sim.perf import PerfModel
    model = load_model("llama-3.1-8b")
    a100 = get_gpu("A100-80GB")
    config = resolve_engine_config({"tensor_parallel_size": 2}, model, a100)
    layers = model.num_layers

    def comm(gpu, rows: int) -> float:
        return PerfModel(model, gpu, config).gpu_cost(rows, rows, rows * 1000, rows * 1000, True).comm

    shm_gpu = with_interconnect(a100, "pcie-no-p2p")
    shm = allreduce_cost(shm_gpu, 2, latency_s=0.0, efficiency=1.0)
    for rows in (8, 32):
        layer_ar = 2 * layers * shm.seconds(2, rows * model.hidden_size * 2)
        gather = NO_P2P_LATENCY_S + 0.5 * rows * model.vocab_size * 2 / (NO_P2P_BUS_GBPS * 1e9)
        assert comm(shm_gpu, rows) == pytest.approx(layer_ar + gather, rel=1e-6)
    nv = allreduce_cost(a100, 2, latency_s=10e-6, efficiency=0.7)
    assert comm(a100, 8) == pytest.approx(2 * layers * nv.seconds(2, 8 * model.hidden_size * 2), rel=1e-6)


@pytest.mark.parametrize("value", ["pcie_no_p2p", "NVSwitch", 3, ["nvlink"]])
def test_a_bad_interconnect_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(SpecError) as err:
        with_interconnect(get_gpu("A100-80GB"), value, "gpu.interconnect")
    assert err.value.field == "gpu.interconnect" and "pcie-no-p2p" in err.value.fix


def test_a_gpu_file_may_state_its_hosts_interconnect(tmp_path) -> None:
    path = tmp_path / "gpus.yaml"
    path.write_text("gpus:\n  - {name: Cloud-A100, memory_gib: 79, hbm_gbps: 1935, bf16_tflops: 312, fp8_tflops: 312,"
                    " interconnect_gbps: 32, interconnect: pcie-no-p2p}\n")
    assert register_gpus_from_yaml(path) == ["Cloud-A100"] and get_gpu("Cloud-A100").link == "pcie-no-p2p"
    path.write_text("gpus:\n  - {name: Cloud-B, memory_gib: 79, hbm_gbps: 1935, bf16_tflops: 312, fp8_tflops: 312,"
                    " interconnect_gbps: 32, interconnect: infiniband}\n")
    with pytest.raises(SpecError) as err:
        register_gpus_from_yaml(path)
    assert err.value.field.endswith("gpus[0].interconnect")


def test_a_pipeline_boundary_is_priced_by_the_interconnect_and_only_under_pp() -> None:
    """PP>1: each micro-batch's hidden states and residual (2 x hidden x dtype bytes a token, each
    TP rank its slice) cross pp - 1 boundaries (a lone request pays all of them; a full pipeline
    its stages' average); over PCIe P2P at the link's calibrated rate, through host memory (no
    P2P) at NCCL's SHM figures. PP=1 pays nothing."""
    from servetune.sim.perf import PerfModel
    model = load_model("llama-3.1-8b")
    l40s = get_gpu("L40S")
    args = dict(num_reqs=64, num_tokens=2048, kv_context=64 * 1000, attn_work=2048 * 1000, decode_only=False)
    pp2 = resolve_engine_config({"pipeline_parallel_size": 2}, model, l40s)
    p2p_cost = PerfModel(model, l40s, pp2).gpu_cost(**args).comm
    shm_cost = PerfModel(model, with_interconnect(l40s, "pcie-no-p2p"), pp2).gpu_cost(**args).comm
    assert 0 < p2p_cost < shm_cost
    # Two micro-batches fill the pipeline: each stage's share of the one boundary ((pp - 1) / pp, the
    # last stage sends nothing) of the 2,048 tokens' 2 x 4,096 bf16 values at 5.2 GB/s, one send each.
    expected = 0.5 * (NO_P2P_LATENCY_S * 2 + 2048 * 2 * model.hidden_size * 2 / (NO_P2P_BUS_GBPS * 1e9))
    assert shm_cost == pytest.approx(expected, rel=0.05)
    assert PerfModel(model, l40s, resolve_engine_config({}, model, l40s)).gpu_cost(**args).comm == 0.0


@pytest.mark.parametrize("gpu, link, tp, runs", [
    ("H100-80GB", None, 2, True), ("H100-80GB", None, 8, True), ("A100-80GB", None, 4, True),
    ("H100-80GB", None, 3, False),  # vLLM's _SUPPORTED_WORLD_SIZES are 2, 4, 6, 8
    ("L40S", None, 2, True), ("L40S", None, 4, False),  # "not supported on more than two PCIe-only GPUs"
    ("L40S", "pcie-no-p2p", 2, False), ("A100-80GB", "pcie-no-p2p", 2, False),  # "lacks GPU P2P capability"
    ("H100-80GB", None, 1, False),
])
def test_the_custom_all_reduce_runs_where_vllm_sets_it_up(gpu: str, link: str | None, tp: int, runs: bool) -> None:
    assert custom_all_reduce_runs(with_interconnect(get_gpu(gpu), link), tp) is runs


def test_disabling_the_custom_all_reduce_names_nccls_path_and_keeps_the_calibrated_cost() -> None:
    """vLLM 0.26 ``disable_custom_all_reduce``: the path is NCCL's where the custom kernel would have run; the
    price stays the calibrated one (no cited figure for NCCL's small messages fits: the path says so), and
    where the custom all-reduce is off anyway nothing changes, not even the words."""
    h100, l40s = get_gpu("H100-80GB"), get_gpu("L40S")
    for gpu, tp, over in ((h100, 2, "NVLink"), (h100, 8, "NVLink"), (l40s, 2, "PCIe P2P")):
        on = allreduce_cost(gpu, tp, latency_s=10e-6, efficiency=0.7)
        off = allreduce_cost(gpu, tp, latency_s=10e-6, efficiency=0.7, custom_all_reduce=False)
        assert "custom all-reduce" in on.path and not on.path.startswith("NCCL")
        assert off.path.startswith(f"NCCL over {over}") and "not modelled" in off.path
        assert off.seconds(tp, 4096 * 2 * 64) == on.seconds(tp, 4096 * 2 * 64)
    for gpu, tp in ((l40s, 4), (with_interconnect(l40s, "pcie-no-p2p"), 2)):
        assert (allreduce_cost(gpu, tp, latency_s=10e-6, efficiency=0.7, custom_all_reduce=False)
                == allreduce_cost(gpu, tp, latency_s=10e-6, efficiency=0.7))


def test_the_custom_all_reduce_buffers_are_vllms_three_8_mib_buffers_and_the_plan_keeps_its_figures() -> None:
    """meta (signal + 8 MiB scratch), 8 MiB input buffer, 8 MiB rank_data: 24 MiB outside the KV budget, inside
    the fitted context figure; the flag leaves every memory figure as it was and the plan says so."""
    assert CUSTOM_ALL_REDUCE_BUFFER_BYTES == 24 << 20
    model, gpu = load_model("llama-3.1-8b"), get_gpu("L40S")
    flags = {"tensor_parallel_size": 2, "max_model_len": 8192}
    plain = plan_memory(model, gpu, resolve_engine_config(flags, model, gpu))
    off = plan_memory(model, gpu, resolve_engine_config({**flags, "disable_custom_all_reduce": True}, model, gpu))
    assert (off.memory, off.kv_cache_tokens) == (plain.memory, plain.kv_cache_tokens)
    added = [n for n in off.notes if n not in plain.notes]
    assert len(added) == 2 and all(n.startswith("disable_custom_all_reduce at TP=2") for n in added)
    assert "24 MiB" in added[0] and "not modelled" in added[1] and all("\n" not in n for n in added)


@pytest.mark.parametrize("gpu, tp, expect", [("L40S", 4, "changes nothing on L40S"), ("H100-80GB", 1, None)])
def test_where_the_flag_changes_nothing_the_plan_says_so_or_stays_silent(gpu: str, tp: int, expect: str | None) -> None:
    model, g = load_model("llama-3.1-8b"), get_gpu(gpu)
    plan = plan_memory(model, g, resolve_engine_config(
        {"tensor_parallel_size": tp, "max_model_len": 8192, "disable_custom_all_reduce": True}, model, g))
    ours = [n for n in plan.notes if "disable_custom_all_reduce" in n]
    assert ours == ([] if expect is None else [n for n in ours if expect in n]) and len(ours) == (expect is not None)


def test_the_simulator_prices_the_same_step_and_says_the_nccl_path_is_not_modelled() -> None:
    from servetune.sim import simulate
    from servetune.sim.perf import PerfModel
    from servetune.workload import Workload
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    base = {"tensor_parallel_size": 2, "max_model_len": 8192}
    plain = resolve_engine_config(base, model, gpu)
    off = resolve_engine_config({**base, "disable_custom_all_reduce": True}, model, gpu)
    args = dict(num_reqs=64, num_tokens=64, kv_context=64 * 1000, attn_work=64 * 1000, decode_only=True)
    p_plain, p_off = PerfModel(model, gpu, plain), PerfModel(model, gpu, off)
    assert p_off.gpu_cost(**args).comm == p_plain.gpu_cost(**args).comm > 0
    assert p_plain.allreduce_path.startswith("custom all-reduce") and p_off.allreduce_path.startswith("NCCL over NVLink")
    w = Workload.from_dict({"input_len": 128, "output_len": 16, "num_requests": 8, "concurrency": 4})
    said = [n for n in simulate(model, gpu, off, w).notes if "small-message latency is not modelled" in n]
    assert len(said) == 1 and said[0].startswith("disable_custom_all_reduce at TP=2")
    assert not [n for n in simulate(model, gpu, plain, w).notes if "disable_custom_all_reduce" in n]


def test_vllm_0_10_charges_the_communicators_over_nvlink_only():
    """0.10.x snapshots before building its communicators (gpu_worker.py:175 / :193@0.10.2): their memory moves from
    the context into the charged growth over NVLink; without P2P (SHM through host memory) nothing is charged."""
    from servetune.planner.comm import CONTEXT_GIB_MULTI, CONTEXT_GIB_SINGLE, NON_TORCH_GIB_MULTI_V1
    h200 = get_gpu("H200")
    old = comm_memory(h200, tp=2, pp=1, env=SERVETUNE_LAUNCH_ENV, version=(0, 10, 2))
    new = comm_memory(h200, tp=2, pp=1, env=SERVETUNE_LAUNCH_ENV, version=(0, 11, 0))
    delta = int(CONTEXT_GIB_MULTI * GiB) - int(CONTEXT_GIB_SINGLE * GiB)
    assert new.non_torch_bytes == int(NON_TORCH_GIB_MULTI_V1 * GiB) and new.context_bytes == int(CONTEXT_GIB_MULTI * GiB)
    assert old.non_torch_bytes - new.non_torch_bytes == delta and old.context_bytes == int(CONTEXT_GIB_SINGLE * GiB)
    shm = with_interconnect(get_gpu("A100-80GB"), "pcie-no-p2p")
    assert (comm_memory(shm, tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=(0, 10, 1)).non_torch_bytes
            == comm_memory(shm, tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=(0, 11, 0)).non_torch_bytes)
    # 0.10.2's VLLM_ALLREDUCE_USE_SYMM_MEM defaults to 0 (envs.py:1221): no symmetric-memory buffer in the context
    assert comm_memory(h200, tp=2, pp=1, env=VLLM_DEFAULT_ENV, version=(0, 10, 2)).context_bytes == int(
        CONTEXT_GIB_SINGLE * GiB)


# vLLM's has_flashinfer(), unchanged 0.17-0.28: vllm/utils/flashinfer.py:50-62@0.17.0, :47-62@0.19.0, :48-62@0.28.0
# (find_spec("flashinfer"), then has_flashinfer_cubin() or shutil.which("nvcc")); has_flashinfer_cubin :39@0.17.0,
# :36@0.19.0, :37@0.28.0 (VLLM_HAS_FLASHINFER_CUBIN, bool(int(...)): envs.py:1404@0.17.0, :1420@0.19.0, :1813@0.28.0,
# or find_spec("flashinfer_cubin")). It gates the pass: enable_allreduce_rms_fusion, config/vllm.py:113@0.17.0,
# :116@0.19.0, :147@0.28.0, the -O2 default at :204@0.17.0, :208@0.19.0, :272@0.28.0.
@pytest.mark.parametrize("package, cubin_package, nvcc, env, usable", [
    (True, False, True, {}, True),  # vLLM's images: flashinfer-python and the CUDA devel toolkit's nvcc
    (True, True, False, {}, True),  # flashinfer-cubin installed, no nvcc
    (True, False, False, {"VLLM_HAS_FLASHINFER_CUBIN": "1"}, True),  # cubins pre-downloaded
    (True, False, False, {"VLLM_HAS_FLASHINFER_CUBIN": "0"}, False),  # the package alone cannot get its kernels
    (True, False, False, {}, False),
    (False, True, True, {"VLLM_HAS_FLASHINFER_CUBIN": "1"}, False),  # no flashinfer package
])
def test_has_flashinfer_is_vllms_rule(package, cubin_package, nvcc, env, usable):
    assert has_flashinfer(package=package, cubin_package=cubin_package, nvcc=nvcc, env=env) is usable


def test_has_flashinfer_refuses_a_cubin_setting_vllm_cannot_read():
    with pytest.raises(SpecError) as err:
        has_flashinfer(package=True, cubin_package=False, nvcc=True, env={"VLLM_HAS_FLASHINFER_CUBIN": "true"})
    assert err.value.field == "VLLM_HAS_FLASHINFER_CUBIN" and "VLLM_HAS_FLASHINFER_CUBIN=1" in err.value.fix


def test_a_real_trial_is_planned_with_the_workers_flashinfer_and_charged_when_not_probed():
    """TP=2 on an H100 with vLLM 0.19: the fusion workspace is charged where the worker's FlashInfer is usable (and
    where it was not probed), not where it is not; a simulated trial keeps the measured host's (none)."""
    h100 = get_gpu("H100-80GB")
    usable, unusable, unprobed = trial_env(True, True), trial_env(True, False), trial_env(True)
    for env in (usable, unusable, unprobed):  # the launch variables are servetune's in every case
        assert (env.nvls, env.symm_mem, env.torch_multicast) == (SERVETUNE_LAUNCH_ENV.nvls, False, False)
    assert trial_env(False) == SERVETUNE_LAUNCH_ENV and trial_env(False, True) == SERVETUNE_LAUNCH_ENV
    on = comm_memory(h100, tp=2, pp=1, env=usable, version=(0, 19, 0))
    off = comm_memory(h100, tp=2, pp=1, env=unusable, version=(0, 19, 0))
    assert on.fused_allreduce and not off.fused_allreduce
    assert on.non_torch_bytes - off.non_torch_bytes == int(FI_ALLREDUCE_FUSION_WORKSPACE_GIB * GiB)
    assert comm_memory(h100, tp=2, pp=1, env=unprobed, version=(0, 19, 0)) == on
    assert "not probed" in unprobed.source and "probed on a GPU worker" in usable.source
    # vLLM 0.16 has the pass off by default: the probe changes nothing there
    assert (comm_memory(h100, tp=2, pp=1, env=usable, version=(0, 16, 0))
            == comm_memory(h100, tp=2, pp=1, env=unusable, version=(0, 16, 0)))


def test_the_plans_kv_cache_differs_by_the_fusion_workspace():
    model, gpu = load_model("llama-3.1-8b"), get_gpu("H100-80GB")
    cfg = resolve_engine_config({"tensor_parallel_size": 2, "max_model_len": 8192}, model, gpu, "0.19.0")
    on = plan_memory(model, gpu, cfg, env=trial_env(True, True))
    off = plan_memory(model, gpu, cfg, env=trial_env(True, False))
    assert on.fits and off.fits
    assert off.memory.kv_cache - on.memory.kv_cache == pytest.approx(FI_ALLREDUCE_FUSION_WORKSPACE_GIB, abs=1e-6)
    per_block = 2 * 16 * model.kv_heads_per_gpu(2) * model.head_dim * 2 * model.num_layers
    extra = int(FI_ALLREDUCE_FUSION_WORKSPACE_GIB * GiB)
    assert off.num_gpu_blocks - on.num_gpu_blocks in (extra // per_block, extra // per_block + 1)
    assert any("FlashInfer all-reduce + RMSNorm fusion" in n for n in on.notes)
    assert not any("FlashInfer all-reduce + RMSNorm fusion" in n for n in off.notes)
    eager = resolve_engine_config({"tensor_parallel_size": 2, "max_model_len": 8192, "enforce_eager": True}, model,
                                  gpu, "0.19.0")
    assert plan_memory(model, gpu, eager, env=trial_env(True, True)).memory == plan_memory(
        model, gpu, eager, env=trial_env(True, False)).memory  # no compile pass under enforce_eager


def test_one_probe_answers_the_sampler_and_the_fusion_workspace():
    """The GPU worker's probe (``trial_env(True, answer)``) decides the plan's FlashInfer for vLLM 0.11.0's profile-run
    sampler as it does the 0.17+ fusion workspace: a probed True plans FlashInfer's top-k/top-p (a lower activation
    peak, more KV), a probed False the sort, whatever the config says; unprobed, the config's own statement stands."""
    model, gpu = load_model("qwen3-8b"), get_gpu("H100-80GB")
    cfg = resolve_engine_config({}, model, gpu, "0.11.0")
    assert cfg.flashinfer_available is None
    yes, no, unprobed = (plan_memory(model, gpu, cfg, env=env) for env in (trial_env(True, True), trial_env(True, False),
                                                                          trial_env(True)))
    assert yes.memory.activation_peak < no.memory.activation_peak and yes.memory.kv_cache > no.memory.kv_cache
    assert unprobed.memory == no.memory  # not stated: 0.11.0 planned with the sort, as its published starts profile
    stated = dataclasses.replace(cfg, flashinfer_available=True)
    assert plan_memory(model, gpu, stated, env=trial_env(True)).memory == yes.memory
    assert plan_memory(model, gpu, stated, env=trial_env(True, False)).memory == no.memory  # the probe wins
    later = resolve_engine_config({}, model, gpu, "0.11.1")  # opt-in from 0.11.1: the probe moves no sampler
    assert (plan_memory(model, gpu, later, env=trial_env(True, True)).memory
            == plan_memory(model, gpu, later, env=trial_env(True, False)).memory)
