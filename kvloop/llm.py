"""Offline inference shaped like vLLM's: `LLM(model).generate(prompts, params)`.

Everything runs in this process: the tokenizer (`kvloop.front.tokenizer`), the real
scheduler, KV cache manager and block pool (`EngineCore`), and the model runner. `generate`
adds every request, steps the engine until all finish (with a tqdm progress bar), and returns
one `RequestOutput` per prompt, in prompt order.

What the engine does not do is done by the API server's output processing
(`kvloop.front.processor`), the same code for both: `n` > 1 fanned out into n requests
(seeded ones get seeds seed, seed+1...), EOS and the model's other end-of-turn ids, stop
strings (detokenized incrementally, not before `min_tokens`; a hit aborts the request and
truncates its text), text and logprobs; this module only shapes vLLM's `RequestOutput`.

With `speculative_config` (vLLM's dict, e.g. `{"method": "ngram", "num_speculative_tokens":
4}`) the engine drafts by prompt lookup and verifies the drafts in each forward pass; with
`disable_log_stats=False` it counts them, and `get_metrics()` returns the counts under vLLM's
names (`vllm:spec_decode_num_drafts`, ...), as vLLM's `LLM.get_metrics()` does.

With `kv_transfer_config` (a `kvloop.config.KVTransferConfig`, or its dict or JSON) the engine
gets a KV connector (`kvloop.kv_transfer`): requests whose `SamplingParams.extra_args` carry
`kv_transfer_params` prefill for a decode worker or pull their prompt's KV from a prefill
worker (docs/disaggregation.md), and each `RequestOutput` carries the `kv_transfer_params`
its request handed on. `generate` returns when its requests finish; blocks a prefill worker
still holds for a decode worker are freed by later steps (`wait_for_kv_transfers`). The side
channel needs the fleet secret (`fleet_secret`, else $KVLOOP_FLEET_SECRET_FILE or
$KVLOOP_FLEET_SECRET; kvloop/trust.py), the same in both engines.

`embed(prompts)` is vLLM's `LLM.embed` for a generative model served as an embedding model:
each prompt becomes a pooling request (`kvloop.pooling_params.PoolingParams`) batched through
the same engine loop, and comes back as the final-norm hidden state of its last token,
L2-normalized unless the params say not (`EmbeddingRequestOutput.outputs.embedding`).

A prompt that leaves no room for an output token raises ContextLengthError (a ValueError) with
the server's message, before any request is added; so does a prompt token id outside the
model's vocabulary (TokenIdError, a ValueError). `max_tokens` beyond the context is not an
error here (the server answers 400 for it only when the client set it; SamplingParams always
carries one): as in vLLM's offline LLM, generation stops at `max_model_len` ("length").
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvloop.config import (
    AUTO_BUDGET,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    AutoBudget,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    budget_floor,
)
from kvloop.core.request import (
    NO_GRAMMAR_BACKEND,
    PoolingParams,
    SamplingParams,
    check_context_length,
    check_token_ids,
)
from kvloop.core.runner import LoadedRunner
from kvloop.engine.build import BuiltEngine, build_engine
from kvloop.front.processor import OutputOptions, OutputState, TokenLogprob, fan_out, model_stops
from kvloop.front.tokenizer import Tokenizer
from kvloop.lora_request import LoRARequest
from kvloop.trust import FleetSecret, load_fleet_secret
from kvloop.wire import SpecDecodingStats

PromptType = str | dict[str, Any]
Message = dict[str, Any]

OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048
_IDLE_WAIT_S = 0.05   # how long a step with nothing to do waits for connector news
OFFLINE_MAX_NUM_SEQS = 256


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # with `prompt_logprobs`: None for the first prompt token, then one dict per token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's shape: `outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class Metric:
    """One metric of `LLM.get_metrics()` (vLLM's `vllm.v1.metrics.reader` shapes)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class _Sequence:
    """One engine request (one of a prompt's n samples) while it runs."""

    request_id: str
    prompt_index: int
    sample_index: int
    params: SamplingParams
    state: OutputState
    kv_transfer_params: dict[str, Any] | None = None


class LLM:
    """An in-process engine for offline batch generation."""

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", device: str = "auto", seed: int = 0,
                 max_num_batched_tokens: int | str = OFFLINE_MAX_NUM_BATCHED_TOKENS,
                 target_tpot_ms: float | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 kv_cache_memory: int | None = None, num_gpu_blocks_override: int | None = None,
                 num_threads: int | None = None, gpu_memory_utilization: float | None = None,
                 low_bit_max_tokens: int | None = None,
                 speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
                 disable_log_stats: bool = True, check_invariants: bool = False,
                 kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None,
                 fleet_secret: FleetSecret | None = None, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, kv_cache_dtype: str = "auto"):
        """vLLM's keyword arguments; the runner's (`kvloop.config.RunnerConfig` says what
        each does) become one RunnerConfig, the engine's one EngineConfig
        (`speculative_config`: `SpeculativeConfig.from_dict`'s keys).
        `max_num_batched_tokens="auto"` measures the loaded runner's steps and takes the
        largest budget whose step stays within `target_tpot_ms` (`kvloop.core.budget`)."""
        spec = (SpeculativeConfig.from_dict(speculative_config)
                if isinstance(speculative_config, dict) else speculative_config)
        rc = RunnerConfig(
            model=model, dtype=dtype, device=device, block_size=block_size,
            kv_cache_memory=kv_cache_memory, num_gpu_blocks_override=num_gpu_blocks_override,
            max_model_len=max_model_len, seed=seed, num_threads=num_threads,
            gpu_memory_utilization=gpu_memory_utilization,
            low_bit_max_tokens=low_bit_max_tokens, kv_cache_dtype=kv_cache_dtype,
            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None)
        tok = Tokenizer.from_model(tokenizer if tokenizer is not None else model)
        config = engine_config(DEFAULT_MAX_MODEL_LEN, block_size=rc.block_size,
                               max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs,
                               enable_prefix_caching=enable_prefix_caching,
                               enable_chunked_prefill=enable_chunked_prefill,
                               long_prefill_token_threshold=long_prefill_token_threshold,
                               check_invariants=check_invariants, speculative=spec,
                               log_stats=not disable_log_stats,
                               kv_transfer=kv_transfer_of(kv_transfer_config),
                               target_tpot_ms=target_tpot_ms)
        self._init(build_engine(rc, config, tokenizer=tok,
                                secret=fleet_secret or load_fleet_secret()), tok)

    @classmethod
    def from_runner(cls, runner: LoadedRunner, tokenizer: Tokenizer, config: EngineConfig,
                    num_gpu_blocks: int | None = None,
                    fleet_secret: FleetSecret | None = None) -> LLM:
        """An LLM over an already loaded runner (tests and benchmarks share one model), built
        as `LLM(...)` builds (`kvloop.engine.build_engine`), with at most `num_gpu_blocks` of
        its KV blocks; `config` is the template (`engine_config`), its connectors
        (`kv_transfer`, `kv_offload`) built over the runner's block store."""
        rc = RunnerConfig(block_size=config.cache.block_size)
        llm = cls.__new__(cls)
        llm._init(build_engine(rc, config, runner=runner, tokenizer=tokenizer,
                               num_gpu_blocks=num_gpu_blocks,
                               secret=fleet_secret or load_fleet_secret()), tokenizer)
        return llm

    def _init(self, built: BuiltEngine, tokenizer: Tokenizer) -> None:
        self.engine = built.engine
        self.runner = built.runner
        self.config = built.config
        self.kv_transfer_info = built.kv_transfer
        self.tokenizer = tokenizer
        self._ids = itertools.count()
        self._spec_stats = SpecDecodingStats()

    @property
    def _vocab_size(self) -> int:
        return int(getattr(self.runner, "vocab_size", None) or self.tokenizer.vocab_size)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The counters of every `generate` so far, under vLLM's names and labels: with
        speculative decoding, `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
        `..._num_accepted_tokens` (Counters) and `..._num_accepted_tokens_per_pos` (a Vector,
        one value per position). ValueError unless built with `disable_log_stats=False`."""
        if not self.config.log_stats:
            raise ValueError("stats are not kept: build the LLM with disable_log_stats=False")
        spec = self.config.speculative
        if spec is None:
            return []
        labels = {"model_name": getattr(self.runner, "model_name", ""), "engine": "0"}
        s = self._spec_stats
        per_pos = s.num_accepted_tokens_per_pos
        per_pos = per_pos + [0] * (spec.num_speculative_tokens - len(per_pos))
        return [Counter("vllm:spec_decode_num_drafts", labels, s.num_drafts),
                Counter("vllm:spec_decode_num_draft_tokens", labels, s.num_draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", labels, s.num_accepted_tokens),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos)]

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, or `{"prompt_token_ids": [...]}`); `lora_request`:
        one adapter for all, or one (or None: the base model) per prompt, registered with the
        engine the first time its name is seen (needs `enable_lora=True`)."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params = _params_per_prompt(sampling_params, len(prompt_list))
        encoded = [self._encode_prompt(p) for p in prompt_list]
        return self._run(encoded, params, use_tqdm, self._lora_names(lora_request,
                                                                    len(prompt_list)))

    def _lora_names(self, lora: LoRARequest | Sequence[LoRARequest | None] | None,
                    num_prompts: int) -> list[str | None]:
        per_prompt = ([lora] * num_prompts if lora is None or isinstance(lora, LoRARequest)
                      else list(lora))
        if len(per_prompt) != num_prompts:
            raise ValueError("lora_request: one per prompt, or one for all")
        known = set(self.engine.list_loras())
        for req in per_prompt:
            if req is not None and req.lora_name not in known:
                self.engine.add_lora(req.lora_name, req.lora_path)
                known.add(req.lora_name)
        return [None if req is None else req.lora_name for req in per_prompt]

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate."""
        conversations = ([messages] if messages and isinstance(messages[0], dict)
                         else list(messages))
        prompts: list[PromptType] = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(
                list(conv), add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                **(chat_template_kwargs or {}))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (text, or `{"prompt_token_ids": [...]}`), in prompt
        order: pooling requests through the same engine loop (module docstring).
        RuntimeError if the engine fails one."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        encoded = [self._encode_prompt(p) for p in prompt_list]
        params = [SamplingParams(max_tokens=1)] * len(encoded)
        seqs = self._execute(encoded, params, use_tqdm, pooling_params or PoolingParams())
        return [_embedding_output(s, ids) for s, (_, ids) in zip(seqs, encoded, strict=True)]

    def _encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', "
                         f"got {prompt!r}")

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             params: list[SamplingParams], use_tqdm: bool,
             lora_names: list[str | None] | None = None) -> list[RequestOutput]:
        return self._collect(encoded, self._execute(encoded, params, use_tqdm,
                                                    lora_names=lora_names))

    def _execute(self, encoded: list[tuple[str | None, list[int]]],
                 params: list[SamplingParams], use_tqdm: bool,
                 pooling: PoolingParams | None = None,
                 lora_names: list[str | None] | None = None) -> list[_Sequence]:
        """Add the requests (pooling ones with `pooling`; prompt i with adapter
        `lora_names[i]`) and step until all finish."""
        seqs = self._add_requests(encoded, params, pooling, lora_names)
        live = {s.request_id: s for s in seqs}
        try:
            self._drive(live, len(seqs), use_tqdm)
        finally:
            if live:  # interrupted: leave the engine clean for the next call
                self.engine.abort_requests(list(live))
                while self.engine.has_unfinished_requests():
                    self.engine.step()
        return seqs

    def _add_requests(self, encoded: list[tuple[str | None, list[int]]],
                      params: list[SamplingParams],
                      pooling: PoolingParams | None = None,
                      lora_names: list[str | None] | None = None) -> list[_Sequence]:
        """Every prompt is checked before any is added, so a bad one leaves nothing behind."""
        max_len = self.engine.config.scheduler.max_model_len
        for _, ids in encoded:
            check_context_length(max_len, len(ids))
            check_token_ids(ids, self._vocab_size)
        params = [model_stops(sp, self.tokenizer) for sp in params]
        for sp in params:
            self._check_structured_outputs(sp)
            sp.check_vocab(self._vocab_size)
        seqs: list[_Sequence] = []
        for i, ((_, ids), sp) in enumerate(zip(encoded, params, strict=True)):
            for j, sub in enumerate(fan_out(sp)):
                rid = str(next(self._ids))
                state = OutputState(self.tokenizer, ids, OutputOptions.of(sub))
                seqs.append(_Sequence(rid, i, j, sub, state))
                lora_name = lora_names[i] if lora_names is not None else None
                self.engine.add_request(self.engine.make_request(
                    rid, ids, sub, lora_name=lora_name, pooling_params=pooling))
        return seqs

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError naming the problem for a schema, regex or grammar that does not compile
        (compiled now, and kept for the request), or for any constraint without a grammar
        backend."""
        if params.structured_outputs is None:
            return
        if self.engine.structured_output is None:
            raise ValueError(NO_GRAMMAR_BACKEND)
        self.engine.structured_output.validate(params.structured_outputs)

    def _drive(self, live: dict[str, _Sequence], total: int, use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        with tqdm(total=total, desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                result = self.engine.step()
                if result.stats is not None and result.stats.spec_decoding_stats is not None:
                    self._spec_stats.add(result.stats.spec_decoding_stats)
                if not (result.executed or result.outputs):
                    self.engine.wait_for_work(_IDLE_WAIT_S)   # loads in flight: do not spin
                for out in result.outputs:
                    seq = live.get(out.request_id)
                    if seq is None:
                        continue
                    if out.kv_transfer_params is not None:
                        seq.kv_transfer_params = out.kv_transfer_params
                    if seq.state.process(out).stopped_locally:
                        self.engine.abort_requests([seq.request_id])
                    if seq.state.finished:
                        del live[out.request_id]
                        bar.update(1)

    def _logprob_dict(self, entry: TokenLogprob) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        lps = {entry.token_id: Logprob(entry.logprob, entry.rank,
                                       decode([entry.token_id], False))}
        for r, (tid, lp) in enumerate(entry.top, start=1):
            if tid not in lps:
                lps[tid] = Logprob(lp, r, decode([tid], False))
        return lps

    def _collect(self, encoded: list[tuple[str | None, list[int]]],
                 seqs: list[_Sequence]) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        for i, (prompt, ids) in enumerate(encoded):
            mine = [s for s in seqs if s.prompt_index == i]
            outputs = [self._completion(s) for s in mine]
            prompt_lps = mine[0].state.prompt_logprobs
            results.append(RequestOutput(
                request_id=mine[0].request_id, prompt=prompt, prompt_token_ids=ids,
                outputs=outputs, finished=all(o.finish_reason for o in outputs),
                num_cached_tokens=mine[0].state.num_cached_tokens,
                kv_transfer_params=mine[0].kv_transfer_params,
                prompt_logprobs=None if prompt_lps is None else [
                    None if e is None else self._logprob_dict(e) for e in prompt_lps]))
        return results

    def _completion(self, seq: _Sequence) -> CompletionOutput:
        st = seq.state
        wanted = seq.params.logprobs is not None
        return CompletionOutput(
            index=seq.sample_index, text=st.text, token_ids=list(st.token_ids),
            cumulative_logprob=sum(e.logprob for e in st.logprobs) if wanted else None,
            logprobs=[self._logprob_dict(e) for e in st.logprobs] if wanted else None,
            finish_reason=st.finish_reason, stop_reason=st.stop_reason)

    def wait_for_kv_transfers(self, timeout: float) -> bool:
        """Step until no request waits on a KV transfer (a prefill worker's held blocks
        freed by Done or expiry), at most `timeout` seconds; True if none is left."""
        deadline = time.monotonic() + timeout
        while self.engine.has_transfers() and time.monotonic() < deadline:
            if not self.engine.step().executed:
                self.engine.wait_for_work(min(_IDLE_WAIT_S, max(deadline - time.monotonic(), 0)))
        return not self.engine.has_transfers()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _embedding_output(seq: _Sequence, prompt_ids: list[int]) -> EmbeddingRequestOutput:
    vector = seq.state.pooling_output
    if vector is None:
        raise RuntimeError(f"request {seq.request_id} finished without an embedding "
                           f"({seq.state.finish_reason})")
    return EmbeddingRequestOutput(seq.request_id, prompt_ids, EmbeddingOutput(vector),
                                  num_cached_tokens=seq.state.num_cached_tokens)


def engine_config(max_model_len: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
                  max_num_batched_tokens: int | str = OFFLINE_MAX_NUM_BATCHED_TOKENS,
                  max_num_seqs: int | None = None, enable_prefix_caching: bool = True,
                  enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                  check_invariants: bool = False, num_gpu_blocks: int = 1024,
                  speculative: SpeculativeConfig | None = None,
                  log_stats: bool = False,
                  kv_transfer: KVTransferConfig | None = None,
                  target_tpot_ms: float | None = None) -> EngineConfig:
    """The offline engine's config; `max_num_seqs` defaults to min(256, token budget).
    `max_num_batched_tokens="auto"`: `auto_budget` set, the budget the floor until
    `resolve_budget` replaces it."""
    budget, auto = _offline_budget(max_num_batched_tokens, max_num_seqs, target_tpot_ms)
    seqs = max_num_seqs or min(OFFLINE_MAX_NUM_SEQS, budget)
    return EngineConfig(
        cache=CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                  max_num_seqs=seqs, max_model_len=max_model_len,
                                  enable_chunked_prefill=enable_chunked_prefill,
                                  long_prefill_token_threshold=long_prefill_token_threshold),
        check_invariants=check_invariants, log_stats=log_stats, speculative=speculative,
        kv_transfer=kv_transfer, auto_budget=auto)


def _offline_budget(budget: int | str, max_num_seqs: int | None, target_tpot_ms: float | None
                    ) -> tuple[int, AutoBudget | None]:
    """(the budget, or with "auto" the floor; `AutoBudget` for "auto", else None)."""
    if budget == AUTO_BUDGET:
        return (budget_floor(max_num_seqs or OFFLINE_MAX_NUM_SEQS),
                AutoBudget(target_tpot_ms=target_tpot_ms))
    if isinstance(budget, str):
        raise ValueError(f"max_num_batched_tokens must be a number of tokens or "
                         f"{AUTO_BUDGET!r}, got {budget!r}")
    return budget, None


def kv_transfer_of(config: KVTransferConfig | dict[str, Any] | str | None
                   ) -> KVTransferConfig | None:
    """`LLM(kv_transfer_config=...)`: a KVTransferConfig, its dict, or its JSON."""
    if config is None or isinstance(config, KVTransferConfig):
        return config
    if isinstance(config, str):
        return KVTransferConfig.from_json(config)
    return KVTransferConfig.from_dict(config)


def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       count: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
