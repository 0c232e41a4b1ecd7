"""Scoring and routing policies: pure functions of candidate snapshots, no I/O.

Every candidate is scored with one cost model (Dynamo's is the reference): the work, in
prompt tokens, that stands between this request and its first token on that worker.

    cost = queued_prefill                      router-sent prompts not yet started there,
                                               + requests waiting there that it did not send
                                               (worker-reported load beyond its in-flight)
         + (1 + w) * (prompt_tokens - credited_hit)
                                               what this request must prefill there: once as
                                               its own wait, w times as work it adds to the
                                               fleet (w = marginal_work_weight)
         + decode_token_cost * active_requests the decode batch each prefill step shares
         + kv_shortage_weight * recompute      blocks it lacks, in tokens (KV usage)
         + eviction_weight * evicted           cached blocks (per the index) its new blocks
                                               would push out, in tokens
         + adapter affinity                    0 if its LoRA adapter is active there, else
                                               a load (+ an eviction when no slot is free)

`credited_hit` is the predicted cached prefix, capped as vLLM caps a hit (the last prompt
token is always recomputed), each block weighted by the tier it would be used from
(`CostConfig.tier_weight`: device 1, host/disk/shared store less, so a lower-tier block
costs its load time in prefill tokens), times `cache_credit`; it is 0 for a worker whose
cache signal is not trusted (load-only fallback). Session affinity
(kvloop/router/sessions.py) is a soft term of the same credit: the worker that served the
request's session last is credited with at least `session_weight` x the session's last
prompt (capped the same way), whatever its index says, so a multi-turn session stays with
its cache unless load outweighs it. The cheapest worker wins; ties go to the worker with
fewer requests in flight, then to a rendezvous hash of the prompt's first block, so cold
requests of one prefix land on one worker.

Hot prefixes (bounded load): a worker is saturated when its in-flight requests would exceed
both `load_bound` x the fleet mean (counting this request) and `saturation_floor`. When the
cheapest worker is saturated, the request goes to the cheapest unsaturated one instead: the
hot prefix is replicated on purpose to one more worker (which then shares it through the same
cost model), rather than piling onto its holder or giving up affinity fleet-wide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from dataclasses import dataclass, field
from typing import Protocol

from kvloop.router.config import CostConfig

# Decision reasons (a metric label each).
COLD = "cold"                          # no worker holds any of the prefix
PREFIX_HIT = "prefix_hit"              # the worker with the longest cached prefix
LOAD_OVERRIDE = "load_override"        # a shorter/no match won on cost (holder busier)
HOT_PREFIX_REPLICA = "hot_prefix_replica"  # holder saturated: prefix copied to another
BOUNDED_LOAD = "bounded_load"          # cheapest worker saturated, no prefix involved
LOAD_ONLY = "load_only"                # chosen worker's cache signal is distrusted
ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
RANDOM = "random"
DECODE_LOAD = "decode_load"            # P/D: a decode worker, chosen load first (pd.py)
SESSION = "session"                    # the session's worker, on its session credit
REASONS = (COLD, PREFIX_HIT, LOAD_OVERRIDE, HOT_PREFIX_REPLICA, BOUNDED_LOAD, LOAD_ONLY,
           ROUND_ROBIN, LEAST_LOADED, RANDOM, DECODE_LOAD, SESSION)


@dataclass(frozen=True)
class Candidate:
    """One worker as the scorer sees it at decision time.

    `cached_blocks`: predicted consecutive cached prefix (blocks). `load_only`: the cache
    signal of this worker is distrusted, so its prediction earns no credit.
    `in_flight`: requests the router sent and that have not finished; `prefilling`: those
    of them still before their first token, holding `queued_prefill_tokens` uncached
    tokens. `running`/`waiting`/`kv_usage`: the worker's own last reported figures.
    `indexed_blocks`: blocks the index says the worker has cached. `tiers`: the tier
    each of its `cached_blocks` would be used from (`BlockIndex.match_tiers`).
    `session_tokens`: the prompt length of the request's session's last turn, if this worker
    served it (else 0).
    `lora_adapters` and `max_loras`: from its `vllm:lora_requests_info`.
    """

    name: str
    cached_blocks: int = 0
    load_only: bool = False
    in_flight: int = 0
    prefilling: int = 0
    queued_prefill_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    capacity_blocks: int | None = None
    indexed_blocks: int = 0
    tiers: tuple[str, ...] = ()    # the tier of each cached block (empty: all device)
    session_tokens: int = 0
    lora_adapters: frozenset[str] = frozenset()   # active there (running or waiting)
    max_loras: int | None = None                  # its --max-loras (None: not reported)


@dataclass(frozen=True)
class RouteRequest:
    """What the policy knows about the request being routed."""

    prompt_tokens: int
    block_size: int
    prefix_key: int = 0
    expected_output_tokens: int = 16
    lora_name: str | None = None      # the adapter the request runs with (None: base)


@dataclass(frozen=True)
class Decision:
    """The chosen worker, why, and the figures behind it (for metrics and logs)."""

    worker: str
    reason: str
    cost: float = 0.0
    credited_cached_tokens: int = 0
    costs: dict[str, float] = field(default_factory=dict)


def hit_tokens(cached_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine can reuse from `cached_blocks`: never the prompt's last token."""
    if prompt_tokens <= 0:
        return 0
    usable_blocks = (prompt_tokens - 1) // block_size
    return min(cached_blocks, usable_blocks) * block_size


def tier_credit(c: Candidate, req: RouteRequest, cfg: CostConfig) -> float:
    """Tokens of the usable cached prefix, each block weighted by its tier."""
    blocks = hit_tokens(c.cached_blocks, req.prompt_tokens, req.block_size) // req.block_size
    if not c.tiers:
        return float(blocks * req.block_size)
    return req.block_size * sum(cfg.tier_weight(t) for t in c.tiers[:blocks])


def index_credit(c: Candidate, req: RouteRequest, cfg: CostConfig) -> float:
    """Prompt tokens credited as cached on `c` by the index, each block by its tier."""
    return 0.0 if c.load_only else cfg.cache_credit * tier_credit(c, req, cfg)


def session_credit(c: Candidate, req: RouteRequest, cfg: CostConfig) -> float:
    """Prompt tokens credited as cached on `c` because it served the session last."""
    return cfg.session_weight * hit_tokens(c.session_tokens // req.block_size,
                                           req.prompt_tokens, req.block_size)


def external_requests(running: int, waiting: int, in_flight: int) -> int:
    """Requests a worker reports beyond the router's own in-flight ones. The router's own
    are exact; the worker's figures (polled, so a little stale) only add what the router
    cannot explain: another router's requests."""
    return max(0, running + waiting - in_flight)


def estimate_cost(c: Candidate, req: RouteRequest, cfg: CostConfig) -> float:
    """The candidate's estimated work (tokens) before this request's first token."""
    credited = max(index_credit(c, req, cfg), session_credit(c, req, cfg))
    own_prefill = (1.0 + cfg.marginal_work_weight) * (req.prompt_tokens - credited)
    external = external_requests(c.running, c.waiting, c.in_flight)
    queued = c.queued_prefill_tokens + min(c.waiting, external) * req.prompt_tokens
    active = c.in_flight + external
    return (queued + own_prefill + cfg.decode_token_cost * active
            + cfg.kv_shortage_weight * _recompute_tokens(c, req, credited)
            + cfg.eviction_weight * _evicted_tokens(c, req, credited)
            + _adapter_tokens(c, req, cfg))


def _adapter_tokens(c: Candidate, req: RouteRequest, cfg: CostConfig) -> float:
    """Adapter affinity: 0 where the adapter is active, a load where a slot is free (or
    the worker reports none), a load and an eviction where every slot is busy."""
    if req.lora_name is None or req.lora_name in c.lora_adapters:
        return 0.0
    if c.max_loras is None or len(c.lora_adapters) < c.max_loras:
        return cfg.lora_load_tokens
    return cfg.lora_load_tokens + cfg.lora_evict_tokens


def _new_blocks(req: RouteRequest, credited: float) -> int:
    return -(-(req.prompt_tokens + req.expected_output_tokens - int(credited))
             // req.block_size)


def _evicted_tokens(c: Candidate, req: RouteRequest, credited: float) -> float:
    """Tokens of cached blocks this request's new blocks would push out of the cache."""
    if not c.capacity_blocks:
        return 0.0
    overflow = c.indexed_blocks + _new_blocks(req, credited) - c.capacity_blocks
    return max(0, overflow) * req.block_size


def _recompute_tokens(c: Candidate, req: RouteRequest, credited: float) -> float:
    """Tokens some request will recompute if the worker lacks free blocks for this one."""
    if not c.capacity_blocks:
        return 0.0
    free = c.capacity_blocks * (1.0 - min(max(c.kv_usage, 0.0), 1.0))
    return max(0.0, _new_blocks(req, credited) - free) * req.block_size


def rendezvous(key: int, name: str) -> int:
    """Highest-random-weight hash of (key, worker): a stable per-prefix preference order."""
    digest = hashlib.blake2b(f"{key}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _pick(costs: dict[str, float], cands: dict[str, Candidate], key: int) -> str:
    """Cheapest; ties: fewer in flight, then the prefix's rendezvous order."""
    best = min((round(c, 6), cands[n].in_flight) for n, c in costs.items())
    tied = [n for n, c in costs.items() if (round(c, 6), cands[n].in_flight) == best]
    return tied[0] if len(tied) == 1 else max(tied, key=lambda n: rendezvous(key, n))


def saturated(c: Candidate, candidates: list[Candidate], cfg: CostConfig) -> bool:
    """Bounded load: would one more request push `c` over `load_bound` x the mean
    (and over `saturation_floor`)?"""
    total = sum(x.in_flight for x in candidates) + 1
    cap = cfg.load_bound * total / len(candidates)
    return c.in_flight + 1 > max(cap, float(cfg.saturation_floor))


def kv_aware(candidates: list[Candidate], req: RouteRequest, cfg: CostConfig) -> Decision:
    """The default policy: lowest estimated cost, with bounded-load hot-prefix replication."""
    if not candidates:
        raise ValueError("no candidate workers")
    cands = {c.name: c for c in candidates}
    costs = {c.name: estimate_cost(c, req, cfg) for c in candidates}
    chosen = _pick(costs, cands, req.prefix_key)
    reason = _reason(cands, chosen, req, cfg)
    if len(candidates) > 1 and saturated(cands[chosen], candidates, cfg):
        free = {n: costs[n] for n, c in cands.items() if not saturated(c, candidates, cfg)}
        if free:
            holder_hit = cands[chosen].cached_blocks > 0 and not cands[chosen].load_only
            chosen = _pick(free, cands, req.prefix_key)
            reason = HOT_PREFIX_REPLICA if holder_hit else BOUNDED_LOAD
    c = cands[chosen]
    credited = 0 if c.load_only else hit_tokens(c.cached_blocks, req.prompt_tokens,
                                                req.block_size)
    return Decision(chosen, reason, costs[chosen], credited, costs)


def _reason(cands: dict[str, Candidate], chosen: str, req: RouteRequest,
            cfg: CostConfig) -> str:
    c = cands[chosen]
    if session_credit(c, req, cfg) > index_credit(c, req, cfg):
        return SESSION
    if c.load_only:
        return LOAD_ONLY
    best = max((x.cached_blocks for x in cands.values() if not x.load_only), default=0)
    if best == 0:
        return COLD
    return PREFIX_HIT if c.cached_blocks == best else LOAD_OVERRIDE


class Policy(Protocol):
    """Chooses one of `candidates` (never empty) for `req`."""

    name: str

    def choose(self, candidates: list[Candidate], req: RouteRequest) -> Decision: ...


class KvAwarePolicy:
    name = "kv-aware"

    def __init__(self, cfg: CostConfig):
        self.cfg = cfg

    def choose(self, candidates: list[Candidate], req: RouteRequest) -> Decision:
        return kv_aware(candidates, req, self.cfg)


class RoundRobinPolicy:
    """Each request to the next worker in name order; ignores caches and load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: list[Candidate], req: RouteRequest) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.name)
        c = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(c.name, ROUND_ROBIN)


class LeastLoadedPolicy:
    """The cost model with no cache credit: load only; ties rotate round-robin."""

    name = "least-loaded"

    def __init__(self, cfg: CostConfig):
        self.cfg = dataclasses.replace(cfg, cache_credit=0.0, session_weight=0.0)
        self._turn = 0

    def choose(self, candidates: list[Candidate], req: RouteRequest) -> Decision:
        costs = {c.name: estimate_cost(c, req, self.cfg) for c in candidates}
        low = min(round(v, 6) for v in costs.values())
        tied = sorted(n for n, v in costs.items() if round(v, 6) == low)
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return Decision(chosen, LEAST_LOADED, costs[chosen], 0, costs)


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def choose(self, candidates: list[Candidate], req: RouteRequest) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.name)
        return Decision(self._rng.choice(ordered).name, RANDOM)


def make_policy(name: str, cfg: CostConfig, seed: int | None = None) -> Policy:
    """The policy called `name` (kv-aware, round-robin, least-loaded, random)."""
    if name == "kv-aware":
        return KvAwarePolicy(cfg)
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy(cfg)
    if name == "random":
        return RandomPolicy(seed)
    raise ValueError(f"unknown policy {name!r}; choose kv-aware, round-robin, "
                     f"least-loaded or random")
