"""The GPU table: built-in figures, case-insensitive lookup, YAML registration with field errors."""

from __future__ import annotations

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import GpuSpec, get_gpu, known_gpus, register_gpus_from_yaml


@pytest.mark.parametrize(("name", "memory_gib"), [
    ("H100-80GB", 79.19), ("H200", 139.8), ("A100-80GB", 79.25), ("A100-40GB", 39.39),
    ("L40S", 44.39), ("L4", 22.05), ("B200", 178.4), ("T4", 14.58), ("V100-16GB", 15.77), ("V100-32GB", 31.74),
    ("A6000", 47.54), ("RTX-3060", 11.76), ("RTX-3090", 23.69), ("RTX-4090", 23.65), ("A10G", 22.19),
])
def test_builtin_memory_is_what_torch_reports(name, memory_gib):
    g = get_gpu(name)
    assert g.name == name and g.memory_gib == memory_gib
    assert g.hbm_gbps > 0 and g.bf16_tflops > 0 and g.fp8_tflops >= g.bf16_tflops and g.interconnect_gbps > 0


def test_relative_figures_are_sane():
    h100, h200, l40s, b200 = (get_gpu(n) for n in ("H100-80GB", "H200", "L40S", "B200"))
    assert h200.hbm_gbps > h100.hbm_gbps and h200.bf16_tflops == h100.bf16_tflops  # same Hopper die
    assert l40s.interconnect_gbps < h100.interconnect_gbps / 10  # PCIe vs NVLink
    assert b200.fp8_tflops == 2 * b200.bf16_tflops and b200.compute_capability == 10.0


REQUIRED = ("A10G", "A10", "L4", "L40", "L40S", "T4", "V100-16GB", "V100-32GB", "A6000", "RTX-6000-Ada", "RTX-3060",
            "RTX-3090",
            "RTX-4090", "RTX-5090", "H100-PCIe", "H100-80GB", "H100-NVL", "H800", "H20", "GH200-96GB", "H200",
            "H200-NVL", "B200", "MI300X")


@pytest.mark.parametrize("name", REQUIRED)
def test_every_gpu_people_rent_or_own_is_in_the_table_with_its_source(name):
    g = get_gpu(name)
    assert g.source and g.compute_capability > 0 and g.memory_gib > 10
    assert g.fp8_tflops >= g.bf16_tflops and g.platform in ("cuda", "rocm")


def test_what_the_gpu_changes_in_vllm_follows_its_compute_capability():
    t4, v100, a10g, l4, h100, b200, mi = (get_gpu(n) for n in ("T4", "V100-16GB", "A10G", "L4", "H100-80GB", "B200",
                                                             "MI300X"))
    assert not t4.has_bf16 and not v100.has_bf16 and a10g.has_bf16
    assert t4.attention_backend == "TRITON_ATTN" and h100.attention_backend == "FLASH_ATTN"
    assert b200.attention_backend == "FLASHINFER" and mi.attention_backend == "ROCM_ATTN"
    assert not a10g.fp8_compute and l4.fp8_compute and h100.fp8_compute
    assert any("fp16" in n for n in t4.vllm_notes()) and not any("fp16" in n for n in h100.vllm_notes())


@pytest.mark.parametrize(("name", "sms"), [
    ("H100-80GB", 132), ("H100-PCIe", 114), ("H200", 132), ("H20", 78), ("A100-80GB", 108), ("A100-40GB", 108),
    ("L40S", 142), ("L4", 58), ("A10G", 80), ("T4", 40), ("V100-16GB", 80), ("RTX-3060", 28), ("RTX-4090", 128),
    ("RTX-5090", 170), ("B200", 148), ("MI300X", 304),
])
def test_each_gpu_has_its_datasheet_sm_count(name, sms):
    """GpuSpec.sm_count, the grid the simulator's GEMM wave model fills (sim._perf_gemm.wave_fill); MI300X:
    compute units."""
    assert get_gpu(name).sm_count == sms


def test_every_builtin_gpu_has_an_sm_count():
    assert all(get_gpu(n).sm_count > 0 for n in (*REQUIRED, "A100-80GB", "A100-40GB", "A800-80GB"))


def test_the_rtx_3060_is_a_ga10x_at_a_third_of_the_3090s_sms_with_360_gbps():
    """28 SMs at 1.78 GHz against the 3090's 82 at 1.70 (the GA10x SM rate), 192-bit GDDR6 at 15 Gbps;
    under WSL 2 torch sees the whole 12 GB. (Only the 12 GB board's names: an 8 GB RTX 3060 exists.)"""
    from servetune.planner.gpus import under_wddm

    r3060, r3090 = get_gpu("RTX 3060 12GB"), get_gpu("RTX-3090")
    assert r3060.hbm_gbps == 360.0 and r3060.compute_capability == r3090.compute_capability == 8.6
    assert (r3060.sm_count, r3090.sm_count) == (28, 82)
    assert r3060.bf16_tflops == pytest.approx(r3090.bf16_tflops * (r3060.sm_count * 1.777) / (r3090.sm_count * 1.695),
                                              rel=0.01)
    assert under_wddm(r3060).memory_gib == 12.0 and r3060.memory_gib < 12.0


def test_multicast_only_on_nvswitch_boards():
    on = {n for n in REQUIRED if get_gpu(n).nvlink_multicast}
    assert on == {"H100-80GB", "H800", "H20", "H200", "B200"}


def test_names_are_case_insensitive_with_aliases():
    assert get_gpu("h200") is get_gpu("H200")
    assert get_gpu("  l40s ").name == "L40S"
    assert get_gpu("h100-sxm").name == "H100-80GB" and get_gpu("a100-40g").name == "A100-40GB"


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(SpecError) as err:
        get_gpu("B201")
    text = str(err.value)
    assert err.value.field == "gpu" and "did you mean 'B200'" in text
    for name in ("H100-80GB", "A100-40GB", "L4", "B200"):
        assert name in text


def test_spec_is_hashable():
    assert len({get_gpu("H200"), get_gpu("h200")}) == 1
    assert dict(get_gpu("H200").calibration) == {}


def test_register_from_yaml(tmp_path):
    path = tmp_path / "gpus.yaml"
    path.write_text(
        "gpus:\n"
        "  - name: RTX-6000-Ada-test\n"
        "    memory_gib: 47.5\n"
        "    hbm_gbps: 960\n"
        "    bf16_tflops: 182\n"
        "    fp8_tflops: 364\n"
        "    interconnect_gbps: 32\n"
        "    compute_capability: 8.9\n"
        "    sm_count: 142\n"
        "    calibration: {decode_overhead_ms: 0.3}\n"
        "  - {name: no-sms-test, memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1}\n")
    assert register_gpus_from_yaml(path) == ["RTX-6000-Ada-test", "no-sms-test"]
    g = get_gpu("rtx-6000-ada-test")
    assert isinstance(g, GpuSpec) and g.memory_gib == 47.5 and g.calibration["decode_overhead_ms"] == 0.3
    assert g.sm_count == 142 and get_gpu("no-sms-test").sm_count == 0  # 0: not known (the simulator takes 132)
    assert "RTX-6000-Ada-test" in known_gpus()


@pytest.mark.parametrize(("entry", "field"), [
    ("{name: bad1, memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1}", "gpus[0].interconnect_gbps"),
    ("{name: bad2, memory_gib: -1, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1}",
     "gpus[0].memory_gib"),
    ("{name: bad3, memory_gib: 10, hbm_gbps: fast, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1}",
     "gpus[0].hbm_gbps"),
    ("{memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1}", "gpus[0].name"),
    ("{name: bad4, memory_gb: 10, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1}",
     "gpus[0].memory_gb"),
    *((f"{{name: bad5, memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1, sm_count: {v}}}",
       "gpus[0].sm_count") for v in ("1.5", "-1", "true", "many")),
])
def test_yaml_errors_name_the_field(tmp_path, entry, field):
    path = tmp_path / "g.yaml"
    path.write_text(f"gpus:\n  - {entry}\n")
    with pytest.raises(SpecError) as err:
        register_gpus_from_yaml(path)
    assert err.value.field.endswith(field) and str(path) in err.value.field


def test_yaml_nothing_registered_when_one_entry_is_bad(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("- {name: good-x, memory_gib: 10, hbm_gbps: 1, bf16_tflops: 1, fp8_tflops: 1, interconnect_gbps: 1}\n"
                    "- {name: bad-x}\n")
    with pytest.raises(SpecError, match=r"gpus\[1\]"):
        register_gpus_from_yaml(path)
    assert "good-x" not in known_gpus()


def test_missing_yaml_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        register_gpus_from_yaml(tmp_path / "nope.yaml")
