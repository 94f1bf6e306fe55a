"""The target model: an HF Llama- or Qwen-style checkpoint run by our own layer loop.

We load weights, config and tokenizer with transformers and reuse its modules (projections, norms, MLP,
rotary embedding). The layer loop is ours so that one forward can take a tree: per-request positions, an
ancestor-only mask and a preallocated cache with compaction (see `ddtree.kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ddtree.errors import UserError
from ddtree.kernels.tree_attention import tree_attention
from ddtree.kv_cache import KVCache
from ddtree.models.layers import residual_mlp

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# recurrent layers with attention (`ddtree.models.hybrid`): gated delta-net (Qwen), Mamba2 (Bamba)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "bamba")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES
# Vision-language checkpoints whose text model is a target (Qwen3.5 ships as these): their `text_config` is
# the target's (checked as any other), and transformers loads the text model alone from them.
MULTIMODAL_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Shapes a compiled region may be compiled for before torch falls back to eager for new ones: an adaptive
# session verifies every (rows, width) of its caps (7 row counts x 8 widths at 64 slots), besides the drafts.
COMPILED_SHAPES = 256


@dataclass(frozen=True)
class TokenOrder:
    """How a forward's tokens follow one another, which layers with a recurrent state need (attention reads
    `visible` alone): a draft tree's links, or a chain (a prefill) with each request's real length."""

    parents: torch.Tensor | None = None  # [batch, n] each node's parent (-1: the root, padding); None: a chain
    depths: torch.Tensor | None = None  # [batch, n] (0: the root, padding)
    max_depth: int = 0  # a host-side bound on `depths`
    lengths: torch.Tensor | None = None  # [batch] a chain's real tokens (the rest is padding)
    windows: torch.Tensor | None = None  # [batch, n, kernel] a tree's convolution windows, made once a forward


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [batch, n, vocab] in the target's dtype
    features: torch.Tensor | None  # [batch, n, len(feature_layers) * hidden]: drafter context features


class Target:
    """Wraps a loaded `*ForCausalLM`. `feature_layers` are the layers whose outputs the drafter reads."""

    def __init__(self, model: nn.Module, feature_layers: tuple[int, ...] = ()) -> None:
        config: Any = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"unsupported target model type {config.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model.eval()
        self.config = config
        inner: Any = model.model
        self.embed_tokens: nn.Module = inner.embed_tokens
        self.layers: nn.ModuleList = inner.layers
        self.norm: nn.Module = inner.norm if hasattr(inner, "norm") else inner.final_layernorm  # Bamba's name
        self.rotary: nn.Module = inner.rotary_emb
        self.lm_head: nn.Module = model.lm_head  # type: ignore[assignment]
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.kv_heads = int(config.num_key_value_heads)
        self.feature_layers = feature_layers
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self._qkv: Any = _qkv  # replaced by compiled versions in compile_layers()
        self._residual_mlp: Any = residual_mlp
        self._qkv_any: Any = _qkv  # the same, compiled for any shape
        self._residual_mlp_any: Any = residual_mlp

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.num_layers, batch, self.kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, n] -> [batch, n, hidden]."""
        out: torch.Tensor = self.embed_tokens(tokens)
        return out

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states -> logits in the target's dtype. Not cast to float32 here: argmax and
        the fused tree build read 16-bit logits as they are (the same values, half the bytes, no copy), and
        what needs float32 math (sampling, `log_softmax`) casts where it computes."""
        out: torch.Tensor = self.lm_head(hidden)
        return out

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        cache: KVCache,
        key_span: int,
        logit_index: torch.Tensor | None = None,
        fused: bool = True,
        attention: str = "sdpa",
        any_shape: bool = False,
        order: TokenOrder | None = None,
    ) -> TargetOutput:
        """Run `tokens` (`[batch, n]`) at `positions` (`[batch, n]`) on top of the cache.

        Token i is written to slot `cache.lengths + i` and sees the committed prefix plus the tokens j
        with `visible[b, i, j]` (`[batch, n, n]`). `key_span` is a host-side bound on
        `max(cache.lengths) + n`. With `logit_index` (`[batch, m]`) only those rows get logits. After
        `compile_layers`, `fused` runs the compiled regions: those compiled per shape (a step's few shapes), or
        with `any_shape` those compiled once for symbolic sizes (the prefill's many shapes); `fused=False` runs
        the layers eagerly. `attention` is `sdpa` (torch's attention given a dense mask) or `triton`
        (`ddtree.kernels.tree_attention`, which reads `visible` directly). `order`: the tokens' tree or
        chain, for targets with recurrent layers (`ddtree.models.hybrid`); attention-only ones ignore it.
        """
        n = tokens.shape[1]
        slots = cache.lengths[:, None] + torch.arange(n, device=tokens.device)[None, :]  # [batch, n]
        mask = (  # [batch, 1, n, key_span] for sdpa; the Triton kernel takes `visible` as it is
            visible if attention == "triton" else tree_attention_mask(cache.lengths, visible, key_span)
        )
        x = self.embed(tokens)
        cos, sin = self.rotary(x, self._rotary_positions(positions))
        order = self._prepare(order)
        features: dict[int, torch.Tensor] = {}
        regions = self._regions(fused, any_shape)
        for i, layer in enumerate(self.layers):
            x = self._layer(layer, i, x, cos, sin, slots, mask, cache, key_span, regions, attention, order)
            if i in self.feature_layers:
                features[i] = x
        x = self.norm(x)
        if logit_index is not None:
            x = x.gather(1, logit_index[:, :, None].expand(-1, -1, x.shape[-1]))
        feats = torch.cat([features[i] for i in self.feature_layers], dim=-1) if features else None
        return TargetOutput(logits=self.head(x), features=feats)

    def _rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def _prepare(self, order: TokenOrder | None) -> TokenOrder | None:
        """What every layer of a forward reads of the tokens' order, made once (attention reads none)."""
        return order

    def compile_layers(self) -> None:
        """Fuse each layer's work around attention with `torch.compile` (regional compilation: the code is
        compiled once per shape and reused by every layer, since layers differ only in their weights).
        Attention and the cache writes stay eager, so the compiled regions hold no in-place updates."""
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, COMPILED_SHAPES)
        self._qkv = torch.compile(_qkv, dynamic=False)
        self._residual_mlp = torch.compile(residual_mlp, dynamic=False)
        # The prefill's shapes (requests joining, prompt bucket) are many and each rarely seen: one compile
        # with symbolic sizes serves them all.
        self._qkv_any = torch.compile(_qkv, dynamic=True)
        self._residual_mlp_any = torch.compile(residual_mlp, dynamic=True)

    def _regions(self, fused: bool, any_shape: bool) -> Any:
        """The functions a forward's layers run around attention and the cache, eager or compiled per shape or
        for any: here (qkv, residual and MLP); a subclass's `_layer` reads its own."""
        if not fused:
            return _qkv, residual_mlp
        return (self._qkv_any, self._residual_mlp_any) if any_shape else (self._qkv, self._residual_mlp)

    def _layer(
        self,
        layer: Any,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache,
        key_span: int,
        regions: Any,
        attention: str,
        order: TokenOrder | None = None,
    ) -> torch.Tensor:
        scale = getattr(layer.self_attn, "scaling", None)
        qkv, rest = regions
        q, k, v = qkv(layer, x, cos, sin, self.head_dim)
        cache.write(index, slots, k, v)
        result: torch.Tensor = rest(layer, x, attend(q, cache, index, mask, key_span, scale, attention))
        return result


def attend(
    q: torch.Tensor,
    cache: KVCache,
    layer: int,
    mask: torch.Tensor,
    key_span: int,
    scale: float | None,
    attention: str,
) -> torch.Tensor:
    """`q` `[batch, heads, n, head_dim]` over layer `layer`'s cache (its new keys written): the Triton tree
    kernel, which reads `visible` as `mask`, or torch's attention over the first `key_span` slots."""
    if attention == "triton":
        return tree_attention(q, cache.keys[layer], cache.values[layer], cache.lengths, mask, scale)
    keys, values = cache.read(layer, key_span)
    out: torch.Tensor = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out


def _qkv(
    layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values `[batch, heads, n, head_dim]` of `x` `[batch, n, hidden]`, normed and rotated."""
    attn = layer.self_attn
    batch, n, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(batch, n, -1, head_dim)
    k = attn.k_proj(h).view(batch, n, -1, head_dim)
    v = attn.v_proj(h).view(batch, n, -1, head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before rotary
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def tree_attention_mask(lengths: torch.Tensor, visible: torch.Tensor, key_span: int) -> torch.Tensor:
    """[batch, 1, n, key_span] bool: the committed prefix, plus slot `lengths + j` where `visible[:, i, j]`."""
    n = visible.shape[-1]
    rel = torch.arange(key_span, device=lengths.device)[None, None, :] - lengths[:, None, None]  # [batch, 1, span]
    in_tree = (rel >= 0) & (rel < n)
    tree_part = visible.gather(2, rel.clamp(0, n - 1).expand(-1, n, -1)) & in_tree
    return ((rel < 0) | tree_part)[:, None, :, :]


def read_target_config(path: str | Path) -> Any:
    """Read and check a target's config, with a clear error when the directory can't be used."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    directory = Path(path)
    if directory.is_file():
        raise UserError(f"{str(path)!r} is {_file_kind(directory)}, not a model directory (HF layout: config.json)")
    if not (directory / "config.json").is_file():
        raise UserError(f"model directory {str(path)!r} is missing or has no config.json")
    config_file = str(directory / "config.json")
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as exc:
        raise UserError(f"cannot read the model config {config_file!r}: {exc}") from exc
    if config.model_type in MULTIMODAL_MODEL_TYPES and getattr(config, "text_config", None) is not None:
        config = config.text_config  # a vision-language checkpoint: its text model is the target
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"unsupported target model type {config.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            f" (and the vision-language {', '.join(MULTIMODAL_MODEL_TYPES)}, whose text model is run)"
        )
    problem = _config_problem(config)
    if problem:
        raise UserError(f"cannot use the model config {config_file!r}: {problem}")
    return config


def _config_problem(config: Any) -> str | None:
    """What makes a config unusable for our layer loop, or None."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
    optional = ("num_key_value_heads", "head_dim", "max_position_embeddings")
    for name in required + optional:
        value = getattr(config, name, None)
        if (value is not None or name in required) and not (isinstance(value, int) and value >= 1):
            return f"{name} must be an integer >= 1, got {value!r}"
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 1
    if not getattr(config, "head_dim", None) and config.hidden_size % heads:
        return f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads {heads}"
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    return None


def _file_kind(path: Path) -> str:
    with path.open("rb") as f:
        magic = f.read(4)
    return "a GGUF file" if magic == b"GGUF" else "a file"


def check_weight_files(directory: Path) -> None:
    """Open every safetensors file's header, so that a truncated or garbage file is named in the error."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"cannot load the model weights {str(file)!r}: {exc}") from exc


def load_target(path: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Load an HF causal LM from a directory, with a clear error when it can't be read."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    config = read_target_config(path)
    check_weight_files(Path(path))
    try:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(Path(path), config=config, dtype=dtype)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise UserError(f"cannot load the model weights in {str(path)!r}: {exc}") from exc
    return model.to(device)
