"""The router's brain, without HTTP: register workers, hash prompts, pick, account.

Owner: `Router` owns the policy, the session table and the tickets' life; its base
`Membership` (`membership.py`) owns the prefix index, the registry, the event feeds and
subscribers, the alarms and the metrics. The HTTP front (`proxy.py`) calls `route()` /
`first_token()` / `finish()` around each forwarded request and `register()` /
`worker_down()` when it learns about a worker, and nothing else.

Request lifecycle:
    1. route(tokens): hash full blocks with the fleet's algorithm and seed; match the
       index (confirmed + provisional); score candidates (policy); add provisional entries
       for the chosen worker; open a ticket (in-flight load, predicted hit).
    2. first_token(ticket): its prefill is done; its tokens leave the worker's queue.
    3. finish(ticket, cached_tokens): compare the reported hit with the prediction
       (self-verification); close the ticket.

With decode workers and no `both` worker up (P/D mode, `pd_mode()`), `route_pd()` replaces
step 1: it picks the decode worker, decides remote or local prefill (`pd.py`) and, for a
remote one, the prefill worker, with a ticket on each; `prefill_done()` or
`prefill_failed()` (a fallback to decode-only, counted and visible) closes the prefill leg.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvloop.config import KV_LOADS, SchedulerConfig
from kvloop.core.hashing import block_extra_keys
from kvloop.events.types import TIER_DEVICE, event_int
from kvloop.router import filters
from kvloop.router.config import RouterConfig
from kvloop.router.filters import Filter
from kvloop.router.groups import hit_blocks, is_hybrid
from kvloop.router.membership import Membership, SubscriberFactory, capacity
from kvloop.router.membership import Subscription as Subscription
from kvloop.router.membership import make_index as make_index
from kvloop.router.pd import (
    DECODE_CANNOT_LOAD,
    PREFILL_TIMEOUT,
    PDDecision,
    PDWorker,
    TransferModel,
    decide,
    decode_order,
    estimate,
    fingerprint_bytes_per_token,
)
from kvloop.router.registry import (
    PREFILL_FAILING,
    Ticket,
    WorkerState,
)
from kvloop.router.request import RoutingRequest, tokens_request
from kvloop.router.scorer import (
    DECODE_LOAD,
    Candidate,
    Decision,
    RouteRequest,
    external_requests,
    hit_tokens,
    make_policy,
    rendezvous,
    session_credit,
    tier_credit,
)
from kvloop.router.sessions import SessionTable
from kvloop.sim.latency import LatencyModel

log = logging.getLogger("kvloop.router")

SERVING_ORDER = (("both",), ("decode",), ("prefill",))
# the profiles' filters (kvloop/router/filters.py), in order
AGGREGATED: tuple[Filter, ...] = (filters.usable, filters.not_excluded)
DECODE: tuple[Filter, ...] = (filters.role("decode"), filters.usable, filters.not_excluded,
                              filters.adapter_holders)
PREFILL: tuple[Filter, ...] = (filters.role("prefill"), filters.usable, filters.not_excluded,
                               filters.prefill_capable, filters.adapter_holders)


class NoWorkerError(RuntimeError):
    """No usable worker for the request (the HTTP front answers 503)."""


@dataclass(frozen=True)
class Routed:
    """The outcome of `route()`: where to send the request and its ticket."""

    worker: WorkerState
    decision: Decision
    ticket: Ticket
    predicted_tokens: int
    num_blocks: int
    request: RoutingRequest | None = None   # what was routed (a retry continues it)


@dataclass(frozen=True)
class PDRouted:
    """The outcome of `route_pd()`: the decode leg, the prefill leg (None: decode-only) and
    the decision between them."""

    decode: Routed
    prefill: Routed | None
    decision: PDDecision


@dataclass(frozen=True)
class Fallback:
    """The last prefill leg that fell back to decode-only (for /health)."""

    worker: str
    reason: str
    detail: str
    at: float


class TicketPeers(Protocol):
    """Who hears of every ticket this router opens, starts and closes (other router
    replicas: kvloop/router/replicas.py)."""

    def opened(self, t: Ticket, hashes: list[int]) -> None: ...

    def first(self, t: Ticket) -> None: ...

    def closed(self, t: Ticket) -> None: ...


class Router(Membership):
    """Membership (`kvloop.router.membership`) + policy + sessions + tickets; thread-safe
    for one event loop plus feeds."""

    def __init__(self, config: RouterConfig | None = None,
                 subscriber_factory: SubscriberFactory | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(config, subscriber_factory, clock)
        self.latency = LatencyModel.from_file(self.config.pd.latency_file,
                                              self.config.pd.speedup)
        self.last_fallback: Fallback | None = None
        self.sessions = SessionTable()
        self.policy = make_policy(self.config.policy, self.config.cost,
                                  self.config.random_seed)
        self.details: dict[str, Callable[[], dict[str, Any]]] = {}   # more of /health
        self.problems: list[Callable[[], list[str]]] = []   # more /health reasons
        self.replicas: TicketPeers | None = None   # tells other routers of each ticket

    def forget_cache(self, name: str) -> None:
        self.sessions.forget_worker(name)

    # --- routing --------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora_name: str | None = None) -> list[int]:
        """The fleet's 64-bit block hashes of every full block of `token_ids` (a LoRA
        adapter's name in every block's extra keys, as the engine hashes them)."""
        hasher = self.hasher
        if hasher is None:
            return []
        extra = None
        if cache_salt is not None or lora_name is not None:
            n = len(token_ids) // hasher.block_size
            extra = [block_extra_keys(i, lora_name=lora_name, cache_salt=cache_salt)
                     for i in range(n)]
        return [event_int(h) for h in hasher.hash_range(token_ids, None, 0, extra)]

    def adapter_of(self, model: object) -> str | None:
        """The LoRA adapter a request body's `model` names: a name that is not one of the
        workers' served (base) names (None while no worker has described itself)."""
        bases = {n for w in self.registry.all() if w.description is not None
                 for n in w.description.served_model_names}
        if not isinstance(model, str) or not bases or model in bases:
            return None
        return model

    def serving_pool(self, exclude: Sequence[str] = ()) -> list[WorkerState]:
        """Who serves a request end to end (aggregated): `both` workers; if none is up,
        `decode` workers (they prefill locally); `prefill` workers only when nothing else is
        up. With decode workers and no `both` worker up, P/D requests take `pick_pd()`.
        """
        for roles in SERVING_ORDER:
            pool = [w for w in self.registry.usable(roles) if w.name not in exclude]
            if pool:
                return pool
        return []

    def pick(self, rr: RoutingRequest) -> Routed | PDRouted:
        """THE routing decision, the one entry point of every front (the HTTP proxy, the
        Envoy ext_proc endpoint picker): where `rr` goes, with a ticket opened on each leg.

        In P/D mode (`pd_mode()`) a disaggregable request (`rr.disaggregable`) gets a
        `PDRouted` (`pick_pd`: the decode profile, the P/D decision, the prefill profile);
        any other a `Routed` (`pick_one`: the aggregated profile). Raises NoWorkerError when
        no worker may take it. The caller closes every ticket it gets (`finish`, or
        `abandon` when nothing is sent), reports the first token (`first_token`) and, for a
        prefill leg, its outcome (`prefill_done` / `prefill_failed` / ...). A retry or a
        migration picks again with `rr.continued(...)`, never with a request built anew.
        """
        if rr.disaggregable and self.pd_mode():
            return self.pick_pd(rr)
        return self.pick_one(rr)

    def pick_one(self, rr: RoutingRequest) -> Routed:
        """The aggregated profile: the serving pool (`SERVING_ORDER`, through `AGGREGATED`'s
        filters), scored by the policy with the index's matches and the session's credit;
        the session's turn recorded on the chosen worker."""
        t0 = time.perf_counter()
        workers = self._serving(rr)
        if not workers:
            raise NoWorkerError(self._no_worker_message())
        hashes = list(rr.hashes)
        matches = self.index.match_tiers(hashes, [w.name for w in workers]) if hashes else {}
        matches = self._group_matches(matches, hashes, workers, rr.prompt_tokens)
        session = self._session_tokens(rr)
        candidates = [self._candidate(w, matches.get(w.name, ()), session.get(w.name, 0))
                      for w in workers]
        decision = self.policy.choose(candidates, rr.scoring())
        chosen = self.registry.get(decision.worker)
        assert chosen is not None
        n, bs = rr.prompt_tokens, rr.block_size
        self.sessions.record(rr.session, chosen.name, n, self.clock())
        tiers = matches.get(chosen.name, ())
        predicted = hit_tokens(len(tiers), n, bs)
        ticket = self._open(chosen, hashes, n, predicted, n - predicted,
                            tiers=tiers[:predicted // bs])
        self._count_decision(decision, chosen.name, n, predicted, t0)
        return Routed(chosen, decision, ticket, predicted, len(hashes), rr)

    def _group_matches(self, matches: dict[str, tuple[str, ...]], hashes: list[int],
                       workers: Sequence[WorkerState], prompt_tokens: int
                       ) -> dict[str, tuple[str, ...]]:
        """A hybrid worker's match (sliding-window groups, `kvloop.router.groups`) replaced
        by the engine's hit rule over its groups (its device tier only: such a worker has no
        KV connector)."""
        bs = self.block_size
        max_blocks = max(0, prompt_tokens - 1) // bs
        for w in workers:
            groups = w.events.groups
            if not hashes or not is_hybrid(groups):
                continue
            name = w.name
            n = hit_blocks(self._held_by(name), hashes, dict(groups), max_blocks, bs)
            if n:
                matches[name] = (TIER_DEVICE,) * n
            else:
                matches.pop(name, None)
        return matches

    def _held_by(self, name: str) -> Callable[[list[int]], set[int]]:
        def held(keys: list[int]) -> set[int]:
            return set(self.index.held(name, keys))
        return held

    def _serving(self, rr: RoutingRequest) -> list[WorkerState]:
        everyone = self.registry.all()
        for roles in SERVING_ORDER:
            pool = filters.run((filters.role(*roles), *AGGREGATED), everyone, rr)
            if pool:
                return filters.adapter_holders(pool, rr)
        return []

    def _session_tokens(self, rr: RoutingRequest) -> dict[str, int]:
        """{the worker of the session's last turn: that turn's prompt tokens} (empty: no
        session, or none recent)."""
        turn = self.sessions.last_turn(rr.session, self.clock())
        return {} if turn is None else {turn.worker: turn.prompt_tokens}

    def route(self, token_ids: Sequence[int], exclude: Sequence[str] = (),
              cache_salt: str | None = None, expected_output_tokens: int = 16,
              session: int | None = None, lora_name: str | None = None) -> Routed:
        """`pick_one` of a bare prompt (run with LoRA adapter `lora_name`, None: the base
        model); `session` (a digest, `kvloop.router.sessions.session_key`) steers it softly
        to the session's last worker. Raises NoWorkerError."""
        return self.pick_one(tokens_request(self, token_ids, exclude, cache_salt,
                                            expected_output_tokens, session, lora_name))

    def _open(self, w: WorkerState, hashes: list[int], prompt_tokens: int, predicted: int,
              uncached: int, verify: bool = True, tiers: tuple[str, ...] = ()) -> Ticket:
        """Provisional entries (where the worker caches) and a ticket for one leg."""
        bs = self.block_size
        caches = w.caches_prefixes
        if caches:
            self.index.add_provisional(w.name, hashes)
        expects_event = caches and len(hashes) * bs > predicted
        ticket = self.registry.open_ticket(w.name, prompt_tokens, uncached, predicted,
                                           expects_event, verify, tiers)
        if self.replicas is not None:
            self.replicas.opened(ticket, hashes if caches else [])
        return ticket

    # --- prefill/decode disaggregation ----------------------------------------------------
    def pd_mode(self) -> bool:
        """True while decode workers and no `both` worker are up: P/D requests take
        `pick_pd`; `both` workers keep the aggregated routing of `pick_one`."""
        return not self.registry.usable(("both",)) and bool(self.registry.usable(("decode",)))

    def route_pd(self, token_ids: Sequence[int], exclude: Sequence[str] = (),
                 cache_salt: str | None = None, expected_output_tokens: int = 16,
                 local_reason: str | None = None, lora_name: str | None = None,
                 session: int | None = None) -> PDRouted:
        """`pick_pd` of a bare prompt (`local_reason`: why it cannot take a remote
        prefill, None: it can)."""
        return self.pick_pd(tokens_request(self, token_ids, exclude, cache_salt,
                                           expected_output_tokens, session, lora_name,
                                           local_reason))

    def pick_pd(self, rr: RoutingRequest) -> PDRouted:
        """llm-d's P/D profile handler: the decode profile (`DECODE`'s filters; load first,
        then the cache and the session's credit), the P/D decision (remote or local prefill:
        the cost model, or `rr.local_reason`), then the prefill profile (`PREFILL`'s filters,
        the policy), each leg with its ticket; the session's turn recorded on the decode
        worker. Raises NoWorkerError without a decode worker."""
        t0 = time.perf_counter()
        everyone = self.registry.all()
        decoders = filters.run(DECODE, everyone, rr)
        if not decoders:
            raise NoWorkerError(self._no_worker_message())
        prefillers = filters.run(PREFILL, everyone, rr)
        hashes = list(rr.hashes)
        matches = self.index.match_tiers(hashes, [w.name for w in decoders + prefillers]) \
            if hashes else {}
        matches = self._group_matches(matches, hashes, decoders + prefillers, rr.prompt_tokens)
        req = rr.scoring()
        snaps = {w.name: self._pd_worker(w, matches.get(w.name, ()), req)
                 for w in decoders + prefillers}
        d = self._decode_profile(decoders, snaps, rr)
        local = rr.local_reason
        if local is None and d.kv_role not in KV_LOADS:
            local = DECODE_CANNOT_LOAD
        p_choice, est = None, None
        if prefillers and local is None and self.config.pd.policy != "never":
            p_choice = self.policy.choose(
                [self._candidate(w, matches.get(w.name, ())) for w in prefillers], req)
            p = self.registry.get(p_choice.worker)
            assert p is not None
            est = estimate(self.latency, self._transfer(p), snaps[d.name], snaps[p.name],
                           rr.prompt_tokens, rr.block_size)
        decision = PDDecision(False, local) if local else decide(self.config.pd.policy, est)
        self.sessions.record(rr.session, d.name, rr.prompt_tokens, self.clock())
        routed = self._open_pd(d, p_choice if decision.remote else None, hashes, matches,
                               rr, decision)
        self._count_pd(routed, t0)
        return routed

    def _decode_profile(self, decoders: list[WorkerState], snaps: dict[str, PDWorker],
                        rr: RoutingRequest) -> WorkerState:
        """The decode worker: load first (`decode_order`), the larger of its cache and its
        session credit (`scorer.session_credit`) next, then a rendezvous tie-break."""
        req, session = rr.scoring(), self._session_tokens(rr)
        cfg = self.config.cost

        def credit(w: WorkerState) -> int:
            tokens = session.get(w.name, 0)
            return int(session_credit(Candidate(w.name, session_tokens=tokens), req, cfg)) \
                if tokens else 0

        return min(decoders, key=lambda w: (decode_order(snaps[w.name], credit(w)),
                                            -rendezvous(req.prefix_key, w.name)))

    def _pd_worker(self, w: WorkerState, tiers: tuple[str, ...],
                   req: RouteRequest) -> PDWorker:
        """`cached_tokens` is the tier-weighted hit: a block loaded from below the device
        leaves (1 - its weight) of its tokens to the prefill estimate, i.e. its load time."""
        prefilling = w.prefilling()
        decoding = tuple(t.prompt_tokens for t in w.open_tickets()
                         if t.first_token_at is not None)
        load = w.reported_load()
        external = external_requests(load.running, load.waiting, w.in_flight())
        budget = (w.description.max_num_batched_tokens if w.description is not None
                  else SchedulerConfig.max_num_batched_tokens)   # not a kvloop worker: ours
        cached = 0 if w.load_only else int(tier_credit(
            Candidate(w.name, cached_blocks=len(tiers), tiers=tiers), req, self.config.cost))
        return PDWorker(
            w.name, budget, sum(t.uncached_tokens for t in prefilling)
            + min(load.waiting, external) * req.prompt_tokens,
            decoding + (req.prompt_tokens,) * max(0, external - load.waiting), cached,
            w.in_flight() + external, load.kv_usage)

    def _transfer(self, prefill: WorkerState) -> TransferModel:
        cfg = self.config.pd
        return TransferModel(cfg.transfer_bandwidth,
                             prefill.kv_bytes_per_token or cfg.kv_bytes_per_token)

    def _open_pd(self, d: WorkerState, p_choice: Decision | None, hashes: list[int],
                 matches: dict[str, tuple[str, ...]], rr: RoutingRequest,
                 decision: PDDecision) -> PDRouted:
        n, bs = rr.prompt_tokens, rr.block_size
        d_tiers = matches.get(d.name, ()) if not d.load_only else ()
        d_hit = hit_tokens(len(d_tiers), n, bs)
        d_decision = Decision(d.name, DECODE_LOAD)
        if p_choice is None:
            ticket = self._open(d, hashes, n, d_hit, n - d_hit, tiers=d_tiers[:d_hit // bs])
            return PDRouted(Routed(d, d_decision, ticket, d_hit, len(hashes), rr), None,
                            decision)
        p = self.registry.get(p_choice.worker)
        assert p is not None
        p_tiers = matches.get(p.name, ()) if not p.load_only else ()
        p_hit = hit_tokens(len(p_tiers), n, bs)
        p_ticket = self._open(p, hashes, n, p_hit, n - p_hit, tiers=p_tiers[:p_hit // bs])
        d_ticket = self._open(d, hashes, n, d_hit, min(1, n), verify=False)
        return PDRouted(Routed(d, d_decision, d_ticket, d_hit, len(hashes), rr),
                        Routed(p, p_choice, p_ticket, p_hit, len(hashes), rr), decision)

    def _count_pd(self, r: PDRouted, t0: float) -> None:
        m, d = self.metrics, r.decision
        m.pd_decisions.labels("remote" if d.remote else "local", d.reason).inc()
        n = r.decode.ticket.prompt_tokens
        if r.prefill is not None:
            p = r.prefill
            m.decisions.labels(self.policy.name, p.decision.reason).inc()
            m.prompt_tokens.labels(p.worker.name).inc(n)
            m.predicted_hit.labels(p.worker.name).inc(p.predicted_tokens)
        self._count_decision(r.decode.decision, r.decode.worker.name, n,
                             r.decode.predicted_tokens, t0)

    def prefill_done(self, r: PDRouted, cached_tokens: int | None,
                     params: dict[str, Any]) -> None:
        """The prefill leg answered with usable `params`: close its ticket, verify its hit,
        learn its KV bytes per token from its `kv_fingerprint`."""
        assert r.prefill is not None
        p = r.prefill
        self.registry.first_token(p.ticket)
        self.finish(p.ticket, cached_tokens, "ok")
        self.registry.prefill_leg_done(p.worker.name, True)
        learned = fingerprint_bytes_per_token(params.get("kv_fingerprint"))
        if learned is not None:
            self.registry.set_kv_bytes_per_token(p.worker.name, learned)

    def prefill_failed(self, r: PDRouted, reason: str, detail: str) -> None:
        """The prefill leg failed (`reason`, a `pd.FALLBACK_REASONS` label): the request is
        served decode-only. Counted, logged, and shown in /health."""
        assert r.prefill is not None
        name = r.prefill.worker.name
        self.finish(r.prefill.ticket, None, "worker_error")
        self.registry.prefill_leg_done(name, False)
        self.registry.serve_locally(r.decode.ticket)
        self.metrics.pd_fallbacks.labels(name, reason).inc()
        self.last_fallback = Fallback(name, reason, detail, self.clock())
        log.warning("prefill worker %s: %s (%s); request served decode-only by %s", name,
                    reason, detail, r.decode.worker.name)

    def prefill_timed_out(self, r: PDRouted, detail: str) -> None:
        """The prefill leg went unanswered for --prefill-timeout: a fallback (as
        `prefill_failed`), and its prefill worker gets no prefill leg for one window from
        now (`prefill_failing`, raised at once: new requests must not wait on it too)."""
        assert r.prefill is not None
        name = r.prefill.worker.name
        self.prefill_failed(r, PREFILL_TIMEOUT, detail)
        self.registry.prefill_frozen(name)
        self._raise(name, PREFILL_FAILING, f"a prefill leg timed out ({detail}); requests "
                    f"are served decode-only without it for {self.config.liveness.window_s:g}s")

    def prefill_refused(self, r: PDRouted) -> None:
        """P answered 4xx: the request itself is bad; its answer goes to the client, and the
        decode leg is never sent."""
        assert r.prefill is not None
        self.finish(r.prefill.ticket, None, "client_error")
        self.registry.drop_ticket(r.decode.ticket)
        if self.replicas is not None:
            self.replicas.closed(r.decode.ticket)

    def abandon(self, r: Routed | PDRouted) -> None:
        """A decision nobody will act on (its request was cancelled meanwhile): close every
        ticket it opened."""
        legs = [r] if isinstance(r, Routed) else [r.decode, r.prefill]
        for leg in legs:
            if leg is not None:
                self.finish(leg.ticket, None, "disconnected")

    def prefill_abandoned(self, r: PDRouted) -> None:
        """The client left during the prefill leg: close both legs' tickets."""
        if r.prefill is not None:
            self.finish(r.prefill.ticket, None, "disconnected")
        self.finish(r.decode.ticket, None, "disconnected")

    def _candidate(self, w: WorkerState, tiers: tuple[str, ...],
                   session_tokens: int = 0) -> Candidate:
        prefilling, load = w.prefilling(), w.reported_load()
        return Candidate(
            name=w.name, cached_blocks=len(tiers), tiers=tiers, load_only=w.load_only,
            in_flight=w.in_flight(), prefilling=len(prefilling),
            queued_prefill_tokens=sum(t.uncached_tokens for t in prefilling),
            running=load.running, waiting=load.waiting, kv_usage=load.kv_usage,
            capacity_blocks=capacity(w.description),
            indexed_blocks=0 if w.load_only else self.index.worker_blocks(w.name),
            session_tokens=session_tokens,
            lora_adapters=load.lora_adapters, max_loras=load.max_loras)

    def _count_decision(self, d: Decision, worker: str, prompt_tokens: int, predicted: int,
                        t0: float) -> None:
        m = self.metrics
        m.decisions.labels(self.policy.name, d.reason).inc()
        m.prompt_tokens.labels(worker).inc(prompt_tokens)
        m.predicted_hit.labels(worker).inc(predicted)
        if prompt_tokens:
            m.match_fraction.observe(predicted / prompt_tokens)
        m.decision_seconds.observe(time.perf_counter() - t0)

    def _no_worker_message(self) -> str:
        all_workers = self.registry.all()
        if not all_workers:
            return "no worker is registered"
        down = [f"{w.name} ({w.down_reason})" for w in all_workers if not w.up]
        text = "no usable worker"
        return text + (f"; down: {', '.join(down)}" if down else "")

    def first_token(self, ticket: Ticket) -> None:
        if ticket.first_token_at is None and self.replicas is not None:
            self.replicas.first(ticket)
        self.registry.first_token(ticket)

    def finish(self, ticket: Ticket, cached_tokens: int | None, outcome: str = "ok") -> None:
        """Close the ticket (`outcome`: ok, client_error, worker_error, disconnected,
        draining); with a reported hit, verify the prediction. Closing a closed ticket does
        nothing, so every path of a request may close it in its `finally`."""
        if not self.registry.close_ticket(ticket, outcome == "ok"):
            return
        if self.replicas is not None:
            self.replicas.closed(ticket)
        self.metrics.requests.labels(ticket.worker, outcome).inc()
        if cached_tokens is None or not ticket.verify:
            return   # a pulled prompt's hit is its prefill worker's, counted on that leg
        self.metrics.actual_hit.labels(ticket.worker).inc(cached_tokens)
        w = self.registry.get(ticket.worker)
        if w is not None and w.up:
            bs = self.block_size
            w.verifier.record(ticket.predicted_tokens, cached_tokens, bs, ticket.tiers)

    # --- health ---------------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body): 200 ok/degraded with reasons; 503 when nothing is usable."""
        workers = self.registry.all()
        reasons = [a.message for w in workers if w.up for a in w.alarms.values()]
        reasons += [f"worker {w.name} is down: {w.down_reason}" for w in workers if not w.up]
        fallback = self._recent_fallback()
        if fallback is not None:
            reasons.append(fallback)
        reasons += self.index.alarms()
        reasons += [r for problems in self.problems for r in problems()]
        usable = [w for w in workers if w.up]
        status = "ok" if not reasons else "degraded"
        if not usable:
            status = "unavailable"
            if not reasons:   # never unavailable without saying why
                reasons.append(self._no_worker_message())
        body = {"status": status, "reasons": reasons,
                "workers": {w.name: self.describe_worker(w) for w in workers}}
        if any(w.role != "both" for w in workers):
            body["pd"] = self.describe_pd()
        body.update({name: describe() for name, describe in self.details.items()})
        return (200 if usable else 503), body

    def _recent_fallback(self) -> str | None:
        """A /health reason while the last fallback to decode-only is within the window."""
        f = self.last_fallback
        if f is None or self.clock() - f.at >= self.config.liveness.window_s:
            return None
        return (f"prefill worker {f.worker}: a prefill leg failed ({f.reason}: {f.detail}) "
                f"{self.clock() - f.at:.1f}s ago; that request was served decode-only")

    def describe_pd(self) -> dict[str, Any]:
        """P/D mode, decisions and fallbacks so far (the `pd` part of /health)."""
        m, f = self.metrics, self.last_fallback
        return {
            "mode": "disaggregated" if self.pd_mode() else "aggregated",
            "policy": self.config.pd.policy,
            "decisions": m.pd_counts(m.pd_decisions),
            "fallbacks": m.pd_counts(m.pd_fallbacks),
            "last_fallback": None if f is None else {
                "worker": f.worker, "reason": f.reason, "detail": f.detail,
                "age_s": self.clock() - f.at},
        }

    def describe_worker(self, w: WorkerState) -> dict[str, Any]:
        now = self.clock()
        e = w.events
        return {
            "url": w.spec.url, "role": w.role, "up": w.up, "down_reason": w.down_reason,
            "routing": "load-only" if w.load_only else "cache-aware",
            "alarms": {k: a.message for k, a in w.alarms.items()},
            "in_flight": w.in_flight(), "served": w.served, "failed": w.failed,
            "index_blocks": self.index.worker_blocks(w.name),
            "index_tier_blocks": self.index.tier_blocks(w.name),
            "shared_store": w.description.kv_shared_store if w.description else None,
            "epoch": w.description.epoch if w.description is not None else None,
            "events": {
                "batches": e.batches, "stored_blocks": e.stored_blocks,
                "removed_blocks": e.removed_blocks, "cleared": e.cleared,
                "refused_batches": e.refused, "verified_roots": e.verified_roots,
                "lower_tiers": {"stored": dict(e.tier_stored),
                                "placeholders_mapped": e.placeholders_mapped,
                                "placeholders_ignored": e.placeholders_ignored,
                                "block_size_skipped": e.tier_size_skipped,
                                "unknown_medium": e.unknown_medium},
                "last_event_age_s": None if e.last_event_at is None else now - e.last_event_at,
                "last_heartbeat_age_s": None if e.last_heartbeat_at is None
                else now - e.last_heartbeat_at,
                "subscriber": w.subscriber_stats() if w.subscriber_stats else None,
            },
            "verification": {"predicted_tokens": w.verifier.predicted_tokens,
                             "actual_tokens": w.verifier.actual_tokens,
                             "window": [kind for kind, _ in w.verifier.samples],
                             "predicted_by_tier": dict(w.verifier.predicted_by_tier),
                             "found_by_tier": dict(w.verifier.found_by_tier)},
            "load": {"running": w.load.running, "waiting": w.load.waiting,
                     "kv_usage": w.load.kv_usage, "draining": w.load.draining},
            "pd": {"kv_role": w.kv_role, "caches_prefixes": w.caches_prefixes,
                   "prefill_failures": w.prefill_failures,
                   "kv_bytes_per_token": w.kv_bytes_per_token},
        }
