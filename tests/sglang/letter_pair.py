"""Tiny random targets over eight letters, as SGLang 0.5.23 loads them, and a random DFlash drafter for each,
written to disk for SGLang's Engine and for `ddtree generate`: the gated-delta-net (GDN) hybrids Qwen3.5
(dense), Qwen3-Next and Qwen3.5-MoE (a sparse mixture of experts with a gated shared expert), and a dense
Llama.

Four layers (for the hybrids three GDN and one gated attention). Eight letters, an end-of-text and a mask token:
with so few tokens the random drafter's guesses are often the target's, so trees of a dozen nodes or more accept
paths two and three drafts deep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ddtree.cli.main import main
from ddtree.models.tiny import EOS_TOKEN, MASK_TOKEN, random_hybrid, random_llama, tiny_hybrid_config, tiny_llama_config

LETTERS = 8
BLOCK_SIZE = 8
KINDS = ("qwen3_5", "qwen3_next", "qwen3_5_moe")  # the GDN kinds, `tiny_hybrid_config`'s names
DENSE = "llama"


def letter_tokenizer(letters: int = LETTERS) -> PreTrainedTokenizerFast:
    """`letters` one-byte tokens, then an end-of-text and a mask token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:letters]
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)  # type: ignore[no-untyped-call]
    fast.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    return fast


def gdn_config(kind: str, vocab_size: int) -> Any:
    """The tiny config of `kind` (`KINDS`). Qwen3-Next's has four experts of 32, two a token (normalised), and
    a shared expert of 32."""
    if kind not in KINDS:
        raise ValueError(f"unknown GDN target kind {kind!r}; known: {', '.join(KINDS)}")
    config = tiny_hybrid_config(kind, vocab_size, hidden_size=64, num_layers=4)
    config.full_attention_interval = 4  # SGLang reads the layer pattern from it (layer 3 attends)
    return config


def write_letter_pair(out: Path, seed: int = 0, kind: str = "qwen3_5") -> tuple[Path, Path]:
    """Write a target of `kind` (`KINDS` or `DENSE`) to `out/target` and its drafter (`out/drafter`, block of
    `BLOCK_SIZE`); return both."""
    tokenizer = letter_tokenizer()
    config = tiny_llama_config(len(tokenizer)) if kind == DENSE else gdn_config(kind, len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    model = random_llama(config, seed) if kind == DENSE else random_hybrid(config, seed)
    with torch.no_grad():
        model.lm_head.weight[LETTERS:] *= 0.05  # end-of-text and mask: seldom the target's or the drafter's pick
    target, drafter = out / "target", out / "drafter"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    init = ["drafter", "init", "--model", str(target), "--out", str(drafter), "--block-size", str(BLOCK_SIZE)]
    assert main([*init, "--seed", str(seed)]) == 0
    return target, drafter
