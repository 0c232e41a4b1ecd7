"""`kvloop serve --kv-cache-dtype int8` with the embedded SmolLM2-135M: the block budget of
`--kv-cache-memory` in the quantized format (32 MiB: 171 blocks of 16 tokens, where fp32 KV
gives 45: a block's rows are 64 codes + a 4-byte scale instead of 64 fp32), shown in
`vllm:cache_config_info` with the cache dtype; it answers, and a repeated prompt hits the
prefix cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import needs_embedded_model, sdk, serving

pytestmark = [pytest.mark.processes, needs_embedded_model]

PROMPT = ("The city of Paris is the capital of France. It is known for the Eiffel Tower, "
          "the Louvre museum and its cafes. The river that runs through Paris is the")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with serving(tmp_path_factory, "serve_kvq", ["--kv-cache-dtype", "int8",
                                                 "--kv-cache-memory", "32MiB",
                                                 "--max-model-len", "512",
                                                 "--debug-check-invariants"],
                 timeout_s=300) as srv:
        yield srv


def test_block_count_and_dtype_in_cache_config_info(server: ServeProcess) -> None:
    assert server.metric("vllm:cache_config_info", cache_dtype="int8",
                         num_gpu_blocks="171", block_size="16") == 1
    assert server.engine_stats()["num_total_blocks"] == 170     # the null block aside


def test_answers_and_hits_the_prefix_cache(server: ServeProcess) -> None:
    client = sdk(server.url, timeout=240)
    first = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                      max_tokens=3, temperature=0)
    again = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                      max_tokens=3, temperature=0)
    assert first.choices[0].text and again.choices[0].text == first.choices[0].text
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (
        first.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert server.metric("vllm:prefix_cache_hits_total") >= details.cached_tokens
