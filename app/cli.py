"""The `genscore` command: `genscore serve [--flags]`; every Settings field is a flag and a GENSCORE_* variable."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError
from pydantic_settings import CliApp

from app.settings import Settings

USAGE = "usage: genscore serve [--help] [--FLAG VALUE ...]"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # transformers' progress bars and advisory warnings would drown the start-up lines
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def serve(settings: Settings) -> int:
    """Run the server until SIGINT/SIGTERM (uvicorn's own signal handling); non-zero exit when the model cannot load."""
    from app.main import create_app
    from models import ModelNotFoundError
    from models.loading import resolve_source

    configure_logging(settings.log_level)
    try:
        resolve_source(settings.model)  # fail fast, before binding a port, when the model names nothing
    except ModelNotFoundError as exc:
        logging.getLogger("genscore").error("%s", exc)
        return 2
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level))
    server.run()
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\ncommands:\n  serve    serve a model over HTTP (genscore serve --help lists the flags)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"genscore: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        settings = CliApp.run(Settings, cli_args=argv[1:], cli_prog_name="genscore serve")
    except ValidationError as exc:
        print(f"genscore: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
