"""GPU names resolve strictly: an exact name or an alias that means one GPU; an ambiguous one is refused.

Before this rule, ``A100`` silently became the A100-80GB (an A100-40GB owner got 80 GB predictions
and exit 0) and ``H100`` the H100-80GB SXM part. Now both are refused with the candidates, through
the library, a study spec and the CLI (exit 2), and every shipped file names an exact type.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servetune.errors import SpecError
from servetune.planner.gpus import get_gpu, known_gpus
from servetune.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, candidates", [
    ("A100", "A100-40GB, A100-80GB"), ("a100", "A100-40GB, A100-80GB"), (" A100 ", "A100-40GB, A100-80GB"),
    ("H100", "H100-80GB, H100-PCIe, H100-NVL"), ("h100", "H100-80GB, H100-PCIe, H100-NVL"),
    ("V100", "V100-16GB, V100-32GB"), ("RTX 6000", "RTX-6000-Ada, A6000"), ("GH200", "GH200-96GB"),
])
def test_an_ambiguous_name_is_refused_with_its_candidates(name, candidates):
    with pytest.raises(SpecError) as err:
        get_gpu(name)
    text = str(err.value)
    assert err.value.field == "gpu" and "ambiguous GPU" in text and f"it names {candidates}" in text
    assert f"one of: {candidates}" in text


def test_h100_names_its_three_parts_and_says_which_is_the_sxm():
    with pytest.raises(SpecError) as err:
        get_gpu("H100")
    text = str(err.value)
    assert "H100-80GB is the SXM part" in text and "H100-PCIe" in text and "H100-NVL" in text


def test_gh200_says_the_part_the_table_does_not_hold():
    with pytest.raises(SpecError) as err:
        get_gpu("gh200")
    assert "144 GB" in str(err.value) and "--gpu-file" in str(err.value)


@pytest.mark.parametrize("name, exact", [
    ("A100-40GB", "A100-40GB"), ("a100-40gb", "A100-40GB"), ("a100-40g", "A100-40GB"), ("a100_80gb", "A100-80GB"),
    ("H100-80GB", "H100-80GB"), ("h100-sxm", "H100-80GB"), ("h200-141gb", "H200"), ("L4", "L4"),
    ("h200-sxm", "H200"), ("H200-NVL", "H200-NVL"), ("rtx 4090", "RTX-4090"), ("RTX3090", "RTX-3090"),
    ("tesla t4", "T4"), ("a10g", "A10G"), ("A10", "A10"), ("L40", "L40"), ("h100-pcie", "H100-PCIe"),
    ("MI300X", "MI300X"), ("rtx-a6000", "A6000"),
])
def test_exact_names_and_unambiguous_aliases_resolve(name, exact):
    assert get_gpu(name).name == exact


def test_every_builtin_name_resolves_to_itself():
    assert all(get_gpu(n).name == n for n in known_gpus())


def _spec_with_gpu(tmp_path: Path, gpu_type: str) -> Path:
    data = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())
    data["gpu"]["type"] = gpu_type
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_study_spec_with_an_ambiguous_gpu_names_the_field_and_the_candidates(tmp_path):
    with pytest.raises(SpecError) as err:
        load_spec(_spec_with_gpu(tmp_path, "A100"))
    assert err.value.field == "gpu.type" and "A100-40GB, A100-80GB" in str(err.value)
    assert load_spec(_spec_with_gpu(tmp_path, "A100-40GB")).gpu.type == "A100-40GB"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servetune", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_plan_with_an_ambiguous_gpu_exits_2_with_one_line(tmp_path):
    proc = _cli("plan", "--model", "llama-3.1-8b", "--gpu", "A100", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "A100-40GB, A100-80GB" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_registered_gpu_with_the_short_name_is_an_exact_name(tmp_path):
    """A user who adds their own 'A100' in a GPU file means that one: an exact name wins."""
    (tmp_path / "g.yaml").write_text("gpus:\n  - {name: A100, memory_gib: 39.39, hbm_gbps: 1555, bf16_tflops: 312, "
                                     "fp8_tflops: 312, interconnect_gbps: 300}\n")
    proc = _cli("plan", "--model", "llama-3.1-8b", "--gpu", "A100", "--gpu-file", "g.yaml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["memory_gib"]["total"] == 39.39  # the user's own entry, not the 80 GB card


def test_no_shipped_file_names_an_ambiguous_gpu():
    ambiguous = {"a100", "h100", "v100", "gh200", "rtx 6000", "rtx-6000"}
    found = []
    for path in [REPO / "jobs" / "quickstart.yaml", REPO / "jobs" / "nightly.yaml",
                 *sorted((REPO / "search_spaces").glob("*.yaml"))]:
        doc = yaml.safe_load(path.read_text())
        gpu = doc.get("gpu") if isinstance(doc, dict) else None
        types = [gpu.get("type")] if isinstance(gpu, dict) else []
        types += [g.get("type") if isinstance(g, dict) else g for g in (doc.get("gpus") or [])] \
            if isinstance(doc, dict) else []
        found += [(path.name, t) for t in types if isinstance(t, str) and t.strip().lower() in ambiguous]
        for t in types:
            if isinstance(t, str):
                get_gpu(t)  # every one resolves
    assert found == []
