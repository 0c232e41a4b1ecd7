"""Small builders for core tests: requests, managers, scheduler steps."""

from __future__ import annotations

from kvloop.config import SchedulerConfig
from kvloop.core.block_pool import BlockPool
from kvloop.core.hashing import BlockHasher
from kvloop.core.kv_cache_manager import KVCacheManager
from kvloop.core.outputs import RunnerOutput, SchedulerOutput
from kvloop.core.request import Request, SamplingParams
from kvloop.core.scheduler import Scheduler

HASHER = BlockHasher(16, "sha256", "vllm-none-hash")


def make_request(rid: str, tokens: list[int], max_tokens: int = 16, arrival: float = 0.0,
                 hasher: BlockHasher | None = HASHER, **params) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival, hasher=hasher)


def make_manager(num_blocks: int, block_size: int = 16, caching: bool = True,
                 events: bool = True, max_model_len: int = 8192) -> KVCacheManager:
    pool = BlockPool(num_blocks, enable_caching=caching, enable_kv_cache_events=events)
    return KVCacheManager(pool, block_size, max_model_len, enable_caching=caching)


def admit(kv: KVCacheManager, req: Request) -> list[int]:
    """Look up the prefix, allocate the rest of the prompt; return the request's block ids."""
    hits, n = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, req.num_tokens - n, n, hits)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return kv.get_block_ids(req.request_id)


def make_scheduler(num_blocks: int = 10000, caching: bool = False, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 8192)
    cfg.setdefault("max_num_seqs", 16)
    cfg.setdefault("max_model_len", cfg["max_num_batched_tokens"])
    kv = make_manager(num_blocks, caching=caching, events=False,
                      max_model_len=cfg["max_model_len"])
    return Scheduler(SchedulerConfig(**cfg), kv)


def run_step(sched: Scheduler, sampled: dict[str, list[int]] | None = None,
             default: int | None = None) -> tuple[SchedulerOutput, list]:
    """schedule() then update_from_output(); requests that reach their end sample `default`
    unless `sampled` says otherwise."""
    out = sched.schedule()
    ro = RunnerOutput()
    for rid in out.num_scheduled_tokens:
        ro.req_ids.append(rid)
        if sampled is not None and rid in sampled:
            ro.sampled_token_ids.append(list(sampled[rid]))
        elif default is not None and rid in out.sampling_req_ids:
            ro.sampled_token_ids.append([default])
        else:
            ro.sampled_token_ids.append([])
    outputs = sched.update_from_output(out, ro)
    sched.check_invariants()
    return out, outputs
