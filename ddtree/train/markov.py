"""Training a Markov head (`ddtree.models.markov`) on the drafter's own teacher-forced candidates.

A tree's node at depth d+1 counts only where its parent, at depth d, was accepted: the target's token there.
So the head learns from the target's replies: for every anchor of every reply and every depth d+1 >= 2, the
drafter's top-k candidates at depth d+1 (`ddtree.train.teacher.draft_logits`, the training forward), the
target's token at depth d (the parent) and at depth d+1 (the label). The loss is the cross-entropy of the
label among the candidates under `ddtree.tree.Transition.condition`'s scores; a label outside the candidates
is left out (no tree of those candidates could hold it). The drafter and the target stay frozen.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

from ddtree.models.dflash import WEIGHTS_NAME, DFlashDrafter
from ddtree.models.markov import MarkovHead, save_head
from ddtree.models.target import Target
from ddtree.train.data import TrainingSequence
from ddtree.train.teacher import Reply, draft_logits, target_after_anchors

CANDIDATES = 16  # the candidates per depth a head is trained over (a tree's top-k rarely reaches past them)


@dataclass(frozen=True)
class HeadSamples:
    """One row per (anchor, depth >= 2) whose target token is among the depth's candidates."""

    log_probs: torch.Tensor  # [n, k] float32: the candidates' marginal log-probabilities
    ids: torch.Tensor  # [n, k] int64: the candidates' token ids
    parent: torch.Tensor  # [n] int64: the target's token at the depth above
    label: torch.Tensor  # [n] int64: the target's token's index among the candidates

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def to(self, device: torch.device) -> HeadSamples:
        return HeadSamples(*(t.to(device) for t in (self.log_probs, self.ids, self.parent, self.label)))


def replies_of(sequences: Sequence[TrainingSequence], depth: int) -> list[Reply]:
    """Training sequences as replies whose every anchor has `depth` target tokens after it."""
    replies = []
    for s in sequences:
        tokens = s.ids[s.prompt_len :]
        if len(tokens) > depth + 1:
            replies.append(Reply(s.ids[: s.prompt_len], tokens, len(tokens) - depth - 1))
    return replies


def head_samples(
    target: Target, drafter: DFlashDrafter, replies: Sequence[Reply], k: int = CANDIDATES, quiet: bool = True
) -> HeadSamples:
    """Every reply's (anchor, depth >= 2) rows whose label is among the depth's top-`k` candidates."""
    depth = drafter.depth
    parts: list[tuple[torch.Tensor, ...]] = []
    for reply in tqdm(replies, desc="samples", unit="reply", disable=quiet):
        logits = draft_logits(target, drafter, reply)  # [limit, depth, vocab]
        truth = target_after_anchors(reply, depth + 1, logits.device)  # [limit, depth + 1]: truth[:, d] at depth d+1
        lp, ids = torch.log_softmax(logits[:, 1:].float(), dim=-1).topk(k, dim=-1)  # [limit, depth - 1, k]
        parent, child = truth[:, : depth - 1], truth[:, 1:depth]  # [limit, depth - 1]
        hit = ids == child[..., None]  # [limit, depth - 1, k]
        keep = hit.any(dim=-1)
        parts.append((lp[keep], ids[keep], parent[keep], hit[keep].float().argmax(dim=-1)))
    if not parts or sum(len(p[3]) for p in parts) == 0:
        raise ValueError("no reply gives a sample: the replies are shorter than the drafter's depth")
    log_probs, ids, parent, label = (torch.cat(column).cpu() for column in zip(*parts, strict=True))
    return HeadSamples(log_probs, ids, parent, label)


def head_loss(head: MarkovHead, embeddings: torch.Tensor, samples: HeadSamples) -> torch.Tensor:
    """Mean cross-entropy of the labels among their candidates, the candidates scored given their parent."""
    u = embeddings[samples.parent].float() @ head.parent  # [n, rank]
    v = embeddings[samples.ids].float() @ head.child  # [n, k, rank]
    scores = samples.log_probs + (v @ u[:, :, None]).squeeze(-1)  # [n, k]
    return F.cross_entropy(scores, samples.label)


def train_head(
    samples: HeadSamples,
    embeddings: torch.Tensor,
    rank: int,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 2048,
    seed: int = 0,
    valid: HeadSamples | None = None,
    check_every: int = 50,
    quiet: bool = True,
) -> MarkovHead:
    """A head of `rank` trained for up to `steps` Adam steps on batches of `samples`, over `embeddings`
    `[vocab, hidden]` (frozen). It starts as the marginal tree (`MarkovHead`: a zero parent factor). With
    `valid`, its loss is checked every `check_every` steps and the best head is kept: a bigram over a large
    vocabulary learns the training pairs by heart (on 232 replies of the default pair, rank 64 at 3e-3 for
    1,500 steps took the validation loss from 1.75 to 1.96, where 300 steps at 1e-3 took it to 1.28)."""
    gen = torch.Generator().manual_seed(seed)
    embeddings = embeddings.detach().float()
    device = embeddings.device  # where it trains; the samples stay on the host, a batch at a time goes over
    valid = None if valid is None else valid.to(device)
    head = MarkovHead(int(embeddings.shape[1]), rank)
    with torch.no_grad():
        head.child.copy_(torch.randn(head.child.shape, generator=gen) / embeddings.shape[1] ** 0.5)
    head.to(device)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    best = (float("inf"), {k: v.clone() for k, v in head.state_dict().items()})
    if valid is not None:  # the marginal tree's loss: the head kept is never worse on `valid`
        with torch.no_grad():
            best = (float(head_loss(head, embeddings, valid)), best[1])
    for step in tqdm(range(1, steps + 1), desc="train", unit="step", disable=quiet):
        pick = torch.randint(len(samples), (min(batch_size, len(samples)),), generator=gen)
        batch = HeadSamples(samples.log_probs[pick], samples.ids[pick], samples.parent[pick], samples.label[pick])
        batch = batch.to(device)
        loss = head_loss(head, embeddings, batch)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if valid is not None and (step % check_every == 0 or step == steps):
            with torch.no_grad():
                checked = float(head_loss(head, embeddings, valid))
            if checked < best[0]:
                best = (checked, {k: v.clone() for k, v in head.state_dict().items()})
    if valid is not None:
        head.load_state_dict(best[1])
    return head.eval()


def run_head_training(
    target_dir: str,
    drafter_dir: str,
    data: str,
    out: str | None,
    rank: int,
    steps: int,
    lr: float,
    max_sequences: int,
    device: str = "auto",
    seed: int = 0,
) -> dict[str, Any]:
    """`ddtree drafter train-head`: samples from the first `max_sequences` sequences of `data` (a tenth kept
    apart to validate and to keep the best head), a head trained on the rest, written to `out` (default: the
    drafter's directory; a new directory gets the drafter's files too). Returns the sample counts and the
    validation loss without and with the head."""
    from ddtree.models.pair import load_models
    from ddtree.train.data import read_sequences

    target, drafter, _ = load_models(target_dir, drafter_dir, device, "float32")
    assert drafter is not None
    drafter.transition = None  # the samples are the drafter's marginals, whatever head it has now
    replies = replies_of(read_sequences(data)[:max_sequences], drafter.depth)
    apart = max(1, len(replies) // 10)
    if len(replies) < 2:
        raise ValueError(
            f"{data!r} has {len(replies)} sequences longer than the drafter's depth; at least 2 are needed"
        )
    valid = head_samples(target, drafter, replies[:apart], quiet=False)
    train = head_samples(target, drafter, replies[apart:], quiet=False)
    weight: torch.Tensor = target.embed_tokens.weight  # type: ignore[assignment]
    embeddings = weight.detach().float()
    head = train_head(train, embeddings, rank, steps, lr, seed=seed, valid=valid, quiet=False)
    with torch.no_grad():
        valid = valid.to(embeddings.device)
        before = float(head_loss(MarkovHead(head.parent.shape[0], rank).to(embeddings.device), embeddings, valid))
        after = float(head_loss(head, embeddings, valid))
    directory = Path(out or drafter_dir)
    if directory != Path(drafter_dir):
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", WEIGHTS_NAME):
            shutil.copyfile(Path(drafter_dir) / name, directory / name)
    path = save_head(head, directory)
    losses = {"valid_loss_marginal": round(before, 4), "valid_loss_head": round(after, 4)}
    return {
        "head": str(path),
        "rank": rank,
        "steps": steps,
        "train_samples": len(train),
        "valid_samples": len(valid),
    } | losses
