"""serving.metrics on prometheus_client: what it renders parses back as Prometheus text with the values
recorded; labels given at use or declared; registries independent; the HTTP endpoint."""

from __future__ import annotations

import gzip
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.metrics import LATENCY_BUCKETS, MetricsServer, Registry


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for every sample in an exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_counters_gauges_histograms_render_and_parse_back():
    r = Registry()
    requests = r.counter("requests", "requests, by mode")
    active = r.gauge("active", "requests in flight")
    latency = r.histogram("latency_seconds", "latency, by mode", (0.01, 0.1, 1.0))
    requests.inc(mode="gad")
    requests.inc(4, mode="gad")
    requests.inc(2, mode="ar")
    active.inc()
    active.inc()
    active.inc(-1)
    for value in (0.005, 0.01, 0.5, 3.0):  # 0.01 lies on a bound: `le` is inclusive
        latency.observe(value, mode="gad")

    text = r.render()
    families = _families(text)
    assert families["specdec_requests"].type == "counter"
    assert families["specdec_active"].type == "gauge"
    assert families["specdec_latency_seconds"].type == "histogram"
    assert families["specdec_requests"].documentation == "requests, by mode"
    samples = _samples(text)
    assert samples[("specdec_requests_total", (("mode", "gad"),))] == 5
    assert samples[("specdec_requests_total", (("mode", "ar"),))] == 2
    assert samples[("specdec_active", ())] == 1
    buckets = {le: samples[("specdec_latency_seconds_bucket", (("le", le), ("mode", "gad")))] for le in
               ("0.01", "0.1", "1.0", "+Inf")}
    assert buckets == {"0.01": 2, "0.1": 2, "1.0": 3, "+Inf": 4}
    assert samples[("specdec_latency_seconds_count", (("mode", "gad"),))] == 4
    assert samples[("specdec_latency_seconds_sum", (("mode", "gad"),))] == pytest.approx(3.515)
    # The API reads what was recorded, the way the services and the tests use it.
    assert requests.value(mode="gad") == 5 and requests.value(mode="beam") == 0
    assert active.value() == 1
    assert latency.count(mode="gad") == 4 and latency.count(mode="ar") == 0
    assert latency.sum(mode="gad") == pytest.approx(3.515)
    assert requests.samples() == [((("mode", "ar"),), 2.0), ((("mode", "gad"),), 5.0)]
    assert "_created" not in text


def test_an_unused_metric_exports_zero_until_its_first_use_fixes_its_labels():
    r = Registry()
    errors = r.counter("errors", "errors, by code")
    degraded = r.counter("degraded", "fallbacks")
    assert _samples(r.render()) == {("specdec_errors_total", ()): 0.0, ("specdec_degraded_total", ()): 0.0}
    errors.inc(code="UNAVAILABLE")
    samples = _samples(r.render())
    assert samples == {("specdec_errors_total", (("code", "UNAVAILABLE"),)): 1.0, ("specdec_degraded_total", ()): 0.0}
    with pytest.raises(ValueError, match="specdec_errors_total"):
        errors.inc()  # its labels are fixed now
    with pytest.raises(ValueError):
        errors.inc(code="X", peer="drafter")
    degraded.inc()
    with pytest.raises(ValueError):
        degraded.inc(code="X")


def test_declared_labels_are_fixed_from_the_start():
    r = Registry()
    latency = r.histogram("request_seconds", "latency", LATENCY_BUCKETS, labels=("mode", "rpc"))
    waits = r.histogram("queue_wait_seconds", "wait", labels=())
    families = _families(r.render())
    assert families["specdec_request_seconds"].samples == []  # no label values yet: no series
    assert _samples(r.render())[("specdec_queue_wait_seconds_count", ())] == 0
    with pytest.raises(ValueError):
        latency.observe(0.1, mode="ar")
    latency.observe(0.1, rpc="Generate", mode="ar")  # keyword order does not matter
    waits.observe(0.0)
    assert latency.count(mode="ar", rpc="Generate") == 1 and waits.count() == 1
    bounds = [s.labels["le"] for s in _families(r.render())["specdec_request_seconds"].samples if "le" in s.labels]
    assert bounds[0] == "0.001" and bounds[-2:] == ["60.0", "+Inf"]


def test_value_reads_without_creating_a_series():
    r = Registry()
    errors = r.counter("errors", "errors", labels=("code",))
    assert errors.value(code="INTERNAL") == 0
    assert "INTERNAL" not in r.render()


def test_two_registries_in_one_process_do_not_collide():
    # `specdec serve all`: three services, the same metric names, one process.
    a, b = Registry(), Registry()
    for r, n in ((a, 3), (b, 5)):
        r.counter("active_sessions_opened", "opened").inc(n)
        r.gauge("active_sessions", "open").set(n)
        r.histogram("step_seconds", "step").observe(n / 100)
    assert a.counter("active_sessions_opened", "opened").value() == 3  # the same name is the same metric
    sa, sb = _samples(a.render()), _samples(b.render())
    opened = ("specdec_active_sessions_opened_total", ())
    assert sa[opened] == 3 and sb[opened] == 5
    assert sa[("specdec_step_seconds_count", ())] == 1 and sb[("specdec_step_seconds_sum", ())] == 0.05
    assert Registry(namespace="other").render() == ""


def test_on_collect_refreshes_gauges_at_each_scrape():
    r = Registry()
    held = r.gauge("kv_cache_bytes", "bytes held")
    state = {"bytes": 10}
    r.on_collect(lambda: held.set(state["bytes"]))
    assert _samples(r.render())[("specdec_kv_cache_bytes", ())] == 10
    state["bytes"] = 42
    assert _samples(r.render())[("specdec_kv_cache_bytes", ())] == 42


def test_concurrent_increments_are_exact():
    r = Registry()
    tokens = r.counter("tokens", "tokens")
    latency = r.histogram("latency_seconds", "latency")

    def work(i: int) -> None:
        for _ in range(2000):
            tokens.inc(2, mode=f"m{i % 2}")
            latency.observe(0.002, mode=f"m{i % 2}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tokens.value(mode="m0") == tokens.value(mode="m1") == 4 * 2000 * 2
    assert latency.count(mode="m0") + latency.count(mode="m1") == 8 * 2000


def test_metrics_server_serves_text_openmetrics_and_gzip_on_loopback():
    r = Registry()
    r.counter("requests", "requests", labels=("mode",)).inc(3, mode="ar")
    server = MetricsServer(r, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = response.read().decode()
        assert _samples(text)[("specdec_requests_total", (("mode", "ar"),))] == 3
        with urllib.request.urlopen(f"{url}/", timeout=10) as response:
            assert response.read().decode() == text
        # A Prometheus server asks for OpenMetrics; the reply says so and ends with its EOF marker.
        asks = {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"}
        with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=asks), timeout=10) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            assert response.headers["Content-Encoding"] == "gzip"
            body = gzip.decompress(response.read()).decode()
        assert body.endswith("# EOF\n") and 'specdec_requests_total{mode="ar"} 3.0' in body
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{url}/other", timeout=10)
        assert missing.value.code == 404
    finally:
        server.stop()
