"""A small Prometheus text-format registry and its HTTP endpoint (ARCHITECTURE.md section 9).

Why not prometheus_client: the project keeps its run-time dependencies to grpcio, protobuf,
structlog, numpy and torch, and the services need only counters, gauges and sums with a few
labels, which the text exposition format makes a few dozen lines.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Labels = tuple[tuple[str, str], ...]


class Metric:
    def __init__(self, name: str, help_text: str, kind: str) -> None:
        self.name = name
        self.help = help_text
        self.kind = kind
        self._values: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = _key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[_key(labels)] = float(value)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(_key(labels), 0.0)

    def samples(self) -> list[tuple[Labels, float]]:
        with self._lock:
            return sorted(self._values.items())


class Histogram(Metric):
    """Cumulative buckets, `_sum` and `_count`, as the text format has them."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        super().__init__(name, help_text, "histogram")
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, **labels: str) -> None:
        key = _key(labels)
        with self._lock:
            for bound in self.buckets:
                if value <= bound:
                    self._inc(("_bucket", (*key, ("le", repr(float(bound))))))
            self._inc(("_bucket", (*key, ("le", "+Inf"))))
            self._inc(("_count", key))
            self._values[("_sum", key)] = self._values.get(("_sum", key), 0.0) + value

    def _inc(self, key) -> None:
        self._values[key] = self._values.get(key, 0.0) + 1.0

    def count(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(("_count", _key(labels)), 0.0)

    def rendered(self) -> list[tuple[str, Labels, float]]:
        with self._lock:
            return [(self.name + suffix, labels, v) for (suffix, labels), v in sorted(self._values.items())]


class Registry:
    """Metrics of one service; `collectors` refresh gauges (e.g. KV cache bytes) at scrape time."""

    def __init__(self, namespace: str = "specdec") -> None:
        self.namespace = namespace
        self._metrics: dict[str, Metric] = {}
        self._collectors: list[Callable[[], None]] = []

    def counter(self, name: str, help_text: str) -> Metric:
        return self._add(name + "_total", help_text, "counter")

    def gauge(self, name: str, help_text: str) -> Metric:
        return self._add(name, help_text, "gauge")

    def histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        full = f"{self.namespace}_{name}"
        if full not in self._metrics:
            self._metrics[full] = Histogram(full, help_text, buckets)
        return self._metrics[full]  # type: ignore[return-value]

    def on_collect(self, fn: Callable[[], None]) -> None:
        self._collectors.append(fn)

    def render(self) -> str:
        for fn in self._collectors:
            fn()
        lines: list[str] = []
        for m in self._metrics.values():
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            if isinstance(m, Histogram):
                samples = m.rendered()
            else:
                samples = [(m.name, labels, value) for labels, value in (m.samples() or [((), 0.0)])]
            for name, labels, value in samples:
                label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(f"{name}{{{label_text}}} {value!r}" if label_text else f"{name} {value!r}")
        return "\n".join(lines) + "\n"

    def _add(self, name: str, help_text: str, kind: str) -> Metric:
        full = f"{self.namespace}_{name}"
        if full not in self._metrics:
            self._metrics[full] = Metric(full, help_text, kind)
        return self._metrics[full]


class MetricsServer:
    """Serves `GET /metrics` from a daemon thread; port 0 picks a free port."""

    def __init__(self, registry: Registry, host: str, port: int) -> None:
        handler = _handler_for(registry)
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _handler_for(registry: Registry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = registry.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # scrapes are not worth a log line
            pass

    return Handler


def _key(labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
