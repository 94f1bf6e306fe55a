"""Token choice from logits without host syncs: argmax at T=0, Gumbel-max sampling at T>0."""

from __future__ import annotations

import torch


def choose_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Return `logits.shape[:-1]` token ids.

    At `temperature == 0` this is the argmax. Otherwise it is an exact sample from `softmax(logits / T)`,
    drawn as `argmax(logits / T + Gumbel noise)`, which stays on the device (no `multinomial` sync).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny, max=1.0 - 1e-7)))
    return (logits.float() / temperature + gumbel).argmax(dim=-1)
