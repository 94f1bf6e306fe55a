"""Data files shipped with the package: the held-out prompts (none used in training)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ddtree.errors import UserError


def heldout_prompts(path: str | None = None) -> list[str]:
    """The committed held-out prompts (none used in training), or a JSONL file of `{"prompt": ...}`."""
    source = Path(path) if path else Path(str(resources.files(__name__).joinpath("heldout_prompts.jsonl")))
    try:
        lines = [(n, line) for n, line in enumerate(source.read_text().splitlines(), 1) if line.strip()]
        prompts = [(n, json.loads(line)["prompt"]) for n, line in lines]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read prompts from {str(source)!r}: {type(exc).__name__}: {exc}") from exc
    bad = next((n for n, prompt in prompts if not isinstance(prompt, str) or not prompt), None)
    if bad is not None:
        raise UserError(f"cannot read prompts from {str(source)!r}: line {bad}: 'prompt' must be a non-empty string")
    return [prompt for _, prompt in prompts]
