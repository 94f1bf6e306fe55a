"""The decoding methods and the facts about each, in one place.

- `ar`: the target alone; the tree is the root.
- `dflash`: a chain of the drafter's top-1 token at each depth (a tree with budget = depth, top-k = 1).
- `ddtree`: the `budget` most probable prefixes of the drafter's block, `topk` candidates per depth.

The CLI, `bench`, the engine and the analysis ask this module instead of comparing method names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree.errors import SettingsError


@dataclass(frozen=True)
class TreeShape:
    """What one step verifies per request, resolved once from the method, the user's settings and the drafter:
    `budget` draft nodes (0 for `ar`), found with at most `topk` candidates per depth (None: no cap)."""

    method: str
    budget: int
    topk: int | None
    label: str  # as tables and messages name the run (`Method.label` of the user's budget)

    @property
    def width(self) -> int:
        """Tree nodes per request, the root included."""
        return 1 + self.budget

    @property
    def drafting(self) -> bool:
        return self.budget > 0


@dataclass(frozen=True)
class Method:
    name: str
    needs_drafter: bool
    chain: bool  # the tree is one path: budget = depth, top-k = 1
    tuned_by_budget: bool  # the budget is the user's to choose (and belongs in the label)

    def shape(self, budget: int, topk: int | None, depth: int) -> TreeShape:
        """The tree this method verifies, given the user's budget and top-k and the drafter's depth."""
        label = self.label(budget)
        if not self.needs_drafter:
            return TreeShape(self.name, 0, None, label)
        if self.chain:
            return TreeShape(self.name, depth, 1, label)
        return TreeShape(self.name, budget, topk, label)

    def label(self, budget: int | None = None, topk: int | None = None) -> str:
        """`ar`, `dflash`, `ddtree B=32` or `ddtree B=32 k=8`: the one label format of tables and logs."""
        if not self.tuned_by_budget or budget is None:
            return self.name
        return f"{self.name} B={budget}" + (f" k={topk}" if topk else "")


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", needs_drafter=False, chain=True, tuned_by_budget=False),
        Method("dflash", needs_drafter=True, chain=True, tuned_by_budget=False),
        Method("ddtree", needs_drafter=True, chain=False, tuned_by_budget=True),
    )
}
METHOD_NAMES = tuple(METHODS)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHOD_NAMES)}") from None


def check_tree(method: str, budget: int | None, topk: int | None, vocab_size: int | None = None) -> Method:
    """The one check of a tree's settings (SettingsError): a known method, a budget >= 1 (None only where the
    method has no budget to choose), a top-k >= 1 and, where `vocab_size` is known, no more than it."""
    known = METHODS.get(method)
    if known is None:
        raise SettingsError("method", f"must be one of {', '.join(METHOD_NAMES)}, got {method!r}")
    if budget is None:
        if known.tuned_by_budget:
            raise SettingsError("budget", f"must be >= 1 for {method}, got none")
    elif budget < 1:
        raise SettingsError("budget", f"must be >= 1, got {budget}")
    if topk is not None and vocab_size is not None and not 1 <= topk <= vocab_size:
        raise SettingsError("topk", f"must be in 1..{vocab_size} (the vocabulary size), got {topk}")
    if topk is not None and topk < 1:
        raise SettingsError("topk", f"must be >= 1, got {topk}")
    return known


def method_label(name: str, budget: int | None = None, topk: int | None = None) -> str:
    """The label of a method run; unknown names (from foreign logs) are shown as they are."""
    method = METHODS.get(name)
    return method.label(budget, topk) if method is not None else name


def curve_widths(budget: int) -> list[int]:
    """The widths below a tree of `budget` draft nodes that a step's prediction is given at and an adaptive
    step chooses between: the powers of two below `budget`, and `budget` itself."""
    widths, w = [], 1
    while w < budget:
        widths.append(w)
        w *= 2
    return [*widths, budget] if budget > 0 else []


def mean_acceptance_length(lengths: list[int]) -> float | None:
    """tau: the mean of per-step acceptance lengths (accepted drafts + 1). None when there are no steps."""
    return sum(lengths) / len(lengths) if lengths else None
