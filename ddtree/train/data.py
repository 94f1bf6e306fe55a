"""Training data: the target's own greedy responses to chat prompts, stored as token ids.

A data file is JSON lines, one sequence per line: `{"ids": [prompt + response], "prompt_len": n}`. A
conversation of several user turns is one sequence: each turn is asked after the target's own reply to the
one before, and the prompt is everything before the last reply, so that only the last reply is trained on.
Packed, the same sequences are a bundle named `data` (`ddtree.train.bundle`): safetensors shards of at most 15 MiB,
each holding whole sequences as `ids` (all their tokens end to end, uint16 when every id is below 65,536,
else int32), `lengths` and `prompt_len` (int32, one per sequence). About 2 bytes a token instead of 6.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ddtree.engine.engine import Engine
from ddtree.errors import UserError
from ddtree.models.chat import chat_ids
from ddtree.models.target import Target
from ddtree.settings import GenerationConfig
from ddtree.train.bundle import SHARD_BYTES, load_bundle, save_bundle, tensor_budget

DATA_BUNDLE = "data"


@dataclass(frozen=True)
class TrainingSequence:
    ids: list[int]
    prompt_len: int


def next_turn_ids(tokenizer: Any, message: str) -> list[int]:
    """The ids that close an assistant reply and add the user turn `message`, ready for generation: what the
    chat template writes between two replies, or without one, `message` after a blank line."""
    text = _between_replies(tokenizer, message) if getattr(tokenizer, "chat_template", None) else "\n\n" + message
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


_REPLY = "<<ddtree-reply>>"


def _between_replies(tokenizer: Any, message: str) -> str:
    def render(turns: list[str], generation_prompt: bool) -> str:
        roles = ("user", "assistant")
        chat = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False)
        return str(text)

    opening, closed = render(["?"], True), render(["?", _REPLY], False)
    following = render(["?", _REPLY, message], True)
    if not (closed.startswith(opening + _REPLY) and following.startswith(closed)):
        raise ValueError(
            "the chat template does not write a conversation as its turns end to end (it rewrites an earlier "
            "turn), so the target's replies cannot be kept as generated"
        )
    return closed[len(opening + _REPLY) :] + following[len(closed) :]


def generate_conversations(
    target: Target,
    tokenizer: Any,
    conversations: Sequence[Sequence[str]],
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    batch_size: int = 64,
    quiet: bool = False,
) -> list[TrainingSequence]:
    """The target's greedy replies to conversations of user turns, turn by turn, in batches: turn k + 1
    follows the target's own reply to turn k, kept as generated (where the reply ends with the
    end-of-sequence token that the template writes next, that token is not written twice). A sequence's
    prompt is everything before its last reply."""
    if not all(conversations):
        raise ValueError("every conversation needs at least one user turn")
    first = [chat_ids(tokenizer, turns[0]) for turns in conversations]
    seqs = generate_responses(target, first, max_new_tokens, eos_token_ids, batch_size, quiet)
    for turn in range(1, max(map(len, conversations), default=0)):
        todo = [i for i, turns in enumerate(conversations) if len(turns) > turn]
        prompts = [
            _continued(seqs[i].ids, next_turn_ids(tokenizer, conversations[i][turn]), eos_token_ids) for i in todo
        ]
        replies = generate_responses(target, prompts, max_new_tokens, eos_token_ids, batch_size, quiet)
        for i, seq in zip(todo, replies, strict=True):
            seqs[i] = seq
    return seqs


def _continued(ids: list[int], turn: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """`ids` then `turn`, less the turn's first token where the reply already ended with it."""
    if ids and turn and ids[-1] == turn[0] and ids[-1] in eos_token_ids:
        turn = turn[1:]
    return ids + turn


def write_training_data(
    target: str | None,
    out: str | Path,
    conversations: Sequence[Sequence[str]],
    max_new_tokens: int,
    batch_size: int,
    device: str = "auto",
    dtype: str = "auto",
) -> int:
    """Write the target's greedy replies to `conversations` (lists of user turns) as a data file; returns
    the number of sequences. `target` is a target directory, None for the default target."""
    from ddtree.models.chat import eos_ids
    from ddtree.models.default import default_target
    from ddtree.models.pair import load_models

    if max_new_tokens < 1 or batch_size < 1:
        raise UserError(f"--max-new-tokens and --batch-size must be >= 1, got {max_new_tokens} and {batch_size}")
    target_model, _, tokenizer = load_models(
        target if target is not None else str(default_target()), None, device, dtype
    )
    if tokenizer is None:
        raise UserError("the target has no tokenizer")
    if any(len(turns) > 1 for turns in conversations):
        try:
            next_turn_ids(tokenizer, "?")
        except ValueError as exc:
            raise UserError(f"multi-turn prompts: {exc}") from exc
    eos = eos_ids(tokenizer, target_model)
    seqs = generate_conversations(target_model, tokenizer, conversations, max_new_tokens, eos, batch_size)
    write_sequences(out, seqs)
    return len(seqs)


def generate_responses(
    target: Target,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    batch_size: int = 64,
    quiet: bool = False,
) -> list[TrainingSequence]:
    """Greedy target responses (method ar), batched; prompts sorted by length to limit padding. A batch that
    runs out of device memory is retried at half the size by a fresh engine, and the rest keep the smaller size."""
    engine = Engine(target)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, TrainingSequence] = {}
    config = GenerationConfig(method="ar", max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    with tqdm(total=len(order), desc="responses", unit="prompt", disable=quiet) as bar:
        start = 0
        while start < len(order):
            chunk = order[start : start + batch_size]
            try:
                result = engine.generate([prompts[i] for i in chunk], config)
            except torch.OutOfMemoryError:
                if batch_size == 1:
                    raise
                result = None
            if result is None:  # outside the handler, so that its traceback no longer holds the batch's tensors
                batch_size = max(1, batch_size // 2)
                engine = Engine(target)  # drops the caches and CUDA graphs sized for the batch that failed
                gc.collect()
                torch.cuda.empty_cache()
                note = f"out of device memory at {len(chunk)} prompts a batch: going on with {batch_size}"
                bar.write(note, sys.stderr)
                continue
            for i, res in zip(chunk, result.outputs, strict=True):
                out[i] = TrainingSequence(ids=list(prompts[i]) + res.token_ids, prompt_len=len(prompts[i]))
            start += len(chunk)
            bar.update(len(chunk))
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
