"""The `genscore` command: `genscore serve`, `warm-cache`, `build-kernels`, `run-batch` and `calibrate`; every
Settings field is a flag and a GENSCORE_* variable."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp, CliSettingsSource

from app.logs import configure_logging
from app.settings import Settings

# How long a thread holds the GIL before one waiting for it may take it (serve sets it, below).
SWITCH_INTERVAL_S = 0.0005

USAGE = "usage: genscore {serve,warm-cache,build-kernels,run-batch,calibrate} [--help] [--FLAG VALUE ...]"
COMMANDS = """commands:
  serve          serve a model over HTTP (genscore serve --help lists the flags)
  warm-cache     convert the model's GGUF weights into --cache-dir once (e.g. at image build time), then exit
  build-kernels  build genscore's CPU kernels (attention, linear) for each instruction set into --cache-dir (needs
                 a C++ compiler; an image's build stage runs it, so that the image needs none)
  run-batch      answer an OpenAI Batch JSONL file in-process, no server (genscore run-batch --help)
  calibrate      fit a label set's calibration on labelled prompts, scored by a running server (genscore calibrate --help)"""

log = logging.getLogger("genscore")


def serve(settings: Settings) -> int:
    """Run the server until SIGTERM/SIGINT, then drain (app/server.py); non-zero exit when the model cannot load.

    After a signal, uvicorn re-raises it once shutdown is complete: a drained server ends as killed by that
    signal (143 for SIGTERM), except as PID 1 in a container, which ignores it and returns here (exit 0).
    """
    # The device thread runs Python between kernels and must take the GIL back from the event loop each time; a
    # waiting thread asks for it only after the switch interval (5 ms by default), so with many requests in flight
    # the forward stalls. A shorter interval measured faster at 32 concurrent requests (docs/users/performance.md).
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    from app.main import create_app
    from app.server import DrainingServer
    from models import ModelNotFoundError
    from models.loading import resolve_source

    configure_logging(settings.log_level, settings.log_format)
    try:
        resolve_source(settings.model)  # fail fast, before binding a port, when the model names nothing
    except ModelNotFoundError as exc:
        log.error("%s", exc)
        return 2
    log.info("genscore starting: model %s (served as %s), device %s, dtype %s, cache %s, max batch %d sequences / "
             "%d tokens, max wait %.1f ms, log format %s", settings.model, settings.model_name, settings.device,
             settings.dtype, settings.cache_dir, settings.max_batch_size, settings.max_batch_tokens,
             settings.max_wait_ms, settings.log_format)
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # keep configure_logging's handler (text or JSON) for uvicorn's lines too
        access_log=False,  # app/edge/observability.py writes the access log, with the request id
        timeout_graceful_shutdown=settings.drain_timeout_s,
    )
    server = DrainingServer(config)
    server.run()
    return 1 if fatal else 0


def warm_cache(settings: Settings) -> int:
    """Load the model once on CPU so its GGUF weights are converted into settings.cache_dir (and, with --compile,
    its compiled layers are cached there too); 0 when they are there."""
    from models import ModelNotFoundError, load_model
    from models.loading import converted_weights_dir

    configure_logging(settings.log_level, settings.log_format)
    try:
        target = converted_weights_dir(settings.model, settings.cache_dir)
    except ModelNotFoundError as exc:
        log.error("%s", exc)
        return 2
    if target is None and not settings.compile:
        log.info("%s is not a GGUF file: it loads without conversion, nothing to cache", settings.model)
        return 0
    folder = settings.cache_dir if target is None else target.parent
    try:  # fail before the (long) conversion when the cache cannot be written
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error("cannot write the cache directory %s: %s", folder, exc)
        return 1
    if target is not None:
        loaded = load_model(settings.model, device="cpu", dtype="float32", cache_dir=settings.cache_dir)
        if not (target / "config.json").is_file():
            log.error("the converted weights of %s could not be written to %s (see the warning above)",
                      settings.model, target)
            return 1
        log.info("converted weights of %s are in %s (load took %.1f s)", settings.model, target, loaded.load_seconds)
    if settings.compile:
        # The serving dtype: compiled graphs are cached per dtype.
        loaded = load_model(settings.model, device="cpu", dtype=settings.dtype, cache_dir=settings.cache_dir,
                            compile=True)
        if not loaded.plan.compiled:
            log.error("the compiled layers of %s did not pass the self-check; nothing to cache", settings.model)
            return 1
        log.info("compiled layers of %s (%s) are cached under %s (load took %.1f s)", settings.model,
                 str(loaded.dtype).removeprefix("torch."), settings.cache_dir, loaded.load_seconds)
    return 0


_BUILD_ONE = "import sys; from models.attention_cpu import build_main; sys.exit(build_main(sys.argv[1:]))"


def build_kernels(settings: Settings) -> int:
    """Build the CPU attention kernel ahead for each instruction set this machine's compiler targets, into
    settings.cache_dir, where a server with that cache directory loads the one for its CPU; 0 when all are built."""
    from models.attention_cpu import ahead_targets, built_library

    configure_logging(settings.log_level, settings.log_format)
    failed = []
    for target in ahead_targets():
        # A process per build: loading a build for an instruction set this CPU lacks may end the process that does.
        subprocess.run([sys.executable, "-c", _BUILD_ONE, "--target", target, "--cache-dir", str(settings.cache_dir)],
                       check=False)
        library = built_library(target, settings.cache_dir)
        if library.exists():
            log.info("the CPU attention kernel for %s is built: %s", target, library)
        else:
            failed.append(target)
            log.error("the CPU attention kernel for %s could not be built (see above)", target)
    return 1 if failed else 0


def _batch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genscore run-batch", add_help=False,
        description="Answer an OpenAI Batch JSONL file (urls /v1/completions, /v1/chat/completions, /score, "
                    "/v1/rerank, /v1/judge/pairwise) with the server's own routes in-process. Every `genscore serve` flag applies too.")
    parser.add_argument("-i", "--input", type=Path, required=True, help="input JSONL, one request per line")
    parser.add_argument("-o", "--output", type=Path, required=True,
                        help="output JSONL, one answer per input line of the shard, in input order")
    parser.add_argument("--resume", action="store_true",
                        help="continue an output a previous run left: skip the lines it already answered")
    parser.add_argument("--shard", default="0/1", help="i/N: answer every N-th line, starting at line i (0-based)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once (default 64)")
    return parser


def run_batch(argv: list[str]) -> int:
    """`genscore run-batch`: 0 when every line got an output line (error lines included), else non-zero."""
    from app.batch_runner import BatchInputError, BatchOptions, parse_shard
    from app.batch_runner import run_batch as run

    parser = _batch_parser()
    if any(arg in ("-h", "--help") for arg in argv):
        parser.print_help()
        print("\nServer flags (the same as genscore serve):")
        parse_settings(["--help"], "genscore run-batch")
        return 0
    try:
        args, rest = parser.parse_known_args(argv)
        shard, shards = parse_shard(args.shard)
        if args.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
    except (SystemExit, ValueError) as exc:
        print(f"genscore run-batch: {exc}" if isinstance(exc, ValueError) else "", file=sys.stderr)
        return 2
    try:
        # No deadline by default: a batch row waits its turn behind the window however long the queue is.
        settings = parse_settings(["--request-timeout-s", "0", "--no-access-log", *rest], "genscore run-batch")
    except ValidationError as exc:
        print(f"genscore: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per row would bury the progress lines
    options = BatchOptions(args.input, args.output, args.resume, shard, shards, min(args.concurrency,
                                                                                    settings.max_queued_requests))
    try:
        counts = asyncio.run(run(settings, options))
    except BatchInputError as exc:
        log.error("%s", exc)
        return 2
    except RuntimeError as exc:  # the model could not load
        log.error("%s", exc)
        return 1
    log.info("run-batch: wrote %d lines (%d errors), %d were already there", counts["written"], counts["errors"],
             counts["skipped"])
    return 0


def parse_settings(args: list[str], prog: str) -> Settings:
    """Settings from the command line (and GENSCORE_* variables); `--help` prints usage under `prog` and exits."""
    return CliApp.run(Settings, cli_args=args, cli_settings_source=CliSettingsSource(Settings, cli_prog_name=prog))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{COMMANDS}")
        return 0 if argv else 2
    commands = {"serve": serve, "warm-cache": warm_cache, "build-kernels": build_kernels}
    if argv[0] == "run-batch":
        return run_batch(argv[1:])
    if argv[0] == "calibrate":
        from app.calibrate import main as calibrate

        return calibrate(argv[1:])
    if argv[0] not in commands:
        print(f"genscore: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        settings = parse_settings(argv[1:], f"genscore {argv[0]}")
    except ValidationError as exc:
        print(f"genscore: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    return commands[argv[0]](settings)


if __name__ == "__main__":
    sys.exit(main())
