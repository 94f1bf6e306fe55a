"""Sessions are checked before they allocate: tokens and tree width against the model's context length, the
KV cache and tree buffers against the device's free memory. The errors speak of values, never of CLI flags."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ddtree.engine import capacity
from ddtree.engine import engine as engine_module
from ddtree.engine.capacity import ModelDims, plan_session, recurrent_bytes, session_bytes
from ddtree.engine.engine import Engine
from ddtree.errors import CapacityError
from ddtree.models.default import default_drafter
from ddtree.models.dflash import read_drafter_config
from ddtree.models.target import TokenOrder
from ddtree.models.tiny import tiny_llama_config
from ddtree.runtime import EngineOptions, check_capacity
from ddtree.settings import GenerationConfig, tree_shapes
from tests.helpers import tiny_hybrid_pair, tiny_pair

CONTEXT = 4096  # tiny_llama_config's max_position_embeddings


class Allocated(Exception):
    pass


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Engine:
    """An engine on a tiny pair whose sessions may not be made: a check that lets one through fails the test."""
    target, drafter = tiny_pair(3, vocab=40, block_size=5)

    def refuse(*args: object, **kwargs: object) -> None:
        raise Allocated("a session was allocated")

    monkeypatch.setattr(engine_module, "DecodeSession", refuse)
    return Engine(target, drafter)


def _message(excinfo: pytest.ExceptionInfo[CapacityError]) -> str:
    text = str(excinfo.value)
    assert "--" not in text, "library errors never name CLI flags"
    return text


def test_a_tree_wider_than_the_context_is_refused_before_allocating(engine: Engine) -> None:
    config = GenerationConfig(method="ddtree", budget=100_000, max_new_tokens=8)
    with pytest.raises(CapacityError) as excinfo:
        engine.generate([[1, 2, 3]], config)
    assert _message(excinfo) == (
        "ddtree B=100000: a tree of 100001 tokens (verified in one forward) exceeds the model's context length of "
        f"{CONTEXT} tokens"
    )


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_more_tokens_than_the_context_are_refused(engine: Engine, method: str) -> None:
    config = GenerationConfig(method=method, budget=8, max_new_tokens=1_000_000_000)
    with pytest.raises(CapacityError) as excinfo:
        engine.stream([[1, 2, 3]], config, slots=2)
    assert "requests of up to 1000000003 tokens (prompt and new tokens)" in _message(excinfo)


def test_buffers_larger_than_the_free_memory_are_refused(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capacity, "free_memory", lambda device: 10**6)
    config = GenerationConfig(method="ddtree", budget=64, max_new_tokens=100)
    with pytest.raises(CapacityError) as excinfo:
        engine.generate([[1, 2, 3]] * 4, config)
    text = _message(excinfo)
    assert text.startswith("ddtree B=64 with 4 request slots of up to 103 tokens needs ")
    assert text.endswith(" of tree buffers); 1.0 MB are free on cpu")


def test_what_fits_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    target, drafter = tiny_pair(3, vocab=40, block_size=5)
    engine = Engine(target, drafter)
    plan = plan_session(engine.dims, engine.shape(GenerationConfig(budget=8, max_new_tokens=6)), slots=1, tokens=9)
    kv, tree = session_bytes(engine.dims, plan)
    monkeypatch.setattr(capacity, "free_memory", lambda device: kv + tree)  # exactly enough
    out = engine.generate([[1, 2, 3]], GenerationConfig(budget=8, max_new_tokens=6)).outputs[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_a_temperature_that_is_no_finite_non_negative_number_is_refused(engine: Engine, temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        engine.generate([[1, 2]], GenerationConfig(temperature=temperature))


def test_the_estimate_counts_what_the_session_allocates() -> None:
    """The KV caches of target and drafter as `DecodeSession` makes them, and a tree's mask and ancestors."""
    target, drafter = tiny_pair(3, vocab=40, block_size=5, dtype=torch.float32)
    engine = Engine(target, drafter)
    plan = plan_session(engine.dims, engine.shape(GenerationConfig(budget=8)), slots=2, tokens=100)
    kv, tree = session_bytes(engine.dims, plan)
    caches = (target.new_cache(2, plan.capacity), drafter.new_cache(2, plan.capacity, target.dtype, target.device))
    assert kv == sum(t.numel() * t.element_size() for c in caches for t in (c.keys, c.values))
    assert tree > 2 * plan.width * (plan.width + plan.capacity)


def test_the_default_pair_at_batch_64_fits_an_h200_as_measured() -> None:
    """The README's batch-64 runs (B=64, 128 new tokens, bfloat16) must not be refused on a 139 GB GPU."""
    smollm2 = tiny_llama_config(49152, hidden_size=576, num_layers=30, heads=9, kv_heads=3)
    smollm2.intermediate_size, smollm2.max_position_embeddings = 1536, 8192
    dims = ModelDims.of(smollm2, torch.bfloat16, read_drafter_config(default_drafter()))
    kv, tree = session_bytes(
        dims, plan_session(dims, tree_shapes(GenerationConfig(budget=64), dims.block - 1).widest, slots=64, tokens=300)
    )
    assert kv + tree < 5 * 10**9


def test_the_check_from_configs_agrees_with_the_engine(
    tiny_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_capacity` (what `serve` runs before it starts) reads only the configs."""
    target, drafter = (str(p) for p in tiny_dirs)
    options = EngineOptions(device="cpu")
    check_capacity(target, drafter, GenerationConfig(budget=32), slots=8, tokens=2048, options=options)
    with pytest.raises(CapacityError, match="exceeds the model's context length"):
        check_capacity(target, drafter, GenerationConfig(budget=5000), slots=1, tokens=64, options=options)
    monkeypatch.setattr(capacity, "free_memory", lambda device: 10**6)
    with pytest.raises(CapacityError, match=r"ar with 8 request slots of up to 2048 tokens needs .* free on cpu"):
        check_capacity(target, None, GenerationConfig(method="ar"), slots=8, tokens=2048, options=options)


def test_a_hybrids_states_are_counted_as_allocated_and_named_when_they_do_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hybrid target: the KV cache covers its attention layers only, the committed recurrent states and a
    verify's per-node inputs are what the cache holds, and a refusal gives their bytes a slot."""
    target, drafter = tiny_hybrid_pair("qwen3_5", 0, vocab=24, dtype=torch.float32)
    engine = Engine(target, drafter)
    dims = engine.dims
    assert dims.recurrent is not None and dims.kv_layers == len(target.attention_layers)  # type: ignore[attr-defined]
    plan = plan_session(dims, engine.shape(GenerationConfig(budget=8)), slots=2, tokens=40)
    cache = target.new_cache(2, plan.capacity)
    kv, _ = session_bytes(dims, plan)
    caches = (cache, drafter.new_cache(2, plan.capacity, target.dtype, target.device))
    assert kv == sum(t.numel() * t.element_size() for c in caches for t in (c.keys, c.values))
    committed = sum(t.numel() * t.element_size() for t in (cache.conv, cache.recurrent))  # type: ignore[attr-defined]
    assert dims.recurrent.committed_bytes(dims.dtype_bytes) * 2 == committed
    n = plan.width  # a verify of a chain of that many nodes leaves each layer's node inputs until the commit
    nodes = torch.arange(n).expand(2, -1)
    visible = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(2, -1, -1)
    order = TokenOrder(parents=nodes - 1, depths=nodes, max_depth=n - 1)
    target.forward(nodes % 24, nodes, visible, cache, n, order=order)
    pending = cache.pending  # type: ignore[attr-defined]
    held = sum(inputs.nbytes for _, inputs, _ in pending.values())
    node_states = 3 * 4 * math.prod(dims.recurrent.mixer.state)  # float32
    assert held == 2 * plan.width * (dims.recurrent.node_bytes(dims.dtype_bytes) - node_states)
    assert recurrent_bytes(dims, plan) > committed
    monkeypatch.setattr(capacity, "free_memory", lambda device: 10**4)
    with pytest.raises(CapacityError, match=r"of recurrent states \(.* a slot at 9 tree nodes\)"):
        capacity.check_session(dims, plan, target.device)
