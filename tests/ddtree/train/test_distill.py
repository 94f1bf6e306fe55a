from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributions import Categorical, kl_divergence

from ddtree.train.data import TrainingSequence
from ddtree.train.distill import kl_per_position
from ddtree.train.trainer import TrainConfig, block_batch, block_loss, train

Fresh = Callable[[], tuple[torch.nn.Module, Any]]


def test_kl_per_position_is_kl_from_the_target_to_the_drafter() -> None:
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 11, generator=gen, dtype=torch.float64), torch.randn(6, 11, generator=gen)
    kl = kl_per_position(student, teacher)
    expected = kl_divergence(Categorical(logits=teacher.double()), Categorical(logits=student))
    torch.testing.assert_close(kl, expected.float(), rtol=1e-5, atol=1e-6)
    assert torch.all(kl > 0)
    torch.testing.assert_close(kl_per_position(teacher + 3.0, teacher), torch.zeros(6), atol=1e-6, rtol=0)


class Oracle(torch.nn.Module):
    """A drafter that answers every block position k with the target's own final state at a+k-1: its
    distributions are the target's next-token distributions, exactly what `kl` distils."""

    def __init__(self, like: Any, last_hidden: torch.Tensor) -> None:
        super().__init__()
        self.block_size, self.mask_token_id, self.target_layer_ids = like.block_size, like.mask_token_id, (0,)
        self.last_hidden = last_hidden  # [b, s, hidden]
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward_blocks(self, embeds: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> Any:
        rows = torch.arange(pos.shape[0])[:, None]
        return self.last_hidden[rows, (pos - 1).clamp(min=0)] * self.scale


def _batch(data: list[TrainingSequence], block: int) -> dict[str, torch.Tensor]:
    return block_batch(data[:8], block, 6, 64, random.Random(0), torch.device("cpu"))


def test_the_kl_loss_is_zero_for_the_targets_own_distributions(tiny_data: list[TrainingSequence], fresh: Fresh) -> None:
    model, drafter = fresh()
    batch = _batch(tiny_data, drafter.block_size)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=batch["ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    oracle: Any = Oracle(drafter, hidden)
    with torch.no_grad():
        assert float(block_loss(oracle, model, batch, 4.0, "kl")[0]) < 1e-6
        assert float(block_loss(oracle, model, batch, 4.0, "ce")[0]) > 0.1
        oracle.scale.fill_(0.5)  # flatter than the target: no longer its distributions
        assert float(block_loss(oracle, model, batch, 4.0, "kl")[0]) > 1e-3


def test_the_kl_loss_is_finite_differentiable_and_training_lowers_it(
    tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh
) -> None:
    model, drafter = fresh()
    batch = _batch(tiny_data, drafter.block_size)
    loss, acc = block_loss(drafter, model, batch, 4.0, "kl")
    assert torch.isfinite(loss) and float(loss.detach()) >= 0 and 0 <= float(acc) <= 1
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads if g is not None)
    before = float(loss.detach())
    cfg = TrainConfig(steps=40, batch_size=8, anchors=6, lr=3e-3, warmup=5, gamma=4.0, distill="kl")
    report = train(drafter, model, tiny_data, tmp_path, cfg, quiet=True)
    with torch.no_grad():
        after = float(block_loss(drafter, model, batch, 4.0, "kl")[0])
    assert after < 0.8 * before and report["config"]["distill"] == "kl"
