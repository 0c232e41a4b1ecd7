"""ModelRunner: SchedulerOutput -> one forward pass -> sampled tokens (the Runner protocol).

Owner: the runner alone owns the KV tensors (which a KV connector reads and writes block by
block through `kv_block_store`, `kvloop.model.kv_store`, only for blocks no step computes)
and its per-request state (`RequestState`: known tokens, block ids, sampling params). It
learns about requests only through
`SchedulerOutput`: new (or resumed after preemption: state rebuilt from `all_token_ids`),
cached (new blocks appended, this step's tokens written at `num_computed_tokens`), finished
and preempted (dropped).

One step, for request r with `c` computed tokens and `n` scheduled:

    positions   c .. c+n-1
    slots       block_ids[pos // block_size] * block_size + pos % block_size
    seq_len     c + n
    samples     iff r is in `sampling_req_ids`, from the logits of its last token

Requests with n == 1 go first (batched decode attention), then the chunks (see attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvloop.core.outputs import Logprobs, RunnerOutput, SchedulerOutput
from kvloop.core.request import SamplingParams
from kvloop.model.attention import AttentionMetadata, PrefillChunk, lower_right_causal_mask
from kvloop.model.kv_store import ModelKVBlockStore
from kvloop.model.llama import LlamaModel
from kvloop.model.loader import ModelConfig
from kvloop.model.sampler import Sampler, SamplingRow


@dataclass
class RequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]           # every known token (prompt + outputs seen so far)
    block_ids: list[int]
    params: SamplingParams


@dataclass
class _Scheduled:
    """One request's part of the step."""

    state: RequestState
    num_computed: int
    token_ids: list[int]
    samples: bool

    @property
    def seq_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass
class StepInputs:
    """The tensors of one forward pass, in batch order."""

    req_ids: list[str]
    input_ids: torch.Tensor        # [T]
    positions: torch.Tensor        # [T]
    logits_indices: torch.Tensor   # [S]
    meta: AttentionMetadata
    sampling_rows: list[SamplingRow]
    sampling_req_ids: list[str]


class ModelRunner:
    """Implements `kvloop.core.runner.Runner` for a Llama-family model."""

    def __init__(self, model: LlamaModel, config: ModelConfig, *, num_gpu_blocks: int,
                 block_size: int, max_model_len: int, device: torch.device,
                 model_name: str, seed: int = 0):
        self.model = model
        self.config = config
        self.device = device
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks      # includes the null block 0
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        self.model_name = model_name
        self.dtype = model.dtype
        self.kv_caches = allocate_kv_caches(config, num_gpu_blocks, block_size,
                                            model.dtype, device)
        self.sampler = Sampler(seed, device)
        self.requests: dict[str, RequestState] = {}
        self.num_steps = 0
        self.kv_block_store = ModelKVBlockStore(self.kv_caches, config, block_size, model_name)

    # --- the Runner protocol --------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        inputs, logits = self.forward(scheduler_output)
        if inputs is None:
            return RunnerOutput()
        with torch.inference_mode():
            sampled = self.sampler(logits, inputs.sampling_rows)
        return self._make_output(inputs, sampled.token_ids, sampled.logprobs)

    def forward(self, scheduler_output: SchedulerOutput
                ) -> tuple[StepInputs | None, torch.Tensor]:
        """Update request state, run the model: (inputs, logits [S, vocab] fp32), one row per
        entry of `inputs.sampling_req_ids`. Used by `execute` and by tests."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return None, torch.empty(0, self.vocab_size)
        inputs = self._prepare_inputs(scheduler_output)
        with torch.inference_mode():
            logits = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.meta, inputs.logits_indices)
        self.num_steps += 1
        return inputs, logits

    def shutdown(self) -> None:
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
                list(new.block_ids), new.sampling_params)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            c = cached.num_computed_tokens
            state.token_ids[c:] = cached.token_ids

    def _scheduled(self, so: SchedulerOutput) -> list[_Scheduled]:
        """Requests of this step, decodes (one token) first, then chunks."""
        parts = [(d.req_id, d.num_computed_tokens, d.token_ids)
                 for d in so.scheduled_cached_reqs]
        parts += [(d.req_id, d.num_computed_tokens, d.token_ids) for d in so.scheduled_new_reqs]
        items = [_Scheduled(self.requests[rid], computed, tokens, rid in so.sampling_req_ids)
                 for rid, computed, tokens in parts]
        for item in items:
            if len(item.token_ids) != so.num_scheduled_tokens[item.state.req_id]:
                raise ValueError(f"request {item.state.req_id}: token_ids and "
                                 "num_scheduled_tokens disagree")
        return sorted(items, key=lambda s: len(s.token_ids) > 1)

    # --- inputs ---------------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        items = self._scheduled(so)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        for item in items:
            start = item.num_computed
            pos = range(start, item.seq_len)
            input_ids.extend(item.token_ids)
            positions.extend(pos)
            slots.extend(self._slots(item.state.block_ids, pos))
            if item.samples:
                logits_indices.append(len(input_ids) - 1)
        dev = self.device
        meta = self._attention_metadata(items, torch.tensor(slots, dtype=torch.long, device=dev))
        sampling = [i for i in items if i.samples]
        return StepInputs(
            req_ids=[i.state.req_id for i in items],
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            meta=meta, sampling_rows=[_sampling_row(i) for i in sampling],
            sampling_req_ids=[i.state.req_id for i in sampling])

    def _slots(self, block_ids: list[int], positions: range) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in positions]

    def _attention_metadata(self, items: list[_Scheduled],
                            slot_mapping: torch.Tensor) -> AttentionMetadata:
        decodes = [i for i in items if len(i.token_ids) == 1]
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=len(decodes))
        if decodes:
            meta.decode_block_ids, meta.decode_bias = self._decode_tables(decodes)
        start = len(decodes)
        for item in items[len(decodes):]:
            meta.prefills.append(self._chunk(item, start))
            start += len(item.token_ids)
        return meta

    def _decode_tables(self, decodes: list[_Scheduled]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids [D * nb] (each row 0-padded to the longest) and the key bias
        [1, D, 1, nb * block_size] (0 for keys < seq_len, -inf after)."""
        bs = self.block_size
        num_blocks = max(-(-d.seq_len // bs) for d in decodes)
        ids: list[int] = []
        for d in decodes:
            row = d.state.block_ids[:num_blocks]
            ids.extend(row)
            ids.extend([0] * (num_blocks - len(row)))
        block_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        seq_lens = torch.tensor([d.seq_len for d in decodes], device=self.device)
        beyond = torch.arange(num_blocks * bs, device=self.device) >= seq_lens.unsqueeze(1)
        bias = torch.zeros(beyond.shape, dtype=torch.float32, device=self.device)
        bias.masked_fill_(beyond, float("-inf"))
        return block_ids, bias[None, :, None, :]

    def _chunk(self, item: _Scheduled, start: int) -> PrefillChunk:
        end = start + len(item.token_ids)
        if item.num_computed == 0:
            return PrefillChunk(start, end, 0, None, None)
        num_blocks = -(-item.seq_len // self.block_size)
        block_ids = torch.tensor(item.state.block_ids[:num_blocks], dtype=torch.long,
                                 device=self.device)
        mask = lower_right_causal_mask(len(item.token_ids), item.seq_len, self.device)
        return PrefillChunk(start, end, item.num_computed, block_ids, mask)

    # --- outputs --------------------------------------------------------------------------
    @staticmethod
    def _make_output(inputs: StepInputs, tokens: list[int],
                     logprobs: list[Logprobs | None]) -> RunnerOutput:
        by_req = dict(zip(inputs.sampling_req_ids, zip(tokens, logprobs, strict=True),
                          strict=True))
        out = RunnerOutput(req_ids=list(inputs.req_ids))
        wants_logprobs = any(lp is not None for lp in logprobs)
        out.logprobs = [] if wants_logprobs else None
        for rid in inputs.req_ids:
            token, lp = by_req.get(rid, (None, None))
            out.sampled_token_ids.append([] if token is None else [token])
            if out.logprobs is not None:
                out.logprobs.append([lp] if lp is not None else None)
        return out


def _sampling_row(item: _Scheduled) -> SamplingRow:
    state = item.state
    num_prompt = len(state.prompt_token_ids)
    return SamplingRow(state.params, state.prompt_token_ids,
                       state.token_ids[num_prompt:item.seq_len])


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One zeroed (so touched) `[2, kv_heads, num_blocks, block_size, head_dim]` per layer."""
    shape = (2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(config.num_hidden_layers)]
