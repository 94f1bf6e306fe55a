from __future__ import annotations

import torch

from ddtree.kv_cache import KVCache


def test_compact_moves_the_path_and_commits_only_active_rows() -> None:
    cache = KVCache(
        layers=2, batch=2, kv_heads=1, head_dim=1, capacity=12, dtype=torch.float32, device=torch.device("cpu")
    )
    cache.lengths[:] = torch.tensor([2, 4])
    slots = cache.lengths[:, None] + torch.arange(5)[None, :]
    values = (slots * 10).float()[:, None, :, None]  # value = 10 * slot
    for layer in range(2):
        cache.write(layer, slots, values, values + 1)
    path = torch.tensor([[0, 3, 4, 4, 4], [0, 2, 2, 2, 2]])
    cache.compact(path, advance=torch.tensor([3, 0]))
    assert cache.lengths.tolist() == [5, 4]
    assert cache.keys[1, 0, 0, 2:5, 0].tolist() == [20.0, 50.0, 60.0]
    assert cache.values[0, 0, 0, 2:5, 0].tolist() == [21.0, 51.0, 61.0]
