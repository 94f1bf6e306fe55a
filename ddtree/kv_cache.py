"""A preallocated KV cache with per-request lengths and in-place compaction to the accepted path.

Slot j of request b holds the key and value of the token at position j. The `lengths` committed tokens
sit in slots `0..lengths[b]-1`. A verify step writes its tree into the scratch slots after them; the
accept step then moves the accepted path to the front of the scratch area, so slot == position again.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for all layers: `[layers, batch, kv_heads, capacity, head_dim]`."""

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [batch] committed tokens
        self.capacity = capacity

    def narrow(self, rows: int) -> KVCache:
        """A view of the first `rows` requests: same storage, so writes through it land here. A subclass's
        view is of its class (it narrows its own tensors after this)."""
        view = type(self).__new__(type(self))
        view.keys, view.values = self.keys[:, :rows], self.values[:, :rows]
        view.lengths = self.lengths[:rows]
        view.capacity = self.capacity
        return view

    def load_rows(self, rows: torch.Tensor, source: KVCache) -> None:
        """Put `source`'s requests (their keys, values and lengths) into requests `rows` (`[k]`) of this cache."""
        width = source.keys.shape[3]
        self.keys[:, rows, :, :width] = source.keys
        self.values[:, rows, :, :width] = source.values
        self.lengths[rows] = source.lengths

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `keys`/`values` (`[batch, kv_heads, n, head_dim]`) at `slots` (`[batch, n]`)."""
        index = slots[:, None, :, None].expand_as(keys)
        self.keys[layer].scatter_(2, index, keys)
        self.values[layer].scatter_(2, index, values)

    def read(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots `0..upto-1`: each `[batch, kv_heads, upto, head_dim]`."""
        return self.keys[layer, :, :, :upto], self.values[layer, :, :, :upto]

    def compact(self, path: torch.Tensor, advance: torch.Tensor) -> None:
        """Keep the tree nodes on `path` (`[batch, n]`, node indices in the last verify) and commit them.

        Node i of the last verify sits in slot `lengths + i`; path entry p moves to slot `lengths + p`.
        `advance` (`[batch]`) is how many of them become committed (0 for finished requests).
        """
        layers, batch, heads, _, dim = self.keys.shape
        n = path.shape[1]
        src = self.lengths[:, None] + path  # [batch, n]
        dst = self.lengths[:, None] + torch.arange(n, device=path.device)[None, :]
        src_index = src[None, :, None, :, None].expand(layers, batch, heads, n, dim)
        dst_index = dst[None, :, None, :, None].expand(layers, batch, heads, n, dim)
        for store in (self.keys, self.values):
            kept = store.gather(3, src_index)
            store.scatter_(3, dst_index, kept)
        self.lengths += advance
