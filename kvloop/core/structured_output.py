"""Structured output in the engine: grammars compiled off the loop, the step's bitmask, the
grammar's advance after sampling (vLLM's `StructuredOutputManager`).

Owner: the engine's `StructuredOutputManager` owns the compile pool, the cache of compiled
grammars and each request's `StructuredOutputRequest` (its grammar state). The scheduler
asks whether a grammar is ready, failed or terminated and advances it with the tokens it
appends; it alone changes `Request.status`.

The life of a constrained request:

1. `grammar_init` (from `EngineCore.add_request`): its grammar, keyed by
   `StructuredOutputsParams.key` (kind, spec, whitespace), is taken from the cache or its
   compile is submitted to the `CompileQueue` (`kvloop.core.compile_queue`: smallest spec
   first, max(1, (cpus + 1) // 2) compiles at once as vLLM's pool, a slow compile yields its
   slot, a time limit); the scheduler queues the request as
   WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.
2. `schedule()` skips it while its grammar compiles (the requests behind it are admitted
   meanwhile), makes it WAITING once compiled (then it is admitted like any request), and
   finishes it with an error output if the compile failed or timed out. A request that
   finishes (aborted: its client left) `release`s its compile, which is dropped if it has
   not started and nobody else waits for it.
3. A step in which it samples gives it one bitmask row per sampled position (1 + its drafts,
   which the scheduler has cut to the longest prefix the grammar accepts, `valid_prefix`),
   filled by `grammar_bitmask` on the engine thread while the forward pass runs.
4. After sampling, the scheduler feeds each new token to its grammar; a token the grammar
   refuses ends the request with an error; a terminated grammar ends it ("stop").

The grammar engine is a `GrammarBackend` (xgrammar's: `kvloop.structured`); this module
imports none, and builds the backend lazily (in a pool thread) on the first compile.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError
from typing import Any, Protocol

from kvloop.core.compile_queue import CompileJob, CompileLimits, CompileQueue
from kvloop.core.outputs import GrammarOutput, SchedulerOutput
from kvloop.core.request import Request, StructuredOutputsParams

logger = logging.getLogger("kvloop.engine")

DEFAULT_GRAMMAR_CACHE_SIZE = 256   # compiled grammars kept (least recently used dropped)
GRAMMAR_REJECTED = "structured output: the grammar refused the sampled token {token}"


def default_num_workers() -> int:
    """vLLM's compile pool size: max(1, (cpus + 1) // 2)."""
    return max(1, ((os.cpu_count() or 1) + 1) // 2)


class Grammar(Protocol):
    """One request's grammar state (xgrammar's `GrammarMatcher` is one as it is)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar refuses it."""
        ...

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> bool:
        """Write the tokens allowed next into row `index` of `bitmask` (state unchanged)."""
        ...

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token (nothing may follow)."""
        ...


class GrammarBackend(Protocol):
    """A grammar engine over one vocabulary."""

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compile `params`' constraint (slow; called from pool threads). ValueError with a
        message naming the problem for an invalid schema, regex or grammar."""
        ...

    def matcher(self, compiled: Any) -> Grammar:
        """A fresh grammar state at the start of `compiled` (cheap)."""
        ...

    def allocate_bitmask(self, num_rows: int) -> Any:
        """An int32 NumPy array `[num_rows, ceil(vocab_size / 32)]`."""
        ...


class StructuredOutputRequest:
    """A request's grammar: compiling, failed (`error`) or ready (`grammar`).

    Created by the manager; `poll()` (engine thread) turns a finished compile into the
    request's own grammar state; `release()` says the request no longer waits for it.
    """

    def __init__(self, params: StructuredOutputsParams, job: CompileJob,
                 new_matcher: Callable[[Any], Grammar],
                 release: Callable[[CompileJob], None]):
        self.params = params
        self._job: CompileJob | None = job
        self._new_matcher = new_matcher
        self._release = release
        self.grammar: Grammar | None = None
        self.error: str | None = None

    def poll(self) -> bool:
        """True once the grammar is ready; sets `error` (and stays False) when the compile
        failed or timed out."""
        if self.grammar is not None:
            return True
        job = self._job
        if self.error is not None or job is None or not job.future.done():
            return False
        self._job = None
        exc = compile_exception(job)
        if exc is not None:
            self.error = compile_error_message(exc)
            return False
        self.grammar = self._new_matcher(job.future.result())
        return True

    def release(self) -> None:
        """The request finished: it no longer waits for its compile. Idempotent."""
        job, self._job = self._job, None
        if job is not None:
            self._release(job)

    def accept_token(self, token_id: int) -> bool:
        assert self.grammar is not None, "a request samples only once its grammar is ready"
        return self.grammar.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.grammar is not None and self.grammar.is_terminated()

    def valid_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts from its state (left as is)."""
        if self.grammar is None:
            return []
        accepted = 0
        for tok in tokens:
            if self.grammar.is_terminated() or not self.grammar.accept_token(tok):
                break
            accepted += 1
        if accepted:
            self.grammar.rollback(accepted)
        return list(tokens[:accepted])


def compile_exception(job: CompileJob) -> BaseException | None:
    """A finished compile's exception (a cancelled one's too), None when it succeeded."""
    try:
        return job.future.exception()
    except CancelledError as e:
        return e


def compile_error_message(exc: BaseException) -> str:
    """What a failed compile tells the client: the backend's message for an invalid spec
    (ValueError), the exception's type and text otherwise."""
    if isinstance(exc, ValueError):
        return str(exc)
    return f"structured output: the grammar could not be compiled ({type(exc).__name__}: {exc})"


class StructuredOutputManager:
    """Compiles grammars in a thread pool, caches them, fills the step's bitmask.

    `backend_factory` builds the `GrammarBackend` (once, on the first compile, in a compile
    thread: importing a grammar engine takes a second). `limits`: how compiles share the
    CPU (default: `num_workers`, else `default_num_workers()`, at once, and
    `kvloop.core.compile_queue`'s times).
    """

    def __init__(self, backend_factory: Callable[[], GrammarBackend],
                 num_workers: int | None = None,
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE,
                 limits: CompileLimits | None = None):
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.compiles = CompileQueue(
            limits or CompileLimits(num_workers or default_num_workers()))
        self._cache: OrderedDict[tuple[Any, ...], CompileJob] = OrderedDict()
        self._cache_size = cache_size
        self._bitmask: Any = None      # reused buffer, grown as needed
        self._bitmask_rows = 0

    # --- compiling ------------------------------------------------------------------------
    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (thread-safe)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def grammar_init(self, request: Request) -> None:
        """Attach the request's `StructuredOutputRequest`, its compile submitted (or found in
        the cache). Mutates only `request.structured_output_request`."""
        params = request.sampling_params.structured_outputs
        assert params is not None, "grammar_init is for constrained requests"
        request.structured_output_request = StructuredOutputRequest(
            params, self._compiled(params, request.tenant), self._matcher, self.compiles.release)

    def _compiled(self, params: StructuredOutputsParams,
                  tenant: str | None = None) -> CompileJob:
        """The compile of `params`, one more waiter counted: the cached one unless it
        failed (or was dropped), else a new one, for `tenant` (compile_queue's share)."""
        key = params.key
        job = self._cache.get(key)
        if job is not None and not (job.future.done() and compile_exception(job) is not None):
            self._cache.move_to_end(key)
            self.compiles.retain(job)
            return job
        job = self.compiles.submit(params.compile_cost,
                                   functools.partial(self._compile, params), tenant)
        self._cache[key] = job
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return job

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self.backend.compile(params)

    def _matcher(self, compiled: Any) -> Grammar:
        return self.backend.matcher(compiled)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile `params` now (waiting for it, into the cache): ValueError naming the
        problem when it is invalid. For callers that can wait (the offline `LLM`)."""
        job = self._compiled(params)
        exc = compile_exception(job)   # waits for the compile
        self.compiles.release(job)
        if exc is not None:
            raise ValueError(compile_error_message(exc)) from None

    # --- the step's bitmask ---------------------------------------------------------------
    def grammar_bitmask(self, requests: Mapping[str, Request],
                        scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """Rows for every constrained request that samples this step, in scheduling order:
        1 + its drafts each (row i: the tokens allowed after its first i drafts). None when
        no such request. Grammar states are left as found (drafts are rolled back)."""
        so = scheduler_output
        ids = [rid for rid in so.num_scheduled_tokens if rid in so.sampling_req_ids
               and (r := requests.get(rid)) is not None and r.structured_output_request]
        if not ids:
            return None
        drafts = [so.scheduled_spec_decode_tokens.get(rid, []) for rid in ids]
        num_rows = [1 + len(d) for d in drafts]
        bitmask = self._buffer(sum(num_rows))
        first = 0
        for rid, req_drafts in zip(ids, drafts, strict=True):
            so_req = requests[rid].structured_output_request
            assert isinstance(so_req, StructuredOutputRequest) and so_req.grammar is not None
            fill_rows(so_req.grammar, req_drafts, bitmask, first)
            first += 1 + len(req_drafts)
        return GrammarOutput(ids, num_rows, bitmask[:first])

    def _buffer(self, num_rows: int) -> Any:
        if num_rows > self._bitmask_rows:
            self._bitmask_rows = max(num_rows, 2 * self._bitmask_rows, 16)
            self._bitmask = self.backend.allocate_bitmask(self._bitmask_rows)
        return self._bitmask

    def shutdown(self) -> None:
        self.compiles.shutdown()


def fill_rows(grammar: Grammar, drafts: Sequence[int], bitmask: Any, first: int) -> None:
    """Rows `first .. first + len(drafts)` of `bitmask`: the tokens allowed at each draft
    position and after the last one, found by accepting the drafts one by one and rolling
    back. A draft the grammar refuses stops the advance (the rows after it repeat the mask
    of the last valid state; the rejection sampler never reaches them)."""
    advanced = 0
    for i in range(len(drafts) + 1):
        grammar.fill_next_token_bitmask(bitmask, first + i)
        if (i < len(drafts) and advanced == i and not grammar.is_terminated()
                and grammar.accept_token(drafts[i])):
            advanced += 1
    if advanced:
        grammar.rollback(advanced)
