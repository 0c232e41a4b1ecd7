"""Router replicas that agree: in-flight load and provisional entries over the event plane.

Several routers in front of one fleet each see only the requests they sent themselves, plus
what the workers' /metrics said at the last poll. A burst split across them can then pile
onto one worker: each replica lets the holder of a hot prefix take up to `saturation_floor`
requests before it replicates the prefix, so N replicas let it take N times that. Replicas
on a NATS event plane (`--discover` or `--event-plane`) therefore tell each other, on
`namespace.{ns}.kvloop.router-load` (`kvloop.wire.RouterLoad`, signed as every bus message
when the fleet has a secret):

- "open": a request sent to a worker, its prompt's size and uncached part, and the block
  hashes it will cache; a peer opens a ticket for it (counted by its cost model as in-flight
  and, until "first", prefilling) and adds the hashes as provisional entries;
- "first": its first token came (no longer prefilling);
- "close": it ended; the peer drops its ticket (never counted as served or failed).

A peer ticket not closed within `LivenessConfig.request_timeout_s` (its replica died) is
dropped by the liveness check. A replica ignores its own messages and bounds what one peer
may hold open (`MAX_PEER_TICKETS`) and the hashes one message may carry.

Owner: `ReplicaSync` owns the peer tickets; it changes the registry and the index only
through their own methods. Messages arrive on the plane's thread; the router's own tickets
are published from whichever thread opens or closes them.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import TYPE_CHECKING

import msgspec

from kvloop.events.nats_plane import router_load_subject
from kvloop.router.registry import Ticket
from kvloop.wire import RouterLoad

if TYPE_CHECKING:
    from kvloop.events.nats_subscriber import NatsEventPlane
    from kvloop.router.router import Router

log = logging.getLogger("kvloop.router")

MAX_PEER_TICKETS = 100_000      # open tickets one router keeps for all its peers
MAX_HASHES = 65_536             # block hashes one "open" may carry (a 1M-token prompt)
_DECODER = msgspec.json.Decoder(RouterLoad)


class ReplicaSync:
    """Publishes this router's tickets and applies its peers' (module docstring)."""

    def __init__(self, router: Router, plane: NatsEventPlane, namespace: str):
        self.router = router
        self.plane = plane
        self.subject = router_load_subject(namespace)
        self.replica = uuid.uuid4().hex
        self._peer: dict[tuple[str, int], Ticket] = {}
        self._lock = threading.Lock()
        self.received = self.refused = self.applied = 0   # messages; peer opens applied

    def start(self) -> ReplicaSync:
        self.plane.subscribe(self.subject, self._on_message)
        self.router.replicas = self
        self.router.watchers.append(lambda router: self.expire())
        return self

    # --- this router's tickets ------------------------------------------------------------
    def opened(self, t: Ticket, hashes: list[int]) -> None:
        self._publish(RouterLoad(replica=self.replica, ticket=t.request_id, op="open",
                                 worker=t.worker, prompt_tokens=t.prompt_tokens,
                                 uncached_tokens=t.uncached_tokens, hashes=hashes))

    def first(self, t: Ticket) -> None:
        self._publish(RouterLoad(replica=self.replica, ticket=t.request_id, op="first"))

    def closed(self, t: Ticket) -> None:
        self._publish(RouterLoad(replica=self.replica, ticket=t.request_id, op="close"))

    def _publish(self, msg: RouterLoad) -> None:
        self.plane.publish(self.subject, msgspec.json.encode(msg))

    # --- the peers' ----------------------------------------------------------------------
    def _on_message(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        try:
            msg = _DECODER.decode(payload)
        except msgspec.DecodeError:
            self.refused += 1
            return
        if msg.replica == self.replica:
            return
        self.received += 1
        key = (msg.replica, msg.ticket)
        if msg.op == "open":
            self._open(key, msg)
        elif msg.op == "first":
            t = self._peer.get(key)
            if t is not None:
                self.router.registry.first_token(t)
        elif msg.op == "close":
            with self._lock:
                t = self._peer.pop(key, None)
            if t is not None:
                self.router.registry.drop_ticket(t)

    def _open(self, key: tuple[str, int], msg: RouterLoad) -> None:
        w = self.router.registry.get(msg.worker)
        if w is None or len(msg.hashes) > MAX_HASHES or msg.prompt_tokens < 0 \
                or not 0 <= msg.uncached_tokens <= msg.prompt_tokens:
            self.refused += 1
            return
        with self._lock:
            if key in self._peer or len(self._peer) >= MAX_PEER_TICKETS:
                self.refused += 1
                return
            self._peer[key] = self.router.registry.open_ticket(
                w.name, msg.prompt_tokens, msg.uncached_tokens, 0, expects_event=False,
                verify=False)
            self.applied += 1
        if msg.hashes and w.caches_prefixes:
            self.router.index.add_provisional(w.name, msg.hashes)

    def expire(self) -> None:
        """Drop peer tickets older than the request timeout (their replica died)."""
        now = self.router.clock()
        limit = self.router.config.liveness.request_timeout_s
        with self._lock:
            old = [k for k, t in self._peer.items() if now - t.sent_at > limit]
            dropped = [self._peer.pop(k) for k in old]
        for t in dropped:
            self.router.registry.drop_ticket(t)
        if dropped:
            log.warning("replicas: %d requests of other routers were never closed; dropped",
                        len(dropped))

    def describe(self) -> dict[str, int]:
        with self._lock:
            return {"peer_in_flight": len(self._peer), "received": self.received,
                    "applied": self.applied, "refused": self.refused}
