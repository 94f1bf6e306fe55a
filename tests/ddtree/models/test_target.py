from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from ddtree.engine.engine import Engine
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.models.target import Target
from ddtree.models.tiny import random_llama, tiny_llama_config
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, shape_of, tiny_pair


def test_our_ar_equals_hf_generate() -> None:
    """The layer loop, cache and masks reproduce transformers' own greedy decoding, batch and all."""
    model = random_llama(tiny_llama_config(40, hidden_size=32, num_layers=2), seed=9).double()
    prompts = random_prompts(9, 3, vocab=40)
    ours = Engine(Target(model)).generate(prompts, GenerationConfig(method="ar", max_new_tokens=16)).outputs
    for prompt, out in zip(prompts, ours, strict=True):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def test_the_head_keeps_the_targets_dtype() -> None:
    """Logits come out in the target's dtype (no float32 copy of a [batch, nodes, vocab] tensor per step)."""
    for dtype in (torch.float32, torch.bfloat16):
        target, _ = tiny_pair(2, vocab=24, dtype=dtype)
        hidden = torch.randn(2, 3, target.hidden_size, dtype=dtype)
        logits = target.head(hidden)
        assert logits.dtype == dtype and logits.shape == (2, 3, 24)


def test_compiled_layers_decode_the_same_tokens() -> None:
    """The regions that `compile_layers` fuses, in the target and the drafter, compute what the eager layers
    compute (inductor on CPU here; the GPU checks compare graphed and compiled decoding with eager `ar`)."""
    target, drafter = tiny_pair(3, vocab=24, block_size=5, dtype=torch.float32)
    prompts = random_prompts(3, 3, vocab=24)
    target.compile_layers()
    drafter.compile_layers()
    outputs = {}
    graphs_before = counters["stats"]["unique_graphs"]
    for fused in (False, True):
        session = DecodeSession(
            target, drafter, shape_of("ddtree", 8, None, drafter), slots=3, capacity=128, fused=fused
        )
        slots = session.join([Request(p, 20) for p in prompts])
        while session.has_active():
            session.step()
        outputs[fused] = [session.leave(s) for s in slots]
    assert counters["stats"]["unique_graphs"] > graphs_before, "the fused session ran compiled regions"
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    assert [o.acceptance_lengths for o in outputs[True]] == [o.acceptance_lengths for o in outputs[False]]
