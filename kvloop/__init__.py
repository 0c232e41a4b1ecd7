"""kvloop: an LLM serving engine built on vLLM V1's ideas, and a KV-cache-aware router.

`import kvloop` stays light (no torch): `LLM` is imported on first use.
"""

from typing import TYPE_CHECKING, Any

from kvloop.lora_request import LoRARequest
from kvloop.pooling_params import PoolingParams
from kvloop.sampling_params import SamplingParams, StructuredOutputsParams
from kvloop.version import __version__

__all__ = ["LLM", "LoRARequest", "PoolingParams", "SamplingParams", "StructuredOutputsParams",
           "__version__"]

if TYPE_CHECKING:
    from kvloop.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvloop.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvloop' has no attribute {name!r}")
