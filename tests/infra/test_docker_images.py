"""The image recipes in ``infra/docker/`` against the versions servetune pins and targets.

No image is built here (no Docker in CI): these checks catch the drift that a build would not,
a Dockerfile still on an old Ray or MLflow after pyproject.toml moved, or a vLLM base that is
not the version servetune's memory planner is calibrated for.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from _manifests import containers, everything, kustomization

from servetune.planner.memory import DEFAULT_VLLM_VERSION

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "infra" / "docker"


def _pins() -> dict[str, str]:
    """The exact versions CI installs (constraints.txt), names lowercased with ``_`` as ``-``."""
    text = (REPO / "constraints.txt").read_text()
    return {name.lower().replace("_", "-"): version
            for name, version in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", text, re.M)}


def _extras() -> dict[str, list[str]]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _args(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), re.M))


def _from(dockerfile: Path) -> list[str]:
    return re.findall(r"^FROM (\S+)", dockerfile.read_text(), re.M)


@pytest.mark.parametrize("name", ["Dockerfile.gpu-worker", "Dockerfile.mlflow"])
def test_dockerfile_pins_the_versions_ci_tests(name: str) -> None:
    pins, args = _pins(), _args(DOCKER / name)
    checked = 0
    for package, arg in (("ray", "RAY_VERSION"), ("optuna", "OPTUNA_VERSION"), ("mlflow", "MLFLOW_VERSION"),
                         ("mlflow-skinny", "MLFLOW_SKINNY_VERSION"), ("psycopg", "PSYCOPG_VERSION")):
        if arg in args:
            assert pins.get(package) == args[arg], f"{name}: {arg}={args[arg]}, constraints.txt {pins.get(package)}"
            checked += 1
    assert checked >= 2
    assert "PSYCOPG2_VERSION" not in args and "psycopg2" not in (DOCKER / name).read_text(), \
        f"{name}: PostgreSQL's driver is psycopg 3 (servetune[postgres])"
    text = (DOCKER / name).read_text()
    for arg in args:
        assert f"${{{arg}}}" in text, f"{name}: ARG {arg} is never used"


def test_constraints_pin_inside_pyproject_ranges_and_the_extras_exist() -> None:
    from packaging.requirements import Requirement

    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    pins, extras = _pins(), _extras()
    assert {"ui", "server", "postgres", "gpu", "test"} <= set(extras)
    core = [Requirement(r) for r in project["dependencies"]]
    assert {r.name for r in core} >= {"mlflow-skinny", "prometheus-client"}
    assert not {r.name for r in core} & {"mlflow", "psycopg", "psycopg2", "psycopg2-binary", "vllm"}, \
        "the core stays lean: full mlflow, PostgreSQL's driver and vLLM are extras"
    tested = [Requirement(r) for r in [*project["dependencies"], *extras["ui"], *extras["postgres"]]]
    for req in tested:
        assert req.name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[req.name]), f"constraints.txt {req.name}=={pins[req.name]} outside {req}"
    (vllm,) = [Requirement(r) for r in extras["gpu"] if r.startswith("vllm")]
    assert str(vllm.specifier) == f"=={DEFAULT_VLLM_VERSION}", "the [gpu] extra is the vLLM the planner models"


def test_gpu_worker_installs_servetune_with_the_gpu_extras_without_repinning_vllm() -> None:
    text = (DOCKER / "Dockerfile.gpu-worker").read_text()
    installs = re.findall(r'"\.\[([a-z,]+)\]"', text)
    assert installs == ["gpu,postgres"], installs
    assert set(installs[0].split(",")) <= set(_extras())
    assert "pip freeze" in text and "-c /tmp/vllm-image.txt" in text, "the image's own packages constrain the install"
    assert "pip check" in text


def test_gpu_worker_is_vllm_of_servetunes_target_version() -> None:
    (base,) = _from(DOCKER / "Dockerfile.gpu-worker")
    assert base == f"vllm/vllm-openai:v{DEFAULT_VLLM_VERSION}"
    text = (DOCKER / "Dockerfile.gpu-worker").read_text()
    assert '"ray[default]==${RAY_VERSION}"' in text, "ray job submit and KubeRay's RayJob need Ray's job server"


@pytest.mark.parametrize("name", ["Dockerfile.gpu-worker", "Dockerfile.mlflow"])
def test_images_are_pinned_non_root_and_hold_no_secret(name: str) -> None:
    text = (DOCKER / name).read_text()
    for base in _from(DOCKER / name):
        assert ":" in base and not base.endswith(":latest"), f"{name}: base {base} is not pinned"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), f"{name}: runs as root"
    for line in re.findall(r"^(?:ENV|ARG) .+$", text, re.M):
        assert not re.search(r"TOKEN|PASSWORD|SECRET|ACCESS_KEY", line, re.I), f"{name}: {line}"


def test_gpu_worker_copies_files_that_exist_and_its_dockerignore_lets_them_in() -> None:
    text = (DOCKER / "Dockerfile.gpu-worker").read_text()
    ignore = (DOCKER / "Dockerfile.gpu-worker.dockerignore").read_text().split()
    sources = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert f"!{src}" in ignore, f"Dockerfile.gpu-worker.dockerignore keeps {src} out of the build context"


def test_manifests_use_the_images_built_here() -> None:
    """servetune/gpu-worker and servetune/mlflow in the manifests are the images infra/docker builds,
    and the MLflow image's tag is the MLflow version it installs."""
    images = {c["image"] for m in everything() for _, c in containers(m.doc)}
    built = {"servetune/gpu-worker": "Dockerfile.gpu-worker", "servetune/mlflow": "Dockerfile.mlflow"}
    for image in images:
        name = image.rsplit(":", 1)[0]
        if name.startswith("servetune/"):
            assert name in built, f"{image}: no recipe in infra/docker"
            assert f"-t {name}:" in (DOCKER / built[name]).read_text(), f"{built[name]} does not say how to build {name}"
    assert {i.rsplit(":", 1)[0] for i in images} >= set(built)
    tags = {e["name"]: e["newTag"] for e in kustomization()["images"]}
    assert tags["servetune/mlflow"] == _args(DOCKER / "Dockerfile.mlflow")["MLFLOW_VERSION"]
