"""Each service's metrics on `prometheus_client`, and their HTTP endpoint (ARCHITECTURE.md, "Observability").

Why prometheus_client: it is the reference client of the format every scraper reads, and serving
under load needs what a few dozen lines of our own did not give: histograms whose buckets,
`_sum` and `_count` follow the exposition rules (latency, time to first token, queue wait, batch
sizes), thread-safe children per label set, name and label validation at definition, and content
negotiation and gzip at the endpoint. Dashboards written for vLLM's `spec_decode` counters read
ours the same way.

Each `Registry` owns its own `CollectorRegistry`, never prometheus_client's global one: `specdec
serve all` runs the three services in one process, and each must export only its own metrics on its
own port (and tests start many services in one process).

The API stays the small one the services were written against: `registry.counter(name, help)`,
`.gauge`, `.histogram(name, help, buckets)`, and labels given as keyword arguments where a value is
recorded (`m.inc(2, mode="gad")`). prometheus_client wants a metric's label names fixed when it is
defined; pass `labels=(...)` to fix them there. A metric defined without `labels=` is exported
unlabelled at zero until its first use, and that use fixes its label names (a later use with other
names is a programming error and raises ValueError).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

Labels = tuple[tuple[str, str], ...]

# The `_created` series (a timestamp per counter and histogram child) would double the exposition
# and nothing here reads it; rate() works from the counters alone. Process-wide, as the library has it.
prometheus_client.disable_created_metrics()

# Seconds, for request latency, time to first token and queue waits: 1 ms to 60 s, about x2.5 a step.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)
# Counts per forward (batch rows, batch tokens): powers of two up to 4096.
SIZE_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(13))

_KINDS = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge}


class Metric:
    """One counter or gauge; labels are keyword arguments of `inc`, `set` and `value`."""

    def __init__(
        self, registry: CollectorRegistry, name: str, help_text: str, kind: str, labels: Sequence[str] | None = None
    ) -> None:
        # `name` is the exported name: a counter's ends in `_total`, which prometheus_client adds itself.
        self.name = name
        self.help = help_text
        self.kind = kind
        self._registry = registry
        self._lock = threading.Lock()
        # Label names are fixed once declared or once first used; until then an unlabelled
        # placeholder exports zero, as a metric nothing has happened to should.
        self._fixed = labels is not None
        self._labelnames: tuple[str, ...] = tuple(labels or ())
        self._sorted_names = tuple(sorted(self._labelnames))
        self._impl = self._make(self._labelnames)
        registry.register(self._impl)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def value(self, **labels: str) -> float:
        """The current value for these labels (0 when none was recorded), read without creating it."""
        return self._sample(self._sample_name(), labels)

    def samples(self) -> list[tuple[Labels, float]]:
        """(labels, value) of every child, sorted by labels."""
        name = self._sample_name()
        return sorted((_key(s.labels), s.value) for s in self._all_samples() if s.name == name)

    # ---- the prometheus_client object behind it ---------------------------------------------------

    def _make(self, labelnames: tuple[str, ...]):
        base = self.name.removesuffix("_total") if self.kind == "counter" else self.name
        return _KINDS[self.kind](base, self.help, labelnames=labelnames, registry=None)

    def _child(self, labels: dict[str, str]):
        names = tuple(sorted(labels))
        if not self._fixed or names != self._sorted_names:
            self._fix(names)
        impl = self._impl
        return impl.labels(**labels) if labels else impl

    def _fix(self, names: tuple[str, ...]) -> None:
        with self._lock:
            if self._fixed:
                if names != self._sorted_names:
                    raise ValueError(
                        f"metric {self.name} has labels {list(self._labelnames)}, used with {list(names)}"
                    )
                return
            if names != self._labelnames:  # replace the unlabelled placeholder (nothing recorded in it)
                impl = self._make(names)
                self._registry.unregister(self._impl)
                self._registry.register(impl)
                self._impl, self._labelnames, self._sorted_names = impl, names, names
            self._fixed = True

    def _sample_name(self) -> str:
        return self.name

    def _all_samples(self) -> Iterable:
        for family in self._impl.collect():
            yield from family.samples

    def _sample(self, name: str, labels: dict[str, str]) -> float:
        want = {k: str(v) for k, v in labels.items()}
        for s in self._all_samples():
            if s.name == name and s.labels == want:
                return float(s.value)
        return 0.0


class Histogram(Metric):
    """A histogram: `observe(value, **labels)`; `count(**labels)` is how many were observed."""

    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        help_text: str,
        buckets: Sequence[float],
        labels: Sequence[str] | None = None,
    ) -> None:
        self.buckets = tuple(sorted(float(b) for b in buckets))
        super().__init__(registry, name, help_text, "histogram", labels)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> float:
        return self._sample(self.name + "_count", labels)

    def sum(self, **labels: str) -> float:
        return self._sample(self.name + "_sum", labels)

    def _make(self, labelnames: tuple[str, ...]):
        return prometheus_client.Histogram(
            self.name, self.help, labelnames=labelnames, buckets=self.buckets, registry=None
        )

    def _sample_name(self) -> str:
        return self.name + "_count"


class Registry:
    """Metrics of one service, in its own `CollectorRegistry`; `on_collect` functions refresh
    gauges (e.g. KV cache bytes) at scrape time, before any metric is read."""

    def __init__(self, namespace: str = "specdec") -> None:
        self.namespace = namespace
        self.collector_registry = CollectorRegistry()
        self._metrics: dict[str, Metric] = {}
        self._collectors: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        # First in the registry, so every scrape (ours or any prometheus_client exposition of this
        # registry) runs the refresh functions before it reads the gauges they set.
        self.collector_registry.register(_Refresh(self._collectors))

    def counter(self, name: str, help_text: str, labels: Sequence[str] | None = None) -> Metric:
        """A counter exported as `<namespace>_<name>_total`."""
        return self._add(f"{self.namespace}_{name}_total", lambda full: Metric(
            self.collector_registry, full, help_text, "counter", labels
        ))

    def gauge(self, name: str, help_text: str, labels: Sequence[str] | None = None) -> Metric:
        return self._add(f"{self.namespace}_{name}", lambda full: Metric(
            self.collector_registry, full, help_text, "gauge", labels
        ))

    def histogram(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float] = LATENCY_BUCKETS,
        labels: Sequence[str] | None = None,
    ) -> Histogram:
        metric = self._add(f"{self.namespace}_{name}", lambda full: Histogram(
            self.collector_registry, full, help_text, buckets, labels
        ))
        assert isinstance(metric, Histogram), f"{metric.name} is a {metric.kind}"
        return metric

    def on_collect(self, fn: Callable[[], None]) -> None:
        self._collectors.append(fn)

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return generate_latest(self.collector_registry).decode()

    def _add(self, full: str, make: Callable[[str], Metric]) -> Metric:
        # The same name twice is the same metric (several modules may ask for it).
        with self._lock:
            if full not in self._metrics:
                self._metrics[full] = make(full)
            return self._metrics[full]


class MetricsServer:
    """Serves `GET /metrics` (and `/`) with prometheus_client's WSGI app from a daemon thread;
    port 0 picks a free port. The app negotiates OpenMetrics and gzip with the scraper."""

    def __init__(self, registry: Registry, host: str, port: int) -> None:
        app = _only_metrics_paths(make_wsgi_app(registry.collector_registry))
        server_class = _IPv6Server if ":" in host else ThreadingWSGIServer
        self._httpd = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        self.host = host if ":" not in host else f"[{host}]"
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which never ran otherwise
            self._httpd.shutdown()
        self._httpd.server_close()


class _Refresh:
    """A collector that exports nothing: it runs the registry's refresh functions."""

    def __init__(self, fns: list[Callable[[], None]]) -> None:
        self._fns = fns

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        for fn in list(self._fns):
            fn()
        return []


class _IPv6Server(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # scrapes are not worth a log line
        pass


def _only_metrics_paths(app: Callable) -> Callable:
    def wrapped(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found; metrics are at /metrics\n"]
        return app(environ, start_response)

    return wrapped


def _key(labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))
