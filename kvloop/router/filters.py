"""Filters: which workers may take a request, as a list of functions over (workers, request).

A profile (`kvloop.router.router`: aggregated, decode, prefill) runs its filters in order
over the registry's workers, then scores what is left (llm-d's filter plugins):

    usable          up and not draining
    role(*roles)    serving one of `roles`
    not_excluded    not one of the request's exclusions (tried already, or pinned away)
    adapter_holders the workers that have the request's LoRA adapter loaded, if any has
                    (else all: they answer for themselves, a 404)
    prefill_capable may take a prefill leg: its connector holds blocks for a decode worker
                    and no `prefill_failing` alarm benches it
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvloop.config import KV_HOLDS
from kvloop.router.registry import PREFILL_FAILING, WorkerState
from kvloop.router.request import RoutingRequest

Filter = Callable[[list[WorkerState], RoutingRequest], list[WorkerState]]


def usable(workers: list[WorkerState], rr: RoutingRequest) -> list[WorkerState]:
    return [w for w in workers if w.up and not w.load.draining]


def role(*roles: str) -> Filter:
    def serving(workers: list[WorkerState], rr: RoutingRequest) -> list[WorkerState]:
        return [w for w in workers if w.role in roles]
    serving.__name__ = f"role({', '.join(roles)})"
    return serving


def not_excluded(workers: list[WorkerState], rr: RoutingRequest) -> list[WorkerState]:
    if not rr.exclude:
        return workers
    return [w for w in workers if w.name not in rr.exclude]


def adapter_holders(workers: list[WorkerState], rr: RoutingRequest) -> list[WorkerState]:
    if rr.adapter is None:
        return workers
    holders = [w for w in workers
               if w.description is not None and rr.adapter in w.description.lora_adapters]
    return holders or workers


def prefill_capable(workers: list[WorkerState], rr: RoutingRequest) -> list[WorkerState]:
    return [w for w in workers if PREFILL_FAILING not in w.alarms and w.kv_role in KV_HOLDS]


def run(filters: Sequence[Filter], workers: list[WorkerState], rr: RoutingRequest
        ) -> list[WorkerState]:
    """`workers` through every filter in order (an empty list stops early)."""
    for f in filters:
        if not workers:
            break
        workers = f(workers, rr)
    return workers
