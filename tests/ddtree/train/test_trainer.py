from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.kv_cache import KVCache
from ddtree.models.dflash import load_drafter
from ddtree.train.data import TrainingSequence
from ddtree.train.trainer import TrainConfig, block_batch, block_loss, block_mask, train
from tests.helpers import random_prompts, tiny_pair


def test_training_forward_matches_the_inference_forward() -> None:
    """A block trained at anchor a sees exactly what the engine's drafter sees when it drafts at a."""
    target, drafter = tiny_pair(4, vocab=24, block_size=5)
    seq_len, anchors = 14, torch.tensor([[3, 9]])
    features = torch.randn(1, seq_len, drafter.fc.in_features, dtype=torch.float64)
    tokens = torch.randint(0, 23, (1, seq_len))
    bs = drafter.block_size
    positions = anchors[:, :, None] + torch.arange(bs)
    block_ids = torch.where(torch.arange(bs) == 0, tokens.gather(1, positions.flatten(1)).view_as(positions), 23)
    embeds = target.embed(block_ids.flatten(1))
    mask = block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), seq_len, bs)
    trained = drafter.forward_blocks(embeds, positions.flatten(1), features, mask)  # [1, 2*bs, hidden]
    for j, a in enumerate(anchors[0].tolist()):
        cache = KVCache(1, 1, 2, drafter.config.head_dim, 64, torch.float64, torch.device("cpu"))
        inferred = drafter(embeds[:, j * bs : (j + 1) * bs], features[:, :a], torch.tensor([a]), cache, key_span=a)
        torch.testing.assert_close(trained[:, j * bs : (j + 1) * bs], inferred)


def _data(seed: int, vocab: int) -> list[TrainingSequence]:
    target, _ = tiny_pair(seed, vocab=vocab)
    prompts = random_prompts(seed, 24, vocab=vocab, low=2, high=6)
    from ddtree.train.data import generate_responses

    return generate_responses(target, prompts, max_new_tokens=24, eos_token_ids=(), batch_size=8, quiet=True)


def test_training_lowers_the_block_loss(tmp_path: Path) -> None:
    target, drafter = tiny_pair(0, vocab=24, block_size=5)
    model = target.model.float()
    drafter = drafter.float()
    data = _data(0, 24)
    rng = random.Random(0)
    batch = block_batch(data[:8], drafter.block_size, 6, 64, rng, torch.device("cpu"))
    with torch.no_grad():
        before = float(block_loss(drafter, model, batch, gamma=4.0)[0])
    train(drafter, model, data, tmp_path, TrainConfig(steps=60, batch_size=8, anchors=6, lr=3e-3, warmup=5), quiet=True)
    with torch.no_grad():
        after = float(block_loss(drafter, model, batch, gamma=4.0)[0])
    assert after < 0.8 * before
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "training.json").is_file()


def test_training_is_deterministic_and_resumable(tmp_path: Path) -> None:
    data = _data(1, 16)
    cfg = TrainConfig(steps=12, batch_size=4, anchors=4, checkpoint_every=3, seed=3, warmup=2)

    def fresh() -> tuple[torch.nn.Module, torch.nn.Module]:
        target, drafter = tiny_pair(1, vocab=16, block_size=4)
        return target.model.float(), drafter.float()

    model, d1 = fresh()
    train(d1, model, data, tmp_path / "a", cfg, quiet=True)
    model, d2 = fresh()
    train(d2, model, data, tmp_path / "b", cfg, quiet=True)
    model, d3 = fresh()
    train(d3, model, data, tmp_path / "c", cfg, quiet=True, stop_at=6)  # interrupted after step 6
    model, d3 = fresh()
    train(d3, model, data, tmp_path / "c", cfg, resume=True, quiet=True)
    a, b, c = (load_drafter(tmp_path / x, torch.device("cpu"), torch.float32).state_dict() for x in "abc")
    for key in a:
        assert torch.equal(a[key], b[key]), key
        assert torch.equal(a[key], c[key]), key


def test_the_combined_loss_is_the_sum_of_both() -> None:
    target, drafter = tiny_pair(0, vocab=24, block_size=5)
    model, drafter = target.model.float(), drafter.float()
    batch = block_batch(_data(0, 24)[:4], drafter.block_size, 5, 64, random.Random(0), torch.device("cpu"))
    with torch.no_grad():
        ce, kl, both = (float(block_loss(drafter, model, batch, 4.0, loss)[0]) for loss in ("ce", "kl", "ce+kl"))
    assert kl > 0 and both == pytest.approx(ce + kl, rel=1e-5)


def test_an_evaluation_is_due_by_the_unrounded_training_time(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Any
) -> None:
    """Steps of 0.03 s with an evaluation after every step: the records' seconds are rounded to 0.1 s (0.06
    becomes 0.1), and the next due time counts from the time itself, not from the rounded record."""
    readings = iter(0.03 * i for i in range(1000))
    config = TrainConfig(steps=4, batch_size=4, anchors=4, warmup=2, eval_every_seconds=1e-9)
    model, drafter = fresh()
    report = train(
        drafter,
        model,
        tiny_data,
        tmp_path,
        config,
        quiet=True,
        clock=lambda: next(readings),
        evaluate=lambda d: {"dflash": 1.0},
    )
    assert [e["step"] for e in report["evals"]] == [1, 2, 3, 4]
    assert [e["seconds"] for e in report["evals"]] == [0.0, 0.1, 0.1, 0.1]
