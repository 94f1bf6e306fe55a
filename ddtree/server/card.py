"""What an API server process knows of the served model: the facts the engine process sends once, at start-up,
and the tokenizer the API process loads from the model's directory. Nothing here needs torch or the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelCard:
    model_id: str  # the name /v1/models lists and responses carry
    model_dir: str  # the target's directory: where the tokenizer is
    max_model_len: int
    vocab_size: int
    method: str  # the method of every request
    eos_token_ids: tuple[int, ...]
    tree_budget: int  # the budget and top-k the engine verifies (with a schedule, the widest)
    tree_topk: int | None
    schedule: tuple[tuple[int, str], ...] | None = None  # `--budget auto`: (rows, choice's label) per choice
    adaptive: bool = False  # `--budget adaptive`: each step chooses its width, up to `tree_budget`
    device: str = "cpu"
    dtype: str = "float32"
    graphs: bool = False
    telemetry_port: int | None = None  # the telemetry layer's Prometheus exporter on loopback, when on

    def describe(self) -> str:
        """`SmolLM2-135M-Instruct, method ddtree, budget 32, cuda, bfloat16, graphs on`: the budget the engine
        verifies where drafting, its top-k where one is set, and under `--budget auto` the schedule's choices."""
        method = f"method {self.method}"
        if self.schedule is not None:
            method += ", budget auto (" + ", ".join(f"{rows} rows: {label}" for rows, label in self.schedule) + ")"
        elif self.tree_budget:
            topk = f", top-k {self.tree_topk}" if self.tree_topk else ""
            budget = f"adaptive (up to {self.tree_budget}{topk})" if self.adaptive else f"{self.tree_budget}{topk}"
            method += f", budget {budget}"
        graphs = "on" if self.graphs else "off"
        return f"{self.model_id}, {method}, {self.device}, {self.dtype}, graphs {graphs}"


@dataclass
class ApiModel:
    """The card and its tokenizer: all the HTTP side uses of the model."""

    card: ModelCard
    tokenizer: Any

    @property
    def model_id(self) -> str:
        return self.card.model_id

    @property
    def max_model_len(self) -> int:
        return self.card.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.card.vocab_size
