"""The embedded decode loop: prefill, then draft -> tree_build -> verify -> accept until done.

The loop returns tokens; it never counts for telemetry. Observers see each stage through `StepObserver`.
Per step exactly one device->host transfer happens: the accepted tokens, which the caller needs anyway.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from ddtree.engine.kv_cache import KVCache
from ddtree.engine.proposers import make_proposer
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.target import Target
from ddtree.sampling import choose_tokens
from ddtree.verify import accept, ancestor_mask
from telemetry import semconv
from telemetry.hooks import NOOP, GenerateInfo, RequestResult, StepObserver


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "ddtree"
    budget: int = 32
    topk: int | None = None
    temperature: float = 0.0
    seed: int = 0
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class RequestOutput:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    acceptance_lengths: list[int] = field(default_factory=list)  # per step: accepted drafts + 1
    finished: bool = False


@dataclass(frozen=True)
class GenerationResult:
    outputs: list[RequestOutput]
    steps: int
    seconds: float  # prefill and decode, wall clock

    @property
    def new_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class Engine:
    def __init__(self, target: Target, drafter: DFlashDrafter | None = None, observer: StepObserver = NOOP) -> None:
        self.target = target
        self.drafter = drafter
        self.observer = observer

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], config: GenerationConfig, request_ids: list[str] | None = None
    ) -> GenerationResult:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        started = time.perf_counter()
        target, obs = self.target, self.observer
        device = target.device
        proposer = make_proposer(config.method, target, self.drafter, config.budget, config.topk)
        observed = obs is not NOOP
        if observed:
            ids = request_ids or [uuid.uuid4().hex for _ in prompts]
            obs.on_generate_start(_info(config, ids, prompts, proposer.width - 1))
        batch = len(prompts)
        block = self.drafter.block_size if self.drafter is not None else 1
        capacity = max(len(p) for p in prompts) + config.max_new_tokens + 2 * proposer.width + block
        cache = target.new_cache(batch, capacity)
        proposer.start(batch, capacity)
        generator = torch.Generator(device=device).manual_seed(config.seed)
        outputs = [RequestOutput() for _ in prompts]
        eos = set(config.eos_token_ids)

        root, context, counts = self._prefill(prompts, cache, config.temperature, generator)
        host_lengths = [len(p) for p in prompts]
        for out, token in zip(outputs, _to_host(root), strict=True):
            _emit(out, [token], config.max_new_tokens, eos)
        active_host = [not o.finished for o in outputs]
        active = _to_device(active_host, device)  # [batch] bool, rebuilt only when a request finishes
        step = 0
        while not all(o.finished for o in outputs):
            obs.on_step_start(step, batch)
            obs.on_stage_start(semconv.STAGE_DRAFT)
            logits = proposer.draft(root, context, counts, key_span=max(host_lengths))
            obs.on_stage_end(semconv.STAGE_DRAFT)

            obs.on_stage_start(semconv.STAGE_TREE_BUILD)
            tree = proposer.build(logits, batch)
            ancestors = ancestor_mask(tree)  # [batch, nodes, nodes]
            obs.on_tree(tree)
            obs.on_stage_end(semconv.STAGE_TREE_BUILD)

            obs.on_stage_start(semconv.STAGE_VERIFY)
            tokens = torch.where(tree.tokens < 0, 0, tree.tokens)
            tokens[:, 0] = root
            verified = target.forward(
                tokens, cache.lengths[:, None] + tree.depths, ancestors, cache, max(host_lengths) + tree.width
            )
            choice = choose_tokens(verified.logits, config.temperature, generator)  # [batch, nodes]
            obs.on_stage_end(semconv.STAGE_VERIFY)

            obs.on_stage_start(semconv.STAGE_ACCEPT)
            result = accept(tree, ancestors, choice, root)
            counts = torch.where(active, result.accepted + 1, 0)
            cache.compact(result.path, counts)
            if verified.features is not None:
                index = result.path[:, :, None].expand(-1, -1, verified.features.shape[-1])
                context = verified.features.gather(1, index)
            root = result.bonus
            host = _to_host(torch.cat([result.accepted[:, None], result.path_tokens, root[:, None]], dim=1))
            obs.on_stage_end(semconv.STAGE_ACCEPT)

            obs.on_accept(result, [row[0] for row in host])
            emitted = _commit(outputs, host, host_lengths, config.max_new_tokens, eos)
            if any(a and o.finished for a, o in zip(active_host, outputs, strict=True)):
                active_host = [not o.finished for o in outputs]
                active = _to_device(active_host, device)
            obs.on_step_end(step, emitted)
            step += 1
        if observed:
            obs.on_generate_end(_results(ids, outputs, eos))
        return GenerationResult(outputs=outputs, steps=step, seconds=time.perf_counter() - started)

    def _prefill(
        self, prompts: list[list[int]], cache: KVCache, temperature: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Run the prompts; return the first token `[batch]`, context features and their counts."""
        device = self.target.device
        width = max(len(p) for p in prompts)
        tokens = _to_device([p + [0] * (width - len(p)) for p in prompts], device)  # [batch, width]
        lengths = _to_device([len(p) for p in prompts], device)
        steps = torch.arange(width, device=device)
        real = steps[None, :] < lengths[:, None]  # [batch, width]
        causal = torch.tril(torch.ones((width, width), dtype=torch.bool, device=device))
        visible = (causal[None] & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
        out = self.target.forward(
            tokens, steps.expand(len(prompts), -1), visible, cache, width, logit_index=(lengths - 1)[:, None]
        )
        cache.lengths.copy_(lengths)
        first = choose_tokens(out.logits[:, 0], temperature, generator)
        return first, out.features, lengths


def _info(config: GenerationConfig, request_ids: list[str], prompts: list[list[int]], budget: int) -> GenerateInfo:
    return GenerateInfo(
        method=config.method,
        budget=budget,
        topk=1 if config.method == "dflash" else config.topk,
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        request_ids=request_ids,
        prompt_tokens=prompts,
    )


def _results(request_ids: list[str], outputs: list[RequestOutput], eos: set[int]) -> list[RequestResult]:
    return [
        RequestResult(
            request_id=rid,
            output_tokens=out.token_ids,
            acceptance_lengths=out.acceptance_lengths,
            finish_reason="stop" if out.token_ids and out.token_ids[-1] in eos else "length",
        )
        for rid, out in zip(request_ids, outputs, strict=True)
    ]


def _to_host(t: torch.Tensor) -> Any:
    """The one readback per step. On CUDA: a non-blocking copy to pinned memory, then a wait on its event
    (an explicit wait, not an implicit sync, so the loop runs under `set_sync_debug_mode("error")`)."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    done.synchronize()
    return host.numpy().tolist()


def _to_device(values: list[Any], device: torch.device) -> torch.Tensor:
    """Host values to the device without an implicit sync (pinned memory, non-blocking copy)."""
    host = torch.tensor(values, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _commit(
    outputs: list[RequestOutput], host: list[list[int]], host_lengths: list[int], limit: int, eos: set[int]
) -> list[int]:
    """Give each unfinished request its accepted drafts and bonus; return how many tokens each kept.

    A host row is `[accepted, root, path tokens..., bonus]`.
    """
    emitted = [0] * len(outputs)
    for b, (out, row) in enumerate(zip(outputs, host, strict=True)):
        if out.finished:
            continue
        n = row[0]
        out.acceptance_lengths.append(n + 1)
        host_lengths[b] += n + 1
        before = len(out.token_ids)
        _emit(out, [*row[2 : 2 + n], row[-1]], limit, eos)
        emitted[b] = len(out.token_ids) - before
    return emitted


def _emit(out: RequestOutput, tokens: list[int], limit: int, eos: set[int]) -> None:
    """Append tokens up to the limit or the first end-of-sequence token."""
    for token in tokens:
        if len(out.token_ids) >= limit:
            break
        out.token_ids.append(token)
        if token in eos:
            break
    out.finished = len(out.token_ids) >= limit or (bool(out.token_ids) and out.token_ids[-1] in eos)
