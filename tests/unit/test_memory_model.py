"""models/memory.py: its estimates bound the measured peak RSS growth of real forwards, decode steps, merges and
selections on the tiny model, and the memory limit is read from cgroup v1 and v2 files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sampler
from models.decoding import decode_step, merge, prefill, select_rows
from models.forward import forward_logits
from models.memory import (
    MIN_HEADROOM_BYTES,
    MemoryModel,
    budget_for,
    default_memory_budget,
    memory_limit_bytes,
    physical_memory_bytes,
    release_free_memory,
)

# A tiny model's work is small next to allocator noise, so the shapes are as large as its tests allow: hundreds of
# rows, about its 128 positions.
ROWS = 512
WIDTH = 100


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakGrowth:
    """Peak RSS growth over a block: freed heap is given back first and VmHWM reset, so the block's own peak shows."""

    def __enter__(self):
        release_free_memory()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.before = _kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        self.bytes = _kb("VmHWM") * 1024 - self.before


@pytest.fixture(scope="module")
def memory(tiny_loaded) -> MemoryModel:
    if not Path("/proc/self/clear_refs").exists():
        pytest.fail("needs Linux /proc/self/clear_refs to measure peak RSS")
    return MemoryModel.of(tiny_loaded)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]


def test_the_model_is_read_from_the_loaded_config(tiny_loaded, memory):
    config = tiny_loaded.model.config
    assert memory.kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4
    parameters = sum(p.numel() for p in tiny_loaded.model.parameters()) * 4
    assert memory.weights_bytes >= parameters * 0.9  # pre-packed weights are counted, tied ones once
    assert memory.vocab_size == tiny_loaded.vocab_size


def test_forward_estimate_bounds_a_scoring_pass_with_its_sampler(tiny_loaded, memory):
    model, plan, vocab = tiny_loaded.model, tiny_loaded.plan, tiny_loaded.vocab_size
    sequences = [_ids(WIDTH, r, vocab) for r in range(ROWS)]
    params = [sampler.SamplingParams(label_token_ids=tuple(range(vocab)), top_logprobs=20)] * ROWS
    forward_logits(model, plan, sequences[:2], tiny_loaded.pad_token_id)  # one-off kernel set-up is not the pass's
    with PeakGrowth() as peak:
        logits = forward_logits(model, plan, sequences, tiny_loaded.pad_token_id)
        sampler.to_rows(sampler.score(logits, params), params)
    assert 0 < peak.bytes <= memory.forward_bytes(ROWS, ROWS * WIDTH, ROWS, longest=WIDTH)


def test_cache_estimate_bounds_a_merge_and_a_selection(tiny_loaded, memory):
    model, plan, vocab = tiny_loaded.model, tiny_loaded.plan, tiny_loaded.vocab_size
    _, first = prefill(model, plan, [_ids(WIDTH, 1, vocab)], tiny_loaded.pad_token_id)
    _, second = prefill(model, plan, [_ids(WIDTH - 10, 2, vocab)], tiny_loaded.pad_token_id)
    first, second = select_rows(first, [0] * (ROWS // 2)), select_rows(second, [0] * (ROWS // 2))
    held = (ROWS // 2) * (2 * WIDTH - 10) * memory.kv_bytes_per_token  # both caches, before the merge
    with PeakGrowth() as merging:
        merged = merge(first, second)
    del first, second
    assert merging.bytes <= memory.cache_bytes(ROWS, WIDTH) - held
    # a selection that keeps every row re-lays out the whole cache: a second copy, which the estimate includes
    with PeakGrowth() as selecting:
        reordered = select_rows(merged, list(reversed(range(ROWS))))
    assert ROWS * WIDTH * memory.kv_bytes_per_token * 0.9 <= selecting.bytes
    assert selecting.bytes <= memory.cache_bytes(ROWS, WIDTH) - ROWS * WIDTH * memory.kv_bytes_per_token
    assert reordered.size == ROWS


def test_decode_estimate_bounds_steps_that_grow_the_cache(tiny_loaded, memory):
    model, plan, vocab = tiny_loaded.model, tiny_loaded.plan, tiny_loaded.vocab_size
    _, batch = prefill(model, plan, [_ids(WIDTH, 3, vocab)], tiny_loaded.pad_token_id)
    batch = select_rows(batch, [0] * ROWS)
    draw = [sampler.SamplingParams(temperature=1.0, top_p=0.9, top_logprobs=20)] * ROWS
    decode_step(model, plan, select_rows(batch, [0]), torch.tensor([5]))  # one-off kernel set-up
    steps = 8
    with PeakGrowth() as peak:
        for _ in range(steps):
            logits = decode_step(model, plan, batch, torch.full((ROWS,), 5))
            sampler.sample(logits, draw, [None] * ROWS)
            sampler.score(logits, draw)
    width = WIDTH + steps
    assert peak.bytes <= (memory.cache_bytes(ROWS, width) + memory.decode_step_bytes(ROWS, width)
                          - ROWS * WIDTH * memory.kv_bytes_per_token)


def test_largest_rows_is_the_most_that_fit(memory):
    budget = 64 << 20
    rows = memory.largest_rows(WIDTH, budget)
    assert rows > 0
    assert memory.cache_bytes(rows, WIDTH) + memory.decode_step_bytes(rows, WIDTH) <= budget
    assert memory.cache_bytes(rows + 1, WIDTH) + memory.decode_step_bytes(rows + 1, WIDTH) > budget
    assert memory.largest_rows(WIDTH, 1 << 20) == 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_limit_is_the_tightest_of_the_process_cgroup_and_its_ancestors(tmp_path):
    _write(tmp_path / "proc", "5:cpu:/\n4:memory:/kubepods/pod1/ctr\n0::/\n")
    root = tmp_path / "sys"
    _write(root / "memory/kubepods/pod1/ctr/memory.limit_in_bytes", "9223372036854771712\n")  # unlimited
    _write(root / "memory/kubepods/pod1/memory.limit_in_bytes", "6442450944\n")
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert memory_limit_bytes(tmp_path / "proc", root) == 6 << 30


def test_cgroup_v2_limit_and_max_means_none(tmp_path):
    _write(tmp_path / "proc", "0::/kubepods.slice/pod2\n")
    root = tmp_path / "sys"
    _write(root / "kubepods.slice/pod2/memory.max", "4294967296\n")
    _write(root / "kubepods.slice/memory.max", "max\n")
    assert memory_limit_bytes(tmp_path / "proc", root) == 4 << 30
    _write(root / "kubepods.slice/pod2/memory.max", "max\n")
    assert memory_limit_bytes(tmp_path / "proc", root) is None


def test_in_a_container_the_namespace_root_holds_the_limit(tmp_path):
    # with a cgroup namespace, /proc/self/cgroup says "/" and the container's own cgroup is mounted at the root
    _write(tmp_path / "proc", "0::/\n")
    _write(tmp_path / "sys/memory.max", "2147483648\n")
    assert memory_limit_bytes(tmp_path / "proc", tmp_path / "sys") == 2 << 30
    assert memory_limit_bytes(tmp_path / "missing", tmp_path / "sys") is None


def test_default_budget_leaves_headroom_below_the_limit_else_takes_half_of_the_machine():
    assert budget_for(6 << 30, 64 << 30) == (6 << 30) - int((6 << 30) * 0.15)
    assert budget_for(2 << 30, 64 << 30) == (2 << 30) - MIN_HEADROOM_BYTES
    assert budget_for(None, 16 << 30) == 8 << 30
    assert 0 < default_memory_budget() <= (memory_limit_bytes() or physical_memory_bytes())
