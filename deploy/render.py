#!/usr/bin/env python3
"""Render the kustomizations under deploy/ without kubectl (stdlib + PyYAML).

Supports exactly the kustomize features deploy/ uses, and fails loudly on anything else
so that a new feature in a kustomization.yaml cannot be silently ignored:

* `resources`: manifest files and directories holding a kustomization.yaml (bases);
* `patches`: strategic-merge patches given by `path` or inline `patch`, targeted by the
  patch's own apiVersion/kind/metadata.name (no `target`, no JSON 6902);
* `images`: `name` with `newName`, `newTag` and/or `digest`, applied to containers and
  initContainers.

Strategic merge follows the Kubernetes patch strategy for the fields used here: maps
merge recursively, `null` deletes a key, lists of containers / initContainers / env /
volumes / imagePullSecrets merge by `name`, volumeMounts by `mountPath`, container ports
by `containerPort` (service ports by `port`); every other list is replaced as a whole.
Merged lists are ordered as kustomize orders them: the patch's items, then the others.

Output is ordered like `kubectl kustomize` (kustomize's legacy order). Usage:

    python deploy/render.py deploy/overlays/cpu [-o rendered.yaml]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
SUPPORTED_PATCH_KEYS = {"path", "patch"}
SUPPORTED_IMAGE_KEYS = {"name", "newName", "newTag", "digest"}

# kustomize's legacy resource order (api/resid/gvk.go); other kinds go in between.
ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition",
    "ServiceAccount", "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding",
    "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service", "LimitRange",
    "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment",
    "StatefulSet", "CronJob", "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]

# Strategic-merge keys of the associative lists deploy/ may patch.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}


class RenderError(Exception):
    """A kustomization uses something this renderer does not support, or is invalid."""


def _find_kustomization(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise RenderError(f"no kustomization file in {directory}")


def _load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            raise RenderError(f"{path}: every document must be a Kubernetes object")
    return docs


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def resource_id(obj: dict) -> tuple[str, str, str, str]:
    """(group, kind, namespace, name): how kustomize tells resources apart."""
    meta = obj.get("metadata") or {}
    return (_group(obj["apiVersion"]), obj["kind"], meta.get("namespace", ""), meta.get("name", ""))


def _merge_key(field: str, items: list) -> str | None:
    if field == "ports":
        if any(isinstance(i, dict) and "containerPort" in i for i in items):
            return "containerPort"
        return "port"
    return MERGE_KEYS.get(field)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Return `base` with the strategic-merge `patch` applied (inputs are not modified)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise RenderError(f"strategic-merge directive {key!r} is not supported")
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, base + patch)
        if key is None:
            return copy.deepcopy(patch)
        # Like kustomize: the patch's items first (merged with the base item of the same
        # key, if any), in patch order, then the base items the patch does not name.
        out = []
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"item of {field!r} patch lacks its merge key {key!r}")
            match = [b for b in base if isinstance(b, dict) and b.get(key) == item[key]]
            out.append(strategic_merge(match[0], item, field) if match else copy.deepcopy(item))
        named = {item[key] for item in patch}
        out.extend(copy.deepcopy(b) for b in base if not (isinstance(b, dict) and b.get(key) in named))
        return out
    return copy.deepcopy(patch)


def _split_image(image: str) -> tuple[str, str, str]:
    """'repo/name:tag@sha256:x' -> ('repo/name', ':tag', '@sha256:x')."""
    name, at, digest = image.partition("@")
    digest = at + digest
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, digest


def _set_images(node: Any, images: list[dict]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    if isinstance(container, dict) and "image" in container:
                        container["image"] = _new_image(container["image"], images)
            else:
                _set_images(value, images)
    elif isinstance(node, list):
        for value in node:
            _set_images(value, images)


def _new_image(image: str, images: list[dict]) -> str:
    name, tag, digest = _split_image(image)
    for rule in images:
        if rule["name"] != name:
            continue
        name = rule.get("newName", name)
        if "digest" in rule:
            tag, digest = "", "@" + rule["digest"]
        elif "newTag" in rule:
            tag, digest = ":" + str(rule["newTag"]), ""
        break
    return name + tag + digest


def render(directory: str | Path) -> list[dict]:
    """Resources of the kustomization in `directory`, with its patches and images applied."""
    directory = Path(directory)
    kfile = _find_kustomization(directory)
    with kfile.open() as f:
        k = yaml.safe_load(f) or {}
    unsupported = set(k) - SUPPORTED_KEYS
    if unsupported:
        raise RenderError(f"{kfile}: unsupported kustomize fields {sorted(unsupported)}")
    if k.get("kind", "Kustomization") != "Kustomization":
        raise RenderError(f"{kfile}: kind {k['kind']!r} is not supported")

    resources: list[dict] = []
    for entry in k.get("resources") or []:
        path = directory / entry
        if "://" in entry or entry.startswith("git@"):
            raise RenderError(f"{kfile}: remote resource {entry!r} is not supported")
        if path.is_dir():
            resources.extend(render(path))
        elif path.is_file():
            resources.extend(_load_docs(path))
        else:
            raise RenderError(f"{kfile}: resource {entry!r} not found")
    seen: set[tuple] = set()
    for obj in resources:
        rid = resource_id(obj)
        if rid in seen:
            raise RenderError(f"{kfile}: resource {rid} defined twice")
        seen.add(rid)

    for spec in k.get("patches") or []:
        extra = set(spec) - SUPPORTED_PATCH_KEYS
        if extra or len(spec) != 1:
            raise RenderError(f"{kfile}: patch {spec!r}: only one of `path` / `patch` is supported")
        if "path" in spec:
            docs = _load_docs(directory / spec["path"])
        else:
            docs = [d for d in yaml.safe_load_all(spec["patch"]) if d is not None]
        if len(docs) != 1 or not isinstance(docs[0], dict):
            raise RenderError(f"{kfile}: patch {spec!r} must be one strategic-merge object")
        patch = docs[0]
        rid = resource_id(patch)
        for i, obj in enumerate(resources):
            if resource_id(obj) == rid:
                resources[i] = strategic_merge(obj, patch)
                break
        else:
            raise RenderError(f"{kfile}: patch target {rid} not found")

    images = k.get("images") or []
    for rule in images:
        if "name" not in rule or set(rule) - SUPPORTED_IMAGE_KEYS:
            raise RenderError(f"{kfile}: image rule {rule!r} is not supported")
    if images:
        for obj in resources:
            _set_images(obj, images)

    return sorted(resources, key=_order)


def _order(obj: dict) -> tuple:
    kind = obj["kind"]
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    group, _, namespace, name = resource_id(obj)
    return (rank, group, kind, namespace, name)


def dump(resources: list[dict]) -> str:
    return yaml.safe_dump_all(resources, sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="directory holding a kustomization.yaml")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        text = dump(render(args.directory))
    except RenderError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
