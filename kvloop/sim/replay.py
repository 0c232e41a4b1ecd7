"""`kvloop replay`: drive the real scheduler from a conformance trace and write a step log.

Input and output formats and the step semantics are those of
`tests/data/conformance/README.md` (step log format "vllm-sched-steplog/1"), so the log
compares step by step with one produced by vLLM's own scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvloop.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_HASH_ALGO,
    DEFAULT_POLICY,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from kvloop.core.engine import EngineCore, StepResult
from kvloop.core.request import Request, SamplingParams
from kvloop.sim.runner import SimRunner

TRACE_DEFAULTS: dict[str, Any] = {
    "block_size": DEFAULT_BLOCK_SIZE,
    "num_gpu_blocks": 64,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 16,
    "long_prefill_token_threshold": 0,
    "enable_prefix_caching": True,
    "max_model_len": 4096,
    "prefix_caching_hash_algo": DEFAULT_HASH_ALGO,
    "scheduler_reserve_full_isl": True,
    "watermark": 0.0,
    "policy": DEFAULT_POLICY,
    "enable_chunked_prefill": True,
    "max_steps": 10000,
}


def engine_config_from_trace(cfg: dict[str, Any]) -> EngineConfig:
    c = {**TRACE_DEFAULTS, **cfg}
    cache = CacheConfig(block_size=c["block_size"], num_gpu_blocks=c["num_gpu_blocks"],
                        enable_prefix_caching=c["enable_prefix_caching"],
                        prefix_caching_hash_algo=c["prefix_caching_hash_algo"],
                        watermark=c["watermark"], enable_kv_cache_events=True)
    sched = SchedulerConfig(max_num_batched_tokens=c["max_num_batched_tokens"],
                            max_num_seqs=c["max_num_seqs"], max_model_len=c["max_model_len"],
                            long_prefill_token_threshold=c["long_prefill_token_threshold"],
                            policy=c["policy"], enable_chunked_prefill=c["enable_chunked_prefill"],
                            scheduler_reserve_full_isl=c["scheduler_reserve_full_isl"])
    return EngineConfig(cache=cache, scheduler=sched, check_invariants=True)


@dataclass
class _ReqLog:
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    finish_step: int | None = None
    admissions: list[dict[str, int]] = field(default_factory=list)
    request: Request | None = None


def _event_json(ev: Any) -> dict[str, Any]:
    d = msgspec.to_builtins(ev)
    return {"type": type(ev).__name__, **{k: v for k, v in d.items() if k != "type"}}


class Replayer:
    """Holds a trace, an engine and the step log being built."""

    def __init__(self, trace: dict[str, Any]):
        self.trace = trace
        self.config = {**TRACE_DEFAULTS, **trace.get("config", {})}
        self.engine = EngineCore(engine_config_from_trace(self.config),
                                 SimRunner(token_source=self._token))
        self.reqs = {r["id"]: r for r in trace["requests"]}
        self.pending = sorted(enumerate(trace["requests"]),
                              key=lambda p: (p[1].get("arrival_step", 0), p[0]))
        self.log = {rid: _ReqLog() for rid in self.reqs}
        self.steps: list[dict[str, Any]] = []
        self._arrival = 0

    def _token(self, rid: str, k: int) -> int:
        sampled = self.reqs[rid].get("sampled") or []
        return sampled[k] if k < len(sampled) else 1000 + k

    def _arrive(self, step: int) -> list[str]:
        arrived = []
        while self.pending and self.pending[0][1].get("arrival_step", 0) <= step:
            _, r = self.pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"],
                                    stop_token_ids=tuple(r.get("stop_token_ids", ())),
                                    eos_token_id=r.get("eos_token_id"),
                                    priority=r.get("priority", 0))
            self._arrival += 1
            req = self.engine.make_request(r["id"], r["prompt_token_ids"], params,
                                           arrival_time=float(self._arrival))
            self.engine.add_request(req)
            self.log[r["id"]].request = req
            arrived.append(r["id"])
        return arrived

    def run(self) -> dict[str, Any]:
        step = 0
        while step < self.config["max_steps"]:
            arrived = self._arrive(step)
            if not self.engine.has_unfinished_requests():
                if not self.pending:
                    break
                self.steps.append({"step": step, "arrived": arrived, "idle": True})
                step += 1
                continue
            self.steps.append(self._step(step, arrived, self.engine.step()))
            step += 1
        return self._document()

    def _step(self, step: int, arrived: list[str], res: StepResult) -> dict[str, Any]:
        out = res.scheduler_output
        assert out is not None
        new_ids = {d.req_id: d.resumed for d in out.scheduled_new_reqs}
        before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        before.update({d.req_id: d.num_computed_tokens for d in out.scheduled_cached_reqs})
        scheduled = []
        sampled: dict[str, int] = {}
        for rid, n in out.num_scheduled_tokens.items():
            kind = ("resumed" if new_ids[rid] else "new") if rid in new_ids else "running"
            samples = rid in out.sampling_req_ids
            scheduled.append({"id": rid, "kind": kind, "num_computed_before": before[rid],
                              "num_tokens": n, "samples": samples})
        outputs: dict[str, Any] = {}
        finished = []
        for o in res.outputs:
            lg = self.log[o.request_id]
            sampled[o.request_id] = o.new_token_ids[0]
            entry: dict[str, Any] = {"new_token_ids": o.new_token_ids}
            if not lg.output_token_ids:
                entry["num_cached_tokens"] = o.num_cached_tokens
            lg.output_token_ids.extend(o.new_token_ids)
            if o.finish_reason is not None:
                entry["finish_reason"] = o.finish_reason
                lg.finish_reason, lg.finish_step = o.finish_reason, step
                finished.append({"id": o.request_id, "reason": o.finish_reason})
            outputs[o.request_id] = entry
        for a in res.admissions:
            self.log[a.request_id].admissions.append(
                {"step": step, "prefix_hit_tokens": a.prefix_hit_tokens})
        return {
            "step": step, "arrived": arrived, "scheduled": scheduled,
            "total_scheduled_tokens": out.total_num_scheduled_tokens,
            "admitted": [{"id": a.request_id, "resumed": a.resumed,
                          "prefix_hit_tokens": a.prefix_hit_tokens, "num_tokens": a.num_tokens}
                         for a in res.admissions],
            "preempted": list(out.preempted_req_ids), "sampled": sampled, "outputs": outputs,
            "finished": finished,
            "kv_events": [_event_json(e) for e in (res.events.events if res.events else [])],
            "after": self._after(),
        }

    def _after(self) -> dict[str, Any]:
        sched = self.engine.scheduler
        kv = self.engine.kv_cache_manager
        return {
            "running": [r.request_id for r in sched.running],
            "waiting": [r.request_id for r in sched.waiting],
            "num_free_blocks": self.engine.block_pool.get_num_free_blocks(),
            "requests": {rid: {"status": r.status.name,
                               "num_computed_tokens": r.num_computed_tokens,
                               "num_tokens": r.num_tokens,
                               "num_output_tokens": r.num_output_tokens,
                               "block_ids": kv.get_block_ids(rid)}
                         for rid, r in sched.requests.items()},
        }

    def _document(self) -> dict[str, Any]:
        hasher = self.engine.hasher
        return {
            "format": "vllm-sched-steplog/1",
            "engine": "kvloop",
            "trace": self.trace.get("name"),
            "config": self.config,
            "hashing": {"algo": self.config["prefix_caching_hash_algo"],
                        "none_hash_seed": hasher.seed if hasher else None,
                        "none_hash_hex": hasher.none_hash.hex() if hasher else None},
            "initial_num_free_blocks": self.config["num_gpu_blocks"] - 1,
            "num_steps": len(self.steps),
            "steps": self.steps,
            "requests": {rid: {"output_token_ids": lg.output_token_ids,
                               "finish_reason": lg.finish_reason,
                               "finish_step": lg.finish_step,
                               "num_preemptions": lg.request.num_preemptions
                               if lg.request else 0,
                               "admissions": lg.admissions}
                         for rid, lg in self.log.items()},
        }


def replay(trace: dict[str, Any]) -> dict[str, Any]:
    """Run a conformance trace through kvloop's scheduler; return the step log."""
    return Replayer(trace).run()


def dump_steplog(doc: dict[str, Any]) -> str:
    """The step log as JSON with one step per line (as vLLM's expected files)."""
    head = {k: v for k, v in doc.items() if k not in ("steps", "requests")}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines.append('  "steps": [')
    steps = [json.dumps(s) for s in doc["steps"]]
    lines.append(",\n".join(f"    {s}" for s in steps))
    lines.append("  ],")
    lines.append(f'  "requests": {json.dumps(doc["requests"])}')
    lines.append("}")
    return "\n".join(lines) + "\n"
