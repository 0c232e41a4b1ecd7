"""The simulator's KV blocks: modelled bytes, no payload (a `KVBlockStore`).

A block weighs what SmolLM2-135M's would at bf16: 30 layers x (key + value) x 3 KV heads x
64 dims x 2 bytes = 23,040 bytes per token. Reads return no frames and writes take none; the
connector makes a simulated transfer last `nbytes / sim_bandwidth` seconds on D, so fleets of
simulated workers run the real protocol at realistic transfer times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvloop.core.kv_connector import KV_BLOCK_LAYOUT, KVFingerprint

SIM_NUM_LAYERS = 30          # SmolLM2-135M's geometry
SIM_NUM_KV_HEADS = 3
SIM_HEAD_DIM = 64
SIM_DTYPE = "bfloat16"
SIM_DTYPE_BYTES = 2
SIM_KV_BYTES_PER_TOKEN = SIM_NUM_LAYERS * 2 * SIM_NUM_KV_HEADS * SIM_HEAD_DIM * SIM_DTYPE_BYTES


class SimKVBlockStore:
    has_payload = False

    def __init__(self, block_size: int, model_name: str = "sim"):
        self.block_size = block_size
        self.block_nbytes = SIM_KV_BYTES_PER_TOKEN * block_size
        self.fingerprint = KVFingerprint(model=model_name, dtype=SIM_DTYPE,
                                         num_layers=SIM_NUM_LAYERS,
                                         num_kv_heads=SIM_NUM_KV_HEADS, head_dim=SIM_HEAD_DIM,
                                         layout=KV_BLOCK_LAYOUT)

    def read_blocks(self, block_ids: Sequence[int]) -> list[Any]:
        return []

    def write_blocks(self, block_ids: Sequence[int], frames: Sequence[Any]) -> None:
        if frames:
            raise ValueError("the simulator's blocks take no payload")
