"""``infra/k8s/`` checked without a Kubernetes: schemas, then servetune's own invariants.

* Core kinds against the Kubernetes JSON schemas that ``kubernetes-validate`` ships (strict:
  unknown fields fail, as ``kubectl apply``'s default field validation does).
* RayCluster and RayJob against the openAPIV3Schema of KubeRay v1.7.0's CRDs, vendored in
  ``tests/fixtures/kuberay_crds/`` (made strict the same way).
* What no schema knows: each GPU worker group advertises exactly servetune's accelerator resource
  for its type and every GPU type of the nightly matrix has one; the CronJob forbids overlap; the
  RayJobs' entrypoints name files that exist in the repo (and the image) or in the head's mounted
  ConfigMap; images are pinned; no secret is written in a manifest; NVLink multicast is off.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from _manifests import (K8S, REPO, Manifest, containers, crd_schema, everything, kustomization, load_docs, one,
                        pod_specs, rendered, strict, templates)

from servetune.cluster.pool import accelerator_resource
from servetune.nightly import expand_matrix, load_matrix
from servetune.spec.schema import load_spec

#: The Kubernetes minor the manifests target (CronJob.spec.timeZone is GA from 1.27).
K8S_VERSION = "1.31"
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
_SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|ACCESS_KEY|API_KEY", re.I)
_URL_WITH_PASSWORD = re.compile(r"[a-z0-9+]+://[^/\s:@]+:[^/\s@]+@", re.I)


def _core() -> list[Manifest]:
    return [m for m in everything() if not m.doc["apiVersion"].startswith("ray.io/")]


def _kuberay() -> list[Manifest]:
    return [m for m in everything() if m.doc["apiVersion"].startswith("ray.io/")]


def _ids(ms: list[Manifest]) -> list[str]:
    return [m.id for m in ms]


# ---------------------------------------------------------------------------------------- parsing


def test_every_infra_yaml_parses_and_is_used() -> None:
    """Each YAML file under infra/k8s parses, and is either applied by the kustomization, a
    ConfigMap's content, or a RayJob template: no stray manifest that nothing deploys."""
    kust = kustomization()
    used = set(kust["resources"]) | {"kustomization.yaml"}
    used |= {entry.rpartition("=")[2] for gen in kust["configMapGenerator"] for entry in gen["files"]}
    used |= {f"rayjobs/{p.name}" for p in (K8S / "rayjobs").glob("*.yaml")}
    for path in sorted(K8S.rglob("*.yaml")):
        docs = load_docs(path)
        assert docs, f"{path} holds no YAML document"
        assert str(path.relative_to(K8S)) in used, f"{path.relative_to(REPO)} is not used by infra/k8s/kustomization.yaml"
    for m in everything():
        assert {"apiVersion", "kind", "metadata"} <= set(m.doc), m.id
        assert m.name, f"{m.id}: no metadata.name or generateName"
    assert len(everything()) >= 15


# ---------------------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("manifest", _core(), ids=_ids(_core()))
def test_core_kinds_match_the_kubernetes_schema(manifest: Manifest) -> None:
    try:
        kubernetes_validate.validate(manifest.doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{manifest.id}: {exc.message} at {'.'.join(map(str, exc.path))}")


@pytest.mark.parametrize("manifest", _kuberay(), ids=_ids(_kuberay()))
def test_kuberay_kinds_match_the_crd_schema(manifest: Manifest) -> None:
    assert manifest.doc["apiVersion"] == "ray.io/v1", manifest.id
    validator = jsonschema.Draft7Validator(strict(crd_schema(manifest.kind)))
    errors = sorted(validator.iter_errors(manifest.doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{manifest.id}: {e.message} at {'.'.join(map(str, e.path))}" for e in errors)


def test_the_crd_check_rejects_what_kubectl_would() -> None:
    """The CRD check is not vacuous: a misspelled field, wrong types (in the pod template too) and a
    bad enum value all fail."""
    validator = jsonschema.Draft7Validator(strict(crd_schema("RayCluster")))
    good = one("RayCluster")
    assert validator.is_valid(good)
    typo = copy.deepcopy(good)
    typo["spec"]["workerGroupSpec"] = typo["spec"].pop("workerGroupSpecs")
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "one"
    in_pod = copy.deepcopy(good)
    in_pod["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "gcs"
    for bad in (typo, wrong_type, in_pod):
        assert not validator.is_valid(bad)
    job_validator = jsonschema.Draft7Validator(strict(crd_schema("RayJob")))
    bad_job = copy.deepcopy(one("RayJob", "servetune-nightly-"))
    bad_job["spec"]["deletionStrategy"] = {"deletionRules": [{"policy": "DeleteEverything",
                                                              "condition": {"jobStatus": "SUCCEEDED"}}]}
    assert not job_validator.is_valid(bad_job)


def test_the_kubernetes_check_rejects_an_unknown_field() -> None:
    cron = copy.deepcopy(one("CronJob"))
    cron["spec"]["concurencyPolicy"] = cron["spec"].pop("concurrencyPolicy")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(cron, K8S_VERSION, strict=True)


# ------------------------------------------------------------------------------- GPU worker groups


def _ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """The --resources JSON that `ray start` gets: KubeRay pastes the value into a shell command."""
    (word,) = shlex.split(group["rayStartParams"]["resources"])
    return json.loads(word)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_each_worker_group_advertises_servetunes_accelerator_resource() -> None:
    groups = one("RayCluster", "servetune")["spec"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        gpu_type = group["template"]["metadata"]["labels"]["servetune.io/gpu-type"]
        assert _ray_resources(group) == {accelerator_resource(gpu_type): 1}, group["groupName"]
        pod = group["template"]["spec"]
        assert pod["nodeSelector"].get("nvidia.com/gpu.product"), f"{group['groupName']}: not bound to its GPU's nodes"
        (container,) = pod["containers"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert int(limits["nvidia.com/gpu"]) >= 1 and requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        assert "num-gpus" not in group["rayStartParams"], "KubeRay derives num-gpus from nvidia.com/gpu"
    products = [g["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for g in groups]
    assert len(set(products)) == len(products), "two worker groups share one GPU product"


@pytest.mark.parametrize("matrix", ["jobs/nightly.yaml", "infra/k8s/config/nightly.yaml"])
def test_every_nightly_gpu_type_has_a_worker_group(matrix: str) -> None:
    advertised = {k for g in one("RayCluster", "servetune")["spec"]["workerGroupSpecs"] for k in _ray_resources(g)}
    for cell in expand_matrix(load_matrix(REPO / matrix)):
        assert accelerator_resource(cell.gpu_type) in advertised, f"{matrix}: {cell.name} has no worker group"


def test_head_has_no_gpus_and_gpu_workers_keep_nvlink_multicast_off() -> None:
    cluster = one("RayCluster", "servetune")
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for group in cluster["spec"]["workerGroupSpecs"]:
        for container in group["template"]["spec"]["containers"]:
            env = _env(container)
            assert {k: env.get(k) for k in NVLINK_MULTICAST_OFF} == NVLINK_MULTICAST_OFF, group["groupName"]


def test_ray_version_matches_the_tested_one() -> None:
    # pyproject.toml gives users a range; constraints.txt holds the exact Ray CI tests (and the image installs).
    pins = dict(re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", (REPO / "constraints.txt").read_text(), re.M))
    assert one("RayCluster", "servetune")["spec"]["rayVersion"] == pins["ray"]


# --------------------------------------------------------------------------- the nightly schedule


def test_nightly_cronjob_forbids_overlap_and_keeps_bounded_history() -> None:
    spec = one("CronJob", "servetune-nightly")["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert 0 < spec["startingDeadlineSeconds"] <= 6 * 3600
    assert spec["successfulJobsHistoryLimit"] >= 1 and spec["failedJobsHistoryLimit"] >= 1
    assert spec["timeZone"]
    minute, hour, *days = spec["schedule"].split()
    assert days == ["*", "*", "*"] and minute.isdigit() and hour.isdigit(), "once a night"


def test_cronjob_creates_the_nightly_rayjob_from_its_configmap() -> None:
    pod = one("CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = container["command"] + container.get("args", [])
    assert argv[:2] == ["kubectl", "create"], "create, not apply: each night is a new RayJob (generateName)"
    path = Path(argv[argv.index("-f") + 1])
    mount = next(v for v in container["volumeMounts"] if path.is_relative_to(v["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = one("ConfigMap", volume["configMap"]["name"])
    (created,) = yaml.safe_load_all(configmap["data"][str(path.relative_to(mount["mountPath"]))])
    assert created == one("RayJob", "servetune-nightly-"), "the CronJob must create rayjobs/nightly.yaml"
    assert created["metadata"]["generateName"] and "name" not in created["metadata"]


def test_cronjob_may_create_rayjobs_and_nothing_else() -> None:
    cron = one("CronJob")
    account = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one("RoleBinding")
    assert {"kind": "ServiceAccount", "name": account, "namespace": "servetune"} in binding["subjects"]
    assert binding["roleRef"]["kind"] == "Role", "a ClusterRole would reach beyond the namespace"
    role = one("Role", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]}]
    assert not [m for m in rendered() if m.kind in ("ClusterRole", "ClusterRoleBinding")]


def test_rayjobs_run_on_the_servetune_cluster() -> None:
    cluster = one("RayCluster")["metadata"]["name"]
    for m in templates():
        assert m.kind == "RayJob", m.id
        assert m.doc["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}, m.id
        assert m.doc["spec"].get("activeDeadlineSeconds", 0) > 0, m.id


# ------------------------------------------------------------------------ entrypoints and config


def _head() -> dict[str, Any]:
    (container,) = one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def _head_file(path: str) -> str:
    """The text of a file the head container sees at ``path`` through a mounted ConfigMap."""
    pod = one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    for mount in _head().get("volumeMounts", []):
        if Path(path).is_relative_to(mount["mountPath"]):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert "configMap" in volume, f"{path} is on {mount['name']}, not a ConfigMap in the repo"
            data = one("ConfigMap", volume["configMap"]["name"])["data"]
            key = str(Path(path).relative_to(mount["mountPath"]))
            assert key in data, f"{path}: no key {key!r} in ConfigMap {volume['configMap']['name']}"
            return str(data[key])
    raise AssertionError(f"{path} is not mounted on the Ray head")


def _image_paths() -> list[str]:
    """What the GPU worker image copies into /opt/servetune (its COPY lines)."""
    text = (REPO / "infra" / "docker" / "Dockerfile.gpu-worker").read_text()
    assert "WORKDIR /opt/servetune" in text
    return [src.rstrip("/") for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]


@pytest.mark.parametrize("template", ["rayjobs/nightly.yaml", "rayjobs/tune.yaml"])
def test_rayjob_entrypoint_names_files_that_exist(template: str, tmp_path: Path) -> None:
    (job,) = [m.doc for m in templates() if m.source == template]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python"
    script, config = argv[1], argv[2]
    assert script.startswith("/opt/servetune/"), "the script runs from the image's copy of the repo"
    rel = script.removeprefix("/opt/servetune/")
    assert (REPO / rel).is_file(), f"{template}: {rel} is not in the repository"
    assert rel.split("/")[0] in _image_paths(), f"{template}: the image does not copy {rel}"
    text = _head_file(config)
    (tmp_path / "spec.yaml").write_text(text)
    if rel == "jobs/nightly.py":
        cells = expand_matrix(load_matrix(tmp_path / "spec.yaml"))
        assert cells and all(c.spec_data["backend"] == "vllm" for c in cells), \
            "the driver runs on the GPU-less head: `auto` would simulate"
    else:
        spec = load_spec(tmp_path / "spec.yaml")
        assert spec.backend == "vllm", "the driver runs on the GPU-less head: `auto` would simulate"
        assert spec.storage.optuna_url and spec.storage.optuna_url.startswith("postgresql+psycopg://")
        assert spec.tracking.mlflow_uri == "http://mlflow:5000"


def test_cluster_matrix_is_jobs_nightly_yaml_but_for_cluster_settings() -> None:
    """The cluster runs the same cells as jobs/nightly.yaml; only where results go and the backend differ."""
    def cells(path: Path) -> dict[str, Any]:
        (matrix,) = load_docs(path)
        for key in ("tracking", "output"):
            matrix.pop(key)
        matrix["template"].pop("backend")
        return matrix

    assert cells(K8S / "config" / "nightly.yaml") == cells(REPO / "jobs" / "nightly.yaml")
    (matrix,) = load_docs(K8S / "config" / "nightly.yaml")
    assert matrix["tracking"]["mlflow_uri"] == "http://mlflow:5000"
    out = matrix["output"]["dir"]
    assert any(Path(out).is_relative_to(v["mountPath"]) for v in _head()["volumeMounts"]
               if v["name"] == "servetune-data"), "the nightly history must land on the head's volume"


# ------------------------------------------------------------------------------ images and secrets


def test_every_image_is_pinned() -> None:
    for m in everything():
        for where, container in containers(m.doc):
            image = container["image"]
            name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
            assert name and tag and tag != "latest", f"{m.id} {where}: image {image!r} is not pinned"
    for entry in kustomization().get("images", []):
        assert entry.get("newTag", "") not in ("", "latest") or entry.get("digest"), entry


def test_no_secret_is_written_in_a_manifest() -> None:
    assert not [m.id for m in rendered() if m.kind == "Secret"], "Secrets are created by hand (infra/README.md)"
    readme = (REPO / "infra" / "README.md").read_text()
    for m in everything():
        for where, container in containers(m.doc):
            for env in container.get("env", []):
                if _SECRET_NAME.search(env["name"]):
                    ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                    assert ref and "value" not in env, f"{m.id} {where}: {env['name']} is not from a Secret"
                    assert f"create secret generic {ref['name']}" in readme, \
                        f"infra/README.md does not say how to create the Secret {ref['name']}"
        text = yaml.safe_dump(m.doc)
        assert not _URL_WITH_PASSWORD.search(text), f"{m.id}: a URL with a password"
        assert not re.search(r"\bhf_[A-Za-z0-9]{10,}", text), f"{m.id}: a Hugging Face token"


def test_servers_listen_on_all_interfaces_only_behind_a_service() -> None:
    services = [m.doc for m in rendered() if m.kind == "Service"]
    for m in rendered():
        for where, container in containers(m.doc):
            if any("0.0.0.0" in a for a in container.get("command", []) + container.get("args", [])):
                labels = m.doc["spec"]["template"]["metadata"]["labels"]
                assert any(s["spec"]["selector"].items() <= labels.items() for s in services), \
                    f"{m.id} {where} listens on 0.0.0.0 with no Service in front"


def test_pods_run_as_non_root() -> None:
    for m in everything():
        for where, pod in pod_specs(m.doc):
            assert pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{m.id} {where}"
        for where, container in containers(m.doc):
            assert container.get("securityContext", {}).get("allowPrivilegeEscalation") is False, f"{m.id} {where}"
