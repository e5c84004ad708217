"""`genscore warm-cache`: converts the default model's GGUF once into the cache dir (as the Dockerfile does at build time)."""

from __future__ import annotations

import logging

from app.cli import main
from models import load_model
from models.loading import converted_weights_dir


def run_cli(*args: str) -> int:
    """main() configures logging for a whole process; give the test process its handlers (caplog's) back."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        return main(list(args))
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_warm_cache_fills_the_cache_the_server_reads(default_model_cache, caplog):
    # The integration tier's real_loaded fixture may already have converted into this session cache;
    # either way, after warm-cache the converted weights are where the server looks for them.
    assert run_cli("warm-cache", "--cache-dir", str(default_model_cache)) == 0
    target = converted_weights_dir("smollm2-135m", default_model_cache)
    assert target is not None and (target / "config.json").is_file()
    assert any(target.glob("*.safetensors"))
    with caplog.at_level(logging.INFO, logger="genscore.models"):
        loaded = load_model("smollm2-135m", device="cpu", dtype="float32", cache_dir=default_model_cache)
    assert any("from cache" in r.getMessage() for r in caplog.records), "the server would convert again"
    assert loaded.vocab_size == 49152


def test_warm_cache_has_nothing_to_do_for_a_hugging_face_folder(tiny_model_dirs, tmp_path):
    assert run_cli("warm-cache", "--model", str(tiny_model_dirs["llama"]), "--cache-dir", str(tmp_path)) == 0
    assert not any(tmp_path.iterdir())


def test_warm_cache_fails_clearly_on_a_missing_model(tmp_path, capsys):
    assert run_cli("warm-cache", "--model", str(tmp_path / "nothing.gguf"), "--cache-dir", str(tmp_path)) == 2
    assert "nothing.gguf" in capsys.readouterr().err


def test_warm_cache_fails_when_the_cache_cannot_be_written(tmp_path):
    """The server would still serve (converting at every start), but the build step must fail loudly."""
    not_a_directory = tmp_path / "cache"
    not_a_directory.write_text("a file where the cache directory should be")
    assert run_cli("warm-cache", "--cache-dir", str(not_a_directory)) == 1
