"""A decode's settings: what a batch of requests decodes with, checked and resolved in this one place.

- `GenerationConfig`: the method, its tree (a budget and top-k, or a budget schedule), sampling and limits.
- `check_generation`: the one check of those values; `check_request_settings`: the part a single request
  carries, its limit and sampling (the engine checks each joining request with it, the server each body);
  `check_prompt`: a prompt's token ids, as encoded (its text, or its chat template around the text): at least
  one, each in the vocabulary. An empty text is a prompt like any other where its template gives it tokens.
  Both raise `SettingsError` in the words of the values (`budget must be >= 1, got 0`); the CLI names the
  flag and the server the request's field.
- `tree_shapes`: the one resolution of the settings into the trees a step verifies, on a drafter of a
  given depth (`ShapeSchedule`: one shape, or a schedule's by the rows a step runs).

The engine, the Python API, the CLI and the server all go through these; nothing else checks a budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddtree.errors import SettingsError
from ddtree.methods import TreeShape, check_tree, get_method
from ddtree.schedule import BudgetSchedule, ShapeSchedule

MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for per token (OpenAI's `top_logprobs` cap)
SEED_LIMIT = 2**63  # request i of a batch samples with seed + i, an int64
SHOWN_IDS = 5  # out-of-vocabulary ids a message lists


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "ddtree"
    budget: int = 32
    topk: int | None = None
    temperature: float = 0.0
    seed: int = 0  # request i of a batch samples with seed + i
    max_new_tokens: int = 128
    eos_token_ids: tuple[int, ...] = ()
    schedule: BudgetSchedule | None = None  # ddtree only: the tree follows the load (budget and topk unused)
    adaptive: bool = False  # ddtree only: each step verifies the width its tree predicts pays most, up to budget
    top_p: float = 1.0  # in (0, 1]: nucleus sampling of the target's tokens at T > 0 (1: off)
    top_k: int = 0  # the target samples among its k most probable tokens at T > 0 (0: off)
    logprobs: int | None = None  # None: no log-probabilities; 0: the emitted tokens'; N: and N alternatives each


def check_generation(config: GenerationConfig, vocab_size: int | None = None, prompts: int = 1) -> None:
    """SettingsError for settings no session can run; with `vocab_size`, a top-k no larger than it, and with
    `prompts`, seeds seed .. seed + prompts - 1 that fit an int64."""
    check_tree(config.method, config.budget, config.topk, vocab_size)
    if config.schedule is not None and config.method != "ddtree":
        raise SettingsError(
            "schedule", f"needs method 'ddtree' (a budget schedule chooses ddtree trees), got method {config.method!r}"
        )
    if config.adaptive and (config.method != "ddtree" or config.schedule is not None):
        raise SettingsError(
            "adaptive",
            f"needs method 'ddtree' and no budget schedule, got method {config.method!r}"
            + (" and a schedule" if config.schedule is not None else ""),
        )
    if not 0 <= config.seed <= SEED_LIMIT - prompts:
        raise SettingsError("seed", f"must be in 0..{SEED_LIMIT - prompts} (for {prompts} prompts), got {config.seed}")
    check_request_settings(config.max_new_tokens, config.temperature, config.top_p, config.top_k, config.logprobs)


def check_request_settings(
    max_new_tokens: int, temperature: float, top_p: float, top_k: int, logprobs: int | None
) -> None:
    """SettingsError for a request's limit, temperature, top-p, top-k or logprobs setting out of range."""
    if max_new_tokens < 1:
        raise SettingsError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SettingsError("temperature", f"must be a finite number >= 0, got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise SettingsError("top_p", f"must be in (0, 1], got {top_p}")
    if top_k < 0 or top_k != int(top_k):
        raise SettingsError("top_k", f"must be an integer >= 0 (0: off), got {top_k}")
    if logprobs is not None and not (0 <= logprobs <= MAX_TOP_LOGPROBS and logprobs == int(logprobs)):
        raise SettingsError("logprobs", f"must be None or in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")


def check_prompt(ids: list[int], vocab_size: int | None = None) -> None:
    """SettingsError for a prompt with no token ids, or (with `vocab_size`) with ids outside [0, vocab_size)."""
    if not ids:
        raise SettingsError("prompt", "has no tokens")
    if vocab_size is None:
        return
    bad = [(at, i) for at, i in enumerate(ids) if not 0 <= i < vocab_size]
    if bad:
        listed = ", ".join(f"{_short(i)} at index {at}" for at, i in bad[:SHOWN_IDS])
        more = f" and {len(bad) - SHOWN_IDS} more" if len(bad) > SHOWN_IDS else ""
        raise SettingsError("prompt", f"has token ids outside the vocabulary [0, {vocab_size}): {listed}{more}")


def _short(value: int, digits: int = 20) -> str:
    text = str(value)
    return text if len(text) <= digits else f"{text[:digits]}..."


def tree_shapes(config: GenerationConfig, depth: int) -> ShapeSchedule:
    """The trees `config` verifies on a drafter of `depth` draft positions (its block size - 1), by the rows a
    step runs: one shape, or its schedule's."""

    def shape(method: str, budget: int, topk: int | None) -> TreeShape:
        return get_method(method).shape(budget, topk, depth)

    if config.adaptive:
        return ShapeSchedule.up_to(shape(config.method, config.budget, config.topk))
    if config.schedule is None:
        return ShapeSchedule.fixed(shape(config.method, config.budget, config.topk))
    return config.schedule.resolve(shape)
