"""DFlash drafter training (the recipe of arXiv:2602.06036, written for this engine).

Glossary
- anchor a: a response position whose token starts a block `[tok[a], mask, ..., mask]` at positions
  `a..a+L`. The block sees the target's features at positions `< a` (as at inference, where the block's
  first token has not been through the target yet) and, non-causally, the rest of its own block.
- block position k >= 1 predicts `tok[a+k]`; its loss weight is `exp(-(k-1)/gamma)`, since early positions
  decide acceptance. The loss is the cross-entropy on the data's tokens (`ce`) or, with `distill="kl"`,
  KL(target || drafter) against the target's own distribution for that token (`ddtree.train.distill`).
- time budget: `total_seconds` is the training time over all runs that the cosine schedule spans (the state
  keeps the time used so far); `max_seconds` ends this run, which a later run resumes.

Many blocks per sequence train in one forward: a dense boolean mask keeps blocks apart. The target is
frozen and runs without gradients to give the features; the drafter shares its embeddings and head.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

from ddtree.models.dflash import DFlashDrafter, save_drafter
from ddtree.train.data import TrainingSequence
from ddtree.train.distill import kl_per_position, teacher_logits
from ddtree.train.runs import append_run, describe_data, run_record
from ddtree.train.state import STATE_FILE

REPORT_FILE = "training.json"
LOSSES = ("ce", "kl", "ce+kl")
COMPLETE = ("steps", "total time")  # stop reasons after which training is done (others: a run ended early)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    anchors: int = 32  # blocks per sequence
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    gamma: float = 7.0  # loss decay over block positions
    max_len: int = 512
    seed: int = 0
    checkpoint_every: int = 200
    max_seconds: float | None = None  # this run's wall-clock limit
    total_seconds: float | None = None  # training time of all runs that the schedule spans (default max_seconds)
    distill: str = "ce"  # "ce": cross-entropy on the data's tokens; "kl": KL(target || drafter); "ce+kl": both
    eval_every_seconds: float | None = None  # training time between held-out evaluations within a run

    @property
    def schedule_seconds(self) -> float | None:
        """The time budget of the LR schedule, over all runs; it ends the training when used up."""
        return self.total_seconds or self.max_seconds


def check_config(config: TrainConfig) -> None:
    if config.distill not in LOSSES:
        raise ValueError(f"distill must be one of {', '.join(LOSSES)}, got {config.distill!r}")
    if config.gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {config.gamma}")
    for name in ("max_seconds", "total_seconds", "eval_every_seconds"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def block_batch(
    seqs: list[TrainingSequence], block_size: int, anchors: int, max_len: int, rng: random.Random, device: torch.device
) -> dict[str, torch.Tensor]:
    """Pad sequences and draw anchors. Returns ids, attention mask, anchors `[b, n]` and `keep` `[b, n]`."""
    ids = [s.ids[:max_len] for s in seqs]
    width = max(len(x) for x in ids)
    tokens = torch.zeros((len(ids), width), dtype=torch.long)
    attn = torch.zeros((len(ids), width), dtype=torch.long)
    anchor = torch.zeros((len(ids), anchors), dtype=torch.long)
    keep = torch.zeros((len(ids), anchors), dtype=torch.bool)
    for b, (seq, x) in enumerate(zip(seqs, ids, strict=True)):
        tokens[b, : len(x)] = torch.tensor(x)
        attn[b, : len(x)] = 1
        candidates = list(range(seq.prompt_len, len(x) - 1))  # response tokens with at least one label
        chosen = sorted(rng.sample(candidates, min(anchors, len(candidates))))
        anchor[b, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        keep[b, : len(chosen)] = True
    batch = {"ids": tokens, "attention_mask": attn, "anchors": anchor, "keep": keep}
    return {k: v.to(device) for k, v in batch.items()}


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[b, 1, n*block, context_len + n*block]: context before the block's anchor, and the block itself."""
    b, n = anchors.shape
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [q]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, q]
    ctx = torch.arange(context_len, device=anchors.device)[None, None, :] < q_anchor[:, :, None]  # [b, q, s]
    ctx = ctx & keep.repeat_interleave(block_size, dim=1)[:, :, None]
    same = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [b, q, q]
    return torch.cat([ctx, same], dim=2)[:, None]


def block_loss(
    drafter: DFlashDrafter, target: Any, batch: dict[str, torch.Tensor], gamma: float, distill: str = "ce"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted block loss (`ce` or `kl`) and top-1 accuracy over the drafted positions."""
    ids, anchors, keep = batch["ids"], batch["anchors"], batch["keep"]
    bs = drafter.block_size
    last_hidden, features = _target_states(target, batch, drafter.target_layer_ids)
    offsets = torch.arange(bs, device=ids.device)
    positions = anchors[:, :, None] + offsets  # [b, n, bs]
    in_seq = positions < batch["attention_mask"].sum(dim=1)[:, None, None]
    labels = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(positions)
    block_ids = torch.where(offsets == 0, labels, drafter.mask_token_id)  # [b, n, bs]
    hidden = drafter.forward_blocks(
        target.get_input_embeddings()(block_ids.flatten(1)),
        positions.flatten(1),
        features,
        block_mask(anchors, keep, ids.shape[1], bs),
    )
    drafted = (keep[:, :, None] & in_seq)[:, :, 1:]  # [b, n, bs-1]: the positions that count
    head = target.get_output_embeddings()
    logits = head(hidden.view(*positions.shape, -1)[:, :, 1:][drafted]).float()  # [m, vocab]
    wanted = labels[:, :, 1:][drafted]  # [m]
    per_position = torch.zeros_like(wanted, dtype=torch.float32)
    if "kl" in distill.split("+"):  # the target's distribution for token a+k is its output at a+k-1
        per_position = kl_per_position(logits, teacher_logits(head, last_hidden, positions[:, :, :-1], drafted))
    if "ce" in distill.split("+"):
        per_position = per_position + F.cross_entropy(logits, wanted, reduction="none")
    decay = torch.exp(-torch.arange(bs - 1, device=ids.device).float() / gamma)  # [bs-1]: k = 1..bs-1
    weight = decay.expand_as(drafted)[drafted]  # [m]
    loss = (per_position * weight).sum() / weight.sum().clamp(min=1e-6)
    with torch.no_grad():
        acc = (logits.argmax(-1) == wanted).sum() / drafted.sum().clamp(min=1)
    return loss, acc


def _target_states(
    target: Any, batch: dict[str, torch.Tensor], layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's final hidden states `[b, s, hidden]` and the drafter's context features
    `[b, s, len(layers) * hidden]`, from its decoder alone (no logits at every position)."""
    with torch.no_grad():
        out = target.get_decoder()(
            input_ids=batch["ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
        features = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    return out.last_hidden_state, features


@dataclass
class _Progress:
    step: int = 0
    elapsed: float = 0.0  # training seconds of all runs, as of the last checkpoint
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # this run's held-out evaluations
    last_eval: float | None = None  # the training time of the last one, unrounded (evals' seconds are rounded)


Evaluate = Callable[[DFlashDrafter], dict[str, float]]  # the drafter as it is now -> tau by method label


class _Timer:
    """Training time over all runs: what earlier runs used (from the state) plus this run's wall time."""

    def __init__(self, config: TrainConfig, clock: Callable[[], float]) -> None:
        self.config, self.clock = config, clock
        self.before = self.total = self.started = 0.0

    def start(self, before: float) -> None:
        self.before = self.total = before
        self.started = self.clock()

    def tick(self) -> None:
        self.total = self.before + self.clock() - self.started

    def excluded(self, work: Callable[[], Any]) -> Any:
        """Run `work` without counting its time as training time: the clock goes on from the last `tick`."""
        try:
            return work()
        finally:
            self.started = self.clock() - (self.total - self.before)

    @property
    def run(self) -> float:
        return self.total - self.before

    @property
    def fraction(self) -> float:
        """The share of the schedule's time budget used so far (0 without a budget)."""
        budget = self.config.schedule_seconds
        return self.total / budget if budget else 0.0

    def stop_reason(self) -> str | None:
        budget = self.config.schedule_seconds
        if budget and self.total >= budget:
            return "total time"
        if self.config.max_seconds and self.run >= self.config.max_seconds:
            return "run time"
        return None


def train(
    drafter: DFlashDrafter,
    target: Any,
    data: list[TrainingSequence],
    out: Path,
    config: TrainConfig,
    resume: bool = False,
    quiet: bool = False,
    stop_at: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    evaluate: Evaluate | None = None,
) -> dict[str, Any]:
    """Train in place, writing the drafter and the trainer state every `checkpoint_every` steps and when the
    run stops, and appending the run's record to `runs.json` (`ddtree.train.runs`).

    `stop_at` ends this run early at that step (as an interruption would); `resume` continues from the state
    in `out`. `clock` gives seconds (the time budgets read it once at the start and once per step).
    `evaluate`, with `config.eval_every_seconds`: called on the drafter every that much training time and
    at the end of the run, outside the training time; its tau go into the run's record (`evals`).
    """
    check_config(config)
    out.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    drafter.train()
    target.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    timer = _Timer(config, clock)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, config, timer.fraction))
    progress = _Progress()
    if resume and (out / STATE_FILE).is_file():
        progress = _restore(out / STATE_FILE, drafter, opt, sched, rng, device)
    first = progress.step
    timer.start(progress.elapsed)
    last = min(config.steps, stop_at or config.steps)
    stopped = _loop(drafter, target, data, out, config, (opt, sched, rng), timer, progress, last, quiet, evaluate)
    drafter.eval()
    report = _report(config, progress, first, timer, stopped, len(data), device)
    report["evals"] = progress.evals
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if progress.step > first:
        append_run(out, run_record(report, progress.history[first:], describe_data(data)))
    return report


def _loop(
    drafter: DFlashDrafter,
    target: Any,
    data: list[TrainingSequence],
    out: Path,
    config: TrainConfig,
    tools: tuple[torch.optim.Optimizer, Any, random.Random],
    timer: _Timer,
    progress: _Progress,
    last: int,
    quiet: bool,
    evaluate: Evaluate | None = None,
) -> str:
    """Train until a stop reason comes up; returns it."""
    opt, sched, rng = tools
    bar = tqdm(total=config.steps, initial=progress.step, desc="train", unit="step", disable=quiet)
    loss_ema = math.nan
    stopped = _stop_reason(progress.step, last, config, timer)
    while stopped is None:
        record = _train_step(drafter, target, data, config, opt, rng)
        progress.step += 1
        timer.tick()
        sched.step()  # the next step's rate, from the time used up to now
        progress.history.append({"step": progress.step, **record})
        loss_ema = record["loss"] if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * record["loss"]
        bar.update()
        bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{record['accuracy']:.3f}")
        stopped = _stop_reason(progress.step, last, config, timer)
        if progress.step % config.checkpoint_every == 0 or stopped is not None:
            progress.elapsed = timer.total
            _checkpoint(drafter, opt, sched, rng, progress, out)
        if evaluate and config.eval_every_seconds and _eval_due(progress, timer, config.eval_every_seconds, stopped):
            progress.evals.append(_evaluation(drafter, evaluate, timer, progress.step))
            progress.last_eval = timer.total
    bar.close()
    return stopped


def _eval_due(progress: _Progress, timer: _Timer, every: float, stopped: str | None) -> bool:
    """Whether an evaluation is due: `every` seconds of training time after the run's last one (or its
    start), or at its end."""
    last = timer.before if progress.last_eval is None else progress.last_eval
    return stopped is not None or timer.total - last >= every


def _evaluation(drafter: DFlashDrafter, evaluate: Evaluate, timer: _Timer, step: int) -> dict[str, Any]:
    """`evaluate`'s tau on the drafter in eval mode, outside the training time."""
    drafter.eval()
    try:
        tau = timer.excluded(lambda: evaluate(drafter))
    finally:
        drafter.train()
    return {"step": step, "seconds": round(timer.total, 1), "tau": tau}


def _train_step(
    drafter: DFlashDrafter,
    target: Any,
    data: list[TrainingSequence],
    config: TrainConfig,
    opt: torch.optim.Optimizer,
    rng: random.Random,
) -> dict[str, float]:
    """One optimizer step on a fresh batch; returns its loss, accuracy and learning rate."""
    device = next(target.parameters()).device
    seqs = rng.sample(data, min(config.batch_size, len(data)))
    batch = block_batch(seqs, drafter.block_size, config.anchors, config.max_len, rng, device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    with autocast:
        loss, acc = block_loss(drafter, target, batch, config.gamma, config.distill)
    lr = float(opt.param_groups[0]["lr"])
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], 1.0)
    opt.step()
    return {"loss": float(loss.detach()), "accuracy": float(acc), "lr": lr}


def _stop_reason(step: int, last: int, config: TrainConfig, timer: _Timer) -> str | None:
    if step >= config.steps:
        return "steps"
    if step >= last:
        return "stop_at"
    return timer.stop_reason()


def _report(
    config: TrainConfig, progress: _Progress, first: int, timer: _Timer, stopped: str, sequences: int, device: Any
) -> dict[str, Any]:
    recent = progress.history[-50:]
    count = max(1, len(recent))
    return {
        "config": asdict(config),
        "steps": progress.step,
        "start_step": first,
        "run_seconds": round(timer.run, 1),
        "wall_seconds": round(timer.total, 1),  # training time of all runs so far
        "stopped": stopped,
        "complete": stopped in COMPLETE,
        "final_loss": round(sum(h["loss"] for h in recent) / count, 4),
        "final_accuracy": round(sum(h["accuracy"] for h in recent) / count, 4),
        "sequences": sequences,
        "device": str(device),
    }


def _lr_factor(step: int, config: TrainConfig, time_used: float) -> float:
    """Linear warm-up, then cosine decay to 10% over the steps or the time budget, whichever is shorter."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = max(time_used, (step - config.warmup) / max(1, config.steps - config.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _restore(
    path: Path,
    drafter: DFlashDrafter,
    opt: torch.optim.Optimizer,
    sched: Any,
    rng: random.Random,
    device: torch.device,
) -> _Progress:
    state = torch.load(path, map_location=device, weights_only=False)
    drafter.load_state_dict(state["drafter"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    rng.setstate(state["rng"])
    torch.set_rng_state(state["torch_rng"].cpu())
    return _Progress(int(state["step"]), float(state["elapsed"]), list(state["history"]))


def _checkpoint(
    drafter: DFlashDrafter, opt: torch.optim.Optimizer, sched: Any, rng: random.Random, progress: _Progress, out: Path
) -> None:
    save_drafter(drafter, out, dtype=torch.bfloat16)
    state = {
        "drafter": drafter.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "step": progress.step,
        "elapsed": progress.elapsed,  # training seconds of all runs so far
        "history": progress.history,
    }
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out / STATE_FILE)
