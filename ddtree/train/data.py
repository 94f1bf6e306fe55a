"""Training data: the target's own greedy responses to chat prompts, stored as token ids.

A data file is JSON lines, one sequence per line: `{"ids": [prompt + response], "prompt_len": n}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ddtree.engine.decode import Engine, GenerationConfig
from ddtree.errors import UserError
from ddtree.models.target import Target


@dataclass(frozen=True)
class TrainingSequence:
    ids: list[int]
    prompt_len: int


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt wrapped in the tokenizer's chat template, ready for generation."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]


def generate_responses(
    target: Target,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    batch_size: int = 64,
    quiet: bool = False,
) -> list[TrainingSequence]:
    """Greedy target responses (method ar), batched; prompts sorted by length to limit padding."""
    engine = Engine(target)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, TrainingSequence] = {}
    config = GenerationConfig(method="ar", max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    for start in tqdm(range(0, len(order), batch_size), desc="responses", unit="batch", disable=quiet):
        chunk = order[start : start + batch_size]
        result = engine.generate([prompts[i] for i in chunk], config)
        for i, res in zip(chunk, result.outputs, strict=True):
            out[i] = TrainingSequence(ids=list(prompts[i]) + res.token_ids, prompt_len=len(prompts[i]))
    return [out[i] for i in range(len(prompts))]


def write_sequences(path: str | Path, sequences: Sequence[TrainingSequence]) -> None:
    with Path(path).open("w") as f:
        for seq in sequences:
            f.write(json.dumps({"ids": seq.ids, "prompt_len": seq.prompt_len}) + "\n")


def read_sequences(path: str | Path, min_response: int = 2) -> list[TrainingSequence]:
    try:
        lines = Path(path).read_text().splitlines()
        seqs = [TrainingSequence(ids=d["ids"], prompt_len=d["prompt_len"]) for d in map(json.loads, lines) if d]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read training data {str(path)!r}: {exc}") from exc
    seqs = [s for s in seqs if len(s.ids) - s.prompt_len >= min_response]
    if not seqs:
        raise UserError(f"training data {str(path)!r} has no usable sequences")
    return seqs
