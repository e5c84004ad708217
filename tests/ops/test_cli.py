"""The `genscore` command line as an operator reads it: `--help` shows values as they are typed."""

from __future__ import annotations

import pytest

from app.cli import main
from app.settings import Settings
from sampler import LogprobsMode


def _serve_help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_logprobs_modes_as_typed(capsys):
    text = " ".join(_serve_help(capsys).split())  # argparse wraps long lines
    assert "--default-logprobs-mode {raw_logprobs,raw_logits,processed_logprobs,processed_logits}" in text
    assert "(default: raw_logprobs)" in text
    assert "RAW_LOGPROBS" not in text


def test_help_names_the_subcommand(capsys):
    assert _serve_help(capsys).startswith("usage: genscore serve ")
    with pytest.raises(SystemExit):
        main(["warm-cache", "--help"])
    assert capsys.readouterr().out.startswith("usage: genscore warm-cache ")


def test_flags_and_environment_both_reach_the_settings(monkeypatch):
    from app.cli import parse_settings

    monkeypatch.setenv("GENSCORE_PORT", "9123")
    assert parse_settings([], "genscore serve").port == 9123
    assert parse_settings(["--port", "9000"], "genscore serve").port == 9000  # the flag wins


@pytest.mark.parametrize("mode", list(LogprobsMode))
def test_logprobs_mode_flag_takes_the_value_users_type(mode):
    settings = Settings(_cli_parse_args=["--default-logprobs-mode", mode.value])
    assert settings.default_logprobs_mode is mode


def test_logprobs_mode_default_and_environment(monkeypatch):
    assert Settings().default_logprobs_mode is LogprobsMode.RAW_LOGPROBS
    monkeypatch.setenv("GENSCORE_DEFAULT_LOGPROBS_MODE", "processed_logits")
    assert Settings().default_logprobs_mode is LogprobsMode.PROCESSED_LOGITS


def test_unknown_logprobs_mode_is_a_clear_error(capsys):
    assert main(["serve", "--default-logprobs-mode", "logprobs"]) == 2
    err = capsys.readouterr().err
    assert "default_logprobs_mode" in err and "'raw_logprobs'" in err and "'processed_logits'" in err
