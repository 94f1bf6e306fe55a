"""Acceptance measured teacher-forced: tau of the chain and of any tree budget without decoding.

At T=0 the accepted tokens are the target's greedy reply, whatever drafted them. So one target pass over
each prompt and its greedy reply gives the drafter's context at every position, one drafter pass over an
anchor at every reply position (the training forward, `forward_blocks`) gives each position's per-depth
distributions, and the accept walk of the engine (`ddtree.accept.accept`) on each position's tree gives
how many drafts a step starting there would accept (`matched_drafts`). A decode is then a walk over those
counts (`walk`): a step at reply index j accepts `m[j]` drafts and the bonus, and the next starts at
j + m[j] + 1, until the end-of-sequence token or the token limit, as the engine counts them. Steps may
accept drafts past the limit (the engine records them), so the replies run `depth` tokens past it.

In exact arithmetic this is the engine's tau; in float32 the drafter's context comes from a causal pass
rather than the verify forwards, and rounding may flip a near tie (`docs/drafter-training.md` has the
measured agreement with `ddtree bench`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.accept import accept
from ddtree.engine.engine import Engine
from ddtree.methods import TreeShape, get_method, mean_acceptance_length
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.settings import GenerationConfig
from ddtree.train.heldout import HeldoutSet
from ddtree.train.runs import EVAL_BUDGET
from ddtree.train.trainer import block_mask
from ddtree.tree import Transition, ancestor_mask, build_tree, reachable_depth


@dataclass(frozen=True)
class Reply:
    """A prompt and the target's greedy continuation, `limit` + the drafter's depth tokens long (end of
    sequence or not): what a decode with a `limit`-token budget may accept."""

    prompt: list[int]
    tokens: list[int]
    limit: int


def greedy_replies(
    engine: Engine, prompts: list[list[int]], limit: int, depth: int, batch_size: int = 16
) -> list[Reply]:
    """The target's greedy replies to `prompts` (our `ar`, batches of `batch_size`), each `limit` + `depth`
    (the drafter's) tokens long."""
    length = limit + depth
    config = GenerationConfig(method="ar", max_new_tokens=length)
    replies = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        outputs = engine.generate(batch, config).outputs
        replies += [Reply(p, list(o.token_ids), limit) for p, o in zip(batch, outputs, strict=True)]
    return replies


def draft_logits(target: Target, drafter: DFlashDrafter, reply: Reply) -> torch.Tensor:
    """`[limit, depth, vocab]`: the drafter's logits for a step anchored at each reply index j < limit (the
    anchor is reply token j, its context the target's features before it)."""
    ids = torch.tensor([reply.prompt + reply.tokens], device=target.device)
    anchors = len(reply.prompt) + torch.arange(reply.limit, device=target.device)[None]  # [1, n]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    block = drafter.block_size
    with torch.no_grad():
        model: Any = target.model
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        positions = anchors[:, :, None] + torch.arange(block, device=ids.device)  # [1, n, block]
        block_ids = torch.where(positions == anchors[:, :, None], ids[0, anchors][:, :, None], drafter.mask_token_id)
        hidden = drafter.forward_blocks(
            target.embed(block_ids.flatten(1)),
            positions.flatten(1),
            features,
            block_mask(anchors, keep, ids.shape[1], block),
        )
        drafted = hidden.view(reply.limit, block, -1)[:, 1 : 1 + drafter.depth]
        logits: torch.Tensor = target.head(drafted)
    return logits


def matched_drafts(
    logits: torch.Tensor, truth: torch.Tensor, shape: TreeShape, transition: Transition | None = None
) -> torch.Tensor:
    """`[n]` drafts a step of `shape` accepts at each of n positions: its tree built from `logits`
    `[n, depth, vocab]` as the engine builds it (conditioned by a Markov head's `transition`), and walked with
    `truth` `[n, depth + 1]`, the target's tokens after the anchor (a node at depth d is checked against
    `truth[:, d]`)."""
    depth = reachable_depth(shape.budget, logits.shape[1])
    tree = build_tree(logits[:, :depth], shape.budget, shape.topk, transition)
    target_tokens = truth.gather(1, tree.depths)  # [n, nodes]: the target's choice at each node
    root = torch.zeros(truth.shape[0], dtype=torch.long, device=truth.device)
    return accept(tree, ancestor_mask(tree), target_tokens, root).accepted


def target_after_anchors(reply: Reply, width: int, device: torch.device) -> torch.Tensor:
    """`[limit, width]`: the target's `width` tokens after the anchor at each reply index j < limit (past the
    reply's end, its last token)."""
    tokens = torch.tensor(reply.tokens, device=device)
    index = torch.arange(reply.limit, device=device)[:, None] + torch.arange(1, width + 1, device=device)
    return tokens[index.clamp(max=len(reply.tokens) - 1)]


def walk(matched: Sequence[int], reply: Reply, eos: Collection[int]) -> list[int]:
    """The acceptance lengths of a decode of `reply.limit` tokens whose step at reply index j accepts
    `matched[j]` drafts: the first token comes from the prefill, and the decode ends at the first
    end-of-sequence token or the limit."""
    tokens, lengths = reply.tokens, list[int]()
    emitted, j = 1, 0
    if tokens[0] in eos or reply.limit <= 1:
        return lengths
    while True:
        n = matched[j]
        lengths.append(n + 1)
        for token in tokens[j + 1 : j + n + 2]:
            emitted += 1
            if token in eos or emitted >= reply.limit:
                return lengths
        j += n + 1


def acceptance_lengths(
    target: Target, drafter: DFlashDrafter, replies: list[Reply], shapes: list[TreeShape], eos: Collection[int]
) -> dict[str, list[list[int]]]:
    """Per shape (by its label), each reply's acceptance lengths, step by step, as `walk` counts them."""
    lengths: dict[str, list[list[int]]] = {s.label: [] for s in shapes}
    depth = drafter.depth
    for reply in replies:
        logits = draft_logits(target, drafter, reply)
        truth = target_after_anchors(reply, depth + 1, logits.device)  # [limit, depth + 1]
        for shape in shapes:
            matched = matched_drafts(logits, truth, shape, drafter.transition)
            lengths[shape.label].append(walk(matched.tolist(), reply, eos))
    return lengths


def teacher_forced_tau(
    target: Target, drafter: DFlashDrafter, replies: list[Reply], shapes: list[TreeShape], eos: Collection[int]
) -> dict[str, float | None]:
    """tau per shape (by its label) over all steps of all `replies`."""
    per_reply = acceptance_lengths(target, drafter, replies, shapes, eos)
    return {label: mean_acceptance_length([n for r in runs for n in r]) for label, runs in per_reply.items()}


def eval_shapes(budgets: Sequence[int], depth: int, chain: bool = True) -> list[TreeShape]:
    """The chain (`dflash`, with `chain`) and ddtree at each budget, for a drafter of `depth`."""
    shapes = [get_method("dflash").shape(0, None, depth)] if chain else []
    return shapes + [get_method("ddtree").shape(b, None, depth) for b in budgets]


def heldout_teacher_eval(
    held: HeldoutSet, max_new_tokens: int = 64, budgets: Sequence[int] = (EVAL_BUDGET,)
) -> dict[str, Any]:
    """tau of dflash and ddtree at `budgets`, greedy, teacher-forced on the held-out prompts with
    `max_new_tokens` each: the record `--eval-heldout` keeps."""
    evaluate = heldout_evaluator(held.target.model, held.tokenizer, held.drafter, held.prompts, max_new_tokens, budgets)
    return {
        "measure": "teacher-forced",
        "prompts": len(held.prompts),
        "max_new_tokens": max_new_tokens,
        "device": str(held.target.device),
        "tau": evaluate(held.drafter),
    }


def heldout_evaluator(
    model: Any,
    tokenizer: Any,
    drafter: DFlashDrafter,
    encoded: list[list[int]],
    max_new_tokens: int = 64,
    budgets: Sequence[int] = (EVAL_BUDGET,),
) -> Callable[[DFlashDrafter], dict[str, float]]:
    """For training curves: the target's greedy replies to the `encoded` held-out prompts
    (`ddtree.train.heldout.encode_heldout`), made once, and a function that gives a drafter's teacher-forced
    tau on them (dflash and ddtree at `budgets`). `model` is the HF target being trained against; the drafter
    may be in float32 beside a bfloat16 target on CUDA."""
    from ddtree.models.chat import eos_ids
    from ddtree.models.hybrid import make_target

    target = make_target(model, feature_layers=drafter.target_layer_ids)
    replies = greedy_replies(Engine(target, None, cuda_graphs="off"), encoded, max_new_tokens, drafter.depth)
    shapes, eos = eval_shapes(budgets, drafter.depth), eos_ids(tokenizer, target)

    def evaluate(current: DFlashDrafter) -> dict[str, float]:
        on_cuda = target.device.type == "cuda"
        with torch.autocast("cuda", dtype=target.dtype, enabled=on_cuda), torch.no_grad():
            tau = teacher_forced_tau(target, current, replies, shapes, eos)
        return {label: round(t, 4) for label, t in tau.items() if t is not None}

    return evaluate


def chain_depth_counts(logits: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`([depth], [depth])`: of n steps with drafter `logits` `[n, depth, vocab]` and the target's tokens
    `truth` `[n, depth]` after each anchor, how many reach each depth of the chain (every draft before it
    matched) and how many of those match there."""
    matched = torch.cumprod((logits.argmax(-1) == truth).long(), dim=1)  # [n, depth]: drafts 1..d all matched
    reached = torch.cat([torch.ones_like(matched[:, :1]), matched[:, :-1]], dim=1)  # [n, depth]
    return reached.sum(0), matched.sum(0)


def top_k_coverage(logits: torch.Tensor, truth: torch.Tensor, k: int) -> torch.Tensor:
    """`[k]`: how many of n steps have the target's first token `truth` `[n]` among the drafter's top 1 .. k
    first drafts (`logits` `[n, vocab]`)."""
    top = logits.topk(k, dim=-1).indices  # [n, k]
    return (top == truth[:, None]).long().cumsum(dim=1).clamp(max=1).sum(0)


def heldout_depth_profile(held: HeldoutSet, max_new_tokens: int = 64, k: int = 4) -> dict[str, list[float]]:
    """Where the chain loses drafts, teacher-forced at every reply position of the held-out set: the rate at
    which the draft at each depth matches once every draft before it has (`conditional`), and the share of
    positions whose first token is among the drafter's top 1 .. `k` (`first_in_top`: what a tree's width
    can add at depth 1)."""
    depth = held.drafter.depth
    replies = greedy_replies(Engine(held.target, None, cuda_graphs="off"), held.prompts, max_new_tokens, depth)
    reached, matched = torch.zeros(depth), torch.zeros(depth)
    covered, positions = torch.zeros(k), 0
    with torch.no_grad():
        for reply in replies:
            logits = draft_logits(held.target, held.drafter, reply).float().cpu()  # [limit, depth, vocab]
            truth = target_after_anchors(reply, depth, logits.device)  # [limit, depth]
            steps, hits = chain_depth_counts(logits, truth)
            reached, matched = reached + steps, matched + hits
            covered += top_k_coverage(logits[:, 0], truth[:, 0], k)
            positions += reply.limit
    return {
        "conditional": [round(x, 4) for x in (matched / reached.clamp(min=1)).tolist()],
        "first_in_top": [round(x, 4) for x in (covered / max(positions, 1)).tolist()],
    }
