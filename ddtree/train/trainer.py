"""DFlash drafter training (the recipe of arXiv:2602.06036, written for this engine).

Glossary
- anchor a: a response position whose token starts a block `[tok[a], mask, ..., mask]` at positions
  `a..a+L`. The block sees the target's features at positions `< a` (as at inference, where the block's
  first token has not been through the target yet) and, non-causally, the rest of its own block.
- block position k >= 1 predicts `tok[a+k]`; its cross-entropy weight is `exp(-(k-1)/gamma)`, since early
  positions decide acceptance.

Many blocks per sequence train in one forward: a dense boolean mask keeps blocks apart. The target is
frozen and runs without gradients to give the features; the drafter shares its embeddings and head.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from tqdm import tqdm

from ddtree.models.dflash import DFlashDrafter, save_drafter
from ddtree.train.data import TrainingSequence

STATE_FILE = "trainer_state.pt"
REPORT_FILE = "training.json"


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
    max_seconds: float | None = None  # wall-clock budget; the LR schedule follows whichever runs out first


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
    drafter: DFlashDrafter, target: Any, batch: dict[str, torch.Tensor], gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted block cross-entropy and top-1 accuracy over the drafted positions."""
    ids, anchors, keep = batch["ids"], batch["anchors"], batch["keep"]
    bs = drafter.block_size
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=batch["attention_mask"], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    offsets = torch.arange(bs, device=ids.device)
    positions = anchors[:, :, None] + offsets  # [b, n, bs]
    in_seq = positions < batch["attention_mask"].sum(dim=1)[:, None, None]
    labels = ids.gather(1, positions.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(positions)
    block_ids = torch.where(offsets == 0, labels, drafter.mask_token_id)  # [b, n, bs]
    embed = target.get_input_embeddings()
    hidden = drafter.forward_blocks(
        embed(block_ids.flatten(1)), positions.flatten(1), features, block_mask(anchors, keep, ids.shape[1], bs)
    )
    logits = target.get_output_embeddings()(hidden).float().view(*positions.shape, -1)  # [b, n, bs, vocab]
    weights = keep[:, :, None] & in_seq & (offsets > 0)
    decay = torch.exp(-(offsets - 1).clamp(min=0).float() / gamma)
    w = weights.float() * decay
    ce = F.cross_entropy(logits[:, :, 1:].flatten(0, 2), labels[:, :, 1:].flatten(), reduction="none")
    loss = (ce * w[:, :, 1:].flatten()).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (logits[:, :, 1:].argmax(-1) == labels[:, :, 1:]) & weights[:, :, 1:]
        acc = hit.sum() / weights[:, :, 1:].sum().clamp(min=1)
    return loss, acc


def train(
    drafter: DFlashDrafter,
    target: Any,
    data: list[TrainingSequence],
    out: Path,
    config: TrainConfig,
    resume: bool = False,
    quiet: bool = False,
    stop_at: int | None = None,
) -> dict[str, Any]:
    """Train in place, writing the drafter and the trainer state every `checkpoint_every` steps.

    `stop_at` ends this run early at that step (as an interruption would); `resume` continues it.
    """
    device = next(target.parameters()).device
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    drafter.train()
    target.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    progress = {"time": 0.0}  # fraction of the wall-clock budget used, read by the schedule
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, config, progress["time"]))
    step, elapsed, history = 0, 0.0, []
    state_path = out / STATE_FILE
    if resume and state_path.is_file():
        state = torch.load(state_path, map_location=device, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    started = time.perf_counter() - elapsed
    bar = tqdm(total=config.steps, initial=step, desc="train", unit="step", disable=quiet)
    loss_ema = math.nan
    last = min(config.steps, stop_at or config.steps)
    while step < last and progress["time"] < 1.0:
        batch = block_batch(
            rng.sample(data, min(config.batch_size, len(data))),
            drafter.block_size,
            config.anchors,
            config.max_len,
            rng,
            device,
        )
        with autocast:
            loss, acc = block_loss(drafter, target, batch, config.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        if config.max_seconds:
            progress["time"] = (time.perf_counter() - started) / config.max_seconds
        value = float(loss.detach())
        loss_ema = value if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * value
        history.append({"step": step, "loss": value, "accuracy": float(acc)})
        bar.update()
        bar.set_postfix(loss=f"{loss_ema:.3f}", acc=f"{float(acc):.3f}")
        if step % config.checkpoint_every == 0 or step == last or progress["time"] >= 1.0:
            elapsed = time.perf_counter() - started
            _checkpoint(drafter, opt, sched, rng, step, elapsed, history, out)
    bar.close()
    report = {
        "config": asdict(config),
        "steps": step,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "final_loss": round(sum(h["loss"] for h in history[-50:]) / max(1, len(history[-50:])), 4),
        "final_accuracy": round(sum(h["accuracy"] for h in history[-50:]) / max(1, len(history[-50:])), 4),
        "sequences": len(data),
        "device": str(device),
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    drafter.eval()
    return report


def _lr_factor(step: int, config: TrainConfig, time_used: float) -> float:
    """Linear warm-up, then cosine decay to 10% over the steps or the time budget, whichever is shorter."""
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = max(time_used, (step - config.warmup) / max(1, config.steps - config.warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _checkpoint(
    drafter: DFlashDrafter,
    opt: torch.optim.Optimizer,
    sched: Any,
    rng: random.Random,
    step: int,
    elapsed: float,
    history: list[dict[str, float]],
    out: Path,
) -> None:
    save_drafter(drafter, out, dtype=torch.bfloat16)
    state = {
        "drafter": drafter.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": rng.getstate(),
        "torch_rng": torch.get_rng_state(),
        "step": step,
        "elapsed": elapsed,
        "history": history,
    }
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out / STATE_FILE)
