"""The step time of Mamba2 / gated-delta-net hybrids (``sim.perf_hybrid``), and the four real windows that judge it.

The model is counted from vLLM's kernels and the planner's shapes with no constant fitted on these
windows (the H100 SXM, vLLM 0.26.0, 2026-12-06: granite-4.0-h-tiny and Nemotron-H-8B-Base-8K, one
``vllm bench serve`` window each; 2026-12-07: the Qwen3-Next 12-layer and Qwen3.5-35B-A3B 20-layer shapes; ``tests/fixtures/real_h100_classes``). The replay's bounds state
the measured errors; a change that moves them is to update the figures here and in
docs/model-classes.md together.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _fidelity import H100_CLASSES_FIXTURES, H100_GPU, HYBRID_BENCH_STARTS, fidelity_rows, load_hybrid_runs

from servetune.planner.gpus import get_gpu
from servetune.planner.memory import resolve_engine_config
from servetune.planner.hybrid import mamba_state_bytes
from servetune.planner.modelinfo import load_model
from servetune.sim import PerfModel, calibration_for, hybrid_note
from servetune.sim.perf_classes import class_gemms, moe_shape
from servetune.sim.perf_hybrid import (FLA_CHUNK, gdn_partial_chunk_bytes, gdn_scan_kernels, hybrid_shape,
                                       ssd_scan_kernels)

H100 = get_gpu(H100_GPU)
GRANITE = load_model("granite-4.0-h-tiny")
NEMOTRON = load_model(str(H100_CLASSES_FIXTURES / "2026-12-06_h100_host_e" / "nemh8b"))
PLATFORM = Path(__file__).resolve().parents[2] / "platform"


def _perf(model, tp: int = 1) -> PerfModel:
    return PerfModel(model, H100, resolve_engine_config({"tensor_parallel_size": tp}, model, H100))


def test_a_decoding_request_reads_and_writes_its_state_once_a_step_in_every_mamba_layer() -> None:
    """granite-4.0-h-tiny: 36 Mamba layers, a state of 806,400 bytes each (the planner's shape:
    3 x 3,328 conv + 48 x 64 x 128 SSM, bf16), read and written; plus the mixer's activations."""
    perf = _perf(GRANITE)
    rate = H100.hbm_gbps * 1e9 * calibration_for(H100).mem_efficiency
    per_request = (2 * 806_400 * 36 + (3 * 3328 + 4 * 3072) * 2 * 36) / rate
    one = perf.gpu_cost(1, 1, 1000, 1000, True).recurrent
    many = perf.gpu_cost(32, 32, 32_000, 32_000, True).recurrent
    assert one == pytest.approx(per_request) and many == pytest.approx(32 * per_request)
    assert mamba_state_bytes(GRANITE, 1, 2) == 806_400


def test_nemotron_h_keeps_its_ssm_state_in_fp32_as_vllm_0_26_logged() -> None:
    """The server log of 2026-12-06_nemh8b_u09_s256_mbt8192 says "Updating mamba_ssm_cache_dtype to
    'float32' for NemotronH model": 128 heads x 64 x 128 x 4 bytes, plus 3 x 10,240 bf16 conv."""
    config = resolve_engine_config({}, NEMOTRON, H100)
    shape = hybrid_shape(NEMOTRON, 1, NEMOTRON.num_layers, 4)
    assert shape is not None and shape.state_bytes == 128 * 64 * 128 * 4 + 3 * 10240 * 2
    assert (shape.mamba_layers, shape.attention_layers, shape.ffn_layers) == (24, 4, 24)
    assert config.block_size == 1040  # the log's "Setting attention block size to 1040 tokens"


def test_kv_reads_and_prefill_attention_are_the_attention_layers_only() -> None:
    """4 of granite's 40 layers attend: a context token costs 2 x 4 KV heads x 128 x 2 bytes x 4 layers."""
    perf = _perf(GRANITE)
    cal = calibration_for(H100)
    extra = perf.gpu_cost(8, 8, 8 * 2000, 8 * 2000, True).attention - perf.gpu_cost(8, 8, 8 * 1000, 8 * 1000, True).attention
    assert extra == pytest.approx(8 * 1000 * 2 * 4 * 128 * 2 * 4 / (H100.hbm_gbps * 1e9 * cal.kv_read_efficiency))


@pytest.mark.parametrize("model, tp", [(GRANITE, 1), (NEMOTRON, 1), (NEMOTRON, 2)])
def test_the_gemms_are_the_planners_linear_weights(model, tp: int) -> None:
    """One implementation: the step's GEMMs (less the router, which the planner counts as a plain
    weight) plus the routed experts hold exactly the linear weights the planner loads."""
    gemms = class_gemms(model, H100, tp, model.num_layers)
    router = model.num_experts if model.is_moe else -1
    counted = sum(g.n * g.k * g.layers for g in gemms if g.n != router)
    moe = moe_shape(model, H100, tp, model.num_layers)
    if moe is not None:
        counted += moe.experts * 3 * moe.hidden * moe.inter * moe.layers
    planner = sum(model._hybrid_layer_elems(kind, tp)[0] for kind in model.layer_types)
    assert counted == planner


def test_the_ssd_scan_is_counted_per_chunk_kernel() -> None:
    """Nemotron-H-8B's scan (128 heads of 64, state 128, 8 groups, 256-token chunks): 2QNG + 4NPH +
    QPH (+ 2HPN/Q passing states) FLOPs a token and layer; its bytes exceed its FLOPs' time on an
    H100, so the prefill term grows with the tokens, not with the requests."""
    kernels = ssd_scan_kernels(heads=128, head_dim=64, d_state=128, groups=8, chunk=256, act_bytes=2)
    flops = sum(k.flops for k in kernels)
    assert flops == 2 * 256 * 128 * 8 + 4 * 128 * 64 * 128 + 256 * 64 * 128 + 2 * 128 * 64 * 128 / 256
    perf = _perf(NEMOTRON)
    a = perf.gpu_cost(8, 8192, 8192, 8 * 1024 * 513, False).recurrent
    b = perf.gpu_cost(4, 4096, 4096, 4 * 1024 * 513, False).recurrent
    assert a == pytest.approx(2 * b)


def test_a_gated_delta_net_hybrid_is_priced_too() -> None:
    """Qwen3-Next at TP 4 (no real window judges it: the 12-layer start failed under load)."""
    model = load_model("qwen3-next-80b-a3b")
    perf = _perf(model, tp=4)
    decode = perf.gpu_cost(16, 16, 16 * 1000, 16 * 1000, True)
    prefill = perf.gpu_cost(4, 4096, 4096, 4 * 1024 * 513, False)
    assert 0 < decode.recurrent < decode.seconds and 0 < prefill.recurrent < prefill.seconds
    kernels = gdn_scan_kernels(heads=8, head_v=128, head_k=128, act_bytes=2)
    assert [k.name for k in kernels] == ["kkt", "solve_tril", "w_u", "fwd_h", "fwd_o"]
    note = hybrid_note(model)
    assert note is not None and "gated-delta-net" in note and "\n" not in note



def test_a_prefilling_sequence_pays_its_last_partial_chunks_state_tile() -> None:
    """FLA's ``fwd_h`` stores one ``H x V x K`` tile per chunk of every sequence and ``fwd_o`` reads it back
    (``h = k.new_empty(B, NT, H, V, K)``, ``NT`` = each sequence's ``cdiv(T_i, 64)``; vLLM 0.17.1's
    ``layers/fla/ops/chunk_delta_h.py`` lines 297-320): the per-token scan counts ``1/64`` of a tile a token,
    so a one-token sequence (a decode in a pre-0.23 mixed batch) misses ``63/64`` of one, written and read.
    Qwen3-Next at TP 4 on the H100 (8 value heads of 128 x 128, bf16): 256 KiB a tile, 504 KiB a sequence and
    layer; 36 gated-delta-net layers; in a mixed step of vLLM 0.22.1 each decoding request pays it, in 0.23.0's
    only the prefilling ones do."""
    model = load_model("qwen3-next-80b-a3b")
    shape = hybrid_shape(model, 4, model.num_layers, 2)
    assert shape is not None and shape.chunk_state_bytes == 8 * 128 * 128 * 2
    assert gdn_partial_chunk_bytes(shape.chunk_state_bytes) == 2 * 8 * 128 * 128 * 2 * 63 / 64
    assert gdn_partial_chunk_bytes(shape.chunk_state_bytes, chunk=1) == 0.0  # a 1-token chunk: nothing missed
    assert FLA_CHUNK == 64
    assert hybrid_shape(GRANITE, 1, GRANITE.num_layers, 2).chunk_state_bytes == 0  # Mamba2: not this rule
    rate = H100.hbm_gbps * 1e9 * calibration_for(H100).mem_efficiency
    tile = gdn_partial_chunk_bytes(shape.chunk_state_bytes) * shape.mamba_layers / rate
    tp4 = {"tensor_parallel_size": 4}
    old, new = (PerfModel(model, H100, resolve_engine_config(tp4, model, H100, v)) for v in ("0.22.1", "0.23.0"))
    # 256 decoding requests beside one 512-token prefill: 257 sequences through the chunked path before 0.23.0
    assert old.recurrent_seconds(256, 1, 512) - old.recurrent_seconds(256, 0, 0) > 257 * tile
    with_one = new.recurrent_seconds(256, 1, 512) - new.recurrent_seconds(256, 0, 0)
    assert with_one - new.recurrent_seconds(0, 1, 512) == pytest.approx(0.0, abs=1e-12)
    # a prefilling sequence with no tokens of its own: its state read and written, gathered and scattered,
    # and the tile
    copies = (2 * shape.state_bytes + 4 * shape.ssm_state_bytes) * shape.mamba_layers / rate
    assert new.recurrent_seconds(0, 1, 0) == pytest.approx(copies + tile, rel=1e-9)


# -- the four real windows (judged, never fitted) -----------------------------------------------------

@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in fidelity_rows(None, load_hybrid_runs(), gpu=H100_GPU)}


def test_every_window_ran_no_warm_up_and_stalled_on_the_first_request() -> None:
    """No bench warmed up (``num_warmups=0``, the ready check skipped): its first request took over 4 s
    (over 5 s in the two Mamba2 windows; read as first-use Triton JIT of the Mamba and gated-delta-net
    kernels; not traced), which the simulator does not model: the real windows' throughput and TTFT carry it."""
    for start in HYBRID_BENCH_STARTS:
        text = gzip.decompress((H100_CLASSES_FIXTURES / start / "bench.txt.gz").read_bytes()).decode()
        assert "num_warmups=0" in text
        first = re.search(r"\s1/\d+ \[00:(\d\d)<", text)
        assert first is not None and int(first.group(1)) >= (5 if "2026-12-06" in start else 4)


def test_granite_4_0_h_tiny_window(rows) -> None:
    """Measured: output tok/s +29.1% (3,097 against 2,398.71), TPOT -3.7%, mean TTFT -67.4% since its compiled
    steps above the largest capture size pay the CPU of its MoE pieces with a shared expert
    (``PerfModel.forward_cpu_s``, read off the Qwen3.5 shape's trace, 2026-12-07; the Mamba2 mixers' own CPU is
    not timed, not priced); +41.8 / -8.7 / -79.1% since the router's
    measured kernels replaced the fitted MoE floor where the experts stream at the kernel's measured rate
    (``_moe_tiles.MOE_ROUTER_KERNELS_S``, 2026-12-07); +47.0 / -12.4 / -78.5% before it (under the fused-MoE
    streaming rule); +50.8 / -14.8 / -78.6% before that; +61.5 / -19.5 / -82.3% before the simulator priced its
    MoE experts' first-use Triton compiles, ``sim.moe_jit``: 0.3 s per fused-MoE kernel variant, none of the
    Mamba kernels'. The real window lost ~3 s to the JIT
    stall of its first wave (its later waves ran every ~2.7 s: about 3,030 tok/s, against which the
    simulator is ~+19%); the decode steps run fast, and the real median TTFT (470 ms) sits above the
    simulated mean too."""
    r = rows[HYBRID_BENCH_STARTS[0]]
    assert r.real.preemptions == r.sim_preemptions == 0
    assert 0.24 < r.throughput_error < 0.34, r.throughput_error
    assert -0.09 < r.tpot_error < 0.01, r.tpot_error
    assert -0.73 < r.ttft_error < -0.62, r.ttft_error


def test_nemotron_h_8b_window(rows) -> None:
    """Measured: output tok/s +9.0% (2,479 against 2,274.45), TPOT +12.3% (11.00 ms against 9.79),
    mean TTFT -55.1% (495 ms against 1,100.9) as of 2026-12-07 (+8.9 / +13.8 / -58.4% when first judged). Its later waves ran every ~3.1 s (about 2,640 tok/s):
    the simulator ~-6% there, its decode steps ~14% slow, the JIT stall hiding that in the headline."""
    r = rows[HYBRID_BENCH_STARTS[1]]
    assert r.real.preemptions == r.sim_preemptions == 0
    assert 0.04 < r.throughput_error < 0.14, r.throughput_error
    assert 0.09 < r.tpot_error < 0.19, r.tpot_error
    assert -0.64 < r.ttft_error < -0.53, r.ttft_error


def test_qwen3_next_12_layer_window_with_tritons_gated_delta_net_prefill(rows) -> None:
    """The Qwen3-Next-80B-A3B shape at 12 of its 48 layers (9 gated-delta-net, 3 full attention; 512 experts,
    top-10), served 2026-12-07 on an H100 SXM with vLLM 0.26.0's Triton gated-delta-net prefill
    (``--gdn-prefill-backend triton``: its 2026-12-06 start died in FlashInfer's, absent on the host), random
    1,024 / 256 at 32 in flight. Its figures were written before it ran
    (``benchmarks/real_vllm/plan_2026_12_07_q3next12_triton_h100.json``: 2,842.5 tok/s, TTFT 352.7 ms, TPOT
    9.91 ms). Measured: 2,954.73 tok/s, TTFT 631.17 ms (p99 2,301.51: the first request's 4 s JIT stall), TPOT
    8.38 ms, no preemption; so -3.8% on throughput, +18.2% on TPOT (its decode steps priced slow), -44.1% on
    TTFT; -6.5 / +20.4 / -38.1% since a gated delta net's steps outside a FULL CUDA graph pay their forward's CPU
    (``PerfModel.forward_cpu_s``, read off the 20-layer Qwen3.5 shape's trace, 2026-12-07). The KV pool as the 2026-12-06 start's: 4,351,676 tokens logged, 4,343,053 planned (-0.20%)."""
    r = rows[HYBRID_BENCH_STARTS[2]]
    assert r.real.preemptions == r.sim_preemptions == 0
    assert -0.11 < r.throughput_error < -0.02, r.throughput_error
    assert 0.15 < r.tpot_error < 0.25, r.tpot_error
    assert -0.44 < r.ttft_error < -0.32, r.ttft_error
    log = gzip.decompress((H100_CLASSES_FIXTURES / HYBRID_BENCH_STARTS[2] / "server.log.gz").read_bytes()).decode()
    assert "GPU KV cache size: 4,351,676 tokens" in log


def test_qwen3_5_moe_20_layer_window_at_512_in_flight_is_simulated_fast_by_less_since_its_trace(rows) -> None:
    """The Qwen3.5-35B-A3B shape at 20 of its 40 layers (15 gated-delta-net, 5 full attention; 256 experts, top-8),
    served 2026-12-07 on an H100 SXM with vLLM 0.26.0 (``--language-model-only``, Triton gated-delta-net prefill,
    vLLM's default 1,024 sequences), under the published H200 page's random burst: 1,024 / 128 tokens, 1,000
    prompts, 512 in flight. Its figures were written before it ran
    (``benchmarks/real_vllm/plan_2026_12_07_q35moe20_h100.json``: 7,309.6 tok/s, TTFT 2,093.7 ms, TPOT 51.22 ms).
    Measured: 4,863.03 tok/s, TTFT 3,871.01 ms, TPOT 71.24 ms, no preemption: simulated +50.3% fast, TPOT -28.1%,
    TTFT -45.9% (+50.2%, TPOT and TTFT unchanged, since a prefilling sequence's partial FLA chunk is priced:
    ``perf_hybrid.gdn_partial_chunk_bytes``; at 0.26.0 no decode takes the chunked path). Since the same start's
    flags were traced (``2026-12-07_q35moe20tri_prof_u09_default``) and a step outside a FULL CUDA graph pays its
    forward's CPU (``PerfModel.forward_cpu_s``, read off that trace: not held out from this window's shape and load):
    +28.7%, TPOT -16.3%, TTFT -35.1%; its mixed steps are priced 103 ms against 95-107 ms unprofiled, and the rest
    of the miss is the real window's stalls (its progress lines: 3 s with 5 completions at 21-24 s). The published page's miss (gpustack_qwen3_5_35b_a3b.yaml: +32.1% on this burst at vLLM 0.17.1 on
    an H200) is reproduced on another GPU and release; its routed experts are priced within 0.84-0.95 of their
    timed kernel (tests/sim/test_moe_probe.py), so the missing time is elsewhere in the step. KV: 2,448,663 tokens
    logged, 2,425,576 planned before it ran (-0.94%: the two-block vision tower vLLM did not load counted), 2,453,131
    with the planner's ``language_model_only`` (+0.18%, tests/planner/test_vision_towers.py)."""
    r = rows[HYBRID_BENCH_STARTS[3]]
    assert r.real.preemptions == r.sim_preemptions == 0
    assert 0.23 < r.throughput_error < 0.34, r.throughput_error
    assert -0.22 < r.tpot_error < -0.11, r.tpot_error
    assert -0.41 < r.ttft_error < -0.29, r.ttft_error
    log = gzip.decompress((H100_CLASSES_FIXTURES / HYBRID_BENCH_STARTS[3] / "server.log.gz").read_bytes()).decode()
    assert "GPU KV cache size: 2,448,663 tokens" in log and "--language-model-only" in " ".join(
        json.loads((H100_CLASSES_FIXTURES / HYBRID_BENCH_STARTS[3] / "summary.json").read_text())["argv"])


# -- the stand-in server ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_stand_in_server_serves_a_mamba_hybrid(tmp_path: Path) -> None:
    """``python -m servetune.sim.server granite-4.0-h-tiny`` starts, is healthy and completes a request."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(PLATFORM), "SERVETUNE_SIM_STARTUP_S": "0.2"}
    argv = [sys.executable, "-m", "servetune.sim.server", "granite-4.0-h-tiny", "--host", "127.0.0.1",
            "--port", str(port), "--sim-speedup", "50", "--sim-gpu", H100_GPU]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline, status = time.monotonic() + 30, None
        while time.monotonic() < deadline and status != 200:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    status = resp.status
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        assert status == 200, log.read_text()[-3000:]
        body = b'{"model": "granite-4.0-h-tiny", "prompt": "hello", "max_tokens": 8, "ignore_eos": true}'
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as resp:
            assert resp.status == 200 and b'"completion_tokens":8' in resp.read().replace(b" ", b"")
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
