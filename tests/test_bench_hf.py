"""The transformers anchor server (kvloop/bench/hf_server.py) on a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytestmark = pytest.mark.processes   # the anchor: a tiny HF model behind a real HTTP server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvloop.bench import workloads as w  # noqa: E402
from kvloop.bench.driver import BenchConfig, run_bench_sync  # noqa: E402
from kvloop.bench.hf_server import AnchorServer, StaticBatcher, serve  # noqa: E402
from kvloop.bench.report import summarize  # noqa: E402


def _tiny_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=2, pad_token_id=0, bos_token_id=1)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def anchor():
    model = _tiny_model()
    batcher = StaticBatcher(model, max_batch=8, batch_wait_s=0.05)
    batcher.start()
    urls: list[str] = []
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    def on_ready(url: str) -> None:
        urls.append(url)
        ready.set()

    stop = asyncio.Event()
    task = loop.create_task(serve(AnchorServer(batcher, None, "tiny"), "127.0.0.1", 0,
                                  on_ready, stop))
    thread = threading.Thread(target=loop.run_until_complete, args=(task,), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield urls[0], batcher, model
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)
    batcher.stop()


def test_anchor_streams_exact_lengths_in_shared_batches(anchor) -> None:
    url, batcher, _ = anchor
    wl = w.random_workload(6, 12, 6, seed=2, dist="uniform", spread=0.5, token_range=(3, 96))
    before = batcher.stats.batches
    run = run_bench_sync(wl, BenchConfig(url, concurrency=3, progress=False,
                                         token_range=(3, 96)))
    s = summarize(run)
    assert (s["completed"], s["failed"], s["model"]) == (6, 0, "tiny")
    by_session = {r.session_id: r for r in run.results}
    for sess in wl.sessions:
        r = by_session[sess.session_id]
        assert r.output_tokens == sess.turns[0].max_tokens == len(r.output_token_ids or [])
        assert r.cached_tokens == 0
    assert batcher.stats.batches - before < 6      # some requests shared a batch
    assert max(batcher.stats.sizes) > 1


def test_anchor_tokens_equal_generate_and_honour_eos(anchor) -> None:
    url, batcher, model = anchor
    prompt = [5, 17, 33, 60, 7, 9]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                             pad_token_id=0, eos_token_id=None, min_new_tokens=5)
    expected = ref[0, len(prompt):].tolist()
    wl = w.trace_workload([json.dumps({"time_s": 0, "prompt_token_ids": prompt,
                                       "output_len": 5})])
    run = run_bench_sync(wl, BenchConfig(url, progress=False))
    assert run.results[0].output_token_ids == expected
    # with the first generated token as EOS: ignore_eos goes on, the default stops at once
    saved = batcher.eos_ids
    batcher.eos_ids = {expected[0]}
    try:
        stopped = run_bench_sync(wl, BenchConfig(url, progress=False, ignore_eos=False))
        ignored = run_bench_sync(wl, BenchConfig(url, progress=False))
    finally:
        batcher.eos_ids = saved
    assert stopped.results[0].output_token_ids == [expected[0]]
    assert len(ignored.results[0].output_token_ids or []) == 5
