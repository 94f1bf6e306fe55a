"""Training data: the target's own greedy responses to chat prompts, stored as token ids.

A data file is JSON lines, one sequence per line: `{"ids": [prompt + response], "prompt_len": n}`. Packed,
the same sequences are a bundle named `data` (`ddtree.train.bundle`): safetensors shards of at most 15 MiB,
each holding whole sequences as `ids` (all their tokens end to end, uint16 when every id is below 65,536,
else int32), `lengths` and `prompt_len` (int32, one per sequence). About 2 bytes a token instead of 6.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ddtree.engine.decode import Engine, GenerationConfig
from ddtree.errors import UserError
from ddtree.models.target import Target
from ddtree.train.bundle import SHARD_BYTES, load_bundle, save_bundle, tensor_budget

DATA_BUNDLE = "data"


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
    """The sequences of a JSONL file or of a packed data directory, less those with fewer than
    `min_response` response tokens."""
    try:
        if Path(path).is_dir():
            seqs = unpack_sequences(Path(path))
        else:
            lines = Path(path).read_text().splitlines()
            seqs = [TrainingSequence(ids=d["ids"], prompt_len=d["prompt_len"]) for d in map(json.loads, lines) if d]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read training data {str(path)!r}: {exc}") from exc
    seqs = [s for s in seqs if len(s.ids) - s.prompt_len >= min_response]
    if not seqs:
        raise UserError(f"training data {str(path)!r} has no usable sequences")
    return seqs


def pack_sequences(
    sequences: Sequence[TrainingSequence], directory: Path, shard_bytes: int = SHARD_BYTES
) -> dict[str, Any]:
    """Write `sequences` as the bundle `data` in `directory`; returns its metadata."""
    if not sequences:
        raise ValueError("no sequences to pack")
    top = max(max(s.ids, default=0) for s in sequences)
    dtype = torch.uint16 if top < 2**16 else torch.int32
    lengths = np.array([len(s.ids) for s in sequences], dtype=np.int64)
    shards = []
    for start, end in _shard_ranges(lengths * dtype.itemsize + 8, tensor_budget(shard_bytes)):
        chunk = sequences[start:end]
        shards.append(
            {
                "ids": torch.tensor([t for s in chunk for t in s.ids], dtype=torch.int64).to(dtype),
                "lengths": torch.from_numpy(lengths[start:end]).to(torch.int32),
                "prompt_len": torch.tensor([s.prompt_len for s in chunk], dtype=torch.int32),
            }
        )
    meta = {"sequences": len(sequences), "tokens": int(lengths.sum()), "ids_dtype": str(dtype).removeprefix("torch.")}
    save_bundle(directory, DATA_BUNDLE, shards, meta, shard_bytes)
    return meta


def unpack_sequences(directory: Path) -> list[TrainingSequence]:
    """The sequences of the complete bundle `data` in `directory`, in their order."""
    shards, _ = load_bundle(directory, DATA_BUNDLE)
    seqs = []
    for shard in shards:
        rows = torch.split(shard["ids"].to(torch.int64), shard["lengths"].tolist())
        seqs += [TrainingSequence(r.tolist(), int(n)) for r, n in zip(rows, shard["prompt_len"].tolist(), strict=True)]
    return seqs


def _shard_ranges(cost: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive (start, end) ranges whose summed `cost` (bytes per sequence) stays within `budget`."""
    total = np.cumsum(cost)
    ranges, start = [], 0
    while start < len(cost):
        base = total[start - 1] if start else 0
        end = int(np.searchsorted(total, base + budget, side="right"))
        if end == start:
            raise ValueError(f"sequence {start} alone needs {int(cost[start])} bytes, over a shard's {budget}")
        ranges.append((start, end))
        start = end
    return ranges
