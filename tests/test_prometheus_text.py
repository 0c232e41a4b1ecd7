"""The one /metrics parser (`kvloop.front.prometheus_text`) against prometheus_client's own,
on the server's real exposition and on label values that need escaping."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvloop.front.prometheus_text import metric_value, samples
from kvloop.server.metrics import ServerMetrics


def _reference(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value)
            for f in text_string_to_metric_families(text) for s in f.samples]


def _same_samples(text: str) -> int:
    """Every sample prometheus_client reads, read alike here; the number of samples."""
    ref = _reference(text)
    for name in {n for n, _, _ in ref}:
        mine = list(samples(text, name))
        assert mine == [(labels, value) for n, labels, value in ref if n == name], name
    return len(ref)


def test_the_servers_page_reads_as_prometheus_client_reads_it():
    m = ServerMetrics("sim", 1024, 0, {"block_size": "16", "num_gpu_blocks": "40"})
    m.observe_iteration(12)
    m.observe_n(2)
    m.reject("max_waiting_requests")
    text = m.render().decode()
    assert _same_samples(text) > 100
    assert metric_value(text, "vllm:iteration_tokens_total_count", model_name="sim") == 1
    # a name that prefixes another one's is not summed with it
    assert metric_value(text, "vllm:num_requests_waiting") == 0
    assert metric_value(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert metric_value(text, "vllm:no_such_series") == 0.0


def test_escaped_label_values_timestamps_and_sums():
    reg = CollectorRegistry()
    c = Counter("odd", "labels that need escaping", ["path", "w"], registry=reg)
    c.labels('a "quoted", {braced} \\ path', "1").inc(2)
    c.labels("line\nbreak", "2").inc(3)
    Gauge("g", "plain", registry=reg).set(float("inf"))
    Histogram("h", "buckets", buckets=(1.0,), registry=reg).observe(0.5)
    text = generate_latest(reg).decode()
    assert _same_samples(text) >= 6
    assert metric_value(text, "odd_total") == 5
    assert metric_value(text, "odd_total", path='a "quoted", {braced} \\ path') == 2
    assert metric_value(text, "odd_total", path="line\nbreak", w="2") == 3
    assert metric_value(text, "odd_total", w="3") == 0
    assert metric_value(text, "g") == float("inf")
    assert metric_value(text, "h_bucket", le="1.0") == 1
    stamped = 'x{a="1"} 2.5 1700000000000\nx{a="2"} 4\n# TYPE y gauge\nx{a="3"} nope\n'
    assert list(samples(stamped, "x")) == [({"a": "1"}, 2.5), ({"a": "2"}, 4.0)]
