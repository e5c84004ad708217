"""Tiny random models (Llama, GPT-2, Qwen2) with a small byte-level BPE tokenizer, saved as HF folders for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

# A few sentences are enough to learn merges for short test prompts.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Is this review positive or negative? The movie was great. Answer: yes no",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Question: what color is the sky? Answer: blue. Red green yellow white black.",
    "genscore scores candidate tokens with a causal language model.",
    "0 1 2 3 4 5 6 7 8 9 A B C D true false Yes No",
]
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )


def _config(arch: str, vocab_size: int, max_positions: int):
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=max_positions, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
                           **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=max_positions, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHITECTURES}")


TINY_ARCHITECTURES = ("llama", "gpt2", "qwen2")


def make_tiny_model(folder: str | Path, arch: str = "llama", seed: int = 0, max_positions: int = 128,
                    extra_vocab: int = 7) -> Path:
    """Write a random `arch` model and its tokenizer to `folder` and return it.

    `extra_vocab` leaves lm_head rows the tokenizer never produces, as real models
    do, so "vocabulary" always means lm_head rows.
    """
    folder = Path(folder)
    tokenizer = _make_tokenizer(vocab_size=320)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, len(tokenizer) + extra_vocab, max_positions))
    # Random init is near-uniform; a wider spread makes top-k/top-p tests meaningful.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
