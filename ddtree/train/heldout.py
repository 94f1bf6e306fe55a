"""The held-out set a drafter is measured on: the pair loaded once and the held-out prompts encoded once,
for the teacher-forced measure (`ddtree.train.teacher.heldout_teacher_eval`) and for decoding as
`ddtree bench` does (`heldout_eval`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.train.runs import EVAL_BUDGET


@dataclass(frozen=True)
class HeldoutSet:
    """A target, a drafter, the target's tokenizer and the first held-out prompts in its chat format."""

    target: Target
    drafter: DFlashDrafter
    tokenizer: Any
    prompts: list[list[int]]

    @classmethod
    def load(cls, target_dir: str, drafter_dir: str, device: str = "auto", prompts: int = 64) -> HeldoutSet:
        """The pair as saved in `target_dir` and `drafter_dir`, and the first `prompts` held-out prompts."""
        from ddtree.models.pair import load_models

        target, drafter, tokenizer = load_models(target_dir, drafter_dir, device)
        if tokenizer is None:
            raise ValueError(f"the held-out evaluation needs a tokenizer, and {target_dir!r} has none")
        if drafter is None:
            raise ValueError(f"the held-out evaluation needs a drafter, and {drafter_dir!r} gave none")
        return cls(target, drafter, tokenizer, encode_heldout(tokenizer, prompts))


def encode_heldout(tokenizer: Any, prompts: int) -> list[list[int]]:
    """The first `prompts` held-out prompts (`ddtree.data.heldout_prompts`) as the target's chat turns."""
    from ddtree.data import heldout_prompts
    from ddtree.models.chat import chat_ids

    return [chat_ids(tokenizer, p) for p in heldout_prompts()[:prompts]]


def heldout_eval(
    held: HeldoutSet, max_new_tokens: int = 64, batch_size: int = 16, budgets: Sequence[int] = (EVAL_BUDGET,)
) -> dict[str, Any]:
    """tau of dflash and ddtree at `budgets`, greedy, decoded on the held-out prompts with `ddtree bench`'s
    code (eager engine: tau does not depend on it)."""
    from ddtree.bench.rows import run_bench
    from ddtree.engine.engine import Engine
    from ddtree.models.chat import eos_ids

    engine = Engine(held.target, held.drafter, cuda_graphs="off")
    eos = eos_ids(held.tokenizer, held.target)
    rows = run_bench(engine, held.prompts, list(budgets), max_new_tokens, batch_size, ["dflash", "ddtree"], eos)
    return {
        "measure": "decoded",
        "prompts": len(held.prompts),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "device": str(held.target.device),
        "tau": {r.label: round(r.tau, 4) for r in rows if r.tau is not None},
    }
