"""The model runner's KV blocks as a `kvloop.core.kv_connector.KVBlockStore`.

Each layer's cache is `[2, kv_heads, num_blocks, block_size, head_dim]` (keys, values); a
transferred frame is one layer's selected blocks, `[2, kv_heads, n, block_size, head_dim]`
in the cache's dtype (`KV_BLOCK_LAYOUT`), the blocks in the order asked for. A quantized cache
(`--kv-cache-dtype`, kvloop.model.kv_quant) moves its bytes as they are, rows of codes and
scale (`QUANTIZED_KV_BLOCK_LAYOUT`); its fingerprint's dtype names the format ("int8",
"fp8_e4m3", "fp8_e5m2"), so no engine, tier or prefill engine of another KV dtype takes its
blocks. Reads and writes run on the connector's threads while the runner computes other
blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvloop.core.kv_connector import KV_BLOCK_LAYOUT, QUANTIZED_KV_BLOCK_LAYOUT, KVFingerprint
from kvloop.model.kv_quant import KVQuant
from kvloop.model.loader import ModelConfig


class ModelKVBlockStore:
    """Block-wise access to a list of per-layer KV tensors."""

    has_payload = True

    def __init__(self, kv_caches: list[torch.Tensor], config: ModelConfig, block_size: int,
                 model_name: str, kv_quant: KVQuant | None = None):
        self.kv_caches = kv_caches
        self.block_size = block_size
        first = kv_caches[0]
        self.dtype = first.dtype
        self.device = first.device
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.row = first.shape[-1]      # elements of a row: head_dim (+ the scale's bytes)
        self.fingerprint = KVFingerprint(
            model=model_name,
            dtype=kv_quant.name if kv_quant else str(first.dtype).removeprefix("torch."),
            num_layers=len(kv_caches), num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            layout=QUANTIZED_KV_BLOCK_LAYOUT if kv_quant else KV_BLOCK_LAYOUT)
        per_layer = 2 * self.num_kv_heads * block_size * self.row * first.element_size()
        self.block_nbytes = per_layer * len(kv_caches)

    def read_blocks(self, block_ids: Sequence[int]) -> list[Any]:
        """One contiguous uint8 array per layer: `[2, kv_heads, n, block_size, head_dim]`."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return [kv.index_select(2, index).contiguous().view(torch.uint8).cpu().numpy()
                    for kv in self.kv_caches]

    def write_blocks(self, block_ids: Sequence[int], frames: Sequence[Any]) -> None:
        n = len(block_ids)
        if len(frames) != len(self.kv_caches):
            raise ValueError(f"{len(frames)} frames for {len(self.kv_caches)} layers")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        shape = (2, self.num_kv_heads, n, self.block_size, self.row)
        with torch.inference_mode():
            for kv, frame in zip(self.kv_caches, frames, strict=True):
                data = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
                kv.index_copy_(2, index, data.view(self.dtype).view(shape).to(self.device))
