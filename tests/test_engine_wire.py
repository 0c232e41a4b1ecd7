"""The engine core process's typed inputs: `RunnerConfig` (inside `EngineStartConfig`, on its
stdin) and `SamplingParams` (inside each ADD), validated on both sides of the wire.

The engine process runs for real (`python -m kvloop.engine.proc`, the simulator as its
runner) and is spoken to as the API server speaks to it: a ROUTER and a PULL socket bound on
127.0.0.1, the start config on its stdin, msgpack frames.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq

from kvloop.config import (
    REAL_RUNNER_FACTORY,
    SIM_RUNNER_FACTORY,
    CacheConfig,
    EngineConfig,
    RunnerConfig,
    SchedulerConfig,
    SimSettings,
)
from kvloop.core.request import SamplingParams
from kvloop.core.runner import LoadedRunner
from kvloop.sim.worker import make_sim_runner
from kvloop.wire import (
    WIRE_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartConfig,
    RequestType,
    UtilityRequest,
)
from tests.engine_proc_helpers import engine_core_process

TEXT_IDS = (7, 8, 9)
RUNNER = RunnerConfig(block_size=4, num_gpu_blocks_override=24, max_model_len=50, seed=3,
                      sim=SimSettings(model_latency=False, vocab_size=300,
                                      text_token_ids=TEXT_IDS))
ENGINE = EngineConfig(cache=CacheConfig(block_size=4),
                      scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                      check_invariants=True)


# --- RunnerConfig ---------------------------------------------------------------------------
def test_runner_config_picks_its_factory() -> None:
    assert RunnerConfig().factory == REAL_RUNNER_FACTORY
    assert RUNNER.factory == SIM_RUNNER_FACTORY


@pytest.mark.parametrize(("changes", "message"), [
    ({"dtype": "float8"}, "--dtype must be auto or one of"),
    ({"device": "tpu"}, "--device must be one of auto, cpu, cuda, cuda:N, got 'tpu'"),
    ({"block_size": 0}, "block_size must be >= 1, got 0"),
    ({"gpu_memory_utilization": 1.5}, r"--gpu-memory-utilization must be in \(0, 1\], got 1.5"),
    ({"num_threads": 0}, "--num-threads must be >= 1, got 0"),
    ({"max_model_len": 0}, "--max-model-len must be >= 1, got 0"),
    ({"num_gpu_blocks_override": 1}, "--num-gpu-blocks-override must be >= 2"),
])
def test_runner_config_is_validated_on_construction_and_decode(changes: dict[str, Any],
                                                                message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunnerConfig(**changes)
    raw = msgspec.json.decode(msgspec.json.encode(RunnerConfig())) | changes
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.json.decode(msgspec.json.encode(raw), type=RunnerConfig)


def test_sim_settings_are_validated_on_construction_and_decode() -> None:
    with pytest.raises(ValueError, match="--sim-speedup must be > 0, got 0.0"):
        SimSettings(speedup=0.0)
    with pytest.raises(msgspec.ValidationError, match="--sim-speedup must be > 0"):
        msgspec.json.decode(b'{"sim": {"speedup": -1}}', type=RunnerConfig)
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `str` - at "
                                                      r"`\$.sim.text_token_ids\[0\]`"):
        msgspec.json.decode(b'{"sim": {"text_token_ids": ["a"]}}', type=RunnerConfig)


def test_start_config_round_trips_and_checks_the_block_size() -> None:
    start = EngineStartConfig(engine=ENGINE, runner=RUNNER, input_address="a",
                              output_address="b")
    line = msgspec.json.encode(start)
    assert msgspec.json.decode(line, type=EngineStartConfig) == start
    with pytest.raises(ValueError, match=r"the runner's block_size \(16\) differs from the "
                                         r"engine's \(4\)"):
        EngineStartConfig(engine=ENGINE, runner=RunnerConfig(), input_address="a",
                          output_address="b")
    raw = msgspec.json.decode(line)
    raw["runner"]["block_size"] = 8
    with pytest.raises(msgspec.ValidationError, match="differs from the engine's"):
        msgspec.json.decode(msgspec.json.encode(raw), type=EngineStartConfig)


def test_the_sim_factory_returns_a_loaded_runner_with_its_config_s_facts() -> None:
    runner = make_sim_runner(RUNNER)
    assert isinstance(runner, LoadedRunner)
    assert (runner.num_gpu_blocks, runner.max_model_len, runner.vocab_size,
            runner.model_name) == (24, 50, 300, "sim")
    assert runner.text_token_ids == TEXT_IDS
    defaults = make_sim_runner(RunnerConfig(sim=SimSettings(model_latency=False)))
    assert (defaults.num_gpu_blocks, defaults.max_model_len, defaults.vocab_size) == \
        (4096, 8192, 259)                  # the byte vocabulary's, without a model to say


# --- the engine process ---------------------------------------------------------------------
@dataclass
class Engine:
    router: zmq.Socket
    pull: zmq.Socket
    identity: bytes
    ready: EngineReady

    def send(self, kind: bytes, payload: bytes) -> None:
        self.router.send_multipart([self.identity, kind, payload])

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.send(RequestType.ADD, msgspec.msgpack.encode(
            EngineCoreRequest(request_id, prompt, params)))

    def finished(self, *request_ids: str, timeout_s: float = 20.0) -> dict[str, EngineCoreOutput]:
        """Collect outputs until every one of `request_ids` finished; their tokens summed
        into the last output of each."""
        tokens: dict[str, list[int]] = {}
        done: dict[str, EngineCoreOutput] = {}
        deadline = time.monotonic() + timeout_s
        while set(done) != set(request_ids):
            assert self.pull.poll(max(1, int((deadline - time.monotonic()) * 1000))), done
            outs = msgspec.msgpack.decode(self.pull.recv(), type=EngineCoreOutputs)
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    done[o.request_id] = msgspec.structs.replace(
                        o, new_token_ids=tokens[o.request_id])
        return done

    def utility(self, method: str, timeout_s: float = 20.0) -> Any:
        self.send(RequestType.UTILITY, msgspec.msgpack.encode(UtilityRequest(1, method)))
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.pull.poll(max(1, int((deadline - time.monotonic()) * 1000)))
            outs = msgspec.msgpack.decode(self.pull.recv(), type=EngineCoreOutputs)
            if outs.utility_output is not None:
                assert outs.utility_output.failure_message is None
                return outs.utility_output.result


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    def start(input_address: str, output_address: str) -> EngineStartConfig:
        return EngineStartConfig(engine=ENGINE, runner=RUNNER, input_address=input_address,
                                 output_address=output_address)

    with engine_core_process(start) as e:
        yield Engine(e.router, e.pull, e.identity, e.ready)
        assert e.proc.stdin is not None
        e.proc.stdin.close()                   # the API server's way of stopping it
        assert e.proc.wait(timeout=20) == 0


@pytest.mark.processes
def test_runner_config_reaches_the_factory_across_the_process_boundary(engine: Engine
                                                                       ) -> None:
    r = engine.ready
    assert isinstance(r, EngineReady) and r.wire_version == WIRE_VERSION
    # the runner's facts, as the sim factory built them from RUNNER
    assert (r.num_gpu_blocks, r.max_model_len, r.vocab_size, r.model_name, r.block_size) == \
        (24, 50, 300, "sim", 4)
    engine.add("greedy", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0))
    (out,) = engine.finished("greedy").values()
    assert out.finish_reason == "length" and len(out.new_token_ids) == 6
    assert set(out.new_token_ids) <= set(TEXT_IDS)       # the text ids reached the runner


def _add_payload(request_id: str, params: Any) -> bytes:
    """An ADD as the wire lays it out (`EngineCoreRequest` is array-like), unchecked."""
    return msgspec.msgpack.encode([request_id, [1, 2, 3], params])


@pytest.mark.processes
def test_a_malformed_request_is_refused_and_the_engine_goes_on(engine: Engine) -> None:
    engine.send(RequestType.ADD, _add_payload("hot", {"temperature": 5.0}))
    engine.send(RequestType.ADD, _add_payload("typed", {"max_tokens": "many"}))
    engine.send(RequestType.ADD, b"\xc1")                   # not msgpack: no id to answer
    engine.send(RequestType.ADD, msgspec.msgpack.encode({"request_id": "x"}))   # no array
    engine.add("fine", [4, 5], SamplingParams(max_tokens=3))
    done = engine.finished("hot", "typed", "fine")
    assert {rid: (o.finish_reason, o.new_token_ids) for rid, o in done.items()
            if rid != "fine"} == {"hot": ("error", []), "typed": ("error", [])}
    assert done["hot"].error == ("invalid request: temperature must be in [0, 2], got 5.0. "
                                 "- at `$[2]`")
    assert done["typed"].error == ("invalid request: Expected `int | null`, got `str` - at "
                                   "`$[2].max_tokens`")
    assert done["fine"].finish_reason == "length" and len(done["fine"].new_token_ids) == 3
    assert engine.utility("check_invariants") is True
    assert engine.utility("get_stats")["num_requests"] == 0     # nothing left behind
