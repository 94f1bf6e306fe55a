"""Tiny randomly initialised targets with a byte-level tokenizer: for tests, demos and CI, no hub needed."""

from __future__ import annotations

from pathlib import Path

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


def tiny_llama_config(
    vocab_size: int, hidden_size: int = 64, num_layers: int = 4, heads: int = 4, kv_heads: int = 2
) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def random_llama(config: LlamaConfig, seed: int, init_std: float = 0.2) -> LlamaForCausalLM:
    """A random Llama. A large init std gives peaked, varied next-token distributions (useful in tests)."""
    torch.manual_seed(seed)
    config.initializer_range = init_std
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.train(False)
    return model


def write_tiny_target(out: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 4) -> Path:
    """Write a random tiny Llama target with a byte-level tokenizer to `out`."""
    directory = Path(out)
    tokenizer = byte_tokenizer()
    config = tiny_llama_config(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers)
    config.eos_token_id = tokenizer.eos_token_id
    model = random_llama(config, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
