"""From user input to engine output: load and check the pair, tokenize, generate, detokenize."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ddtree.engine.capacity import ModelDims, check_session, plan_session
from ddtree.engine.engine import Engine
from ddtree.errors import SettingsError, UserError
from ddtree.methods import get_method
from ddtree.models.cache import ddtree_home
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter, default_target
from ddtree.models.dflash import DFlashDrafter, read_drafter_config
from ddtree.models.pair import load_models, resolve_device, resolve_dtype
from ddtree.models.target import Target, read_target_config
from ddtree.observer import NOOP, StepObserver
from ddtree.schedule import BudgetSchedule, read_schedule
from ddtree.settings import GenerationConfig, check_generation, check_prompt, tree_shapes
from telemetry import TelemetryConfig, start_telemetry


@dataclass(frozen=True)
class EngineOptions:
    """Where and how the engine runs: the device flags that `generate`, `bench` and `serve` share."""

    device: str = "auto"
    dtype: str = "auto"
    cuda_graphs: str = "auto"
    tree_kernel: str = "auto"
    attention: str = "auto"

    def check(self) -> None:
        """Against the device they would run on, before anything loads (UserError, in the words of the
        flags: the engine itself raises ValueError for the same combinations)."""
        if self.cuda_graphs == "on" and resolve_device(self.device).type != "cuda":
            raise UserError("--cuda-graphs on needs a CUDA device (--device cuda)")
        if self.tree_kernel == "triton":
            from ddtree.kernels.tree_build import triton_available

            if not triton_available():
                raise UserError("--tree-kernel triton needs triton and a CUDA device")
        if self.attention == "triton":
            from ddtree.kernels.tree_attention import triton_attention_available

            if not triton_attention_available(resolve_device(self.device)):
                raise UserError("--attention triton needs triton and a CUDA device")
            if self.dtype == "float64":
                raise UserError("--attention triton takes float32, bfloat16 or float16, not --dtype float64")

    def load_models(self, model: str, drafter: str | None) -> tuple[Target, DFlashDrafter | None, Any]:
        return load_models(model, drafter, self.device, self.dtype)

    def engine(self, target: Target, drafter: DFlashDrafter | None, observer: StepObserver = NOOP) -> Engine:
        return Engine(
            target,
            drafter,
            observer=observer,
            cuda_graphs=self.cuda_graphs,
            tree_kernel=self.tree_kernel,
            attention=self.attention,
        )


@dataclass(frozen=True)
class GenerateRequest:
    model: str | None  # None: the default pair
    drafter: str | None
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    options: EngineOptions = field(default_factory=EngineOptions)
    prompts: list[str] | None = None
    prompt_ids: list[list[int]] | None = None
    chat: bool = False


def check_request(request: GenerateRequest, vocab_size: int | None = None) -> None:
    """Check the request's settings (`check_generation`: SettingsError); the checks that need the vocabulary
    (a top-k and prompt ids within it) run when `vocab_size` is given."""
    prompts = len(request.prompts or request.prompt_ids or [None])
    check_generation(request.generation, vocab_size, prompts)
    if vocab_size is None:
        return
    for ids in request.prompt_ids or []:
        try:
            check_prompt(ids, vocab_size)
        except SettingsError as exc:
            raise UserError(f"--prompt-ids: a prompt {exc.problem}") from None


def resolve_paths(model: str | None, drafter: str | None, method: str) -> tuple[str, str | None]:
    """Fill in the default pair where no model is given; check that drafting methods have a drafter. A method
    without one gets no drafter directory, whatever was given."""
    if not get_method(method).needs_drafter:
        return model or str(default_target()), None
    if model is None:
        return str(default_target()), drafter or str(default_drafter())
    if drafter is None:
        raise UserError(f"--method {method} needs --drafter DIR")
    return model, drafter


def check_capacity(
    model: str, drafter_dir: str | None, config: GenerationConfig, slots: int, tokens: int, options: EngineOptions
) -> None:
    """From the configs alone, before any weights load: CapacityError where `slots` requests of up to `tokens`
    tokens with `config` exceed the model's context length or the device's free memory (the weights not
    counted: the engine checks again, once they are loaded, when it makes the session)."""
    device = resolve_device(options.device)
    drafter = read_drafter_config(drafter_dir) if drafter_dir is not None else None
    dims = ModelDims.of(read_target_config(model), resolve_dtype(options.dtype, device), drafter)
    shape = tree_shapes(config, dims.block - 1).widest
    check_session(dims, plan_session(dims, shape, slots, tokens), device)


def pair_identity(model: str, drafter: str | None, target: Target) -> dict[str, str]:
    """What a budget schedule is tuned for: the pair's names, the device's model and the dtype."""
    device = target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "model": Path(model).name,
        "drafter": Path(drafter).name if drafter else "",
        "device": name,
        "dtype": str(target.dtype).removeprefix("torch."),
    }


def schedule_path(identity: dict[str, str]) -> Path:
    """Where `ddtree tune` writes the schedule for `identity` and `serve --budget auto` looks for it:
    `$DDTREE_HOME/schedules/<model>-<hash of the identity>.json`."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return ddtree_home() / "schedules" / f"{identity['model']}-{digest}.json"


def load_schedule(path: str | Path) -> BudgetSchedule:
    """A schedule file, or UserError naming it."""
    try:
        return read_schedule(Path(path))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def find_schedule(identity: dict[str, str]) -> tuple[BudgetSchedule | None, str]:
    """The schedule tuned for `identity`, or None and why there is none."""
    path = schedule_path(identity)
    if not path.is_file():
        return None, f"no budget schedule for {identity['model']} on {identity['device']} ({identity['dtype']})"
    schedule = load_schedule(path)
    mismatch = schedule.mismatch(identity)
    if mismatch is not None:
        return None, f"the schedule {path} was tuned for {mismatch}"
    return schedule, str(path)


def encode_prompts(request: GenerateRequest, tokenizer: Any) -> list[list[int]]:
    if request.prompt_ids is not None:
        return request.prompt_ids
    if tokenizer is None:
        raise UserError("the model directory has no tokenizer; pass --prompt-ids instead")
    prompts = request.prompts or []
    if request.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat was given, but the model has no chat template")
        encoded = [chat_ids(tokenizer, p) for p in prompts]
    else:
        encoded = [[int(t) for t in tokenizer.encode(p)] for p in prompts]
    for i, ids in enumerate(encoded):
        try:
            check_prompt(ids)  # an empty --prompt is refused only where it encodes to nothing (no chat template)
        except SettingsError as exc:
            raise UserError(f"--prompt {i + 1}: the prompt {exc.problem}") from None
    return encoded


def start_pair_telemetry(target: Target, tokenizer: Any, model: str) -> Any:
    """Telemetry from the environment for runs on `target` (`start_telemetry`: the no-op one, importing nothing,
    with DDTREE_DEBUG_METRICS off). The caller shuts it down."""
    return start_telemetry(
        device_type=target.device.type,
        model_name=str(getattr(target.config, "_name_or_path", "") or model),
        detokenize=(lambda ids: str(tokenizer.decode(ids))) if tokenizer is not None else None,
    )


def completion_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of generated ids, special tokens skipped; "" without a tokenizer."""
    if tokenizer is None:
        return ""
    return str(tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


def run_generate(request: GenerateRequest) -> Iterator[dict[str, Any]]:
    """Generate for every prompt of the request; yield one record per prompt."""
    check_request(request)
    request.options.check()
    TelemetryConfig.from_env()  # a bad telemetry variable fails here, before any model loads
    model, drafter_dir = resolve_paths(request.model, request.drafter, request.generation.method)
    check_request(request, int(read_target_config(model).vocab_size))
    target, drafter, tokenizer = request.options.load_models(model, drafter_dir)
    prompts = encode_prompts(request, tokenizer)
    config = replace(request.generation, eos_token_ids=eos_ids(tokenizer, target))
    telemetry = start_pair_telemetry(target, tokenizer, model)
    try:
        result = request.options.engine(target, drafter, telemetry.observer).generate(prompts, config)
    finally:
        telemetry.shutdown()
    switching = request.generation.adaptive or request.generation.schedule is not None
    for out in result.outputs:
        record: dict[str, Any] = {
            "token_ids": out.token_ids,
            "text": completion_text(tokenizer, out.token_ids),
            "steps": len(out.acceptance_lengths),
            "acceptance_lengths": out.acceptance_lengths,
            "tokens_per_second": result.new_tokens / result.seconds if result.seconds > 0 else 0.0,
        }
        if switching:  # the tree changes between steps: each step's draft nodes (0: ar), and gains if adaptive
            record["step_budgets"] = out.budgets
        if request.generation.adaptive:
            record["step_gains"] = [round(g, 4) for g in out.gains]
        yield record
