"""Tiny random models with a small byte-level BPE tokenizer, saved as HF folders: the three of the API tests, and the
conformance zoo, one per kind of model math a fast path could get wrong (windows, sinks, soft-caps, scales, NoPE)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

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


# Every tiny model: 2-4 layers of width 64, 4 query and 2 key/value heads of 16.
_BODY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# A window far shorter than the test prompts (20-100 tokens), so a dropped window changes every later position.
WINDOW = 8
_TWO = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])

# architecture -> (config class name, its settings beyond the body); vocabulary and positions are added later.
_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    # the API tests' models
    "llama": ("LlamaConfig", dict(_BODY, num_hidden_layers=2)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4)),
    "qwen2": ("Qwen2Config", dict(_BODY, num_hidden_layers=2, tie_word_embeddings=False)),
    # the conformance zoo
    "mistral": ("MistralConfig", dict(_BODY, num_hidden_layers=2, sliding_window=WINDOW)),
    "qwen2_sliding": ("Qwen2Config", dict(_BODY, num_hidden_layers=2, use_sliding_window=True,
                                           sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(_BODY, num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", dict(_BODY, **_TWO, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=3.0, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3TextConfig", dict(_BODY, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                         final_logit_softcapping=4.0)),
    "phi3": ("Phi3Config", dict(_BODY, num_hidden_layers=2, sliding_window=WINDOW, pad_token_id=0)),
    "gpt_oss": ("GptOssConfig", dict(_BODY, **_TWO, sliding_window=WINDOW, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "olmo2": ("Olmo2Config", dict(_BODY, num_hidden_layers=2)),
    "granite": ("GraniteConfig", dict(_BODY, num_hidden_layers=2, logits_scaling=4.0, embedding_multiplier=3.0,
                                       residual_multiplier=0.5, attention_multiplier=0.2)),
    "cohere2": ("Cohere2Config", dict(_BODY, **_TWO, sliding_window=WINDOW, logit_scale=0.5)),
    "starcoder2": ("Starcoder2Config", dict(_BODY, num_hidden_layers=2, sliding_window=WINDOW)),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_hidden_layers=2, rotary_pct=0.25)),
    "smollm3": ("SmolLM3Config", dict(_BODY, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])),
    # ALiBi: no position ids at all, a bias on the attention scores
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    # a mixture of experts whose output class carries router logits
    "mixtral": ("MixtralConfig", dict(_BODY, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    # learned positions read with an offset of 2
    "opt": ("OPTConfig", dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
                              word_embed_proj_dim=64)),
    # chunked attention, NoPE layers and a mixture of experts whose output class has no last_hidden_state
    "llama4": ("Llama4TextConfig", dict(_BODY, intermediate_size_mlp=128, num_hidden_layers=4, num_local_experts=4,
                                         num_experts_per_tok=1, attention_chunk_size=WINDOW,
                                         no_rope_layers=[1, 1, 1, 0], interleave_moe_layer_step=2)),
    # Mamba-2 and attention side by side in each layer, with multipliers on the embedding and the output head
    "falcon_h1": ("FalconH1Config", dict(_BODY, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4,
                                          mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
                                          lm_head_multiplier=0.5, embedding_multiplier=2.0)),
    # pure state-space: no attention at all
    "mamba": ("MambaConfig", dict(hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)),
    # Mamba layers, one attention layer and experts
    "jamba": ("JambaConfig", dict(_BODY, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                   expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                                   mamba_d_state=8, use_mamba_kernels=False)),
    # gated-delta linear attention next to full attention, experts with a shared expert
    "qwen3_next": ("Qwen3NextConfig", dict(_BODY, num_hidden_layers=2,
                                            layer_types=["linear_attention", "full_attention"],
                                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # short gated convolutions next to attention
    "lfm2": ("Lfm2Config", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                 block_auto_adjust_ff_dim=False)),
    # a real-gated linear recurrence next to local (windowed) attention, soft-capped logits
    "recurrent_gemma": ("RecurrentGemmaConfig", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                      num_key_value_heads=2, lru_width=64, num_hidden_layers=3,
                                                      attention_window_size=WINDOW,
                                                      block_types=["recurrent", "recurrent", "attention"])),
    # lightning (linear) attention next to full attention, experts
    "minimax": ("MiniMaxConfig", dict(_BODY, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                       block_size=16, num_local_experts=4)),
}
TINY_ARCHITECTURES = ("llama", "gpt2", "qwen2")
# The zoo of attention variants (windows, sinks, soft-caps, scales, NoPE) that every fast path applies to.
ATTENTION_ZOO = ("llama", "mistral", "qwen2_sliding", "qwen3", "gemma2", "gemma3", "phi3", "gpt_oss", "olmo2",
                 "granite", "cohere2", "starcoder2", "gpt_neox", "smollm3")
# One model per family whose layers, positions, outputs or caches differ: Conv1D (gpt2, also an API test model),
# ALiBi, MoE outputs, learned positions with an offset, chunked attention, multiplied heads, state-space,
# attention + state-space hybrids, gated delta, convolutions, recurrent local attention, lightning attention.
FAMILY_ZOO = ("gpt2", "bloom", "mixtral", "opt", "llama4", "falcon_h1", "mamba", "jamba", "qwen3_next", "lfm2",
              "recurrent_gemma", "minimax")
CONFORMANCE_ARCHITECTURES = ATTENTION_ZOO + FAMILY_ZOO


def _config(arch: str, vocab_size: int, max_positions: int):
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {tuple(_ARCHITECTURES)}")
    class_name, settings = _ARCHITECTURES[arch]
    positions = {"n_positions" if arch == "gpt2" else "max_position_embeddings": max_positions}
    return getattr(transformers, class_name)(
        vocab_size=vocab_size, bos_token_id=1, eos_token_id=0, **{"pad_token_id": 0, **settings}, **positions
    )


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
    # Random init is near-uniform; a wider spread makes top-k/top-p tests meaningful, and (in the conformance
    # zoo) larger query/key weights make each position's attention pattern matter, so a wrong mask shows.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
        for name, weight in model.named_parameters() if arch in CONFORMANCE_ARCHITECTURES else ():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query_key_value.weight", "qkv_proj.weight")):
                weight.mul_(4.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
