"""Builders for the KV-event tests (no tests here): a simulated worker whose real EngineCore
publishes its step batches, a subscriber with a CacheView, and a relay that loses,
duplicates, reorders or corrupts frames between them."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import zmq

from kvloop.config import CacheConfig, EngineConfig, SchedulerConfig
from kvloop.core.engine import EngineCore
from kvloop.core.request import SamplingParams
from kvloop.events.config import KVEventsConfig
from kvloop.events.protocol import HEARTBEAT_TOPIC
from kvloop.events.publisher import ZmqEventPublisher
from kvloop.events.subscriber import KVEventSubscriber, WorkerBatch
from kvloop.events.types import event_int
from kvloop.events.view import CacheView
from kvloop.events.wakeup import WakeupPipe
from kvloop.sim.runner import SimRunner

from .conftest import wait_until

Frames = list[bytes]


class SimWorker:
    """A real EngineCore (SimRunner, small pool so blocks get evicted) and its publisher."""

    def __init__(self, events: KVEventsConfig, num_gpu_blocks: int = 40, seed: int = 0,
                 recency: bool = False):
        cfg = EngineConfig(
            cache=CacheConfig(num_gpu_blocks=num_gpu_blocks, enable_kv_cache_events=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=6),
            check_invariants=True)
        self.engine = EngineCore(cfg, SimRunner())
        self.engine.block_pool.track_touches = recency
        self.publisher = ZmqEventPublisher(events).start()
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(20000) for _ in range(32)] for _ in range(3)]
        self.published = 0
        self._n = 0

    @property
    def endpoint(self) -> str:
        assert self.publisher.endpoint is not None
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def step(self) -> None:
        result = self.engine.step()
        if result.events is not None:
            self.publisher.publish(result.events)
            self.published += 1
        touched = self.engine.block_pool.take_touched_hashes()
        if touched:
            self.publisher.publish_touches(touched)

    def run(self, num_requests: int, min_batches: int = 0) -> None:
        """Admit requests (shared prefixes, so there are hits and duplicate stores) and step
        until all finish, then wait until the publisher thread has sent every batch."""
        start = self.published
        while True:
            for _ in range(num_requests):
                self._add_request()
                for _ in range(self.rng.randrange(3)):
                    self.step()
            while self.engine.has_unfinished_requests():
                self.step()
            if self.published - start >= min_batches:
                break
        wait_until(lambda: self.publisher.stats.published == self.published, 5, "publishing")

    def _add_request(self) -> None:
        rng = self.rng
        prompt = rng.choice(self.prefixes)[:rng.choice((16, 32))] + \
            [rng.randrange(20000) for _ in range(rng.randrange(1, 40))]
        self._n += 1
        req = self.engine.make_request(f"r{self._n}", prompt,
                                       SamplingParams(max_tokens=rng.randrange(1, 24)))
        self.engine.add_request(req)

    def cached(self) -> set[int]:
        """The block pool's actual content, as the event integers."""
        return {event_int(h) for h in self.engine.block_pool.cached_hashes()}

    def physical(self) -> dict[int, int]:
        """Event integer -> number of physical blocks holding it."""
        pool = self.engine.block_pool
        return {event_int(h): len(pool.cached_block_hash_to_block.blocks_of(h))
                for h in pool.cached_hashes()}

    def shutdown(self) -> None:
        self.publisher.shutdown()


class ViewSubscriber:
    """A KVEventSubscriber feeding a CacheView (resets clear it, as AllBlocksCleared)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "", **kw):
        self.view = CacheView()
        self.deliveries: list[WorkerBatch] = []
        self.sub = KVEventSubscriber(endpoint, replay_endpoint, topic, self._on_batch,
                                     probe_interval_s=kw.pop("probe_interval_s", 0.1),
                                     request_timeout_s=kw.pop("request_timeout_s", 1.0), **kw)
        self.sub.start()

    def _on_batch(self, wb: WorkerBatch) -> None:
        self.deliveries.append(wb)
        self.view.apply(wb.batch)

    def wait_equal(self, worker: SimWorker, timeout: float = 5.0) -> None:
        """Until the view equals the worker's block pool and every batch was delivered."""
        last = worker.publisher.next_seq - 1

        def done() -> bool:
            st = self.sub.stats
            seq_ok = last < 0 or (st.last_seq is not None and st.last_seq >= last)
            return seq_ok and self.view.hashes() == worker.cached()

        wait_until(done, timeout, "subscriber view == block pool")
        view = self.view
        assert {h: view.copies(h) for h in view.hashes()} == worker.physical()

    def stop(self) -> None:
        self.sub.stop()


class Relay:
    """SUB from a publisher -> `transform` -> PUB to subscribers, on its own thread.

    `transform(frames)` returns the messages to forward (none, one, several).
    """

    def __init__(self, upstream: str, transform: Callable[[Frames], list[Frames]],
                 topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.SUBSCRIBE, HEARTBEAT_TOPIC)
        self.sub.connect(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.transform = transform
        self.heartbeats = 0
        self._stop = threading.Event()
        self._stop_pipe = WakeupPipe()   # close() wakes the thread's poll
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self._stop_pipe.fd, zmq.POLLIN)
        while not self._stop.is_set():
            if self.sub not in dict(poller.poll(1000)):
                continue
            frames = self.sub.recv_multipart()
            if frames[0] == HEARTBEAT_TOPIC:
                self.heartbeats += 1
            for msg in self.transform(frames):
                self.pub.send_multipart(msg)

    def send(self, frames: Frames) -> None:
        """Inject a message (from the test thread; the PUB is only used under the GIL)."""
        self.pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._stop_pipe.wake()
        self._thread.join(2)
        self._stop_pipe.close()
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


def seq_of(frames: Frames) -> int | None:
    """The sequence number of a data message (None for heartbeats and the like)."""
    if frames[0] == HEARTBEAT_TOPIC or len(frames) != 3:
        return None
    return int.from_bytes(frames[1], "big")
