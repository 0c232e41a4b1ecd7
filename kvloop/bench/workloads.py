"""Workloads for `kvloop bench`: lists of sessions, deterministic for a seed.

A *session* is what one client does: one or more turns sent one after the other. Every
workload is a list of sessions, so the driver has one code path:

    random         one turn each: random input and output lengths
    shared-prefix  one turn each: one of N long shared prefixes + a unique suffix
    multi-turn     T turns each: turn k resends the whole conversation so far (every earlier
                   user turn and every earlier answer) followed by the new user tokens
    trace          one turn each, with arrival times and lengths replayed from a JSONL file

Prompts are token ids drawn uniformly from `token_range` (low tokens, where tokenizers keep
their special tokens, are avoided by default). Everything here is pure and seeded: the same
arguments give the same sessions, token for token. Non-goal: natural-language prompts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT_TOKEN_RANGE = (1000, 30000)
LENGTH_DISTS = ("fixed", "uniform", "normal", "exponential")
WORKLOADS = ("random", "shared-prefix", "multi-turn", "trace")


@dataclass(frozen=True)
class Turn:
    """One request of a session: the user tokens it appends and how many tokens to ask for."""

    new_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """A client's sequence of turns. `arrival_s` (open loop, trace): start offset in seconds."""

    session_id: int
    turns: tuple[Turn, ...]
    arrival_s: float | None = None
    group: int | None = None


@dataclass(frozen=True)
class Workload:
    """A named list of sessions and the parameters that made it (for reports)."""

    name: str
    sessions: tuple[Session, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _check_token_range(token_range: tuple[int, int]) -> None:
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ValueError(f"token range must satisfy 0 <= low < high, got {token_range}")


def random_tokens(rng: random.Random, n: int,
                  token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> tuple[int, ...]:
    """`n` token ids uniform in [low, high)."""
    lo, hi = token_range
    return tuple(rng.randrange(lo, hi) for _ in range(n))


def sample_length(rng: random.Random, mean: int, dist: str = "fixed",
                  spread: float = 0.0) -> int:
    """One length >= 1 around `mean`.

    fixed: `mean`; uniform: in [mean(1-spread), mean(1+spread)]; normal: sd = spread*mean;
    exponential: mean `mean` (spread unused).
    """
    if mean < 1:
        raise ValueError(f"a length must be >= 1, got {mean}")
    if dist not in LENGTH_DISTS:
        raise ValueError(f"length distribution must be one of {LENGTH_DISTS}, got {dist!r}")
    if spread < 0:
        raise ValueError(f"spread must be >= 0, got {spread}")
    if dist == "fixed":
        return mean
    if dist == "uniform":
        lo = max(1, round(mean * (1 - spread)))
        return rng.randint(lo, max(lo, round(mean * (1 + spread))))
    if dist == "normal":
        return max(1, round(rng.gauss(mean, spread * mean)))
    return max(1, round(rng.expovariate(1.0 / mean)))


def _single(i: int, tokens: tuple[int, ...], max_tokens: int, group: int | None = None,
            arrival_s: float | None = None) -> Session:
    return Session(i, (Turn(tokens, max_tokens),), arrival_s, group)


def random_workload(num_requests: int, input_len: int, output_len: int, seed: int = 0,
                    dist: str = "fixed", spread: float = 0.0,
                    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> Workload:
    """Independent single-turn requests with random prompts."""
    _check_count(num_requests)
    _check_token_range(token_range)
    rng = random.Random(f"random:{seed}")
    sessions = []
    for i in range(num_requests):
        n_in = sample_length(rng, input_len, dist, spread)
        n_out = sample_length(rng, output_len, dist, spread)
        sessions.append(_single(i, random_tokens(rng, n_in, token_range), n_out))
    return Workload("random", tuple(sessions), dict(
        num_requests=num_requests, input_len=input_len, output_len=output_len, seed=seed,
        dist=dist, spread=spread))


def shared_prefix_workload(num_groups: int, prefix_len: int, suffix_len: int, output_len: int,
                           num_requests: int, seed: int = 0,
                           token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> Workload:
    """`num_requests` prompts: group `g`'s prefix followed by a unique suffix.

    Groups are dealt round-robin, then the order is shuffled (seeded), so groups interleave.
    """
    _check_count(num_requests)
    _check_count(num_groups)
    _check_token_range(token_range)
    if prefix_len < 1 or suffix_len < 0:
        raise ValueError("prefix_len must be >= 1 and suffix_len >= 0")
    rng = random.Random(f"shared-prefix:{seed}")
    prefixes = [random_tokens(rng, prefix_len, token_range) for _ in range(num_groups)]
    groups = [i % num_groups for i in range(num_requests)]
    rng.shuffle(groups)
    sessions = [_single(i, prefixes[g] + random_tokens(rng, suffix_len, token_range),
                        output_len, group=g) for i, g in enumerate(groups)]
    return Workload("shared-prefix", tuple(sessions), dict(
        num_groups=num_groups, prefix_len=prefix_len, suffix_len=suffix_len,
        output_len=output_len, num_requests=num_requests, seed=seed))


def multi_turn_workload(num_conversations: int, num_turns: int, first_len: int, turn_len: int,
                        output_len: int, seed: int = 0,
                        token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> Workload:
    """Conversations of `num_turns` turns: `first_len` user tokens, then `turn_len` per turn.

    Only the user tokens are fixed here; the driver builds each prompt from the conversation so
    far (user tokens and the answers the server returned).
    """
    _check_count(num_conversations)
    _check_count(num_turns)
    _check_token_range(token_range)
    rng = random.Random(f"multi-turn:{seed}")
    sessions = []
    for i in range(num_conversations):
        turns = tuple(Turn(random_tokens(rng, first_len if k == 0 else turn_len, token_range),
                           output_len) for k in range(num_turns))
        sessions.append(Session(i, turns))
    return Workload("multi-turn", tuple(sessions), dict(
        num_conversations=num_conversations, num_turns=num_turns, first_len=first_len,
        turn_len=turn_len, output_len=output_len, seed=seed))


# --- trace replay ---------------------------------------------------------------------------

def _pick(obj: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in obj:
            return obj[k]
    return None


def _trace_time(obj: dict[str, Any], lineno: int) -> float:
    if "time_s" in obj:
        return float(obj["time_s"])
    if "timestamp" in obj:  # Mooncake-style traces: milliseconds
        return float(obj["timestamp"]) / 1000.0
    raise ValueError(f"trace line {lineno}: needs 'time_s' (seconds) or 'timestamp' (ms)")


def _block_tokens(seed: int, hash_id: int, n: int,
                  token_range: tuple[int, int]) -> tuple[int, ...]:
    return random_tokens(random.Random(f"trace-block:{seed}:{hash_id}"), n, token_range)


def _trace_prompt(obj: dict[str, Any], lineno: int, rng: random.Random, seed: int,
                  block_tokens: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    """Prompt of one trace line: explicit ids, or blocks keyed by `hash_ids`, or random."""
    if "prompt_token_ids" in obj:
        return tuple(int(t) for t in obj["prompt_token_ids"])
    n = _pick(obj, "input_len", "input_length")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"trace line {lineno}: needs 'input_len' >= 1 or 'prompt_token_ids'")
    hash_ids = obj.get("hash_ids") or []
    tokens: list[int] = []
    for h in hash_ids:
        if len(tokens) >= n:
            break
        tokens.extend(_block_tokens(seed, int(h), min(block_tokens, n - len(tokens)),
                                    token_range))
    tokens.extend(random_tokens(rng, n - len(tokens), token_range))
    return tuple(tokens)


def parse_trace_line(obj: dict[str, Any], lineno: int, rng: random.Random, seed: int,
                     block_tokens: int, token_range: tuple[int, int]) -> tuple[float, Turn]:
    """(arrival time in seconds, the turn) of one JSONL record."""
    n_out = _pick(obj, "output_len", "output_length", "max_tokens")
    if not isinstance(n_out, int) or n_out < 1:
        raise ValueError(f"trace line {lineno}: needs 'output_len' >= 1")
    prompt = _trace_prompt(obj, lineno, rng, seed, block_tokens, token_range)
    return _trace_time(obj, lineno), Turn(prompt, n_out)


def trace_workload(lines: Iterable[str], seed: int = 0, block_tokens: int = 512,
                   speedup: float = 1.0, max_requests: int | None = None,
                   token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> Workload:
    """Replay a JSONL trace: one request per line, arrivals relative to the first line.

    Each line: `time_s` (seconds) or `timestamp` (milliseconds); `input_len` (or
    `input_length`) and `output_len` (or `output_length`); optionally `hash_ids`, a list of
    block ids: lines sharing a block id share those `block_tokens` tokens (Mooncake's
    convention), or `prompt_token_ids` verbatim. Times are divided by `speedup`.
    """
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    _check_token_range(token_range)
    rng = random.Random(f"trace:{seed}")
    parsed: list[tuple[float, Turn]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if max_requests is not None and len(parsed) >= max_requests:
            break
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"trace line {lineno}: not JSON ({e})") from None
        parsed.append(parse_trace_line(obj, lineno, rng, seed, block_tokens, token_range))
    if not parsed:
        raise ValueError("the trace has no requests")
    t0 = min(t for t, _ in parsed)
    sessions = tuple(Session(i, (turn,), (t - t0) / speedup) for i, (t, turn) in
                     enumerate(parsed))
    return Workload("trace", sessions, dict(num_requests=len(sessions), seed=seed,
                                            speedup=speedup, block_tokens=block_tokens))


def load_trace_workload(path: str, **kwargs: Any) -> Workload:
    with open(path, encoding="utf-8") as f:
        return trace_workload(f, **kwargs)


# --- arrivals -------------------------------------------------------------------------------

def with_poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """Sessions start as a Poisson process of `rate` sessions per second (first at t=0)."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a positive finite number, got {rate}")
    rng = random.Random(f"poisson:{seed}")
    t = 0.0
    sessions = []
    for s in workload.sessions:
        sessions.append(replace(s, arrival_s=t))
        t += rng.expovariate(rate)
    return replace(workload, sessions=tuple(sessions),
                   params={**workload.params, "rate": rate})


def warmup_workload(workload: Workload, num_requests: int, seed: int = 0,
                    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> Workload:
    """Requests shaped like the workload's first turn, with fresh tokens (so they warm the
    server without seeding its prefix cache with the measured prompts)."""
    first = workload.sessions[0].turns[0]
    return random_workload(num_requests, len(first.new_token_ids), first.max_tokens,
                           seed=seed + 7919, token_range=token_range)


def _check_count(n: int) -> None:
    if n < 1:
        raise ValueError(f"counts must be >= 1, got {n}")
