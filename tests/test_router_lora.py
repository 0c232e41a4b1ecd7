"""The router in front of simulated workers serving LoRA adapters: the adapter is in the
router's block keys (predicted hits equal the hits the workers report), a request goes to a
worker that has its adapter loaded, and among those to one where it is active."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvloop.front.prometheus_text import metric_value
from kvloop.router.fleet import Fleet
from kvloop.router.scorer import Candidate, RouteRequest, estimate_cost

from .conftest import RouterThread, wait_until
from .test_router_fleet import ADMIN, random_ids, router_config, start_fleet

pytestmark = pytest.mark.processes
SERIES = ("kvloop_router_predicted_hit_tokens_total", "kvloop_router_actual_hit_tokens_total")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("router_lora")
    for name in ("a", "b", "c"):
        (root / name).mkdir()
    f = start_fleet(2, "--enable-lora", "--max-loras", "2", "--lora-allowed-dirs", str(root))
    try:
        placement = {"a": [0], "b": [1], "c": [0, 1]}   # adapter -> workers that load it
        for name, workers in placement.items():
            for i in workers:
                r = httpx.post(f"{f.workers[i].url}/v1/load_lora_adapter", headers=ADMIN,
                               json={"lora_name": name, "lora_path": str(root / name)})
                assert r.status_code == 200, r.text
        yield f, placement
    finally:
        f.stop()


def _served(f: Fleet) -> list[float]:
    return [metric_value(httpx.get(w.url + "/metrics").text, "vllm:request_success_total")
            for w in f.workers]


def _complete(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt,
                                                  "max_tokens": 2, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_adapter_requests_land_on_holders_and_predictions_match(fleet) -> None:
    f, placement = fleet
    rng = random.Random(4)
    with RouterThread(router_config(), f.specs()) as rt:
        registry = rt.router.registry
        wait_until(lambda: all(w.description is not None and w.description.lora_adapters
                               for w in registry.all()), 15, "the workers' adapters")
        prompt = random_ids(rng, 80)
        for model in ("a", "b", "c", "sim"):
            for attempt in range(2):
                before_m = httpx.get(rt.url + "/metrics").text
                before = _served(f)
                out = _complete(rt.url, model, prompt)
                after = _served(f)
                after_m = httpx.get(rt.url + "/metrics").text
                served = [i for i, (x, y) in enumerate(zip(before, after, strict=True))
                          if y > x]
                assert len(served) == 1, (model, served)
                if model in placement:
                    assert served[0] in placement[model], (model, served)
                cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted, actual = (metric_value(after_m, n) - metric_value(before_m, n)
                                     for n in SERIES)
                assert predicted == actual == cached, (model, attempt, predicted, actual)
                # namespaces: the first request of each adapter misses, its repeat hits
                assert (cached > 0) == (attempt == 1), (model, attempt, cached)


def test_affinity_term_orders_active_room_full() -> None:
    """The cost model's adapter term: active 0 < room to load < every slot busy."""
    req = RouteRequest(prompt_tokens=64, block_size=16, lora_name="x")
    cfg = router_config().cost
    active = Candidate("w0", lora_adapters=frozenset({"x"}), max_loras=2)
    room = Candidate("w1", lora_adapters=frozenset({"y"}), max_loras=2)
    full = Candidate("w2", lora_adapters=frozenset({"y", "z"}), max_loras=2)
    costs = [estimate_cost(c, req, cfg) for c in (active, room, full)]
    assert costs[0] < costs[1] < costs[2]
    base = RouteRequest(prompt_tokens=64, block_size=16)
    assert estimate_cost(full, base, cfg) == estimate_cost(active, base, cfg)
