"""Builders for the event-plane, discovery and shared-index tests (no tests here): real
nats-server and redis-server processes on held 127.0.0.1 ports, a simulated worker publishing
on NATS, and the reference view of a worker's cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from kvloop.core.hashing import resolve_seed
from kvloop.events.config import KVEventsConfig, NatsPlaneConfig
from kvloop.events.nats_publisher import NatsEventPublisher
from kvloop.events.nats_subscriber import NatsEventPlane
from kvloop.events.view import CacheView
from kvloop.router.registry import WorkerDescription
from kvloop.router.services import LocalService, local_nats, local_redis
from kvloop.wire import KVEventsInfo

from .conftest import held_port, wait_until
from .test_events_helpers import SimWorker

NATS_USER, NATS_PASSWORD = "kvloop", "s3cret-nats-pw"


@contextmanager
def nats_server(tmp: Path, user: str | None = NATS_USER, password: str | None = NATS_PASSWORD,
                token: str | None = None) -> Iterator[LocalService]:
    """A nats-server on a port held for the whole block (so it can restart there)."""
    with ExitStack() as stack:
        port = stack.enter_context(held_port()).getsockname()[1]
        srv = local_nats("127.0.0.1", port, tmp / f"nats-{port}.log", user=user,
                         password=password, token=token)
        stack.callback(srv.stop)
        yield srv.start()


@contextmanager
def redis_server(tmp: Path) -> Iterator[LocalService]:
    with ExitStack() as stack:
        port = stack.enter_context(held_port()).getsockname()[1]
        srv = local_redis("127.0.0.1", port, tmp / f"redis-{port}.log")
        stack.callback(srv.stop)
        yield srv.start()


def url_of(srv: LocalService, user: str | None = NATS_USER,
           password: str | None = NATS_PASSWORD) -> str:
    cred = f"{user}:{password}@" if user else ""
    return f"nats://{cred}{srv.host}:{srv.port}"


class NatsSimWorker(SimWorker):
    """`SimWorker` (a real EngineCore on the simulator) publishing on a NATS event plane."""

    def __init__(self, plane: NatsPlaneConfig, recency: bool = False, **kw: object):
        super().__init__(KVEventsConfig(), recency=recency, **kw)   # type: ignore[arg-type]
        self.publisher.shutdown()
        cfg = KVEventsConfig(nats=plane, recency=recency, recency_interval_s=0.1)
        self.publisher = NatsEventPublisher(cfg).start()  # type: ignore[assignment]

    @property
    def worker_id(self) -> int:
        return self.publisher.worker_id   # type: ignore[no-any-return, attr-defined]

    def description(self, block_size: int = 16) -> WorkerDescription:
        """What this worker would answer on /kvloop/worker (its events on NATS)."""
        pub = self.publisher
        cfg = self.engine.config.cache
        return WorkerDescription(
            model="sim", served_model_names=["sim"], role="both", block_size=block_size,
            hash_algo=cfg.prefix_caching_hash_algo,
            hash_seed=resolve_seed(cfg.prefix_caching_hash_algo, cfg.hash_seed),
            enable_prefix_caching=True, num_gpu_blocks=cfg.num_gpu_blocks or 40,
            kv_capacity_blocks=(cfg.num_gpu_blocks or 40) - 1, max_model_len=4096,
            max_num_batched_tokens=256, max_num_seqs=6, epoch=pub.epoch,
            kv_events=KVEventsInfo(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                   topic="", recency=False,
                                   subject=pub.subjects.data,   # type: ignore[attr-defined]
                                   worker_id=self.worker_id,
                                   payload_format=pub.plane.payload_format),  # type: ignore
            version="test", api_key_required=False, api_key_accepted=False)


def snapshot_view(plane: NatsEventPlane, worker_id: int, component: str,
                  timeout: float = 10.0) -> CacheView:
    """A worker's cache as its own mirror says (a fresh snapshot over request/reply)."""
    view = CacheView()
    stream = plane.attach(worker_id, f"ref-{worker_id}", component,
                          on_batch=lambda wb: view.apply(wb.batch), block_size=16)
    try:
        wait_until(lambda: stream.stats.snapshots >= 1, timeout, "a reference snapshot")
        time.sleep(0.05)
        return view
    finally:
        plane.detach(worker_id, stream)
