"""The docs: a strict MkDocs build, generated pages kept current, a short README, and the docs' example requests run on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.conftest import live_server

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_LIMIT_BYTES = 15 * 1024
EXAMPLE_MARK = "<!-- docs-example -->"


def mkdocs_build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir",
         str(site_dir)],
        cwd=config.parent, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor, not a docs fault
    )


def warnings_of(build: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (build.stdout + build.stderr).splitlines() if line.startswith(("WARNING", "ERROR"))]


def test_site_builds_in_strict_mode(tmp_path):
    build = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert build.returncode == 0 and not warnings_of(build), build.stdout + build.stderr
    assert (tmp_path / "site" / "users" / "score" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link_and_a_page_left_out(tmp_path):
    """The site's own config, on a copy of the docs with one page outside the nav and one link to nowhere."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "docs" / "users" / "orphan.md").write_text("# A page no one listed\n")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [a page that is not there](users/missing.md).\n")
    build = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = build.stdout + build.stderr
    assert build.returncode != 0, output
    assert "not included in the \"nav\"" in output and "users/orphan.md" in output, output
    assert "'users/missing.md', but the target is not found" in output, output


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    """docs/users/settings.md and routes.md are what scripts/gen_docs.py writes from today's code."""
    for path, text in _gen_docs().pages().items():
        assert path.read_text() == text, (f"{path.relative_to(ROOT)} is out of date: run `python scripts/gen_docs.py` "
                                          "and commit the page")


def test_settings_page_lists_every_setting_with_its_flag_and_variable():
    from app.settings import Settings

    page = (DOCS / "users" / "settings.md").read_text()
    for name in Settings.model_fields:
        assert f"`--{name.replace('_', '-')}" in page and f"`GENSCORE_{name.upper()}`" in page, name


def test_readme_is_short_and_its_links_resolve():
    readme = ROOT / "README.md"
    assert readme.stat().st_size <= README_LIMIT_BYTES, f"README.md is {readme.stat().st_size} bytes"
    text = readme.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    for command in ("make serve", "make test"):
        assert command in text


# --------------------------------------------------------------------------- examples


def docs_examples() -> list[tuple[str, str, str, dict | None, object]]:
    """Every marked example: (where, method, path, JSON body or None, the answer shown)."""
    examples = []
    for page in sorted(DOCS.rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != EXAMPLE_MARK:
                continue
            where = f"{page.relative_to(ROOT)}:{i + 1}"
            assert lines[i + 1].startswith("```"), f"{where}: the mark must be followed by a fenced block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            block = lines[i + 2:end]
            assert block and block[0].startswith("$ "), f"{where}: the block must start with a `$ curl` line"
            # The command runs until its quotes close and no line ends in a backslash; the answer follows.
            for n in range(1, len(block) + 1):
                command = "\n".join(block[:n])[2:]
                if command.rstrip().endswith("\\"):
                    continue
                try:
                    argv = shlex.split(command)
                except ValueError:  # a quote still open: the body goes on over the next line
                    continue
                break
            else:
                raise AssertionError(f"{where}: the command never ends")
            url = next(arg for arg in argv if "localhost:8000" in arg)
            body = json.loads(argv[argv.index("-d") + 1]) if "-d" in argv else None
            answer = json.loads("\n".join(block[n:]))
            examples.append((where, "POST" if body is not None else "GET", urlparse(f"http://{url}").path, body,
                             answer))
    return examples


EXAMPLES = docs_examples()


def test_the_docs_show_examples_of_every_api_family():
    paths = {path for _, _, path, _, _ in EXAMPLES}
    for family in ("/score", "/v1/completions", "/v1/chat/completions", "/v1/rerank", "/v1/score",
                   "/generative_scoring", "/tokenize"):
        assert family in paths, f"no marked example of {family}"


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {type(None): "null", str: "string", list: "list", dict: "object"}[type(value)]


def assert_same_shape(shown, served, where: str = "$") -> None:
    """The same keys at every level and the same kind of value; lists compared item by item."""
    assert _kind(shown) == _kind(served), f"{where}: the docs show {_kind(shown)}, the server answers {_kind(served)}"
    if isinstance(shown, dict):
        assert set(shown) == set(served), f"{where}: keys {sorted(shown)} in the docs, {sorted(served)} served"
        for key in shown:
            assert_same_shape(shown[key], served[key], f"{where}.{key}")
    elif isinstance(shown, list):
        assert bool(shown) == bool(served), f"{where}: one list is empty, the other not"
        for i, (a, b) in enumerate(zip(shown, served)):
            assert_same_shape(a, b, f"{where}[{i}]")


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """A tiny Llama served under the default model's name, with a vocabulary large enough for the default model's
    token ids in the examples, and a rerank format whose label words are single tokens of its tokenizer."""
    from app.main import create_app
    from app.settings import Settings
    from models import load_model
    from models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("docs-examples")
    folder = make_tiny_model(root / "llama", "llama", max_positions=1024, extra_vocab=10_000)
    loaded = load_model(str(folder), device="cpu", dtype="float32", cache_dir=None)
    rerank_format = root / "judge.json"
    rerank_format.write_text(json.dumps({
        "prefix": "<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n",
        "query": "Task: {instruction}\nQuery: {query}\nDocument:", "document": " {document}",
        "suffix": "<|im_end|>\n<|im_start|>assistant\n", "yes": "Yes", "no": "No",
        "default_instruction": "find the answer",
    }))
    settings = Settings(model="unused", served_model_name="smollm2-135m", device="cpu", dtype="float32",
                        rerank_format=str(rerank_format))
    with live_server(create_app(settings, loaded=loaded)) as base_url:
        yield base_url


@pytest.mark.parametrize("where, method, path, body, answer", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_docs_example_runs_and_answers_in_the_shape_shown(docs_server, where, method, path, body, answer):
    response = httpx.request(method, docs_server + path, json=body, timeout=60)
    assert response.status_code == 200, f"{where}: {response.status_code} {response.text}"
    assert_same_shape(answer, response.json())


def test_module_map_names_every_module_and_only_modules_that_exist():
    """The architecture page's module map (its first code block under "Module map") against the tree."""
    page = (DOCS / "contributors" / "architecture.md").read_text()
    section = page[page.index("## Module map"):]
    block = section[section.index("```"):section.index("```", section.index("```") + 3)]
    named = set(re.findall(r"\b(\w+\.py)\b", block))
    modules = {path for package in ("app", "models", "sampler") for path in (ROOT / package).rglob("*.py")
               if path.name != "__init__.py"}
    # a module is described when the map names it and every folder it sits in (`score/` for app/api/score/...)
    missing = sorted(str(path.relative_to(ROOT)) for path in modules if path.name not in named
                     or any(f"{folder}/" not in block for folder in path.relative_to(ROOT).parts[:-1]))
    assert not missing, f"modules the map does not describe: {missing}"
    files = {path.name for folder in ("app", "models", "sampler", "bench", "scripts", "tests")
             for path in (ROOT / folder).rglob("*.py")}
    assert named <= files, f"the map names files that do not exist: {sorted(named - files)}"
