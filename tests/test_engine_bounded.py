"""Nothing keyed by a request outlives it (issue 37, low: one engine's RSS grew 85 % in a
five-minute soak). After many mixed requests (sampling, logprobs, prompt logprobs, pooling,
aborts while waiting or running) have finished, no dict, set or list anywhere in the engine's
object graph (scheduler, KV cache manager, block pool, runner, structured output) still holds
one of their ids, and the graph's containers are no larger than after a tenth as many."""

from __future__ import annotations

from typing import Any

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import PoolingParams, SamplingParams
from kvloop.sim.worker import SimWorkerRunner

PREFIX = "leak-probe-"


def containers(root: Any) -> dict[str, Any]:
    """path -> every dict/list/set/deque reachable from `root` through kvloop objects."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    todo: list[tuple[str, Any, int]] = [("engine", root, 0)]
    while todo:
        path, obj, depth = todo.pop()
        if id(obj) in seen or depth > 8:
            continue
        seen.add(id(obj))
        if isinstance(obj, (dict, list, set, frozenset)) or type(obj).__name__ == "deque":
            found[path] = obj
            values = obj.values() if isinstance(obj, dict) else obj
            todo += [(f"{path}[]", v, depth + 1) for v in list(values)[:4]]
        elif type(obj).__module__.startswith("kvloop") and hasattr(obj, "__dict__"):
            todo += [(f"{path}.{k}", v, depth + 1) for k, v in vars(obj).items()]
    return found


def holds_a_request_id(obj: Any) -> bool:
    keys = obj.keys() if isinstance(obj, dict) else obj
    return any(isinstance(k, str) and k.startswith(PREFIX) for k in list(keys))


def run(n: int) -> EngineCore:
    runner = SimWorkerRunner(None, 64, 256, block_size=4)
    config = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                                    max_model_len=256),
                          check_invariants=True)
    engine = EngineCore(config, runner, 64)
    for i in range(n):
        kind = i % 4
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                            logprobs=2 if kind == 1 else None,
                            prompt_logprobs=1 if kind == 2 else None)
        rid = f"{PREFIX}{i}"
        engine.add_request(engine.make_request(
            rid, [1 + i % 50, 2, 3, 4, 5, 6, 7, 8, 9], sp,
            pooling_params=PoolingParams() if kind == 3 else None))
        if i % 7 == 0:
            engine.abort_requests([rid])            # waiting, or running a step later
        for _ in range(2):
            engine.step()
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    engine.step()      # the runner hears of the last finished ids with the next step
    return engine


def test_no_request_id_outlives_its_request_and_nothing_grows() -> None:
    small, large = containers(run(40)), containers(run(400))
    assert [p for p, c in large.items() if holds_a_request_id(c)] == []
    grown = {p: (len(small.get(p, ())), len(c)) for p, c in large.items()
             if len(c) > len(small.get(p, ())) + 8}
    assert grown == {}
