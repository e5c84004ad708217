"""The CPU image, built by scripts/build_image.sh and run the way deploy/base runs it (opt-in: `make test-image`).

The pod comes from the rendered cpu overlay: its init container seeds the weights cache from the image,
then the server runs with a read-only root filesystem, the pod's user, no capabilities and the pod's
environment; emptyDir volumes are tmpfs, except the cache, which both containers share and so is a host
directory (a tmpfs lives only as long as one container). The server binds 127.0.0.1 on the host network.
Its /score must give a host server's numbers, its probes must stay out of the INFO log, and SIGTERM must
drain it. A container engine that cannot run here fails these tests with its error: they never skip.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.settings import Settings
from tests.conftest import free_port, json_log_entries, live_server

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ROOT / "scripts" / "podman.sh"
# GENSCORE_TEST_IMAGE names an image built already (e.g. by `make image`), which is then tested as it is.
PREBUILT_IMAGE = os.environ.get("GENSCORE_TEST_IMAGE")
IMAGE = PREBUILT_IMAGE or "localhost/genscore:test"
BUILD_TIMEOUT_S = 3600  # a first build on vfs storage and 2 cores; later ones reuse the cached layers
READY_TIMEOUT_S = 300  # the startup probe's budget in deploy/base
MEASUREMENTS = ROOT / "build" / "test-image.json"
# Each batch waits up to 1 s for more work, so a request is still in flight when SIGTERM comes; torch threads
# stand in for the pod's CPU limit (a resourceFieldRef), here the machine's 2 cores.
TEST_ENV = {"GENSCORE_MAX_WAIT_MS": "1000", "GENSCORE_MAX_BATCH_SIZE": "64", "GENSCORE_TORCH_THREADS": "2"}

REQUESTS = [
    {"query": "The capital of France is", "label_token_ids": [7042, 4528], "top_logprobs": 5},
    {"query": "Question: is this city the capital of France?", "items": [" Paris. Answer:", " London. Answer:"],
     "label_token_ids": [9230, 2838], "logprobs_mode": "processed_logprobs", "temperature": 0.7, "top_k": 50,
     "top_logprobs": 3},
    {"query": "The capital of France is", "candidates": [" Paris", " the city of Paris", " London"]},
]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    command = [str(PODMAN), *args]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(command)}` did not finish within {timeout} s")
    if check and proc.returncode != 0:
        pytest.fail(f"`{' '.join(command)}` exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def image() -> dict:
    """Builds the image (cached layers make a rebuild quicker) and returns what was measured."""
    if PREBUILT_IMAGE:
        size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
        return {"image": IMAGE, "build_s": None, "size_bytes": size}
    if shutil.which("podman") is None and os.geteuid() != 0:
        pytest.fail("no container engine: podman is not installed, and only root can install it "
                    "(scripts/build_image.sh runs apt-get install podman runc debootstrap)")
    log_path = ROOT / "build" / "test-image-build.log"
    log_path.parent.mkdir(exist_ok=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run([str(ROOT / "scripts" / "build_image.sh")], env={**os.environ, "IMAGE": IMAGE},
                                  stdout=log, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the image build did not finish within {BUILD_TIMEOUT_S} s (log: {log_path})")
    build_s = time.monotonic() - started
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        pytest.fail(f"scripts/build_image.sh exited {proc.returncode} (log: {log_path}):\n{tail}")
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    return {"image": IMAGE, "build_s": round(build_s, 1), "size_bytes": size}


def _rendered_pod() -> dict:
    spec = importlib.util.spec_from_file_location("genscore_deploy_render", ROOT / "deploy" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    resources = render.render(ROOT / "deploy" / "overlays" / "cpu")
    deployment = next(r for r in resources if r["kind"] == "Deployment")
    configmap = next(r for r in resources if r["kind"] == "ConfigMap")
    return {"pod": deployment["spec"]["template"]["spec"], "config": configmap["data"]}


def _run_flags(pod: dict, container: dict, shared_dirs: dict[str, Path]) -> list[str]:
    """podman run flags for one container of the pod: its security context and its volumes."""
    pod_sc, sc = pod["securityContext"], container["securityContext"]
    # Kubernetes ignores the image's HEALTHCHECK (podman would need systemd timers to run it).
    flags = ["--no-healthcheck", "--network", "host", "--user", f"{pod_sc['runAsUser']}:{pod_sc['runAsGroup']}"]
    if sc.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]  # podman's default adds tmpfs on /tmp, /run, /var/tmp
    flags += [f"--cap-drop={cap}" for cap in sc["capabilities"]["drop"]]
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    for mount in container["volumeMounts"]:
        if mount["name"] in shared_dirs:
            flags += ["-v", f"{shared_dirs[mount['name']]}:{mount['mountPath']}"]
        else:
            flags += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777"]
    return flags


def _server_env(config: dict, container: dict, port: int) -> dict[str, str]:
    """The server's environment as in the pod (ConfigMap, then the container's values), plus this test's."""
    env = dict(config)
    env.update({e["name"]: e["value"] for e in container.get("env", ()) if "value" in e})
    env.update(TEST_ENV, GENSCORE_HOST="127.0.0.1", GENSCORE_PORT=str(port))
    return env


class Pod:
    """The rendered pod on podman: the seed-cache init container, then the server; removed by close()."""

    def __init__(self, workdir: Path):
        rendered = _rendered_pod()
        self.spec, config = rendered["pod"], rendered["config"]
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.name = f"genscore-test-{uuid.uuid4().hex[:8]}"
        self.server = next(c for c in self.spec["containers"] if c["name"] == "genscore")
        init = self.spec["initContainers"]
        used_by_init = {m["name"] for c in init for m in c["volumeMounts"]}
        self.shared = {}
        for volume in self.spec["volumes"]:
            if "emptyDir" in volume and volume["name"] in used_by_init:
                path = workdir / volume["name"]
                path.mkdir()
                path.chmod(0o777)  # an emptyDir's mode
                self.shared[volume["name"]] = path
        self.env = _server_env(config, self.server, self.port)
        self.init = init

    def seed(self) -> None:
        for container in self.init:
            flags = _run_flags(self.spec, container, self.shared)
            podman("run", "--rm", *flags, "--entrypoint", container["command"][0], IMAGE, *container["command"][1:],
                   timeout=600)

    def start(self) -> dict[str, float]:
        """Starts the server container; returns the seconds `podman run` took and those until /ready said 200."""
        flags = _run_flags(self.spec, self.server, self.shared)
        env_flags = [f"--env={k}={v}" for k, v in sorted(self.env.items())]
        started = time.monotonic()
        podman("run", "-d", "--name", self.name, *flags, *env_flags, IMAGE, *self.server["args"], timeout=600)
        created_s = time.monotonic() - started  # on vfs storage, mostly copying the image into the container
        deadline = started + READY_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                    return {"run_s": round(created_s, 1), "ready_s": round(time.monotonic() - started, 1)}
            if not self.running():
                pytest.fail(f"the container exited before /ready:\n{self.logs_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"/ready not 200 within {READY_TIMEOUT_S} s:\n{self.logs_text()}")
            time.sleep(0.2)

    def running(self) -> bool:
        proc = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return proc.stdout.strip() == "true"

    def logs_text(self) -> str:
        proc = podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def log_entries(self) -> list[dict]:
        return json_log_entries(self.logs_text())

    def close(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture(scope="module")
def pod(image, tmp_path_factory):
    running = Pod(tmp_path_factory.mktemp("pod"))
    try:
        running.seed()
        image.update(running.start())
        image.update(server_log=[e["message"] for e in running.log_entries()
                                 if e["message"].startswith(("loaded ", "ready "))])
        yield running
    finally:
        running.close()
        MEASUREMENTS.parent.mkdir(exist_ok=True)
        MEASUREMENTS.write_text(json.dumps(image, indent=2) + "\n")
        print(f"\nimage measurements ({MEASUREMENTS}): {image}")


@pytest.fixture(scope="module")
def host_server(real_loaded, default_model_cache):
    settings = Settings(device="cpu", dtype="float32", cache_dir=default_model_cache, **{
        k.removeprefix("GENSCORE_").lower(): v for k, v in TEST_ENV.items()})
    with live_server(create_app(settings, loaded=real_loaded), timeout_s=120) as base_url:
        yield base_url


def post_score(base_url: str, body: dict, request_id: str) -> httpx.Response:
    return httpx.post(f"{base_url}/score", json=body, headers={"X-Request-ID": request_id}, timeout=120)


def assert_same_scores(got: dict, want: dict) -> None:
    assert got["model"] == want["model"] == "smollm2-135m"
    assert len(got["data"]) == len(want["data"])
    for g, w in zip(got["data"], want["data"]):
        for key in ("label_logprobs", "candidate_logprobs"):
            if key in w:
                assert g[key] == pytest.approx(w[key], abs=1e-4), key
        if w.get("top_logprobs"):
            assert [t["token_id"] for t in g["top_logprobs"]] == [t["token_id"] for t in w["top_logprobs"]]
            assert [t["logprob"] for t in g["top_logprobs"]] == pytest.approx(
                [t["logprob"] for t in w["top_logprobs"]], abs=1e-4)


def test_server_starts_from_the_baked_weights(pod):
    messages = [e["message"] for e in pod.log_entries()]
    assert any(m.startswith("loading converted GGUF weights from cache /var/cache/genscore") for m in messages), messages
    assert not any(m.startswith("cached converted GGUF weights") for m in messages), "the container dequantized again"
    assert any(m.startswith("ready (warm-up") for m in messages)


def test_scores_match_a_host_server(pod, host_server):
    for i, body in enumerate(REQUESTS):
        got, want = post_score(pod.base_url, body, f"image-{i}"), post_score(host_server, body, f"host-{i}")
        assert got.status_code == 200, got.text
        assert want.status_code == 200, want.text
        assert got.headers["x-request-id"] == f"image-{i}"
        assert_same_scores(got.json(), want.json())


def test_probes_add_no_info_lines_but_requests_do(pod):
    before = len(pod.log_entries())
    for i in range(60):
        path = ("/ready", "/health", "/metrics")[i % 3]
        assert httpx.get(f"{pod.base_url}{path}", timeout=10).status_code == 200
    assert post_score(pod.base_url, REQUESTS[0], "after-probes").status_code == 200
    new = pod.log_entries()[before:]
    access = [e for e in new if e["logger"] == "genscore.access"]
    assert [(e["request_id"], e["http"]["route"]) for e in access] == [("after-probes", "/score")], new


def _in_progress(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "genscore_http_requests_in_progress")
    return family.samples[0].value


def test_sigterm_drains_the_request_in_flight(pod, host_server):
    """Last in this module: it stops the container."""
    body = REQUESTS[1]
    want = post_score(host_server, body, "drain-reference").json()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(post_score, pod.base_url, body, "in-flight")
        deadline = time.monotonic() + 30
        while _in_progress(pod.base_url) < 2:  # the request, and this scrape
            assert time.monotonic() < deadline, "the request never reached the server"
            time.sleep(0.02)
        podman("kill", "--signal", "TERM", pod.name)
        ready_after = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ready_after.append(httpx.get(f"{pod.base_url}/ready", timeout=5).status_code)
            except httpx.TransportError:
                break  # the listening socket is closed
            time.sleep(0.02)
        answer = future.result(timeout=120)
    exit_code = podman("wait", pod.name, timeout=90).stdout.strip()

    assert all(status == 503 for status in ready_after), ready_after
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == "in-flight"
    assert_same_scores(answer.json(), want)
    assert exit_code == "0", f"exit code {exit_code}:\n{pod.logs_text()}"
    entries = pod.log_entries()
    messages = [e["message"] for e in entries]
    signal_at = next(i for i, m in enumerate(messages) if m.startswith("received SIGTERM"))
    answered_at = next(i for i, e in enumerate(entries) if e.get("request_id") == "in-flight"
                       and e["logger"] == "genscore.access")
    assert answered_at > signal_at and entries[answered_at]["http"]["status"] == 200
