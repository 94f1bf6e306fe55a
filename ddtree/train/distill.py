"""Knowledge distillation for the block loss (`--distill kl`).

Block position k >= 1 of the block at anchor a drafts token `a+k`. The target's distribution for that
token is its next-token distribution at position `a+k-1`, which the frozen target forward of the training
step already computed the final hidden state for: only the head runs again, at the drafted positions alone
(`[m, vocab]`, not `[batch, seq, vocab]`; the vocabulary is large). The loss per position is
KL(target || drafter), weighted like the cross-entropy it replaces.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def teacher_logits(head: Any, last_hidden: torch.Tensor, sources: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The target's float32 logits at `sources` `[b, n, bs-1]` (position a+k-1 for block position k) where
    `drafted` `[b, n, bs-1]` is true: `[m, vocab]`, in the order of `drafted`'s true entries."""
    with torch.no_grad():
        rows = torch.arange(drafted.shape[0], device=drafted.device)[:, None, None].expand_as(drafted)
        hidden = last_hidden[rows[drafted], sources[drafted]]  # [m, hidden]
        out: torch.Tensor = head(hidden).float()
    return out


def kl_per_position(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) for each row of `[m, vocab]` logits: `[m]`, >= 0, differentiable in the student."""
    student = F.log_softmax(student_logits.float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="none").sum(dim=-1)
