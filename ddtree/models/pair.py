"""Load a target and its drafter from directories, checked against each other, on a device and dtype.

Configs are read and checked before any weights are: a mismatched pair fails in milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddtree.errors import UserError
from ddtree.models.dflash import DFlashDrafter, check_pair, load_drafter
from ddtree.models.hybrid import make_target
from ddtree.models.markov import MarkovHead, load_head
from ddtree.models.target import Target, load_target, read_target_config
from ddtree.tree import Transition

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_models(
    model: str, drafter_dir: str | None, device_name: str = "auto", dtype_name: str = "auto"
) -> tuple[Target, DFlashDrafter | None, Any]:
    """Load and check the target (and drafter). Configs are checked before any weights are read."""
    config = read_target_config(model)
    device = resolve_device(device_name)
    dtype = resolve_dtype(dtype_name, device)
    drafter = None
    if drafter_dir is not None:
        drafter = load_drafter(drafter_dir, device, dtype)
        check_pair(drafter, config)
    hf_model = load_target(model, device, dtype)
    target = make_target(hf_model, feature_layers=drafter.target_layer_ids if drafter is not None else ())
    if drafter is not None and drafter_dir is not None:
        head = load_head(drafter_dir, device)
        if head is not None:
            drafter.transition = conditioned(head, target)
    return target, drafter, load_tokenizer(model)


def conditioned(head: MarkovHead, target: Target) -> Transition:
    """A Markov head's correction on `target`'s input embeddings (UserError where their sizes differ)."""
    weight: torch.Tensor = target.embed_tokens.weight  # type: ignore[assignment]
    if weight.shape[1] != head.parent.shape[0]:
        raise UserError(f"the Markov head is {head.parent.shape[0]} wide, the target's embeddings {weight.shape[1]}")
    with torch.no_grad():
        return head.transition(weight)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def load_tokenizer(path: str) -> Any:
    """The directory's tokenizer; None where it has no tokenizer files, UserError where they are broken."""
    from transformers import AutoTokenizer

    present = [name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # tokenizers and transformers raise many kinds for a broken file
        if not present:
            return None
        files = ", ".join(present)
        raise UserError(f"cannot load the tokenizer in {path!r} ({files}): {type(exc).__name__}: {exc}") from exc
