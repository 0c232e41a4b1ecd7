"""The NATS event plane with a real nats-server: publishers on Dynamo's subjects, consumers
that stay whole across late joins, gaps and a server restart, both payload formats, and
credentials that never reach a log."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvloop.events.config import NatsPlaneConfig, redact_url
from kvloop.events.nats_plane import (
    H_SEQ,
    H_WORKER,
    RouterEvent,
    Subjects,
    dynamo_tokens_hash,
    subject_matches,
    worker_id_of,
)
from kvloop.events.nats_subscriber import NatsEventPlane
from kvloop.events.view import CacheView
from kvloop.router.bus import RouterBus
from kvloop.router.config import BusConfig, LivenessConfig, RouterConfig
from kvloop.router.registry import WorkerSpec
from kvloop.router.router import Router
from kvloop.router.subscription import kv_event_subscription

from .bus_helpers import NATS_PASSWORD, NatsSimWorker, nats_server, snapshot_view, url_of
from .conftest import wait_until

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def nats(tmp_path_factory):
    with nats_server(tmp_path_factory.mktemp("nats")) as srv:
        yield srv


def plane_cfg(srv, **kw) -> NatsPlaneConfig:
    return NatsPlaneConfig(url_of(srv), **kw)


def test_subjects_and_wildcards():
    s = Subjects("dynamo", "prefill")
    assert s.data == "namespace.dynamo.component.prefill.kv-events"
    assert s.query(7) == "namespace.dynamo.component.prefill.kvloop.query.7"
    assert subject_matches("namespace.dynamo.component.*.kv-events", s.data)
    assert not subject_matches("namespace.dynamo.component.backend.kv-events", s.data)
    assert subject_matches("namespace.dynamo.>", s.heartbeat)
    assert not subject_matches("namespace.dynamo.>", "namespace.dynamo")
    assert worker_id_of("e1") == worker_id_of("e1") != worker_id_of("e2")
    assert redact_url("nats://u:pw@h:4222") == "nats://***@h:4222"
    assert "pw" not in repr(NatsPlaneConfig("nats://u:pw@h:4222", token="tok"))
    with pytest.raises(ValueError, match="one NATS subject token"):
        NatsPlaneConfig("nats://h:1", component="back.end")
    with pytest.raises(ValueError, match="nats://HOST:PORT"):
        NatsPlaneConfig("http://u:pw@h:1")


def test_a_late_joiner_gets_a_snapshot_then_the_live_stream(nats):
    worker = NatsSimWorker(plane_cfg(nats, component="prefill"), seed=1)
    plane = NatsEventPlane(plane_cfg(nats, component="*")).start()
    try:
        worker.run(20)
        view = CacheView()
        sources = []
        plane.attach(worker.worker_id, "w", "prefill",
                     lambda wb: (sources.append(wb.source), view.apply(wb.batch)),
                     block_size=16)
        wait_until(lambda: "snapshot" in sources, 10, "the join snapshot")
        worker.run(20, min_batches=5)
        wait_until(lambda: view.hashes() == worker.cached(), 10, "the view to equal the cache")
        assert sources[0] == "reset" and "live" in sources
    finally:
        plane.stop()
        worker.shutdown()


def test_dynamo_payload_is_routerevent_json(nats):
    """--event-plane-format dynamo: one RouterEvent per event, event ids consecutive from 0,
    tokens_hash as Dynamo computes it; a consumer in that format rebuilds the cache."""
    cfg = plane_cfg(nats, component="backend", payload_format="dynamo")
    plane = NatsEventPlane(plane_cfg(nats, component="*", payload_format="dynamo")).start()
    raw: list[tuple[dict, bytes]] = []
    plane.subscribe(Subjects.of(cfg).data, lambda s, data, h: raw.append((h, data)))
    worker = NatsSimWorker(cfg, seed=2)
    try:
        view = CacheView()
        stream = plane.attach(worker.worker_id, "w", "backend",
                              lambda wb: view.apply(wb.batch), block_size=16)
        wait_until(lambda: stream.stats.snapshots == 1, 10, "the join snapshot")
        worker.run(15)
        wait_until(lambda: view.hashes() == worker.cached(), 10, "the view to equal the cache")
        events = [msgspec.json.decode(data, type=RouterEvent) for _, data in raw]
        assert [e.event.event_id for e in events] == list(range(len(events)))
        assert {e.worker_id for e in events} == {worker.worker_id}
        assert {int(h[H_WORKER]) for h, _ in raw} == {worker.worker_id}
        assert [int(h[H_SEQ]) for h, _ in raw] == [e.event.event_id for e in events]
        stored = [e for e in events if isinstance(e.event.data, dict) and "stored" in e.event.data]
        assert stored and all(e.storage_tier == "device" for e in stored)
        block = stored[0].event.data["stored"]["blocks"][0]
        assert set(block) == {"block_hash", "tokens_hash"}
    finally:
        plane.stop()
        worker.shutdown()


def test_dynamo_tokens_hash_is_xxh3_of_u32_tokens_seed_1337():
    import xxhash

    tokens = list(range(16))
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert dynamo_tokens_hash(tokens) == xxhash.xxh3_64_intdigest(data, seed=1337)
    assert dynamo_tokens_hash(tokens, "lora-a") != dynamo_tokens_hash(tokens)


def _router_on(srv, workers: list[NatsSimWorker]) -> tuple[Router, RouterBus]:
    bus = RouterBus(BusConfig(plane=NatsPlaneConfig(
        f"nats://{srv.host}:{srv.port}", component="*", user="kvloop",
        password=NATS_PASSWORD))).start()
    router = Router(RouterConfig(hash_spec=workers[0].description().hash_spec(),
                                 liveness=LivenessConfig(window_s=30)),
                    bus.factory(kv_event_subscription))
    for i, w in enumerate(workers):
        router.register(WorkerSpec(f"http://10.9.9.{i}:8000"), w.description())
    return router, bus


def test_a_nats_server_restart_is_survived(tmp_path):
    """The server stops while workers serve (their events in that window are lost), then
    comes back on the same port: router and workers reconnect, the router resyncs, and its
    index equals the union of the workers' caches again."""
    with nats_server(tmp_path) as srv:
        workers = [NatsSimWorker(plane_cfg(srv, component=c), seed=10 + i)
                   for i, c in enumerate(("backend", "prefill"))]
        router, bus = _router_on(srv, workers)
        try:
            for w in workers:
                w.run(10)
            names = [w.name for w in router.registry.all()]

            def synced() -> bool:
                return all(router.index.hashes_of(n) == w.cached()
                           for n, w in zip(names, workers, strict=True))
            wait_until(synced, 10, "the index to equal the caches")
            srv.stop()
            for w in workers:
                w.run(15, min_batches=5)          # events nobody receives
            assert not synced()
            srv.start()
            wait_until(lambda: bus.plane.stats.reconnects >= 1, 20, "the router to reconnect")
            wait_until(synced, 20, "the index to equal the caches after the restart")
            for w in workers:
                w.run(10)
            wait_until(synced, 10, "the live stream to continue")
            router.index.check_invariants()
        finally:
            router.shutdown()
            bus.stop()
            for w in workers:
                w.shutdown()
        assert NATS_PASSWORD not in srv.log()


def test_a_gap_is_replayed_from_the_worker(nats):
    """A batch lost in transit (the consumer skips one) is fetched by replay."""
    worker = NatsSimWorker(plane_cfg(nats), seed=3)
    plane = NatsEventPlane(plane_cfg(nats, component="*")).start()
    try:
        view = CacheView()
        stream = plane.attach(worker.worker_id, "w", "backend", lambda wb: view.apply(wb.batch),
                              block_size=16)
        wait_until(lambda: stream.stats.snapshots == 1, 10, "the join snapshot")
        worker.run(5, min_batches=3)
        wait_until(lambda: view.hashes() == worker.cached(), 10, "the first sync")
        original = stream.put
        dropped = []

        def lossy(item):
            if item[0] == "data" and not dropped:
                dropped.append(item)
                return
            original(item)
        stream.put = lossy   # type: ignore[method-assign]
        worker.run(10, min_batches=5)
        wait_until(lambda: view.hashes() == worker.cached(), 10, "the replay to fill the gap")
        assert dropped and stream.stats.gaps >= 1 and stream.stats.replays >= 1
    finally:
        plane.stop()
        worker.shutdown()


def test_wrong_credentials_fail_clearly_and_are_never_shown(nats):
    bad = NatsPlaneConfig(f"nats://kvloop:wrong-pw@{nats.host}:{nats.port}",
                          connect_timeout_s=2)
    with pytest.raises(OSError) as err:
        NatsEventPlane(bad).start()
    assert "wrong-pw" not in str(err.value) and "***@" in str(err.value)


def test_published_blocks_are_the_prompt_blocks(nats):
    worker = NatsSimWorker(plane_cfg(nats), seed=4)
    plane = NatsEventPlane(plane_cfg(nats, component="*")).start()
    try:
        worker.run(4)
        time.sleep(0.2)
        view = snapshot_view(plane, worker.worker_id, "backend")
        assert view.hashes() == worker.cached()
        assert all(isinstance(h, int) for h in view.hashes())
    finally:
        plane.stop()
        worker.shutdown()


def test_heartbeats_and_recency_travel_on_the_plane(nats):
    """An idle worker still sends heartbeats (liveness); cache hits come back as recency
    notices and refresh the router's LRU."""
    worker = NatsSimWorker(plane_cfg(nats), recency=True, seed=5)
    router, bus = _router_on(nats, [worker])
    try:
        (w,) = router.registry.all()
        wait_until(lambda: w.events.last_heartbeat_at is not None, 5, "a heartbeat")
        worker.run(20)                      # shared prefixes: hits, hence touches
        wait_until(lambda: (w.subscriber_stats() or {}).get("touches", 0) > 0, 10,
                   "recency notices")
        wait_until(lambda: router.index.hashes_of(w.name) == worker.cached(), 10, "in sync")
        stats = w.subscriber_stats() or {}
        assert stats.get("heartbeats", 0) >= 1, stats
        assert stats.get("touches", 0) > 0, stats
        assert router.index.hashes_of(w.name) == worker.cached()
    finally:
        router.shutdown()
        bus.stop()
        worker.shutdown()


def test_token_auth_in_the_url(tmp_path):
    token = "tok-7c1d"
    with nats_server(tmp_path, user=None, password=None, token=token) as srv:
        worker = NatsSimWorker(NatsPlaneConfig(f"nats://{token}@{srv.host}:{srv.port}"),
                               seed=6)
        plane = NatsEventPlane(NatsPlaneConfig(f"nats://{srv.host}:{srv.port}", token=token,
                                               component="*")).start()
        try:
            assert worker.publisher.endpoint == f"nats://***@{srv.host}:{srv.port}"
            worker.run(5)
            assert snapshot_view(plane, worker.worker_id, "backend").hashes() == \
                worker.cached()
            with pytest.raises(OSError):
                NatsEventPlane(NatsPlaneConfig(f"nats://{srv.host}:{srv.port}",
                                               connect_timeout_s=1)).start()
        finally:
            plane.stop()
            worker.shutdown()
