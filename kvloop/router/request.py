"""One routing request: everything a routing decision reads, built once at the router's edge.

    front (HTTP body, or Envoy ext_proc headers + body)
      -> routing_request(router, path, body, headers, tokens, flow_key)   (this module)
      -> Router.pick(rr)                                                  (kvloop.router.router)

The edge tokenizes the prompt (`kvloop.router.prompts`, after `tokenizer_fetch.
tokenizing_model`) and hands the parsed body, its headers and the tokens here; nothing below
reads the body or the headers again. A migration or a retry derives its request from the
first one (`continued`: other tokens, more exclusions, another output length), so the
adapter, the session, the cache salt and the flow key stay what the client asked for.

What it carries (llm-d's LLMRequest, Dynamo's SchedulingRequest):
- `tokens`, `hashes`: the prompt and the fleet's 64-bit hashes of its full blocks, with the
  LoRA adapter's name and the cache salt in the blocks' extra keys, as the engine hashes them
  (`Router.block_hashes`);
- `adapter`: the LoRA adapter the body's `model` names (None: the base model);
- `session`: the digest of `x-session-id` (else `user`), `kvloop.router.sessions`;
- `expected_output_tokens`: what it will produce (the body's max tokens; 0 for embeddings);
- `exclude`: workers it must not go to (tried already, or the stored response's others);
- `flow_key`: its band and tenant in flow control (`kvloop.router.flow`);
- `migratable`: a stream that may move mid-stream (`kvloop.router.migration.refusal`);
- `disaggregable`, `local_reason`: whether the P/D flow may serve it, and why it cannot take
  a remote prefill (None: it can).

The builder takes plain values (a path, a parsed JSON body, a header mapping with lower-case
names), never a Starlette request, so the ext_proc picker builds the same object.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvloop.front.anthropic import MESSAGES_PATH
from kvloop.front.openai import MaxTokens
from kvloop.router.migration import MIGRATABLE_PATHS, refusal
from kvloop.router.pd import local_reason
from kvloop.router.scorer import RouteRequest
from kvloop.router.sessions import session_key

if TYPE_CHECKING:
    from kvloop.router.flow import FlowKey

# the paths the P/D flow serves (a prefill leg, then a decode leg); others go to one worker
DISAGGREGABLE_PATHS = (*MIGRATABLE_PATHS, MESSAGES_PATH)

Hashes = Callable[[Sequence[int], str | None, str | None], list[int]]   # tokens, salt, adapter


@dataclass(frozen=True)
class RoutingRequest:
    """What a routing decision reads (module docstring); frozen: derive with `continued`."""

    path: str
    tokens: tuple[int, ...]
    hashes: tuple[int, ...]
    block_size: int
    adapter: str | None = None
    cache_salt: str | None = None
    session: int | None = None
    expected_output_tokens: int = 16
    exclude: tuple[str, ...] = ()
    flow_key: FlowKey | None = None
    migratable: bool = False
    disaggregable: bool = False
    local_reason: str | None = None
    hash_blocks: Hashes | None = field(default=None, compare=False, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prefix_key(self) -> int:
        """What identifies the prompt's prefix for rendezvous tie-breaks: its first block's
        hash, else a digest of its first 64 tokens."""
        if self.hashes:
            return self.hashes[0]
        digest = hashlib.blake2b(repr(list(self.tokens[:64])).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    def scoring(self) -> RouteRequest:
        """The policy's view of it (`kvloop.router.scorer`: one cost in prompt tokens)."""
        return RouteRequest(self.prompt_tokens, self.block_size, self.prefix_key,
                            self.expected_output_tokens, self.adapter)

    def continued(self, tokens: Sequence[int] | None = None, exclude: Sequence[str] = (),
                  expected_output_tokens: int | None = None) -> RoutingRequest:
        """The same request, going on elsewhere: with `tokens` (rehashed with the same
        adapter and salt; None: the same prompt), `exclude` added to its exclusions, and
        `expected_output_tokens` (None: the same)."""
        changes: dict[str, Any] = {
            "exclude": self.exclude + tuple(n for n in exclude if n not in self.exclude)}
        if expected_output_tokens is not None:
            changes["expected_output_tokens"] = expected_output_tokens
        if tokens is not None and tuple(tokens) != self.tokens:
            changes["tokens"] = tuple(tokens)
            changes["hashes"] = tuple(self.hash_blocks(tokens, self.cache_salt, self.adapter)
                                      if self.hash_blocks is not None else ())
        return dataclasses.replace(self, **changes)


class Edge(Protocol):
    """What `routing_request` asks of the router (`kvloop.router.router.Router`)."""

    @property
    def block_size(self) -> int: ...

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora_name: str | None = None) -> list[int]: ...

    def adapter_of(self, model: object) -> str | None: ...


def routing_request(router: Edge, path: str, body: Mapping[str, Any],
                    headers: Mapping[str, str], tokens: Sequence[int] | None,
                    flow_key: FlowKey | None = None, exclude: Sequence[str] = (),
                    output_tokens: int | None = None, migration_limit: int = 0
                    ) -> RoutingRequest:
    """The routing request of a body the front has read and validated for `path` (`headers`
    with lower-case names; `tokens`: its prompt, None when it could not be tokenized:
    routed by load). `output_tokens`: what it will produce (None: what the body asks for);
    `migration_limit`: the router's --migration-limit (0: no stream migrates)."""
    adapter = router.adapter_of(body.get("model"))
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) else None
    ids = tuple(tokens or ())
    if output_tokens is None:
        output_tokens = MaxTokens.of_body(path, body).tokens(None)
    stream = bool(body.get("stream"))
    return RoutingRequest(
        path=path, tokens=ids, hashes=tuple(router.block_hashes(ids, salt, adapter)),
        block_size=router.block_size, adapter=adapter, cache_salt=salt,
        session=session_key(headers, body), expected_output_tokens=output_tokens,
        exclude=tuple(exclude), flow_key=flow_key,
        migratable=stream and migration_limit > 0 and refusal(path, dict(body)) is None,
        disaggregable=path in DISAGGREGABLE_PATHS, local_reason=local_reason(body),
        hash_blocks=router.block_hashes)


def tokens_request(router: Edge, tokens: Sequence[int], exclude: Sequence[str] = (),
                   cache_salt: str | None = None, expected_output_tokens: int = 16,
                   session: int | None = None, lora_name: str | None = None,
                   local: str | None = None) -> RoutingRequest:
    """A routing request for bare token ids (no body: benchmarks, tests, `Router.route`)."""
    ids = tuple(tokens)
    return RoutingRequest(
        path="", tokens=ids, hashes=tuple(router.block_hashes(ids, cache_salt, lora_name)),
        block_size=router.block_size, adapter=lora_name, cache_salt=cache_salt,
        session=session, expected_output_tokens=expected_output_tokens,
        exclude=tuple(exclude), disaggregable=True, local_reason=local,
        hash_blocks=router.block_hashes)
