"""The compiled regions of a hybrid target's layers (`ddtree.models.hybrid_regions`) compute what the eager
layers compute: a session with them decodes the same tokens, with the same acceptance, as one without."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from tests.helpers import random_prompts, shape_of, tiny_hybrid_pair

VOCAB = 8  # the random drafter's guesses are often the target's, so the steps verify deep trees


@pytest.mark.parametrize(("kind", "regions"), [("qwen3_next", 5), ("qwen3_5", 5), ("bamba", 4)])
def test_compiled_hybrid_layers_decode_the_same_tokens(kind: str, regions: int) -> None:
    """Inductor on CPU here; each family runs at least its mixer's and attention's regions compiled
    (`regions` graphs: a GDN's input, tree inputs and rest, or Mamba2's input and rest, and attention's two).
    Dynamo's caches are cleared first: one compiled function serves every layer of its kind, so a test before
    this one in the process (the graphed lossless tests on CUDA) may have compiled these shapes already."""
    torch._dynamo.reset()
    target, drafter = tiny_hybrid_pair(kind, 3, vocab=VOCAB, block_size=5, dtype=torch.float32)
    prompts = random_prompts(3, 3, vocab=VOCAB, low=1, high=9)
    target.compile_layers()
    outputs = {}
    graphs_before = counters["stats"]["unique_graphs"]
    for fused in (False, True):
        session = DecodeSession(
            target, drafter, shape_of("ddtree", 8, None, drafter), slots=3, capacity=64, fused=fused
        )
        slots = session.join([Request(p, 14) for p in prompts])
        while session.has_active():
            session.step()
        outputs[fused] = [session.leave(s) for s in slots]
    assert counters["stats"]["unique_graphs"] - graphs_before >= regions, "the fused session ran compiled regions"
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    assert [o.acceptance_lengths for o in outputs[True]] == [o.acceptance_lengths for o in outputs[False]]
    assert max(a for o in outputs[False] for a in o.acceptance_lengths) > 1, "drafts must be accepted"
