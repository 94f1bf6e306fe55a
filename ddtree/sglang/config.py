"""DDTREE's settings inside SGLang and the start-up checks. No SGLang import at module level.

SGLang 0.5.23 lets no plugin add a server argument, so the tree is configured through the environment,
which every SGLang process inherits:

- `SGLANG_DDTREE_BUDGET`: draft nodes per tree, the root excluded (default 32).
- `SGLANG_DDTREE_TOPK`: candidates per depth (default: unset, every token may be a candidate, as
  `ddtree generate` without `--topk`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddtree.errors import SettingsError
from ddtree.methods import check_tree

BUDGET_ENV = "SGLANG_DDTREE_BUDGET"
TOPK_ENV = "SGLANG_DDTREE_TOPK"
DEFAULT_BUDGET = 32

# Attention backends whose TARGET_VERIFY path ignores a custom mask (FA3 reads the global EAGLE top-k to decide
# whether a tree exists; trtllm_mha and fa4 have no custom-mask path): a tree verified there would attend
# causally across siblings and commit wrong tokens.
MASKLESS_BACKENDS = frozenset({"fa3", "trtllm_mha", "fa4"})
BACKEND_FIELDS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend")


class DDTreeConfigError(ValueError):
    """A setting DDTREE cannot run with; raised at start-up."""


@dataclass(frozen=True)
class DDTreeSettings:
    budget: int = DEFAULT_BUDGET
    topk: int | None = None

    @property
    def width(self) -> int:
        """Tree slots per request, root included: the verify forward's tokens per request."""
        return self.budget + 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DDTreeSettings:
        env = os.environ if env is None else env
        budget, topk = _int(env, BUDGET_ENV), _int(env, TOPK_ENV)
        settings = cls(budget=DEFAULT_BUDGET if budget is None else budget, topk=topk)
        try:
            check_tree("ddtree", settings.budget, settings.topk)  # the one check of a tree's settings
        except SettingsError as exc:
            raise DDTreeConfigError(exc.named({"budget": BUDGET_ENV, "topk": TOPK_ENV}[exc.setting])) from None
        return settings


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise DDTreeConfigError(f"{name} must be an integer >= 1, got {raw!r}") from None


def check_attention_backends(args: Any) -> None:
    """Refuse attention backends that ignore tree masks (`args`: ServerArgs or SGLang's resolving view)."""
    for field in BACKEND_FIELDS:
        backend = getattr(args, field, None)
        if backend in MASKLESS_BACKENDS:
            raise DDTreeConfigError(
                f"DDTREE needs an attention backend that honours tree masks in target verify; "
                f"--{field.replace('_', '-')} {backend} ignores them. Use flashinfer or triton "
                f"(torch_native with DDTREE_SGLANG_CPU=1)."
            )


def check_tree_width(settings: DDTreeSettings, block_size: int) -> None:
    """Refuse a tree exactly as wide as the DFlash block.

    SGLang captures DFlash target-verify CUDA graphs without a mask, for `block_size` tokens per request, and
    replays one whenever a verify batch has that width: a tree of that width would be verified causally.
    """
    if settings.width == block_size:
        raise DDTreeConfigError(
            f"DDTREE tree width ({BUDGET_ENV}={settings.budget} + 1 root = {settings.width}) equals the drafter's "
            f"block size ({block_size}); SGLang would replay a verify graph captured without a tree mask. "
            f"Choose another budget, e.g. {settings.budget - 1} or {settings.budget + 1}."
        )


def drafter_heads(architectures: list[str], selector_rank: int, projector_type: str | None) -> list[str]:
    """The heads a DFlash drafter has beyond the plain one, from its config: a candidate selector (DFlash2,
    `selector_rank`), LiLiCorr, or Domino (`projector_type`)."""
    heads = []
    if selector_rank or any(a.startswith(("DFlash2", "MiniMaxDFlash2")) for a in architectures):
        heads.append("candidate-selector")
    if any("LiLiCorr" in a for a in architectures):
        heads.append("LiLiCorr")
    if projector_type == "domino":
        heads.append("Domino")
    return heads


def check_drafter(heads: list[str]) -> None:
    """Refuse DFlash variants whose proposals are not per-depth distributions."""
    if heads:
        raise DDTreeConfigError(
            f"DDTREE builds its tree from a plain DFlash drafter's per-depth distributions; this drafter has a "
            f"{' and a '.join(heads)} head, which SGLang runs only with --speculative-algorithm DFLASH."
        )


# SGLang's configs (`mambaish_config`) of the hybrids DDTREE verifies trees on: gated delta-net (GDN) layers,
# whose linear-attention backend has a tree path (`ddtree.sglang.hybrid`). Qwen3.5's text configs derive from
# Qwen3-Next's; the multimodal ones are returned as their text configs.
GDN_HYBRID_CONFIGS = {
    "Qwen3NextConfig": "Qwen3-Next",
    "Qwen3_5TextConfig": "Qwen3.5",
    "Qwen3_5MoeTextConfig": "Qwen3.5-MoE",
}


def check_hybrid(hybrid_config: Any) -> None:
    """Refuse hybrid (mamba / linear-attention) targets other than the gated-delta-net ones DDTREE supports;
    `hybrid_config` is SGLang's `mambaish_config` of the target (None for a dense target)."""
    if hybrid_config is None or type(hybrid_config).__name__ in GDN_HYBRID_CONFIGS:
        return
    supported = ", ".join(sorted(set(GDN_HYBRID_CONFIGS.values())))
    raise DDTreeConfigError(
        f"DDTREE supports the gated-delta-net hybrids ({supported}) among hybrid targets, not "
        f"{type(hybrid_config).__name__}: it commits their recurrent states along the accepted tree path, "
        f"which other linear-attention and mamba backends do not offer; use --speculative-algorithm DFLASH."
    )


def check_linear_verify(replayssm_spec: bool) -> None:
    """Refuse SGLang's ReplaySSM verify (`--enable-linear-replayssm-spec`): it replays a chain's accepted
    prefix into the recurrent state, where a tree's accepted path is not a prefix of the verified nodes."""
    if replayssm_spec:
        raise DDTreeConfigError(
            "DDTREE verifies trees, and --enable-linear-replayssm-spec commits a linear chain only; drop the flag"
        )
