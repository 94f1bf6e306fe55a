"""The prefill: prompts that join together run into their slots' rows of the caches, and each request's first
token is chosen from the target's logits at its prompt's last position.

`prefill_inputs` makes the host's inputs (with the requests' settings, which the stage copies into the
session's per-slot tensors so that every later step reads them there) and `prefill_stage` the device function
over them, which the session runs eagerly or as a graph replay (`ddtree.engine.graphs.GraphCache`). Its
output is `first`, the one readback of a join: `[k]` tokens, or `[k, 1 + columns]` with each first token's
log-probability columns (`ddtree.engine.logprobs`) when some request asks for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddtree.engine.graphs import Tensors
from ddtree.engine.logprobs import node_logprobs, path_columns
from ddtree.engine.proposers import Proposer
from ddtree.engine.readback import to_device
from ddtree.engine.requests import Request
from ddtree.kv_cache import KVCache
from ddtree.models.target import Target, TokenOrder
from ddtree.sampling import choose_tokens

SETTINGS = ("temperature", "top_p", "top_k", "seed")  # a request's settings: the stage sets each slot's


@dataclass(frozen=True)
class PrefillFlags:
    """What a prefill computes beyond the greedy token: a key of its graphs."""

    sampled: bool  # some request samples
    filtered: bool  # some request that samples filters
    scored: bool  # some request asks for log-probabilities

    @staticmethod
    def of(requests: list[Request]) -> PrefillFlags:
        return PrefillFlags(
            sampled=any(r.temperature > 0 for r in requests),
            filtered=any(r.filtered for r in requests),
            scored=any(r.logprobs is not None for r in requests),
        )


@dataclass(frozen=True)
class PrefillInto:
    """What a prefill runs on and writes into: the session's models, caches and per-slot tensors."""

    target: Target
    proposer: Proposer
    cache: KVCache
    draft_cache: KVCache | None
    settings: dict[str, torch.Tensor]  # [slots] each, by the names in SETTINGS
    draw: torch.Tensor  # [slots]
    root: torch.Tensor  # [slots]
    counts: torch.Tensor  # [slots]
    fused: bool
    attention: str


def prefill_inputs(ids: list[int], requests: list[Request], width: int, device: torch.device) -> Tensors:
    """The prompts padded to `width`, their lengths, their slots `ids` and their settings, on the device."""
    return {
        "tokens": to_device([r.prompt + [0] * (width - len(r.prompt)) for r in requests], device),  # [k, width]
        "lengths": to_device([len(r.prompt) for r in requests], device),  # [k]
        "index": to_device(ids, device),  # [k] the slots
        "temperature": to_device([float(r.temperature) for r in requests], device).float(),  # [k]
        "top_p": to_device([float(r.top_p) for r in requests], device).float(),  # [k]
        "top_k": to_device([int(r.top_k) for r in requests], device),  # [k]
        "seed": to_device([r.seed for r in requests], device),  # [k]
    }


def prefill_stage(into: PrefillInto, flags: PrefillFlags) -> Callable[[Tensors], None]:
    def run(tensors: Tensors) -> None:
        tokens, lengths, index = tensors["tokens"], tensors["lengths"], tensors["index"]
        k, width = tokens.shape
        device = tokens.device
        steps = torch.arange(width, device=device)
        real = steps[None, :] < lengths[:, None]  # [k, width]
        causal = torch.tril(torch.ones((width, width), dtype=torch.bool, device=device))
        visible = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
        scratch = into.target.new_cache(k, width)
        positions = steps.expand(k, -1)
        last = (lengths - 1)[:, None]
        chain = TokenOrder(lengths=lengths)  # for recurrent layers: each prompt in order, then padding
        out = into.target.forward(
            tokens, positions, visible, scratch, width, last, into.fused, into.attention, any_shape=True, order=chain
        )
        scratch.lengths.copy_(lengths)
        into.cache.load_rows(index, scratch)
        draft_scratch = into.proposer.new_cache(k, width)
        if into.draft_cache is not None and draft_scratch is not None:
            into.proposer.append_context(out.features, lengths, draft_scratch)
            into.draft_cache.load_rows(index, draft_scratch)
        for name in SETTINGS:
            into.settings[name][index] = tensors[name]
        choice, tensors["first"] = _first(out.logits, tensors, flags)
        into.draw.index_fill_(0, index, 1)
        into.root[index] = choice[:, 0]
        into.counts.index_fill_(0, index, 0)

    return run


def _first(logits: torch.Tensor, tensors: Tensors, flags: PrefillFlags) -> tuple[torch.Tensor, torch.Tensor]:
    """The first tokens `[k, 1]` from the last positions' `logits` `[k, 1, vocab]`, and what the host reads back
    of them: the tokens `[k]`, or with `flags.scored` `[k, 1 + columns]`, each token and its log-probabilities."""
    draw = torch.zeros_like(tensors["index"])  # the prefill is each request's draw 0
    top_p, top_k = (tensors["top_p"], tensors["top_k"]) if flags.filtered else (None, None)
    temperature, seed = tensors["temperature"], tensors["seed"]
    choice = choose_tokens(logits, temperature, seed, draw, flags.sampled, top_p, top_k)  # [k, 1]
    if not flags.scored:
        return choice, choice[:, 0]
    columns, _ = path_columns(node_logprobs(logits, choice), torch.zeros_like(choice))  # [k, columns]
    return choice, torch.cat([choice, columns], dim=1)
