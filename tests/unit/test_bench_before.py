"""`make bench --before REF`: the older code's worktree, the check that it is what runs, the after ÷ before report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import before, report
from tests.unit.test_bench_peers import _results, _run


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository with an `app` package whose source says which commit it is."""
    root = tmp_path / "repo"
    (root / "app").mkdir(parents=True)
    _git(root, "init", "-q")
    for version in ("old", "new"):
        (root / "app" / "__init__.py").write_text(f"VERSION = {version!r}\n")
        _git(root, "add", "app")
        _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", version)
    return root


def test_before_tree_is_a_reused_worktree_whose_code_is_what_runs(repo):
    tree = before.prepare("HEAD~1", repo)
    assert tree.path == (repo / ".cache" / "bench" / f"before-{tree.short}").resolve()
    assert _git(tree.path, "rev-parse", "HEAD") == tree.commit == _git(repo, "rev-parse", "HEAD~1")
    assert before.prepare(tree.commit, repo) == tree  # reused, not added twice
    assert tree.verify().startswith(f"[before] running genscore code from {tree.path / 'app'}")
    printed = subprocess.run(tree.command("runpy", "--help"), cwd=tree.path, env=tree.env(), capture_output=True,
                             text=True)
    assert "[before] running genscore code" in printed.stderr
    assert before.commit_facts(repo) == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False}
    (repo / "app" / "__init__.py").write_text("VERSION = 'edited'\n")
    assert before.commit_facts(repo)["dirty"]


def test_a_process_that_imports_app_from_elsewhere_refuses_to_run(repo, tmp_path):
    tree = before.prepare("HEAD~1", repo)
    (tmp_path / "not-the-tree").mkdir()
    # no app there: the import falls through to the installed (or PYTHONPATH's) genscore, as a stale path would
    elsewhere = before.BeforeTree(tmp_path / "not-the-tree", tree.commit, tree.short)
    env = dict(elsewhere.env(), PYTHONPATH=str(tree.path))  # app resolves, but not under the expected root
    probe = subprocess.run([sys.executable, "-c", before._LAUNCH, "json.tool", "--help"], cwd=tree.path, env=env,
                           capture_output=True, text=True)
    assert probe.returncode == 3 and "refusing to run" in probe.stderr
    with pytest.raises(SystemExit, match="refusing to run"):
        elsewhere.verify()


def test_a_directory_at_another_commit_is_not_reused(repo):
    tree = before.prepare("HEAD~1", repo)
    _git(tree.path, "checkout", "-q", "--detach", _git(repo, "rev-parse", "HEAD"))
    with pytest.raises(SystemExit, match="is not a worktree at"):
        before.prepare("HEAD~1", repo)


def test_report_shows_after_over_before_for_each_cell_both_ran():
    reference = [[[-1.0, -2.0]], [[-3.0, -4.0]]]
    systems = {
        "genscore HTTP f32": {"dtype": "float32", "runs": {"short": {"1": _run(reference, 1.0),
                                                                    "8": _run(reference, 0.5)}}},
        "genscore HTTP f32 (before 29cdab4)": {"dtype": "float32",
                                               "runs": {"short": {"1": _run(reference, 2.0)}}},
        "genscore in-process f32 (before 29cdab4)": {"dtype": "float32",  # no after system: no ratio
                                                     "runs": {"short": {"1": _run(reference, 1.0)}}},
    }
    results = _results(systems)
    summary = report.summarise(results)
    assert summary["before_ratios"] == {"genscore HTTP f32": {"short": {1: 2.0}}}
    results.update(machine={"cpu": "x", "cores": 2, "avx512_bf16": True, "amx_bf16": True, "torch": "2.13.0",
                            "torch_threads": 2, "python": "3.11"},
                   loadavg_start=(0.1, 0.1, 0.1), loadavg_end=(0.2, 0.2, 0.2), total_s=60.0,
                   args={"model": "smollm2-135m", "repeats": "2", "warmup": "2"},
                   commits={"after": {"commit": "a" * 40, "dirty": True},
                            "before": {"commit": "29cdab4" + "0" * 33, "short": "29cdab4", "path": "/x"}},
                   generation={"label": "cell", "systems": {"genscore HTTP f32": _generated(30.0),
                                                            "genscore HTTP f32 (before 29cdab4)": _generated(20.0)},
                               "ratios": {}, "before_ratios": {"HTTP f32": 1.5}})
    text = report.markdown(results, summary)
    assert "| genscore HTTP f32 | 1 | 2.0 |" in text and text.count(" 2.00× |") == 1
    assert "| genscore HTTP f32 | 8 | 4.0 |" in text and "| 28% | – |" in text
    assert "after = aaaaaaaaaaaa with uncommitted changes, before = 29cdab400000" in text
    assert "- genscore HTTP f32 after ÷ before, workload `short` (prompts/s): c=1: 2.00×." in text
    assert "- genscore HTTP f32 after ÷ before (`--before`): 1.50x tokens/s" in text


def _generated(tokens_per_s: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "completion_tokens": 10, "wall_s": 1.0, "p50_s": 0.1, "p95_s": 0.2}
