"""The DDTREE algorithm as SGLang's registry sees it: DFlash's family, with the methods `CustomSpecAlgo` lacks.

`is_dflash()` is true so that the scheduler and model runner treat DDTREE as DFlash everywhere they branch on
it: the target captures the drafter's hidden-state layers, the drafter shares the target's KV indices, the
draft runs as TARGET_VERIFY and decode preparation goes to the draft input's `prepare_for_decode`.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.arg_groups.speculative_hook import _handle_dflash
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from ddtree.sglang.config import (
    DDTreeSettings,
    check_attention_backends,
    check_drafter,
    check_linear_verify,
    check_tree_width,
    drafter_heads,
)

NAME = "DDTREE"


class DDTreeSpecAlgo(CustomSpecAlgo):  # type: ignore[misc]
    def is_dflash(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    # Not in CustomSpecAlgo, but the scheduler calls them on every algorithm (disaggregation set-up, the overlap
    # future map, the overlap relay): the enum's own answers for DFLASH.
    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def create_future_map(self, *args: Any, **kwargs: Any) -> Any:
        return SpeculativeAlgorithm.create_future_map(self, *args, **kwargs)

    def handle_server_args(self, server_args: Any) -> None:
        """DFlash's argument handling (draft path, block size, draft backend), then DDTREE's checks."""
        settings = DDTreeSettings.from_env()
        check_attention_backends(resolving_view(server_args))
        _handle_dflash(server_args)
        cfg = resolving_view(server_args)
        check_tree_width(settings, int(cfg.speculative_num_draft_tokens))
        check_drafter(draft_heads(cfg.speculative_draft_model_path, bool(cfg.trust_remote_code)))
        check_linear_verify(bool(getattr(cfg, "enable_linear_replayssm_spec", False)))

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> int | None:
        """The widest window a step writes past the committed prefix: the draft block plus the tree."""
        block = resolving_view(server_args).speculative_num_draft_tokens
        if block is None:
            return None
        return int(block) + max(int(block), DDTreeSettings.from_env().width)


def draft_heads(draft_path: str, trust_remote_code: bool = False) -> list[str]:
    """The extra heads of the DFlash drafter at `draft_path`, read from its config with SGLang's parser."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    hf_config = get_config(draft_path, trust_remote_code=trust_remote_code)
    parsed = parse_dflash_draft_config(draft_hf_config=hf_config)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    return drafter_heads(architectures, int(parsed.selector_rank or 0), parsed.projector_type)
