"""The DDTREE worker: SGLang's DFlash V2 worker with the chain replaced by our tree.

Prefill and idle steps are DFlash's own (`super()`). A decode step is ours:

    draft (DFlash's draft forward, unchanged) -> per-depth logits from the draft hidden states
    -> `ddtree.tree.build_tree` -> target verify of [root] + nodes under the FULL tree mask
    -> target token at every node (argmax, or a sample at T > 0) -> `ddtree.accept.accept`
    -> commit a hybrid target's recurrent states along the accepted path (`ddtree.sglang.hybrid`)
    -> move the accepted path's KV to the front of the window -> draft KV from the path's target hidden states

The scheduler gets DFlash's output layout: rows of `block_size` slots holding `[d1..d_acc, bonus]` and the
commit lengths `acc + 1`, so its accounting, metrics and overlap relay work unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.runtime_context import get_parallel
from sglang.srt.speculative import dflash_info_v2
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2, _resolve_dflash_embedding_module
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import draft_tp_context

from ddtree.sglang import hybrid, observe
from ddtree.sglang.config import (
    DDTreeConfigError,
    DDTreeSettings,
    check_drafter,
    check_hybrid,
    check_tree_width,
)
from ddtree.sglang.tree_step import (
    Commit,
    TreeVerify,
    accept_tree,
    commit,
    draft_tree,
    full_mask,
    kv_moves,
    path_columns,
    sample_nodes,
    tree_verify,
)
from ddtree.tree import reachable_depth

logger = logging.getLogger(__name__)

MASKLESS_BACKEND_CLASSES = ("FlashAttentionBackend", "TRTLLMHAAttnBackend", "FlashAttention4Backend")


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):  # type: ignore[misc]
    """DFlash's verify input with the tree's links (SGLang's names) beside the FULL mask."""

    retrieve_index: torch.Tensor | None = None  # [bs, N] b * N + i
    retrieve_next_token: torch.Tensor | None = None  # [bs, N] first child, -1 none
    retrieve_next_sibling: torch.Tensor | None = None  # [bs, N] next sibling, -1 none
    parents: torch.Tensor | None = None  # [bs, N] -1 for the root and padding
    depth: torch.Tensor | None = None  # [bs, N]


@dataclass
class DDTreeDraftInput(DFlashDraftInputV2):  # type: ignore[misc]
    """DFlash's draft state; `prepare_for_decode` reserves room for a window of max(block, tree width)."""

    reserve_tokens: ClassVar[int] = 0  # block + window, set by the worker at start-up

    def prepare_for_decode(self, batch: Any) -> None:
        with _reserve_at_least(self.reserve_tokens):
            super().prepare_for_decode(batch)


@contextmanager
def _reserve_at_least(tokens: int) -> Iterator[None]:
    """Widen DFlash's per-request decode reservation (2 x block) to `tokens` for one call.

    `DFlashDraftInputV2.prepare_for_decode` reads its reservation from `page_aligned_decode_alloc_lens`'s
    `reserve` argument and nowhere else; the scheduler runs it on one thread.
    """
    original = dflash_info_v2.page_aligned_decode_alloc_lens

    def wider(reqs: Any, *, reserve: int, page_size: int) -> Any:
        return original(reqs, reserve=max(reserve, tokens), page_size=page_size)

    dflash_info_v2.page_aligned_decode_alloc_lens = wider
    try:
        yield
    finally:
        dflash_info_v2.page_aligned_decode_alloc_lens = original


class DDTreeWorker(DFlashWorkerV2):  # type: ignore[misc]
    linear_backend: Any = None  # a hybrid target's linear-attention backend (`init_attention_backends`)

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        super().__init__(server_args=server_args, gpu_id=gpu_id, nccl_port=nccl_port, target_worker=target_worker)
        self.ddtree = DDTreeSettings.from_env()
        self._check_start_up()
        self.window = max(int(self.block_size), self.ddtree.width)
        self.draft_depth = reachable_depth(self.ddtree.budget, int(self.block_size) - 1)  # no node lies deeper
        DDTreeDraftInput.reserve_tokens = int(self.block_size) + self.window
        model_name = getattr(server_args, "served_model_name", None) or server_args.model_path
        self.telemetry = observe.start(str(self.device), self.ddtree.budget, self.ddtree.topk, str(model_name))
        logger.info("DDTREE ready: budget=%s topk=%s block=%s", self.ddtree.budget, self.ddtree.topk, self.block_size)

    def _check_start_up(self) -> None:
        check_tree_width(self.ddtree, int(self.block_size))
        heads = [n for n, on in (("candidate-selector", self.selector), ("LiLiCorr", self.lilicorr)) if on is not None]
        check_drafter(heads + (["Domino"] if self._is_domino else []))
        check_hybrid(mambaish_config(self.model_runner.model_config))
        if self.use_compact_draft_cache:
            raise DDTreeConfigError("DDTREE does not support --speculative-draft-window-size yet")
        if int(get_parallel().tp_group.world_size) != 1:
            raise DDTreeConfigError("DDTREE supports tensor parallel size 1 only in this version")

    def init_attention_backends(self) -> None:
        super().init_attention_backends()
        attn_backend = getattr(self.model_runner, "attn_backend", None)
        backend = type(hybrid.full_attention_backend(attn_backend)).__name__
        if backend in MASKLESS_BACKEND_CLASSES:
            raise DDTreeConfigError(f"DDTREE needs an attention backend that honours tree masks, not {backend}")
        # A hybrid target's linear-attention backend (None for a dense target): tree mode for each verify.
        self.linear_backend = hybrid.linear_backend(attn_backend)

    def _maybe_build_draft_sampler(self) -> None:
        return None  # the tree needs the draft hidden states, not an in-graph argmax

    def _make_next_draft_input_prefill(self, *, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor) -> Any:
        return _draft_input(bonus_tokens, seq_lens)

    def _make_next_draft_input_decode(self, *, bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> Any:
        return _draft_input(bonus_tokens, new_seq_lens)

    def forward_batch_generation(
        self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None, pp_proxy_tensors: Any = None
    ) -> Any:
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            if self.telemetry is not None:
                self.telemetry.join(batch.reqs)
            return super().forward_batch_generation(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        if batch.has_grammar:
            raise DDTreeConfigError("DDTREE does not support grammar-constrained requests yet")
        return self._tree_step(batch, on_publish)

    # -- one decode step ------------------------------------------------------------------------------------

    def _tree_step(self, batch: Any, on_publish: Any) -> Any:
        tel = self.telemetry  # None unless DDTREE_DEBUG_METRICS=1 (`observe`)
        step_index = tel.step_start(batch.reqs) if tel is not None else 0
        draft_input = batch.spec_info
        prefix = batch.seq_lens  # [bs] committed tokens; under overlap, produced on another stream
        prefix.record_stream(torch.get_device_module(self.device).current_stream())
        prefix_host = [int(n) for n in prefix.tolist()]  # the FULL mask's layout needs the exact lengths
        window = self._window_slots(batch)  # [bs, W] virtual slots
        with observe.stage(tel, observe.DRAFT):
            draft_plan = self._plan(batch, window[:, : self.block_size], prefix_host)
            hidden = self._draft_hidden(batch, draft_input.bonus_tokens, draft_plan, prefix_host)  # [bs, block, H]
            draft_logits = self._draft_logits(hidden[:, 1 : 1 + self.draft_depth])
        with observe.stage(tel, observe.TREE_BUILD):
            tree = draft_tree(draft_logits, self.ddtree.budget, self.ddtree.topk)
            if tel is not None:
                tel.tree(tree)
            verify = tree_verify(tree, draft_input.bonus_tokens, prefix)
        with observe.stage(tel, observe.VERIFY):
            verify_plan = self._plan(batch, window[:, : verify.width], prefix_host)
            logits_output = self._verify(batch, verify, verify_plan, prefix_host)
        with observe.stage(tel, observe.ACCEPT):
            target_tokens = self._target_tokens(batch, logits_output.next_token_logits, verify.width)
            result = accept_tree(verify, target_tokens.view(len(prefix_host), verify.width))
            step = commit(result, stride=int(self.block_size))
            if self.linear_backend is not None:  # before any other target forward; seq_lens still pre-verify
                hybrid.commit(self.target_worker, batch, result.path, result.accepted, verify.width)
            self._move_kv(verify_plan, result.path, result.accepted)
            new_seq_lens = prefix + step.commit_lens.to(prefix.dtype)
            if on_publish is not None:
                on_publish(new_seq_lens)
            self._append_draft_kv(logits_output.hidden_states, result.path, draft_plan, prefix, step.commit_lens)
        logits_output.hidden_states = None
        if batch.return_logprob:
            accept_index = self._accept_index(result.path, verify.width)
            compute_spec_logprobs(batch, logits_output, target_tokens, accept_index=accept_index)
        out = self._result(logits_output, step, new_seq_lens)
        if tel is not None:
            observe.mark_result(out, step_index, result)
        return out

    def _result(self, logits_output: Any, step: Commit, new_seq_lens: torch.Tensor) -> Any:
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=step.out_tokens.reshape(-1),
            accept_lens=step.commit_lens,
            can_run_cuda_graph=False,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=step.bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=int(self.block_size),
            new_seq_lens=new_seq_lens,
        )

    def _window_slots(self, batch: Any) -> torch.Tensor:
        """`[bs, W]` the request slots after each committed prefix: the draft block and the tree write here."""
        req_to_token: torch.Tensor = self.model_runner.req_to_token_pool.req_to_token
        cols = batch.seq_lens.to(torch.int64)[:, None] + torch.arange(self.window, device=self.device)
        return req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], cols].to(torch.int64)

    def _plan(self, batch: Any, slots: torch.Tensor, prefix_host: list[int]) -> Any:
        width = int(slots.shape[1])
        return self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=torch.tensor(prefix_host, dtype=torch.int64),
            write_virtual=slots.reshape(-1),
            read_extent=width,
        )

    def _draft_hidden(self, batch: Any, bonus: torch.Tensor, plan: Any, prefix_host: list[int]) -> torch.Tensor:
        """DFlash's draft forward over `[bonus, mask x (block-1)]`: `[bs, block, hidden]`."""
        bs, block = len(prefix_host), int(self.block_size)
        block_ids = torch.full((bs, block), int(self._mask_token_id), dtype=torch.long, device=self.device)
        block_ids[:, 0] = bonus
        positions = batch.seq_lens.to(torch.int64)[:, None] + torch.arange(block, device=self.device)
        seq_lens_cpu = torch.tensor([n + block for n in prefix_host], dtype=torch.int32)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.reshape(-1),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=plan.write_virtual,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions.reshape(-1),
            input_embeds=self._noise_embeds(block_ids),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * block, dtype=torch.int32, device=self.device)
                if enable_num_token_non_padded()
                else None
            ),
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            out = self.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the DFlash draft model returned no hidden states")
        draft_hidden: torch.Tensor = hidden.view(bs, block, -1)
        return draft_hidden

    def _noise_embeds(self, block_ids: torch.Tensor) -> torch.Tensor:
        if self._full_embed_gpu is not None:
            embeds = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            target_model = self.target_worker.model_runner.model
            embeds = _resolve_dflash_embedding_module(self.draft_model, target_model)(block_ids)
        if self._noise_embed_scale != 1.0:
            embeds = embeds * self._noise_embed_scale
        return embeds.view(-1, embeds.shape[-1])

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-depth draft logits `[bs, depth, vocab]` through the target's head (tensor parallel 1)."""
        lm_head = self.target_worker.model_runner.model.lm_head
        vocab = int(self.model_runner.model_config.vocab_size)
        weight = lm_head.weight[:vocab]
        return torch.nn.functional.linear(hidden.to(weight.dtype), weight)

    def _verify(self, batch: Any, verify: TreeVerify, plan: Any, prefix_host: list[int]) -> Any:
        """The target forward over `[root] + nodes` under the tree mask; returns SGLang's logits output."""
        tree, width = verify.tree, verify.width
        bs = len(prefix_host)
        verify_input = DDTreeVerifyInput(
            draft_token=verify.tokens.reshape(-1),
            positions=verify.positions.reshape(-1),
            draft_token_num=width,
            custom_mask=full_mask(verify.ancestors, prefix_host),
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=plan,
            retrieve_index=torch.arange(bs * width, device=self.device).view(bs, width),
            retrieve_next_token=verify.next_token,
            retrieve_next_sibling=verify.next_sibling,
            parents=tree.parents,
            depth=tree.depths,
        )
        batch.out_cache_loc = plan.write_virtual
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        host = torch.tensor([n + width for n in prefix_host], dtype=torch.int64)
        batch.seq_lens_cpu, batch.seq_lens_sum = host, int(host.sum())
        with hybrid.tree_mode(self.linear_backend):
            try:
                forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
            finally:
                batch.seq_lens_cpu, batch.seq_lens_sum = saved
            forward_batch.can_run_decode_cuda_graph = False
            out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=forward_batch, is_verify=True, skip_attn_backend_init=True
            )
        logits_output = out.logits_output
        processor = self._target_logits_processor
        if processor is not None and processor.is_deferred_shard(logits_output.next_token_logits):
            logits_output.next_token_logits = processor.finish_deferred_gather(logits_output.next_token_logits)
        return logits_output

    def _target_tokens(self, batch: Any, logits: torch.Tensor, width: int) -> torch.Tensor:
        """The target's token at every node, flat `[bs * N]`."""
        info = batch.sampling_info
        apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=info, draft_token_num=width)
        if info is None or info.is_all_greedy:
            return logits.argmax(dim=-1)
        bs = logits.shape[0] // width
        tokens = sample_nodes(
            logits.view(bs, width, -1), info.temperatures.view(-1), info.top_ks.view(-1), info.top_ps.view(-1)
        )
        return tokens.reshape(-1)

    def _move_kv(self, plan: Any, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """Put the accepted path's target KV at the front of each request's window."""
        translator = self.target_worker.model_runner.kv_index_translator
        slots = plan.write_ids(translator).view(path.shape[0], -1)  # [bs, N] the pool's own ids
        target, source = kv_moves(slots, path, accepted)
        self.model_runner.token_to_kv_pool.move_kv_cache(target, source)

    def _append_draft_kv(
        self, hidden: torch.Tensor, path: torch.Tensor, plan: Any, prefix: torch.Tensor, lens: torch.Tensor
    ) -> None:
        """The drafter's context KV from the target hidden states along the accepted path."""
        if hidden is None:
            raise RuntimeError("the DDTREE verify needs the target's hidden states")
        bs, block = path.shape[0], int(self.block_size)
        rows = path_columns(path, block)  # [bs, block] node per committed position
        hidden = hidden.view(bs, path.shape[1], -1)
        picked = hidden.gather(1, rows[:, :, None].expand(-1, -1, hidden.shape[-1]))
        slots = self._draft_write_ids(plan)
        positions = prefix.to(torch.int64)[:, None] + torch.arange(block, device=self.device)
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=picked.reshape(-1, hidden.shape[-1]),
            cache_loc=slots,
            cache_loc_2d=slots.view(bs, block),
            positions=positions.reshape(-1),
            commit_lens=lens,
        )

    def _accept_index(self, path: torch.Tensor, width: int) -> torch.Tensor:
        """Flat node rows of the committed tokens in the tree-layout logits, `[bs, block]`."""
        return hybrid.accept_index(path_columns(path, int(self.block_size)), width)


def _draft_input(bonus_tokens: torch.Tensor, seq_lens: torch.Tensor) -> DDTreeDraftInput:
    bs, device = int(seq_lens.numel()), bonus_tokens.device
    return DDTreeDraftInput(
        topk_p=torch.empty((bs, 0), device=device, dtype=torch.float32),
        topk_index=torch.empty((bs, 0), device=device, dtype=torch.int64),
        bonus_tokens=bonus_tokens.to(dtype=torch.int64),
        new_seq_lens=seq_lens.to(dtype=torch.int64),
        hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16),
    )
