"""A tiny random Qwen3.5 target (gated delta-net layers and gated attention, as SGLang 0.5.23 loads it) and a
random DFlash drafter for it, written to disk for SGLang's Engine and for `ddtree generate`.

Eight letters, an end-of-text and a mask token: with so few tokens the random drafter's guesses are often the
target's, so trees of a dozen nodes or more accept paths two and three drafts deep.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ddtree.cli.main import main
from ddtree.models.tiny import EOS_TOKEN, MASK_TOKEN, random_hybrid, tiny_hybrid_config

LETTERS = 8
BLOCK_SIZE = 8


def letter_tokenizer(letters: int = LETTERS) -> PreTrainedTokenizerFast:
    """`letters` one-byte tokens, then an end-of-text and a mask token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:letters]
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)  # type: ignore[no-untyped-call]
    fast.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    return fast


def write_gdn_pair(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write the target (`out/target`) and its drafter (`out/drafter`, block of `BLOCK_SIZE`); return both."""
    tokenizer = letter_tokenizer()
    config = tiny_hybrid_config("qwen3_5", len(tokenizer), hidden_size=64, num_layers=4)
    config.eos_token_id = tokenizer.eos_token_id
    config.full_attention_interval = 4  # SGLang's Qwen3.5 reads the layer pattern from it (layer 3 attends)
    model = random_hybrid(config, seed)
    with torch.no_grad():
        model.lm_head.weight[LETTERS:] *= 0.05  # end-of-text and mask: seldom the target's or the drafter's pick
    target, drafter = out / "target", out / "drafter"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    init = ["drafter", "init", "--model", str(target), "--out", str(drafter), "--block-size", str(BLOCK_SIZE)]
    assert main([*init, "--seed", str(seed)]) == 0
    return target, drafter
