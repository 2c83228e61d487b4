"""The GPU table: built-in figures, case-insensitive lookup, YAML registration with field errors."""

from __future__ import annotations

import pytest

from servetune.errors import SpecError
from servetune.planner.gpus import GpuSpec, get_gpu, known_gpus, register_gpus_from_yaml


@pytest.mark.parametrize(("name", "memory_gib"), [
    ("H100-80GB", 79.19), ("H200", 139.8), ("A100-80GB", 79.25), ("A100-40GB", 39.39),
    ("L40S", 44.39), ("L4", 22.05), ("B200", 178.4),
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


def test_names_are_case_insensitive_with_aliases():
    assert get_gpu("h200") is get_gpu("H200")
    assert get_gpu("  l40s ").name == "L40S"
    assert get_gpu("h100-sxm").name == "H100-80GB" and get_gpu("a100-40g").name == "A100-40GB"


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(SpecError) as err:
        get_gpu("H201")
    text = str(err.value)
    assert err.value.field == "gpu" and "did you mean 'H200'" in text
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
        "    calibration: {decode_overhead_ms: 0.3}\n")
    assert register_gpus_from_yaml(path) == ["RTX-6000-Ada-test"]
    g = get_gpu("rtx-6000-ada-test")
    assert isinstance(g, GpuSpec) and g.memory_gib == 47.5 and g.calibration["decode_overhead_ms"] == 0.3
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
    with pytest.raises(SpecError, match="cannot read"):
        register_gpus_from_yaml(tmp_path / "nope.yaml")
