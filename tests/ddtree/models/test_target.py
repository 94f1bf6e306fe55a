from __future__ import annotations

import torch

from ddtree.engine.decode import Engine, GenerationConfig
from ddtree.models.target import Target
from ddtree.models.tiny import random_llama, tiny_llama_config
from tests.helpers import random_prompts


def test_our_ar_equals_hf_generate() -> None:
    """The layer loop, cache and masks reproduce transformers' own greedy decoding, batch and all."""
    model = random_llama(tiny_llama_config(40, hidden_size=32, num_layers=2), seed=9).double()
    prompts = random_prompts(9, 3, vocab=40)
    ours = Engine(Target(model)).generate(prompts, GenerationConfig(method="ar", max_new_tokens=16)).outputs
    for prompt, out in zip(prompts, ours, strict=True):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
