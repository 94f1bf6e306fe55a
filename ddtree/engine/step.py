"""One decode step, top to bottom: draft -> tree_build -> verify -> accept, then the readout.

Each stage is a plain function of the session's models (`StepModels`) and the step's state (`StepState`):
it reads what the stages before it wrote and writes its own fields. The state's tensors are the step's static
buffers: a CUDA graph captured on one state replays on it, and everything that lives across steps sits in the
session's per-slot tensors (`Rows` views them), which the stages update in place.

    draft       rows.root, rows.context, rows.draft_cache -> logits [n, depth, vocab] (None for ar)
    tree_build  logits -> tree (DraftTree), ancestors [n, nodes, nodes]
    verify      tree, ancestors, rows.cache -> choice [n, nodes] (the target's token at each node), features,
                and with `logprobs` the target's log-probabilities at each node (scores)
    accept      tree, ancestors, choice -> result (AcceptResult); commits the accepted path to the caches
    readout     result (and the tree, the accepted path's ranks and stamps when observed; the path's scores)
                -> out [n, columns], the one host readback

An adaptive step (`--budget adaptive`) runs in two parts. The first drafts and builds its cap's tree, then
`decide`s on the device which width pays most (`ddtree.adaptive`) -> decision [4 + 2K], which the host reads
before the second part, or, where its row count is committed to a width, with the step's tokens.
The second verifies and accepts the tree's first `width` nodes: its state's `source` is the first part's
state, and `narrow` takes the tree from it inside the step (so a replay reads what the first part's replay
wrote).

The flags a step is made with (`sampled`, `filtered`, `logprobs`) are known at launch from the requests
decoding, and are part of the step's graph key: a step in which no request samples, filters or asks for
log-probabilities does none of that work.

`decode_step` is the whole step as the session runs it, in one function: the plan from the slots
(`StepPlan`), the observer's start, the stages (run eagerly or replayed by `ddtree.engine.graphs.StepRunner`,
which chooses that and nothing else), the one readback, then, once resumed (the session launches the next
step first where it pipelines), the wait (`read_back`), an adaptive step's decision, and the commit of the
accepted tokens to the slots (`commit`).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from ddtree.accept import AcceptResult, accept
from ddtree.adaptive import decision, expected_accepted
from ddtree.engine.logprobs import LogprobLayout, NodeLogprobs, node_logprobs, path_columns, read_row
from ddtree.engine.probe import ProbeLayout, readout, split_rows
from ddtree.engine.proposers import Proposer
from ddtree.engine.readback import Readback
from ddtree.engine.requests import Slot, emit
from ddtree.kv_cache import KVCache
from ddtree.methods import TreeShape
from ddtree.models.target import Target, TokenOrder
from ddtree.observer import StepObserver
from ddtree.sampling import choose_tokens
from ddtree.tree import DraftTree

if TYPE_CHECKING:
    from ddtree.engine.session import DecodeSession


@dataclass(frozen=True)
class Rows:
    """Views of the first `n` slots of every per-slot tensor: a step runs only these rows."""

    n: int
    root: torch.Tensor  # [n] the next tree's root token
    context: torch.Tensor | None  # [n, width, features] target features of the last accepted path (the widest
    # shape's width: a narrower step fills its first rows, and `counts` says how many are real)
    counts: torch.Tensor  # [n] real rows of `context`
    active: torch.Tensor  # [n] still decoding
    temperature: torch.Tensor  # [n]
    top_p: torch.Tensor  # [n] float (1: off)
    top_k: torch.Tensor  # [n] int64 (0: off)
    seed: torch.Tensor  # [n]
    draw: torch.Tensor  # [n] sampling draws so far
    cache: KVCache
    draft_cache: KVCache | None


@dataclass(frozen=True)
class StepModels:
    """What every step of a session runs on: fixed for the session's life."""

    target: Target
    proposer: Proposer
    fused: bool  # the models' compiled regions
    attention: str  # sdpa or triton (resolved)
    probed: bool  # the readout carries the probe (an observer is attached)


@dataclass
class StepState:
    """A step's inputs (set when it is made) and what each stage writes (set by the stage, in order)."""

    rows: Rows
    span: int  # keys attended: the committed prefix plus what this step may write, bucketed on CUDA
    sampled: bool  # some row samples (T > 0)
    filtered: bool = False  # some row that samples filters (top-p < 1 or top-k > 0)
    logprobs: bool = False  # some row asks for log-probabilities
    stamps: torch.Tensor | None = None  # [stages + 1] int64: the device clock, written by a stamped graph
    choice_of: Choosing | None = None  # an adaptive step's first part: what `decide` reads
    source: StepState | None = None  # an adaptive step's second part: the first part's state
    width: int | None = None  # an adaptive step's second part: the draft nodes it verifies
    logits: torch.Tensor | None = field(init=False)  # [n, depth, vocab] draft logits; None without a drafter
    tree: DraftTree = field(init=False)
    ancestors: torch.Tensor = field(init=False)  # [n, nodes, nodes] bool
    choice: torch.Tensor = field(init=False)  # [n, nodes] the target's token at each node
    features: torch.Tensor | None = field(init=False)  # [n, nodes, features] for the drafter's next context
    scores: NodeLogprobs | None = field(init=False)  # the target's log-probabilities; None: not `logprobs`
    result: AcceptResult = field(init=False)
    out: torch.Tensor = field(init=False)  # [n, columns] int64, what the host reads back
    layout: ProbeLayout | None = field(init=False)  # where the probe sits in `out`; None: no probe
    scored: LogprobLayout | None = field(init=False)  # the log-probabilities, `out`'s last columns; None: none
    decision: torch.Tensor = field(init=False)  # [4 + 2K] float32: an adaptive step's (`ddtree.adaptive.decision`)


@dataclass(frozen=True)
class Choosing:
    """What an adaptive step's `decide` weighs, static tensors the session updates in place: the widths, the
    step time at each for this row count, and each width's calibration scale."""

    widths: torch.Tensor  # [K] int64, 0 (ar) first
    cost: torch.Tensor  # [K] float32, seconds per step at this row count
    scale: torch.Tensor  # [K] float32, accepted over predicted drafts at each width (1: the raw prediction)


def draft(m: StepModels, s: StepState) -> None:
    r = s.rows
    s.logits = m.proposer.draft(r.root, r.context, r.counts, r.draft_cache, s.span, m.fused, m.attention)


def build(m: StepModels, s: StepState) -> None:
    s.tree = m.proposer.build(s.logits, s.rows.n)
    s.ancestors = m.proposer.ancestors(s.tree)  # [n, nodes, nodes]


def decide(m: StepModels, s: StepState) -> None:
    """The width (an index into `choice_of.widths`) with the most predicted tokens per second, on the device."""
    c = s.choice_of
    assert c is not None, "an adaptive step's first part is made with what it chooses between"
    expected = expected_accepted(s.tree.log_probs, c.widths)  # [n, K]
    s.decision = decision(expected, c.scale, c.widths, s.rows.active, c.cost)  # [4 + 2K]


def narrow(m: StepModels, s: StepState) -> None:
    """An adaptive step's second part: its tree is the first part's first `width` nodes."""
    assert s.source is not None and s.width is not None, "a second part is made on its first part"
    end = 1 + s.width
    s.tree = s.source.tree.first(s.width)
    s.ancestors = s.source.ancestors[:, :end, :end].contiguous()  # [n, end, end]


def narrow_verify(m: StepModels, s: StepState) -> None:
    narrow(m, s)
    verify(m, s)


def verify(m: StepModels, s: StepState) -> None:
    tree, r = s.tree, s.rows
    tokens = torch.where(tree.tokens < 0, 0, tree.tokens)  # [n, nodes]
    tokens[:, 0] = r.root
    positions = r.cache.lengths[:, None] + tree.depths
    order = TokenOrder(tree.parents, tree.depths, m.proposer.block - 1)  # for recurrent layers
    verified = m.target.forward(
        tokens, positions, s.ancestors, r.cache, s.span, fused=m.fused, attention=m.attention, order=order
    )
    top_p, top_k = (r.top_p, r.top_k) if s.filtered else (None, None)
    s.choice = choose_tokens(verified.logits, r.temperature, r.seed, r.draw, s.sampled, top_p, top_k)
    s.scores = node_logprobs(verified.logits, s.choice) if s.logprobs else None
    s.features = verified.features


def accept_step(m: StepModels, s: StepState) -> None:
    r = s.rows
    result = accept(s.tree, s.ancestors, s.choice, r.root)
    counts = torch.where(r.active, result.accepted + 1, 0)  # [n] tokens each slot commits
    r.cache.compact(result.path, counts)
    if s.features is not None and r.context is not None:
        index = result.path[:, :, None].expand(-1, -1, s.features.shape[-1])
        r.context[:, : index.shape[1]].copy_(s.features.gather(1, index))  # a narrower shape fills the first rows
    r.counts.copy_(counts)
    r.root.copy_(result.bonus)
    r.draw.add_(1)
    s.result = result


def finish(m: StepModels, s: StepState) -> None:
    """What the host reads back (after the last stage and its stamp): the tokens, the probe if observed, and
    the path's log-probabilities if asked for."""
    tail, s.scored = (None, None) if s.scores is None else path_columns(s.scores, s.result.path)
    depth = m.proposer.block - 1  # the deepest a tree of this proposer reaches: the path's rank columns
    s.out, s.layout = readout(s.result, s.tree if m.probed else None, s.stamps, tail, depth)


# -- the step, top to bottom --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """What a step runs, known at launch from the slots: its rows, key span, flags and tree."""

    rows: Rows
    span: int
    sampled: bool
    filtered: bool
    scored: bool
    shape: TreeShape  # the tree it drafts (an adaptive step: its cap's, until it chooses)

    @property
    def key(self) -> tuple[int, int, bool, bool, bool]:
        """The step's graph key: steps of one key replay the same graphs."""
        return (self.rows.n, self.span, self.sampled, self.filtered, self.scored)

    def state(self, **fields: Any) -> StepState:
        """A fresh state of this step's shape, with `fields` (an adaptive step's parts)."""
        return StepState(self.rows, self.span, self.sampled, self.filtered, self.scored, **fields)


Launched = Generator[StepState, None, list[int]]  # a step in flight: its state, then what each row kept


def decode_step(session: DecodeSession) -> Launched:
    """One decode step of `session`, top to bottom.

    Launch: the plan from the slots; the observer hears the step start; the stages run, eagerly or as graph
    replays (`DecodeSession.run_stages`: `ddtree.engine.graphs.StepRunner` for a fixed tree, the two parts
    of `ddtree.engine.adaptive` for an adaptive one); the one readback starts. Then the step yields its
    state: with a pipeline depth of 2 the session launches the next step before it finishes this one. Finish:
    the wait for the readback (the probe to the observer), an adaptive step's decision read and weighed, the
    accepted tokens given to the slots that decoded in the step and still do, and the observer hears the
    step end. Returns how many tokens each slot kept (0 past the step's rows)."""
    number, entries = session.steps, list(session.slots)
    plan = session.plan_step()
    state, shape, decision = session.run_stages(number, plan)
    ticket = session.readback.start(state.out)
    session.steps += 1
    yield state
    host, scores = read_back(session.readback, ticket, state, session.observer, number)
    gain = None if decision is None else session.adapt(number, shape, decision, entries, host)
    session.observer.on_accept(number, state.result, [row[0] for row in host])
    emitted, finished = commit(session.slots, entries, host, scores, shape.budget, gain)
    if finished:
        session.refresh_active()
    session.observer.on_step_end(number, emitted)
    return emitted + [0] * (len(session.slots) - len(emitted))


Scores = tuple[npt.NDArray[np.int64], LogprobLayout]  # a step's log-probability columns [rows, columns] on the host


def read_back(
    readback: Readback, ticket: Any, state: StepState, observer: StepObserver, number: int
) -> tuple[list[list[int]], Scores | None]:
    """The step's token rows (`[accepted, path tokens..., bonus]`) and, where asked for, its log-probability
    columns and their layout, after an explicit wait; a probe read back with them goes to the observer."""
    layout, scored = state.layout, state.scored
    if layout is None and scored is None:
        return readback.wait(ticket), None
    block = readback.wait_array(ticket)
    end = block.shape[1] - (0 if scored is None else scored.columns)  # where the log-probabilities start
    scores = None if scored is None else (block[:, end:], scored)
    if layout is None:
        return block[:, :end].tolist(), scores
    rows, probe = split_rows(block[:, :end], layout)
    observer.on_probe(number, probe)
    return rows, scores


def commit(
    slots: list[Slot | None],
    entries: list[Slot | None],
    host: list[list[int]],
    scores: Scores | None,
    budget: int,
    gain: float | None,
) -> tuple[list[int], bool]:
    """Give each slot that decoded in the step (its occupant then, `entries`) and still does its accepted drafts
    and bonus (and their log-probabilities where asked for, from `scores`), after its prefill's token if that
    was still unread. Returns how many tokens each of the step's rows (the first slots) kept, and whether some
    request finished."""
    emitted = [0] * len(host)
    finished_now = False
    for i, (entry, row) in enumerate(zip(slots, host, strict=False)):
        if entry is None or entry is not entries[i] or entry.output.finished:
            continue
        n = row[0]
        entry.length += n + 1  # what the device committed
        if entry.take_first():  # the prefill's token ended the request: this step's tokens are not kept
            finished_now = True
            continue
        entry.output.acceptance_lengths.append(n + 1)
        entry.output.budgets.append(budget)
        if gain is not None:
            entry.output.gains.append(gain)
        before = len(entry.output.token_ids)
        top = entry.request.logprobs
        asked = () if top is None or scores is None else read_row(scores[0][i], scores[1], n + 1, top)
        emit(entry, [*row[2 : 2 + n], row[-1]], *asked)
        emitted[i] = len(entry.output.token_ids) - before
        finished_now |= entry.output.finished
    return emitted, finished_now
