"""Tiny randomly initialised targets with a byte-level tokenizer: for tests, demos and CI, no hub needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2 byte alphabet) plus an end-of-text and a mask token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)  # type: ignore[no-untyped-call]
    fast.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    return fast


def _sizes(vocab_size: int, hidden_size: int, num_layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    """The config fields every tiny target shares."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def tiny_llama_config(
    vocab_size: int, hidden_size: int = 64, num_layers: int = 4, heads: int = 4, kv_heads: int = 2
) -> LlamaConfig:
    return LlamaConfig(**_sizes(vocab_size, hidden_size, num_layers, heads, kv_heads))


def random_llama(config: LlamaConfig, seed: int, init_std: float = 0.2) -> LlamaForCausalLM:
    """A random Llama. A large init std gives peaked, varied next-token distributions (useful in tests)."""
    torch.manual_seed(seed)
    config.initializer_range = init_std
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.train(False)
    return model


def tiny_hybrid_config(
    kind: str, vocab_size: int, hidden_size: int = 64, num_layers: int = 4, heads: int = 4, kv_heads: int = 2
) -> Any:
    """A small hybrid config: three recurrent layers to one of full attention, as the models have.
    `kind`: `qwen3_next` (fused projections, a mixture of experts), `qwen3_5` (Qwen3.5's dense text model),
    `qwen3_5_moe` (its mixture-of-experts text model) or `bamba` (Mamba2 layers)."""
    from transformers import BambaConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    sizes: Any = _sizes(vocab_size, hidden_size, num_layers, heads, kv_heads)
    attention = [i for i in range(num_layers) if i % 4 == 3]
    if kind == "bamba":
        mamba: Any = dict(mamba_n_heads=4, mamba_d_head=hidden_size // 2, mamba_d_state=8, mamba_n_groups=2)
        return BambaConfig(
            **sizes, attn_layer_indices=attention, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, **mamba
        )
    shared: Any = dict(
        **sizes,
        head_dim=hidden_size // heads,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden_size // 8,
        linear_value_head_dim=hidden_size // 8,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i in attention else "linear_attention" for i in range(num_layers)],
    )
    if kind in ("qwen3_next", "qwen3_5_moe"):
        experts: Any = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2)
        moe = Qwen3NextConfig if kind == "qwen3_next" else Qwen3_5MoeTextConfig
        config = moe(**shared, **experts, shared_expert_intermediate_size=hidden_size // 2)
        # any dtype (the grouped kernel takes 16- and 32-bit floats) and no host sync, so CUDA graphs capture
        # it (the eager loop's `nonzero` cannot be captured)
        config._experts_implementation = "batched_mm"
        return config
    if kind == "qwen3_5":
        return Qwen3_5TextConfig(**shared)
    raise ValueError(f"unknown hybrid kind {kind!r}; known: qwen3_next, qwen3_5, qwen3_5_moe, bamba")


def random_hybrid(config: Any, seed: int, init_std: float = 0.2) -> Any:
    """A random hybrid causal LM for `config` (`tiny_hybrid_config`), with varied next-token distributions."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.initializer_range = init_std
    model: Any = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    for param in model.parameters():  # norms and the decay stay as initialised
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=init_std)
    model.train(False)
    return model


def write_tiny_target(
    out: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 4, hybrid: str | None = None
) -> Path:
    """Write a random tiny target with a byte-level tokenizer to `out`: a Llama, or with `hybrid` a hybrid of
    that kind (`tiny_hybrid_config`)."""
    directory = Path(out)
    tokenizer = byte_tokenizer()
    if hybrid is None:
        config: Any = tiny_llama_config(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers)
    else:
        config = tiny_hybrid_config(hybrid, len(tokenizer), hidden_size=hidden_size, num_layers=num_layers)
    config.eos_token_id = tokenizer.eos_token_id
    model = random_llama(config, seed) if hybrid is None else random_hybrid(config, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
