"""Read ``infra/k8s/`` as ``kubectl apply -k`` would see it, without a Kubernetes.

:func:`rendered` is what the kustomization renders: its ``resources`` files, the ConfigMaps of its
``configMapGenerator`` and its namespace (the subset of kustomize that ``infra/k8s`` uses; a
kustomization field this module does not know fails the tests instead of being ignored).
:func:`templates` are the RayJob files created per run (``rayjobs/``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra" / "k8s"
CRDS = REPO / "tests" / "fixtures" / "kuberay_crds"
KNOWN_KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator",
                          "generatorOptions", "images"}


@dataclass(frozen=True)
class Manifest:
    """One Kubernetes object and the file it comes from."""

    source: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind"))

    @property
    def name(self) -> str:
        meta = self.doc.get("metadata") or {}
        return str(meta.get("name") or meta.get("generateName") or "")

    @property
    def id(self) -> str:
        return f"{self.source}:{self.kind}/{self.name}"


def load_docs(path: Path) -> list[dict[str, Any]]:
    """Every YAML document of ``path`` that is not empty."""
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


@functools.cache
def kustomization() -> dict[str, Any]:
    (doc,) = load_docs(K8S / "kustomization.yaml")
    return doc


@functools.cache
def rendered() -> tuple[Manifest, ...]:
    """The objects ``kubectl apply -k infra/k8s`` creates."""
    kust = kustomization()
    unknown = set(kust) - KNOWN_KUSTOMIZE_FIELDS
    assert not unknown, f"kustomization fields this check does not model: {unknown}"
    out: list[Manifest] = []
    for rel in kust["resources"]:
        out += [Manifest(rel, doc) for doc in load_docs(K8S / rel)]
    disable_hash = bool((kust.get("generatorOptions") or {}).get("disableNameSuffixHash"))
    assert disable_hash, "the manifests mount generated ConfigMaps by their plain names"
    for gen in kust.get("configMapGenerator") or []:
        data = {}
        for entry in gen["files"]:
            key, _, rel = entry.rpartition("=")
            data[key or Path(rel).name] = (K8S / rel).read_text(encoding="utf-8")
        out.append(Manifest(f"configMapGenerator:{gen['name']}",
                            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}))
    namespace = kust.get("namespace")
    for m in out:
        if m.kind != "Namespace" and namespace:
            m.doc.setdefault("metadata", {})["namespace"] = namespace
    return tuple(out)


@functools.cache
def templates() -> tuple[Manifest, ...]:
    return tuple(Manifest(f"rayjobs/{p.name}", doc) for p in sorted((K8S / "rayjobs").glob("*.yaml"))
                 for doc in load_docs(p))


def everything() -> tuple[Manifest, ...]:
    return rendered() + templates()


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [m.doc for m in everything() if m.kind == kind and (name is None or m.name == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template an object carries."""
    kind, spec = doc["kind"], doc.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "Job"):
        return [(kind, spec["template"]["spec"])]
    if kind == "CronJob":
        return [(kind, spec["jobTemplate"]["spec"]["template"]["spec"])]
    if kind == "RayCluster":
        out = [("head", spec["headGroupSpec"]["template"]["spec"])]
        return out + [(g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    if kind == "RayJob" and spec.get("rayClusterSpec"):
        return pod_specs({"kind": "RayCluster", "spec": spec["rayClusterSpec"]})
    return []


def containers(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{where}/{c['name']}", c) for where, pod in pod_specs(doc)
            for c in pod.get("initContainers", []) + pod.get("containers", [])]


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The ``v1`` openAPIV3Schema of the vendored KubeRay CRD of ``kind``."""
    path = CRDS / f"ray.io_{kind.lower()}s.yaml"
    with open(path, encoding="utf-8") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1-1.4 MB each
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """``schema`` with unknown fields rejected wherever the CRD lists an object's fields.

    The API server prunes unknown fields silently, but ``kubectl apply`` (field validation
    ``Strict``, its default) rejects them: so does this. Objects the CRD leaves open
    (``x-kubernetes-preserve-unknown-fields``, ``additionalProperties``) stay open.
    """
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out
