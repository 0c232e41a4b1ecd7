"""The runner behind `kvloop serve --model sim`: SimRunner with served-model manners.

- Fake tokens are drawn from `text_token_ids`: ids of ordinary words in the vocabulary the
  worker speaks, chosen by the API process (`kvloop.server.sim_model`), so generated text
  decodes to words and never to EOS. Without them, the byte vocabulary
  (`kvloop.sim.byte_vocab`): printable bytes of 259 ids.
- They are a function of the request's *content*, not its id, so sampling behaves like a
  model's: greedy (temperature 0) output depends on the prompt only, a seeded request on
  (prompt, seed), an unseeded one on its id (different every time).
- Logprobs are made up but well formed (sampled token first, descending values).
- Each step lasts what the latency model says (`kvloop.sim.latency`), divided by `speedup`;
  `modelled_step_time` says it without running (`--max-num-batched-tokens auto` asks it).
- Speculative drafts are verified against these tokens, which copy from the context at
  `copy_rate` (`kvloop.sim.runner`), so acceptance follows the workload.
- Its KV blocks are modelled (`kvloop.sim.kv_store`): a KV connector moves no payload but
  takes the time a real block would.

`make_sim_runner` is the factory the engine core process calls (by name) with a
`kvloop.config.RunnerConfig` whose `sim` is set.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvloop.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    LoRAConfig,
    RunnerConfig,
    SimSettings,
)
from kvloop.core.lora_slots import SlotLRU
from kvloop.core.outputs import (
    Logprobs,
    PromptLogprobs,
    RunnerOutput,
    SchedulerOutput,
    prompt_logprob_positions,
)
from kvloop.core.request import SamplingParams
from kvloop.sim.byte_vocab import PRINTABLE_IDS, VOCAB_SIZE
from kvloop.sim.kv_store import SimKVBlockStore
from kvloop.sim.latency import LatencyModel
from kvloop.sim.runner import SimRunner

DEFAULT_SIM_BLOCKS = 4096


def _digest(*parts: object) -> int:
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


@dataclass(frozen=True)
class _Key:
    """What a request's fake tokens depend on."""

    content: str

    @classmethod
    def of(cls, request_id: str, prompt: Sequence[int], params: SamplingParams,
           lora_name: str | None = None) -> _Key:
        """An adapter's requests get their own tokens (its name is part of the key)."""
        prompt_key = hashlib.blake2b(bytes(str(list(prompt)), "ascii"), digest_size=16).hexdigest()
        if lora_name is not None:
            prompt_key = f"{prompt_key}:lora:{lora_name}"
        if params.greedy:
            return cls(f"greedy:{prompt_key}")
        if params.seed is not None:
            return cls(f"seed:{params.seed}:{prompt_key}")
        return cls(f"id:{request_id}")


class SimWorkerRunner:
    """A `Runner`: SimRunner plus content-keyed tokens, logprobs and the vocabulary size."""

    def __init__(self, latency: LatencyModel | None, num_gpu_blocks: int, max_model_len: int,
                 seed: int = 0, *, vocab_size: int | None = None,
                 text_token_ids: Sequence[int] = PRINTABLE_IDS, copy_rate: float = 0.0,
                 block_size: int = DEFAULT_BLOCK_SIZE, lora: LoRAConfig | None = None,
                 lora_load_s: float = 0.0, sleep: Callable[[float], None] = time.sleep):
        """`lora`: serve adapters by name (no file is read); a step that must load k of
        them into `lora.max_loras` slots (LRU) lasts k * `lora_load_s` longer."""
        self.num_gpu_blocks = num_gpu_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size or VOCAB_SIZE
        self.model_name = "sim"
        self.kv_block_store = SimKVBlockStore(block_size)
        self.text_token_ids = tuple(text_token_ids)
        if not self.text_token_ids or not all(0 <= t < self.vocab_size
                                              for t in self.text_token_ids):
            raise ValueError("text_token_ids must be non-empty ids of the vocabulary")
        self._seed = seed
        self._latency = latency
        self._keys: dict[str, _Key] = {}
        self._logprobs: dict[str, int] = {}
        self._prompts: dict[str, tuple[list[int], int]] = {}   # asking for prompt logprobs
        self._sim = SimRunner(token_source=self._token,
                              step_time=latency.step_time if latency else None,
                              copy_rate=copy_rate)
        self._lora = lora
        self._adapter_of: dict[str, str] = {}   # request -> its adapter (while it runs)
        self._loras: dict[str, str] = {}       # registered adapters: name -> path
        self._slots = SlotLRU(lora.max_loras) if lora is not None else None
        self._lora_load_s = lora_load_s
        self._sleep = sleep
        self.num_lora_loads = 0

    # --- LoRA (kvloop.core.runner.LoRARunner) ---------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        if self._lora is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        if name in self._loras:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if len(self._loras) >= self._lora.max_adapters:
            raise ValueError(f"at most {self._lora.max_adapters} LoRA adapters may be loaded")
        self._loras[name] = path

    def remove_lora(self, name: str) -> None:
        if self._loras.pop(name, None) is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        assert self._slots is not None
        self._slots.drop(name)

    def list_loras(self) -> list[str]:
        return list(self._loras)

    def prepare_lora(self, name: str) -> None:
        """Nothing to read: the simulator keeps no weights (a registered name is ready)."""
        if name not in self._loras:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")

    def _load_adapters(self, so: SchedulerOutput) -> None:
        """Make the step's adapters resident; wait the modelled time of those loaded."""
        names = {d.lora_name for d in so.scheduled_new_reqs if d.lora_name is not None}
        names |= {self._adapter_of[d.req_id] for d in so.scheduled_cached_reqs
                  if d.req_id in self._adapter_of}
        if not names or self._slots is None:
            return
        _, loads = self._slots.activate(names)
        self.num_lora_loads += len(loads)
        if loads and self._lora_load_s > 0:
            self._sleep(len(loads) * self._lora_load_s)

    def _token(self, request_id: str, k: int) -> int:
        key = self._keys[request_id]
        ids = self.text_token_ids
        return ids[_digest(self._seed, key.content, k) % len(ids)]

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        for rid in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self._adapter_of.pop(rid, None)
        for rid in scheduler_output.finished_req_ids:
            self._keys.pop(rid, None)
            self._logprobs.pop(rid, None)
        for d in scheduler_output.scheduled_new_reqs:
            if d.lora_name is not None:
                self._adapter_of[d.req_id] = d.lora_name
        self._load_adapters(scheduler_output)
        for d in scheduler_output.scheduled_new_reqs:
            self._keys[d.req_id] = _Key.of(d.req_id, d.prompt_token_ids, d.sampling_params,
                                           d.lora_name)
            if d.sampling_params.logprobs is not None:
                self._logprobs[d.req_id] = d.sampling_params.logprobs
        out = self._sim.execute(scheduler_output)
        out.prompt_logprobs = self._fake_prompt_logprobs(scheduler_output)
        if self._logprobs:
            out.logprobs = [self._fake_logprobs(rid, toks)
                            for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True)]
        return out

    def modelled_step_time(self, scheduler_output: SchedulerOutput) -> float:
        """What a step of `scheduler_output` lasts (`kvloop.core.runner.ModelledRunner`); 0
        without a latency model."""
        return self._latency.step_time(scheduler_output) if self._latency else 0.0

    def _fake_prompt_logprobs(self, so: SchedulerOutput) -> dict[str, PromptLogprobs]:
        """`fake_logprobs` of each prompt token a chunk scores, for the requests that ask."""
        for rid in so.finished_req_ids:
            self._prompts.pop(rid, None)
        self._prompts.update({d.req_id: (d.prompt_token_ids, d.sampling_params.prompt_logprobs)
                              for d in so.scheduled_new_reqs
                              if d.sampling_params.prompt_logprobs is not None})
        out: dict[str, PromptLogprobs] = {}
        chunks = [(d.req_id, d.num_computed_tokens, len(d.token_ids))
                  for d in so.scheduled_new_reqs]
        chunks += [(d.req_id, d.num_computed_tokens, len(d.token_ids))
                   for d in so.scheduled_cached_reqs]
        for rid, num_computed, num_tokens in chunks:
            if rid not in self._prompts:
                continue
            prompt, num_top = self._prompts[rid]
            span = prompt_logprob_positions(len(prompt), num_computed, num_tokens)
            if span:
                out[rid] = PromptLogprobs(span.start + 1, [
                    fake_logprobs(prompt[p + 1], num_top, self.text_token_ids) for p in span])
        return out

    def _fake_logprobs(self, request_id: str, tokens: list[int]) -> list[Logprobs] | None:
        num_top = self._logprobs.get(request_id)
        if num_top is None:
            return None
        return [fake_logprobs(tok, num_top, self.text_token_ids) for tok in tokens]

    def shutdown(self) -> None:
        self._sim.shutdown()


def fake_logprobs(token_id: int, num_top: int, text_ids: Sequence[int]) -> Logprobs:
    """Deterministic logprobs: the sampled token ranks first, then the `text_ids` after it."""
    sampled = -0.05 - (_digest("lp", token_id) % 1000) / 1000.0
    n = len(text_ids)
    start = text_ids.index(token_id) if token_id in text_ids else 0
    top_ids = [text_ids[(start + j) % n] for j in range(num_top)]
    top_lps = [sampled - 0.5 * j for j in range(num_top)]
    return Logprobs(sampled_logprob=sampled, sampled_rank=1, top_token_ids=top_ids,
                    top_logprobs=top_lps)


def make_sim_runner(config: RunnerConfig) -> SimWorkerRunner:
    """The engine core's factory for `--model sim`: the simulator with `config`'s KV
    capacity, context length and seed, and `config.sim`'s latency model and vocabulary
    (the byte vocabulary's where they are unset; `SimSettings()` when `sim` is None)."""
    sim = config.sim or SimSettings()
    latency = LatencyModel.from_file(sim.latency_file, sim.speedup) if sim.model_latency else None
    return SimWorkerRunner(latency, config.num_gpu_blocks_override or DEFAULT_SIM_BLOCKS,
                           config.max_model_len or DEFAULT_MAX_MODEL_LEN, config.seed,
                           vocab_size=sim.vocab_size,
                           text_token_ids=sim.text_token_ids or PRINTABLE_IDS,
                           copy_rate=sim.copy_rate, block_size=config.block_size,
                           lora=config.lora, lora_load_s=sim.lora_load_s / sim.speedup)
