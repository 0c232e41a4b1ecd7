"""ModelRunner: SchedulerOutput -> one forward pass -> sampled tokens (the Runner protocol).

Owner: the runner alone owns the KV tensors (which a KV connector reads and writes block by
block through `kv_block_store`, `kvloop.model.kv_store`, only for blocks no step computes)
and its per-request state (`RequestState`: known tokens, block ids, sampling params). It
learns about requests only through
`SchedulerOutput`: new (or resumed after preemption: state rebuilt from `all_token_ids`),
cached (new blocks appended, this step's tokens written at `num_computed_tokens`), finished
and preempted (dropped).

One step, for request r with `c` computed tokens and `n` scheduled (k of them drafts,
from `scheduled_spec_decode_tokens`, after its n - k known tokens):

    positions   c .. c+n-1
    slots       block_ids[pos // block_size] * block_size + pos % block_size
    seq_len     c + n
    samples     iff r is in `sampling_req_ids`, from the logits of its last k + 1 tokens
                (its last known token and each draft: `logits_indices`, in that order)
    pools       instead, iff r is a pooling request (`pooling_params`) in `sampling_req_ids`:
                the final-norm hidden state of its last prompt token (`pooling_indices`),
                fp32, L2-normalized unless its params say not (vLLM's LAST pooling)
    prompt lps  iff r asks for `prompt_logprobs`: the logits of every position of the chunk
                that scores a prompt token (`prompt_logprob_positions`) are computed too,
                in the same forward pass, and returned as `RunnerOutput.prompt_logprobs`

Requests with n == 1 go first (batched decode attention), then the chunks (see attention.py;
a request verifying drafts is a chunk of 1 + k queries over its cached context). Drafts are
verified in this one forward pass: the k + 1 rows of each request go to
`Sampler.rejection_sample`, which keeps the accepted drafts and one more token. Drafts are
never part of `RequestState.token_ids`: the accepted ones come back as known tokens in the
next step's `token_ids`, and the KV slots of rejected ones are overwritten then.

The step is split as vLLM's (`kvloop.core.runner.SplitRunner`): `execute_model` hands the
state update, the inputs and the forward pass to the runner's forward thread and returns;
`sample_tokens(grammar_output)` waits for the logits, sets the tokens the grammar bitmask
disallows to -inf (a constrained request has a bitmask row for each of its k + 1 logits
rows), then samples. The engine computes the bitmask in between. `execute` is the two in a
row.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvloop.config import LoRAConfig
from kvloop.core.kv_cache_groups import group_size, layer_slots
from kvloop.core.outputs import (
    GrammarOutput,
    Logprobs,
    PromptLogprobs,
    RunnerOutput,
    SchedulerOutput,
    prompt_logprob_positions,
)
from kvloop.core.request import PoolingParams, SamplingParams
from kvloop.model import cpu_ops
from kvloop.model.attention import AttentionMetadata, PrefillChunk
from kvloop.model.kv_quant import KVQuant
from kvloop.model.kv_store import ModelKVBlockStore
from kvloop.model.llama import LlamaModel
from kvloop.model.loader import ModelConfig
from kvloop.model.lora import LoRAError, LoRASlots, LoRAStep
from kvloop.model.sampler import (
    Sampler,
    SamplingRow,
    apply_token_bitmask,
    prompt_logprob_entries,
)
from kvloop.model.step import StepInputs


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]           # every known token (prompt + outputs seen so far)
    block_ids: list[list[int]]     # one block table per KV-cache group
    params: SamplingParams
    pooling: PoolingParams | None = None    # a pooling request: it pools, never samples
    lora_name: str | None = None            # its LoRA adapter (None: the base model)


@dataclass
class _Scheduled:
    """One request's part of the step: its known tokens, then its drafts."""

    state: RequestState
    num_computed: int
    token_ids: list[int]
    samples: bool
    drafts: list[int]
    pools: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.drafts)

    @property
    def known_len(self) -> int:
        return self.num_computed + len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.num_tokens


@dataclass
class PromptRows:
    """One request's prompt-logprob rows of a step: logits rows `rows` (of the forward's
    output) score prompt tokens `first_position ..` (`targets`)."""

    req_id: str
    first_position: int
    targets: list[int]
    num_top: int
    rows: list[int]


@dataclass
class StepBatch:
    """One step's batch, in batch order: what the model reads (`step`, its logits rows the
    sampling rows and the prompt-logprob rows, [S + P]) and what sampling and pooling read."""

    req_ids: list[str]
    step: StepInputs
    sampling_rows: list[SamplingRow]
    sampling_req_ids: list[str]
    sampling_drafts: list[list[int]]   # drafts of each sampling request (most often [])
    pooling_indices: torch.Tensor      # [P]: the last prompt token of each pooling request
    pooling_req_ids: list[str]
    pooling_normalize: list[bool]
    prompt_rows: list[PromptRows]
    sample_sel: list[int] | None   # the forward's logits rows that sample (None: all of them)


class ModelRunner:
    """Implements `kvloop.core.runner.Runner` for a Llama-family model."""

    def __init__(self, model: LlamaModel, config: ModelConfig, *, num_gpu_blocks: int,
                 block_size: int, max_model_len: int, device: torch.device,
                 model_name: str, seed: int = 0, kv_quant: KVQuant | None = None):
        self.model = model
        self.config = config
        self.device = device
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks      # includes the null block 0
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        self.model_name = model_name
        self.dtype = model.dtype
        self.kv_cache_groups = config.kv_cache_groups   # read by the engine's KV manager
        self.kv_quant = kv_quant          # the cache's codes (None: precision.kv_cache values)
        self.kv_caches = allocate_kv_caches(config, num_gpu_blocks, block_size,
                                            model.precision.kv_cache, device, kv_quant)
        self.sampler = Sampler(seed, device)
        self.requests: dict[str, RequestState] = {}
        self.num_steps = 0
        self.kv_block_store = ModelKVBlockStore(self.kv_caches, config, block_size, model_name,
                                                kv_quant)
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="kvloop-forward")
        self._pending: Future[_Forward] | None = None
        self.lora_slots: LoRASlots | None = None   # set by `enable_lora`

    # --- LoRA adapters (the engine calls these between steps) -----------------------------
    def enable_lora(self, lora: LoRAConfig) -> None:
        self.lora_slots = self.model.enable_lora(lora)

    def add_lora(self, name: str, path: str) -> None:
        """Register adapter `name` from PEFT folder `path` (read and checked now;
        `kvloop.model.lora.LoRAError` if it can never be served)."""
        self._lora_slots().register(name, path)

    def remove_lora(self, name: str) -> None:
        self._lora_slots().unregister(name)

    def prepare_lora(self, name: str) -> None:
        self._lora_slots().prepare(name)

    def list_loras(self) -> list[str]:
        return [] if self.lora_slots is None else self.lora_slots.names()

    def _lora_slots(self) -> LoRASlots:
        if self.lora_slots is None:
            raise LoRAError("LoRA is not enabled (--enable-lora)")
        return self.lora_slots

    # --- the Runner protocol --------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        self.execute_model(scheduler_output)
        return self.sample_tokens(None)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Start the step's forward pass on the forward thread (one step in flight); returns
        once it has started, so what the caller does next overlaps it."""
        if self._pending is not None:
            raise RuntimeError("execute_model called twice without sample_tokens")
        started = threading.Event()
        if scheduler_output.is_empty:   # nothing to compute: no thread hop
            self._pending = Future()
            self._pending.set_result(self._timed_forward(scheduler_output, started))
            return
        self._pending = self._forward_thread.submit(self._timed_forward, scheduler_output,
                                                    started)
        started.wait()

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> RunnerOutput:
        """Wait for the forward pass, then apply the grammar bitmask and sample on the forward
        thread too: every torch op of a step runs on that one thread, so torch's OpenMP
        runtime keeps one team of threads (a second team, on the caller's thread, would spin
        against the first for the same cores: measured here, a decode step 20 -> 27 ms)."""
        if self._pending is None:
            raise RuntimeError("sample_tokens called without execute_model")
        pending, self._pending = self._pending, None
        fwd = pending.result()
        if fwd.inputs is None:
            return RunnerOutput(forward_time=fwd.window)
        if fwd.greedy is not None:      # tokens already chosen with the LM head (no grammar)
            out = self._make_output(fwd.inputs, [[t] for t in fwd.greedy],
                                    [None] * len(fwd.greedy))
            out.forward_time = fwd.window
            return out
        return self._forward_thread.submit(self._finish, fwd, grammar_output).result()

    def _finish(self, fwd: _Forward, grammar_output: GrammarOutput | None) -> RunnerOutput:
        assert fwd.inputs is not None
        inputs, logits = fwd.inputs, fwd.logits
        with torch.inference_mode():
            prompt_logprobs = _prompt_logprobs(logits, inputs.prompt_rows)
            if inputs.sample_sel is not None:
                logits = logits[inputs.sample_sel]
            if grammar_output is not None:
                _apply_grammar(logits, inputs, grammar_output)
            out = self._sample(inputs, logits)
        out.prompt_logprobs = prompt_logprobs
        out.forward_time = fwd.window
        if fwd.pooled is not None:
            out.pooler_output = _pooler_output(fwd.inputs, fwd.pooled)
        return out

    def _sample(self, inputs: StepBatch, logits: torch.Tensor) -> RunnerOutput:
        if not inputs.sampling_req_ids:    # only pooling requests, or partial chunks
            return self._make_output(inputs, [], [])
        if any(inputs.sampling_drafts):
            spec = self.sampler.rejection_sample(logits, inputs.sampling_rows,
                                                 inputs.sampling_drafts)
            return self._make_output(inputs, spec.token_ids, spec.logprobs)
        sampled = self.sampler(logits, inputs.sampling_rows)
        return self._make_output(inputs, [[t] for t in sampled.token_ids],
                                 [None if lp is None else [lp] for lp in sampled.logprobs])

    def _timed_forward(self, scheduler_output: SchedulerOutput,
                       started: threading.Event) -> _Forward:
        start = time.perf_counter()
        started.set()
        self._update_states(scheduler_output)
        inputs = None if scheduler_output.is_empty else self._prepare_inputs(scheduler_output)
        if inputs is not None and _plain_greedy(inputs):
            with torch.inference_mode():
                tokens = self.model.greedy(inputs.step, self.kv_caches).tolist()
            self.num_steps += 1
            return _Forward(inputs, torch.empty(0, self.vocab_size),
                            (start, time.perf_counter()), greedy=tokens)
        inputs, logits, pooled = self._run(inputs)
        return _Forward(inputs, logits, (start, time.perf_counter()), pooled)

    def forward(self, scheduler_output: SchedulerOutput
                ) -> tuple[StepBatch | None, torch.Tensor]:
        """Update request state, run the model: (inputs, logits [S, vocab] fp32), for each
        entry of `inputs.sampling_req_ids` in order 1 + len(its drafts) rows (one without
        drafts). Used by `execute` and by tests; `forward_pooled` also pools."""
        inputs, logits, _ = self.forward_pooled(scheduler_output)
        return inputs, logits

    def forward_pooled(self, scheduler_output: SchedulerOutput
                       ) -> tuple[StepBatch | None, torch.Tensor, torch.Tensor | None]:
        """`forward`, and the pooled vectors [P, hidden] fp32 of
        `inputs.pooling_req_ids`, in order (None when no request pools this step)."""
        self._update_states(scheduler_output)
        return self._run(None if scheduler_output.is_empty
                         else self._prepare_inputs(scheduler_output))

    def _run(self, inputs: StepBatch | None
             ) -> tuple[StepBatch | None, torch.Tensor, torch.Tensor | None]:
        """`forward_pooled` after the state update: the model on `inputs` (None: nothing
        scheduled)."""
        if inputs is None:
            return None, torch.empty(0, self.vocab_size), None
        with torch.inference_mode():
            if not inputs.pooling_req_ids:
                logits = self.model(inputs.step, self.kv_caches)
                pooled = None
            else:
                logits, pooled = self._forward_pooling(inputs)
        self.num_steps += 1
        return inputs, logits, pooled

    def _forward_pooling(self, inputs: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A step with pooling requests: the vectors first (`compute_logits` may normalize
        the hidden states in place), then the logits of the sampling rows."""
        model = self.model
        h, residual = model.decode_layers(inputs.step, self.kv_caches)
        pooled = model.final_hidden(h, residual, inputs.pooling_indices)   # [P, hidden]
        norm = torch.tensor(inputs.pooling_normalize, device=pooled.device)
        pooled = torch.where(norm[:, None], F.normalize(pooled, p=2.0, dim=-1), pooled)
        if inputs.step.logits_indices.shape[0] == 0:
            return torch.empty(0, self.vocab_size, device=pooled.device), pooled
        return model.compute_logits(h, residual, inputs.step.logits_indices), pooled

    def shutdown(self) -> None:
        self._forward_thread.shutdown(wait=True)
        self.requests.clear()
        self.kv_caches = []

    # --- per-request state ----------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RequestState(
                new.req_id, list(new.prompt_token_ids), list(new.all_token_ids),
                self._group_tables(new.block_ids, new.group_block_ids),
                new.sampling_params, new.pooling_params, new.lora_name)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            new_ids = self._group_tables(cached.new_block_ids, cached.new_group_block_ids)
            for table, ids in zip(state.block_ids, new_ids, strict=True):
                table.extend(ids)
            c = cached.num_computed_tokens
            state.token_ids[c:] = cached.token_ids

    def _group_tables(self, block_ids: list[int], group_block_ids: list[list[int]]
                      ) -> list[list[int]]:
        """One list per KV-cache group. A producer that names no other group (a model of
        one group, or the budget's synthetic steps, `kvloop.core.budget`) gives group 0's
        ids to every group."""
        if group_block_ids or len(self.kv_cache_groups) == 1:
            return [list(block_ids), *(list(ids) for ids in group_block_ids)]
        return [list(block_ids) for _ in self.kv_cache_groups]

    def _scheduled(self, so: SchedulerOutput) -> list[_Scheduled]:
        """Requests of this step, decodes (one token) first, then chunks."""
        parts = [(d.req_id, d.num_computed_tokens, d.token_ids)
                 for d in so.scheduled_cached_reqs]
        parts += [(d.req_id, d.num_computed_tokens, d.token_ids) for d in so.scheduled_new_reqs]
        spec = so.scheduled_spec_decode_tokens
        items = [_scheduled_item(self.requests[rid], computed, tokens,
                                 rid in so.sampling_req_ids, list(spec.get(rid, ())))
                 for rid, computed, tokens in parts]
        for item in items:
            if item.num_tokens != so.num_scheduled_tokens[item.state.req_id]:
                raise ValueError(f"request {item.state.req_id}: token_ids and drafts disagree "
                                 "with num_scheduled_tokens")
            if item.drafts and not item.samples:
                raise ValueError(f"request {item.state.req_id}: drafts after a partial chunk")
        return sorted(items, key=lambda s: s.num_tokens > 1)

    # --- inputs ---------------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> StepBatch:
        items = self._scheduled(so)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in self.kv_cache_groups]
        logits_indices: list[int] = []
        pooling_indices: list[int] = []
        sample_sel: list[int] = []
        prompt_rows: list[PromptRows] = []
        for item in items:
            start = item.num_computed
            pos = range(start, item.seq_len)
            prompt = _prompt_rows(item, len(input_ids), len(logits_indices))
            if prompt is not None:
                prompt_rows.append(prompt)
                logits_indices.extend(len(input_ids) + p - start for p in range(
                    prompt.first_position - 1, prompt.first_position - 1 + len(prompt.targets)))
            input_ids.extend(item.token_ids)
            input_ids.extend(item.drafts)
            positions.extend(pos)
            for group_slots, table in zip(slots, item.state.block_ids, strict=True):
                group_slots.extend(self._slots(table, pos))
            if item.samples:
                first = len(input_ids) - 1 - len(item.drafts)
                sample_sel.extend(range(len(logits_indices),
                                        len(logits_indices) + 1 + len(item.drafts)))
                logits_indices.extend(range(first, len(input_ids)))
            if item.pools:
                pooling_indices.append(len(input_ids) - 1)
        dev = self.device
        pooling = [i for i in items if i.pools]
        metas = tuple(self._attention_metadata(
            items, torch.tensor(group_slots, dtype=torch.long, device=dev), g)
            for g, group_slots in enumerate(slots))
        sampling = [i for i in items if i.samples]
        step = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=metas[0],
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            lora=self._lora_step(items), group_metas=metas if len(metas) > 1 else ())
        return StepBatch(
            req_ids=[i.state.req_id for i in items], step=step,
            sampling_rows=[_sampling_row(i) for i in sampling],
            sampling_req_ids=[i.state.req_id for i in sampling],
            sampling_drafts=[i.drafts for i in sampling],
            pooling_indices=torch.tensor(pooling_indices, dtype=torch.long, device=dev),
            pooling_req_ids=[i.state.req_id for i in pooling],
            pooling_normalize=[_normalizes(i.state) for i in pooling],
            prompt_rows=prompt_rows, sample_sel=sample_sel if prompt_rows else None)

    def _lora_step(self, items: list[_Scheduled]) -> LoRAStep | None:
        """Make the step's adapters resident; their rows as (slot, start, end) ranges
        (adjacent requests of one adapter merged). None: no request uses one."""
        names = {i.state.lora_name for i in items if i.state.lora_name is not None}
        if not names:
            return None
        slot_of = self._lora_slots().activate(names)
        ranges: list[tuple[int, int, int]] = []
        start = 0
        for item in items:
            end = start + item.num_tokens
            name = item.state.lora_name
            if name is not None:
                slot = slot_of[name]
                if ranges and ranges[-1][0] == slot and ranges[-1][2] == start:
                    ranges[-1] = (slot, ranges[-1][1], end)
                else:
                    ranges.append((slot, start, end))
            start = end
        return LoRAStep(tuple(ranges))

    def _slots(self, block_ids: list[int], positions: range) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in positions]

    def _attention_metadata(self, items: list[_Scheduled], slot_mapping: torch.Tensor,
                            group: int) -> AttentionMetadata:
        """KV-cache group `group`'s metadata (its block tables and window)."""
        decodes = [i for i in items if i.num_tokens == 1]
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=len(decodes),
                                 kv_quant=self.kv_quant)
        window = self.kv_cache_groups[group].sliding_window
        if decodes:
            (meta.decode_block_table, meta.decode_seq_lens,
             meta.decode_key_starts) = self._decode_tables(decodes, group, window)
        start = len(decodes)
        for item in items[len(decodes):]:
            meta.prefills.append(self._chunk(item, start, group, window))
            start += item.num_tokens
        return meta

    def _decode_tables(self, decodes: list[_Scheduled], group: int, window: int | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Block table [D, nb] (each row 0-padded to the longest), seq_lens [D] and, once a
        row reaches past the sliding window, each row's first visible key [D] (the table
        then starts at the block of a row's first visible key, seq_lens counted from it)."""
        bs = self.block_size
        windowed = window is not None and any(d.seq_len > window for d in decodes)
        firsts = [max(0, d.seq_len - window) // bs if windowed and window is not None else 0
                  for d in decodes]
        rows = [d.state.block_ids[group][first:-(-d.seq_len // bs)]
                for d, first in zip(decodes, firsts, strict=True)]
        num_blocks = max(len(r) for r in rows)
        table = [r + [0] * (num_blocks - len(r)) for r in rows]
        dev = self.device
        seq_lens = [d.seq_len - first * bs for d, first in zip(decodes, firsts, strict=True)]
        starts = None
        if windowed and window is not None:
            starts = torch.tensor([max(0, d.seq_len - window) - first * bs
                                   for d, first in zip(decodes, firsts, strict=True)],
                                  dtype=torch.long, device=dev)
        return (torch.tensor(table, dtype=torch.long, device=dev),
                torch.tensor(seq_lens, dtype=torch.long, device=dev), starts)

    def _chunk(self, item: _Scheduled, start: int, group: int,
               window: int | None) -> PrefillChunk:
        end = start + item.num_tokens
        windowed = window is not None and item.seq_len > window
        seen = window if windowed and window is not None else 0
        if item.num_computed == 0:
            return PrefillChunk(start, end, 0, None, window=seen)
        first = 0
        if windowed and window is not None:
            first = max(0, item.num_computed - window + 1) // self.block_size
        num_blocks = -(-item.seq_len // self.block_size)
        block_ids = torch.tensor(item.state.block_ids[group][first:num_blocks],
                                 dtype=torch.long, device=self.device)
        return PrefillChunk(start, end, item.num_computed, block_ids,
                            key_start=first * self.block_size, window=seen)

    # --- outputs --------------------------------------------------------------------------
    @staticmethod
    def _make_output(inputs: StepBatch, tokens: list[list[int]],
                     logprobs: list[list[Logprobs] | None]) -> RunnerOutput:
        """Tokens and logprobs per sampling request -> per scheduled request."""
        by_req = dict(zip(inputs.sampling_req_ids, zip(tokens, logprobs, strict=True),
                          strict=True))
        out = RunnerOutput(req_ids=list(inputs.req_ids))
        wants_logprobs = any(lp is not None for lp in logprobs)
        out.logprobs = [] if wants_logprobs else None
        for rid in inputs.req_ids:
            toks, lps = by_req.get(rid, ([], None))
            out.sampled_token_ids.append(list(toks))
            if out.logprobs is not None:
                out.logprobs.append(lps)
        return out


@dataclass
class _Forward:
    """A finished forward pass: its inputs (None: nothing scheduled), logits and
    (start, end) perf_counter times."""

    inputs: StepBatch | None
    logits: torch.Tensor
    window: tuple[float, float]
    pooled: torch.Tensor | None = None    # [P, hidden]: `inputs.pooling_req_ids`' vectors
    greedy: list[int] | None = None       # every row plain greedy: its token (no logits)


def _plain_greedy(inputs: StepBatch) -> bool:
    """Every row of the step samples one plain greedy token (`SamplingRow.plain_greedy`:
    nothing reads the logits but the argmax), and nothing else needs the logits (prompt
    logprobs, drafts, pooling): the model may return the tokens alone
    (`LlamaModel.greedy`, the LM head fused with the argmax)."""
    return (bool(inputs.sampling_rows) and inputs.sample_sel is None and not inputs.prompt_rows
            and not inputs.pooling_req_ids and not any(inputs.sampling_drafts)
            and all(row.plain_greedy for row in inputs.sampling_rows))


def _apply_grammar(logits: torch.Tensor, inputs: StepBatch, grammar: GrammarOutput) -> None:
    """Mask the logits rows of the constrained requests with their bitmask rows: a request
    with k drafts has k + 1 logits rows and as many bitmask rows, in position order."""
    first_row: dict[str, int] = {}
    row = 0
    for rid, drafts in zip(inputs.sampling_req_ids, inputs.sampling_drafts, strict=True):
        first_row[rid] = row
        row += 1 + len(drafts)
    logits_rows: list[int] = []
    mask_rows: list[int] = []
    for rid, rows in grammar.row_ranges().items():
        logits_rows.extend(range(first_row[rid], first_row[rid] + len(rows)))
        mask_rows.extend(rows)
    bitmask = torch.from_numpy(grammar.bitmask[mask_rows]).to(logits.device)
    apply_token_bitmask(logits, bitmask, logits_rows)


def _scheduled_item(state: RequestState, num_computed: int, token_ids: list[int],
                    completes: bool, drafts: list[int]) -> _Scheduled:
    """One request's part of the step; `completes`: its chunk reaches the end of its known
    tokens (it is in `sampling_req_ids`): it samples, or pools if it is a pooling request."""
    pools = completes and state.pooling is not None
    return _Scheduled(state, num_computed, token_ids, completes and not pools, drafts, pools)


def _normalizes(state: RequestState) -> bool:
    return state.pooling is not None and state.pooling.normalize


def _pooler_output(inputs: StepBatch, pooled: torch.Tensor) -> list[list[float] | None]:
    """The vectors [P, hidden] of `inputs.pooling_req_ids` -> one entry per scheduled
    request (None for those that did not pool)."""
    by_req = dict(zip(inputs.pooling_req_ids, pooled.cpu().tolist(), strict=True))
    return [by_req.get(rid) for rid in inputs.req_ids]


def _prompt_rows(item: _Scheduled, first_token: int, first_row: int) -> PromptRows | None:
    """The prompt-logprob rows of `item` (None: it asks for none, or its chunk scores no
    prompt token); its tokens start at `first_token` of the step, its rows at `first_row` of
    the forward's logits."""
    state = item.state
    num_top = state.params.prompt_logprobs
    if num_top is None:
        return None
    span = prompt_logprob_positions(len(state.prompt_token_ids), item.num_computed,
                                    len(item.token_ids))
    if not span:
        return None
    targets = state.prompt_token_ids[span.start + 1:span.stop + 1]
    return PromptRows(state.req_id, span.start + 1, targets, num_top,
                      list(range(first_row, first_row + len(targets))))


def _prompt_logprobs(logits: torch.Tensor, rows: list[PromptRows]
                     ) -> dict[str, PromptLogprobs]:
    return {r.req_id: PromptLogprobs(r.first_position, prompt_logprob_entries(
        logits[r.rows[0]:r.rows[-1] + 1], r.targets, r.num_top)) for r in rows}


def _sampling_row(item: _Scheduled) -> SamplingRow:
    state = item.state
    num_prompt = len(state.prompt_token_ids)
    return SamplingRow(state.params, state.prompt_token_ids,
                       state.token_ids[num_prompt:item.known_len])


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device,
                       kv_quant: KVQuant | None = None) -> list[torch.Tensor]:
    """Each layer's zeroed (so touched) `[2, kv_heads, num_blocks, block_size, row]` cache:
    `row` is `head_dim` values in `dtype`, or with `kv_quant` uint8 rows of `head_dim` codes
    and a scale. One tensor per layer for a model of one KV-cache group; with several groups
    layer j of each group shares tensor j (`kvloop.core.kv_cache_groups`: a block belongs
    to one group, so the layers sharing a tensor never share a block)."""
    row = config.head_dim if kv_quant is None else kv_quant.row_bytes(config.head_dim)
    shape = (2, config.num_key_value_heads, num_blocks, block_size, row)
    dtype = dtype if kv_quant is None else torch.uint8
    groups = config.kv_cache_groups
    shared = cpu_ops.huge_page_zeros(shape, dtype, group_size(groups), device)   # 2 MiB pages
    return [shared[j] for _, j in layer_slots(groups, config.num_hidden_layers)]
