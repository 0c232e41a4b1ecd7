"""`StepInputs`: what one forward pass needs beside the weights and the KV cache, one object
handed down the model (SGLang's `ForwardBatch`), so a new per-step input is a field here,
never another argument threaded through every layer's `forward`.

Built once per step by the runner (`kvloop.model.runner.ModelRunner._prepare_inputs`);
`LlamaModel.decode_layers` fills `low_bit` from its own policy (the model owns which steps
run the low-bit weights). Frozen: no layer changes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvloop.model.attention import AttentionMetadata
from kvloop.model.lora import LoRAStep


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    meta: AttentionMetadata        # block tables, slots, chunk layout (attention.py)
    logits_indices: torch.Tensor   # [S]: the rows whose logits are computed
    lora: LoRAStep | None = None   # the rows that use an adapter (None: every row is the base)
    low_bit: bool = False          # the linear layers run their low-bit weights
    # one per KV-cache group (`meta` is group 0's); empty: one group, `meta`
    group_metas: tuple[AttentionMetadata, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def meta_of(self, group: int) -> AttentionMetadata:
        """The attention metadata of KV-cache group `group`."""
        return self.group_metas[group] if self.group_metas else self.meta

    def with_low_bit(self, low_bit: bool) -> StepInputs:
        return self if low_bit == self.low_bit else dataclasses.replace(self, low_bit=low_bit)
