"""`LoRARequest`: vLLM's name for "run this request with that adapter" (offline `LLM`).

An adapter is known by its name (what block hashes, KV events and the router key on); the
path is the PEFT folder it is read from the first time the name is used. vLLM's integer id
is accepted for compatibility and not used. It imports nothing of kvloop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name or not self.lora_path:
            raise ValueError("a LoRARequest needs a lora_name and a lora_path")
