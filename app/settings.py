"""Server settings: one pydantic-settings model, read from GENSCORE_* variables and CLI flags, validated once at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, ByteSize, Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sampler import LogprobsMode


def _logprobs_mode(value: str) -> LogprobsMode:
    # a function, not the enum class itself: on Python 3.12 pydantic cannot read the enum's signature (*values)
    return LogprobsMode(value)


# A logprobs mode read as its value (`raw_logprobs`): typed as the values' Literal, not as the enum, because
# pydantic-settings lists an enum's member names (RAW_LOGPROBS) in --help; converted to the enum once read.
LogprobsModeSetting = Annotated[Literal[tuple(m.value for m in LogprobsMode)], AfterValidator(_logprobs_mode)]


class Settings(BaseSettings):
    """Everything `genscore serve` can be told; each field is also `GENSCORE_<NAME>`."""

    model_config = SettingsConfigDict(
        env_prefix="GENSCORE_",
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        use_attribute_docstrings=True,
    )

    model: str = "smollm2-135m"
    """Model to serve: `smollm2-135m` (bundled), a Hugging Face directory, a .gguf file, or a hub id."""
    served_model_name: str | None = None
    """Name clients use in the `model` field (default: the --model value)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; `auto` is bfloat16 on CUDA and float32 on CPU. bfloat16 on a CPU without avx512_bf16 or AMX
    runs several times slower than float32 (a WARNING at load says so)."""
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "genscore")
    """Where converted GGUF weights are cached so later starts skip dequantization, and where genscore's CPU kernels
    (attention, linear) built for this CPU's instruction set are kept so later starts skip compiling them
    (`genscore build-kernels` fills it ahead for every set; default `~/.cache/genscore`, the home directory read
    when the settings are)."""
    torch_threads: int = Field(default=0, ge=0)
    """CPU threads for torch (0 = torch's default)."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to bind."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the server and uvicorn."""

    max_batch_size: int = Field(default=32, ge=1)
    """Most sequences in one forward pass."""
    max_batch_tokens: int = Field(default=8192, ge=1)
    """Most tokens in one forward pass, padding included (sequences x longest sequence)."""
    max_wait_ms: float = Field(default=20.0, ge=0)
    """How long a batch that is not full waits for more work; it waits only while it holds fewer callers' requests
    than the last batch did (a lone caller runs at once)."""

    default_logprobs_mode: LogprobsModeSetting = Field(default=LogprobsMode.RAW_LOGPROBS.value, validate_default=True)
    """Logprobs mode of requests that do not name one."""
    max_top_logprobs: int = Field(default=20, ge=0)
    """Cap on `top_logprobs`."""
    max_items: int = Field(default=1024, ge=1)
    """Most items in one /score request."""
    max_label_token_ids: int = Field(default=1024, ge=1)
    """Most label token ids in one /score request."""
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    """Longest prompt accepted (default: the model's maximum length)."""

    # --- OpenAI completions, chat and generation ---
    max_choices: int = Field(default=128, ge=1)
    """Most choices (prompts x n) in one /v1/completions or /v1/chat/completions request."""
    memory_budget: ByteSize | None = None
    """Memory the server may use in all, weights included (bytes, or e.g. `6GiB`). Work is admitted against it by
    its worst-case bytes and waits its turn when it does not fit. Default: the cgroup memory limit minus 15% (at
    least 512 MiB) when there is one, else half of physical memory."""
    max_rows_per_request: int = Field(default=16, ge=1)
    """Most decoding rows one prompt holds at once: the rest of its `n` choices wait for its rows to finish, so one
    request with a large `n` cannot take every row of the decode batch while other callers wait."""
    max_cache_tokens: int = Field(default=65536, ge=1)
    """Most KV-cache slots (decoding sequences x padded length) before new generation requests wait their turn."""

    # --- operations: logs, shutdown ---
    log_format: Literal["text", "json"] = "text"
    """Log line format on stderr: `text`, or `json` (one object per line, for log collectors)."""
    access_log: bool = True
    """Log one line per HTTP request (probes and /metrics only at debug level), with its X-Request-ID."""
    drain_timeout_s: float | None = Field(default=30.0, ge=0)
    """After SIGTERM, how long requests already received may take to finish before they get a 503 (null: no limit)."""

    # --- reliability and security ---
    max_queued_requests: int = Field(default=256, ge=1)
    """Most requests admitted to the batcher at once (queued or running); beyond it a request gets 503 at once."""
    max_open_requests: int = Field(default=1024, ge=1)
    """Most HTTP requests in progress at once (being read, validated, queued or computed); beyond it a request
    gets 503 before its body is read, so a flood cannot pile up in front of the queue. Probes are exempt."""
    retry_after_s: int = Field(default=1, ge=0)
    """`Retry-After` seconds sent with the 503 of a full queue."""
    request_timeout_s: float = Field(default=30.0, ge=0)
    """Deadline of a request: 504 when it passes before its work reaches the model (0 = none). The
    `X-Request-Timeout` header (seconds) can shorten it per request."""
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1)
    """Largest request body accepted; a larger one gets 413 (2 MiB holds 1024 items of a few hundred tokens)."""
    max_generated_tokens: int = Field(default=2048, ge=0)
    """Cap on `max_tokens` / `max_completion_tokens` (tokens generated per choice) in the completion routes; also
    the default of chat requests that set none. (`n` is capped by max_choices.)"""
    api_key: SecretStr | None = Field(default=None, min_length=1)
    """When set, every route except the probes (and /metrics with --public-metrics) needs
    `Authorization: Bearer <key>`."""
    public_metrics: bool = True
    """Serve /metrics without the API key (for Prometheus scrapers)."""
    cors_allow_origins: list[str] = []
    """Origins allowed to call the API from a browser (CORS); empty = CORS off. `*` allows any."""

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        self._read_judging_files()
        return self

    def _read_judging_files(self) -> None:
        """Parse --label-sets and --calibration once, so that a bad file stops the start with its reason."""
        from app.api.judge.calibration import read_calibrations
        from app.api.judge.label_sets import read_label_sets

        self._label_sets = read_label_sets(self.label_sets) if self.label_sets is not None else {}
        if self.calibration is not None:
            if self.label_sets is None:
                raise ValueError("--calibration needs --label-sets: a calibration belongs to a named label set")
            self._calibrations = read_calibrations(self.calibration, self._label_sets)

    @property
    def label_set_definitions(self) -> dict:
        """The label sets of --label-sets by name (LabelSet objects), read once."""
        return self._label_sets

    @property
    def calibrations(self) -> dict:
        """The calibrations of --calibration by label set name (Calibration objects), read once."""
        return self._calibrations

    @property
    def model_name(self) -> str:
        """The name the API reports and matches requests against."""
        return self.served_model_name or self.model

    # --- scoring at scale: shared prefixes and multi-token candidates ---
    share_prefixes: bool = True
    """Run the common prefix of a request's prompts (its query) once and batch the items over its key/value states."""
    prefix_cache_mb: float = Field(default=256.0, ge=0)
    """Memory for the key/value states of recent shared prefixes, reused across batches and requests (0: off)."""
    max_candidates: int = Field(default=256, ge=1)
    """Most `candidates` in one /score request."""
    batch_invariant: bool = False
    """A request's numbers are bit-identical alone and in any batch (fixed-shape kernels; proven at load, reported in
    /v1/models as the `batch_invariant` fast path)."""
    compile: bool = False
    """Compile the decoder layers for packed scoring calls with torch.compile (CPU; self-checked at load, reported in
    /v1/models as the `compiled_layers` fast path). Adds seconds to start-up; its cache under --cache-dir makes
    later starts faster (`genscore warm-cache` fills it)."""

    # --- reranking ---
    rerank_format: str = "chat"
    """Prompt of the rerank routes: `chat` (the model's chat template), `qwen3-reranker` (Qwen3-Reranker's own
    format), or the path of a JSON file with prefix, query, document, suffix, yes and no."""

    # --- judging: label sets, calibration, pairwise judgments, long documents in rerank ---
    label_sets: Path | None = None
    """JSON file of named label sets, `{"set": {"label": [surface form, ...], ...}, ...}` (a form is text or a list
    of token ids); a request names one in `labels`."""
    calibration: Path | None = None
    """JSON file written by `genscore calibrate`: per label set name, the temperature (and biases) a request gets with
    `calibrated: true`. Needs --label-sets."""
    max_judge_pairs: int = Field(default=45, ge=1)
    """Most answer pairs one /v1/judge/pairwise request compares (n answers make n(n-1)/2 pairs, each scored in both
    orders)."""
    max_rerank_windows: int = Field(default=1024, ge=1)
    """Most prompts one rerank request is split into: every window of every document, together."""

    _label_sets: dict = PrivateAttr(default_factory=dict)
    _calibrations: dict = PrivateAttr(default_factory=dict)
