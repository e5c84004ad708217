"""Byte model of the engine's work (weights, KV caches, forward and decode transients), the memory limit this process runs under, and giving freed memory back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

# Every coefficient below is an upper bound of what was measured (bench/memory_calibration.py; numbers in
# bench/MEMORY.md): peak RSS growth of a fresh process running the operation, SmolLM2-135M in float32 and bfloat16
# and a tiny random Llama, packed and padded passes. They count tensors of the model dtype ("elements") or float32.

# One decoder layer's live activations per token, in elements of the model dtype: the residual stream, the normed
# input, q/k/v and their rotary temporaries, the attention output, then gate, up, act(gate) and their product in the
# MLP. Only one layer's temporaries are alive at a time (inference mode keeps nothing for backward).
_HIDDEN_COPIES = 8
_INTERMEDIATE_COPIES = 4
# float32 [V] vectors alive per kept position: the logits, the model-dtype logits they were cast from, the mode's
# snapshot (log_softmax), a sorted copy with its int64 indices (ranks and top-N), softmax probabilities for
# sampling or top_p, and the processed copy of a penalised or processed row.
_LOGIT_COPIES = 8
# Attention mask bytes per (query, key) pair of one sequence: transformers builds a bool [T, T] mask (a float one in
# some paths) even when SDPA then runs a blocked kernel that never materialises the scores.
_MASK_BYTES_PER_PAIR = 5
# A response holds each returned number as a Python object in a list, then as JSON text: measured 73 bytes per
# number at the peak of a 1,024 items x 1,024 labels /score with top 20 (3.2 M numbers, forward included).
_RESPONSE_BYTES_PER_VALUE = 96
# What a forward costs beyond its tensors: allocator slack, oneDNN scratch space and python objects (measured
# flat part of the peak of a one-token pass).
_FIXED_FORWARD_BYTES = 32 << 20
# cgroup limits within this much of 2**63 mean "no limit" (v1 writes PAGE_COUNTER_MAX in bytes).
_UNLIMITED = 1 << 60
# Headroom left below a cgroup limit: the python heap, tokenizer, HTTP buffers and allocator fragmentation that no
# estimate covers. Without a cgroup, the budget is this share of physical memory (the rest belongs to other tenants).
DEFAULT_HEADROOM_SHARE = 0.15
MIN_HEADROOM_BYTES = 512 << 20
PHYSICAL_MEMORY_SHARE = 0.5


def _config_int(config, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (tied embeddings share one)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except NotImplementedError:  # a pre-packed oneDNN weight is opaque: count its elements
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total


@dataclass(frozen=True)
class MemoryModel:
    """Worst-case bytes of each kind of work the engine runs, for one loaded model."""

    weights_bytes: int  # parameters + buffers as loaded (pre-packed copies included: they replace the originals,
    # except the head view's packed lm_head, which comes on top)
    kv_bytes_per_token: int  # keys + values of every layer for one token of one sequence, in the cache dtype
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    element_bytes: int  # bytes of one element of the model dtype
    # scoring forwards run in packs of about this many tokens (models/forward.py pack_tokens), so only one pack's
    # activations are alive at a time; 0 when the model cannot pack (padded micro-batches, all at once at worst)
    pack_tokens: int = 0

    @classmethod
    def of(cls, loaded) -> MemoryModel:
        """From a models.loading.LoadedModel: its config for the shapes, its tensors for the weights."""
        from models.forward import pack_tokens

        config = loaded.model.config
        config = getattr(config, "text_config", None) or config
        hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
        layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
        # a model without attention (state-space only) names no heads: count one, a small overestimate
        heads = _config_int(config, "num_attention_heads", "n_head") or 1
        kv_heads = _config_int(config, "num_key_value_heads", "multi_query_group_num") or heads
        head_dim = _config_int(config, "head_dim") or hidden // heads
        intermediate = _config_int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
        element = torch.empty((), dtype=loaded.dtype).element_size()
        head = loaded.plan.held_head  # the head view's packed lm_head, held on top of the model's tensors
        return cls(
            weights_bytes=_tensor_bytes(loaded.model) + (0 if head is None else _tensor_bytes(head)),
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * element,
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=intermediate,
            vocab_size=loaded.vocab_size,
            element_bytes=element,
            pack_tokens=pack_tokens(loaded.model) if loaded.plan.layout == "packed" else 0,
        )

    def logits_bytes(self, kept: int) -> int:
        """float32 logits of `kept` positions and the sampler's copies of them (snapshot, sort, softmax, ...)."""
        return kept * self.vocab_size * (_LOGIT_COPIES * 4 + self.element_bytes)

    def forward_bytes(self, rows: int, tokens: int, kept: int, longest: int | None = None) -> int:
        """Worst-case transient bytes of one scoring/prefill forward: `rows` sequences, `tokens` tokens in all
        (padding included; a suffix pass over a shared prefix counts rows x (prefix + suffix)), `kept` positions
        projected through lm_head (float32 logits + sampler copies). `longest`: the longest sequence, when known
        (it bounds a pack and the attention mask; default: as long as all tokens but one per other row).

        The key/value states a prefill leaves are not included: count them with cache_bytes(rows, width), which
        includes the copy select_rows (decoding) or clone (models/prefix.py) takes of them.
        """
        rows = max(rows, 1)
        longest = tokens - (rows - 1) if longest is None else longest
        alive = tokens if not self.pack_tokens else min(tokens, max(self.pack_tokens, longest))
        activations = alive * (_HIDDEN_COPIES * self.hidden_size + _INTERMEDIATE_COPIES * self.intermediate_size)
        activations *= self.element_bytes
        # sum of each sequence's (or padded row's) length squared: at most longest x tokens
        masks = longest * tokens * _MASK_BYTES_PER_PAIR
        picked = kept * self.hidden_size * self.element_bytes * 2  # kept hidden states, gathered and concatenated
        return _FIXED_FORWARD_BYTES + activations + masks + picked + self.logits_bytes(kept)

    def cache_bytes(self, rows: int, width: int) -> int:
        """Bytes of a decode KV cache of rows x width, including the transient copy when it grows by one column
        (torch.cat) or is merged/selected (models/decoding.py merge/select_rows).

        merge and select_rows build every layer of the new cache while the old one is still referenced, so the peak
        is twice the cache, plus one layer's keys and values (merge's left-padded copy of the narrower batch's layer,
        or a decode step's torch.cat of one layer, never both at once);
        the attention mask ([rows, width] int64) is copied alongside.
        """
        cache = rows * width * self.kv_bytes_per_token
        layer = -(-cache // self.num_layers)
        mask = rows * (width + 1) * 8
        # In bfloat16 eight decode steps grew RSS by as much as in float32 (835 vs 878 MB, SmolLM2, 64 rows x 256):
        # the transient is counted at float32 size until its cause (an upcast or heap holes) is found.
        copy = cache * max(4 // self.element_bytes, 1)
        return cache + copy + 2 * mask + layer

    def decode_step_bytes(self, rows: int, width: int) -> int:
        """Transient bytes of one decode step over rows x width on top of the cache (logits [rows, V], ...)."""
        activations = rows * (_HIDDEN_COPIES * self.hidden_size + _INTERMEDIATE_COPIES * self.intermediate_size)
        activations *= self.element_bytes
        masks = rows * (width + 1) * _MASK_BYTES_PER_PAIR + 2 * rows * (width + 1) * 8
        return _FIXED_FORWARD_BYTES + activations + masks + self.logits_bytes(rows)

    @staticmethod
    def response_bytes(values: int) -> int:
        """Bytes to build and serialise a response of `values` numbers (labels, ranks, top-N entries, logprobs)."""
        return values * _RESPONSE_BYTES_PER_VALUE

    def largest_rows(self, width: int, budget_bytes: int) -> int:
        """Most decode rows of final width `width` whose cache and step fit in `budget_bytes` (0 if not one)."""
        def fits(rows: int) -> bool:
            return self.cache_bytes(rows, width) + self.decode_step_bytes(rows, width) <= budget_bytes

        low, high = 0, 1
        while fits(high):
            low, high = high, high * 2
        while high - low > 1:  # fits(low), not fits(high)
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    value = int(text)
    return None if value >= _UNLIMITED else value


def _own_cgroup_dirs(proc_cgroup: Path, root: Path) -> list[Path]:
    """The memory cgroup folders of this process, innermost first (v2 unified, then v1 `memory` controller)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: 0::/path
            base = root
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        folder = base / path.lstrip("/")
        # inside a container the cgroup namespace's root is mounted at `base`, so the path may not exist as written
        while True:
            found.append(folder)
            if folder == base:
                break
            folder = folder.parent
    return found


def memory_limit_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
                       ) -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors (v2 memory.max, v1
    memory.limit_in_bytes); None when there is none."""
    limits = []
    for folder in _own_cgroup_dirs(proc_cgroup, root):
        for name in ("memory.max", "memory.limit_in_bytes"):
            limit = _read_limit(folder / name)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_for(limit: int | None, physical: int) -> int:
    """A memory limit minus headroom (15%, at least 512 MiB); without a limit, half of physical memory."""
    if limit is not None:
        return max(limit - max(int(limit * DEFAULT_HEADROOM_SHARE), MIN_HEADROOM_BYTES), 0)
    return int(physical * PHYSICAL_MEMORY_SHARE)


def default_memory_budget(device: torch.device | None = None) -> int:
    """This process's budget: on a GPU, the device memory it can reach (free now plus what torch already holds)
    minus headroom; else its cgroup's limit minus headroom, else half of the machine's memory."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return budget_for(free + torch.cuda.memory_reserved(device), physical_memory_bytes())
    return budget_for(memory_limit_bytes(), physical_memory_bytes())


@lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only; musl has no malloc_trim


def release_free_memory() -> bool:
    """Give the pages of freed heap memory back to the OS (glibc malloc_trim(0)); False where unavailable.

    torch's CPU allocator is plain malloc: a tensor freed in the middle of a glibc heap stays resident until trimmed,
    so after a large piece of work RSS stays at its peak. Costs a few ms per GB of heap.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
