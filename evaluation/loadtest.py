"""Drive a running gateway with concurrent requests and measure what it sustains (`specdec loadtest`).

Three ways to offer load:

- closed loop (`concurrency` N): N virtual clients, each sends its next request as soon as its
  previous one answered; the gateway sees exactly N requests in flight.
- waves (`waves=True`, closed loop): the N requests of a wave are sent together and the next wave
  starts only when all of them answered: a static batch whose rows wait for its slowest sentence,
  the comparison point for the scheduler's streaming refill.
- open loop (`rate` R): a request arrives every 1/R seconds whatever happened to the earlier
  ones, so a gateway slower than R requests/s builds a queue (and, past its limits, answers
  RESOURCE_EXHAUSTED) instead of slowing the client down.

A run is always bounded: by `requests`, by `duration` (no request starts after it; those in
flight finish), or when neither is given by one pass over the inputs. Input i of the run is
`inputs[i % len(inputs)]`.

Each virtual client (closed loop) or each request (open loop) presents its own `x-client-id`, as
many users would: the gateway's per-client fairness limit then does not cap the load at
`max_per_client`. `client_id` sends one id for every request instead (one client).

Measured: requests/s and output tokens/s over the run's wall time (first request sent to last
answer), latency and, for `GenerateStream`, time to the first message carrying tokens, over the
requests that succeeded; failures by gRPC status code. The mean rows per batched forward come from
the servers: a `DecodingStats` field named `*batch_rows` when the gateway's wire has one, and the
`*batch_rows` histograms of any Prometheus endpoint given in `metrics_urls` (sum and count read
before and after the run). The same endpoints' `*forward_seconds` histograms give each model
worker's busy share of the run's wall time and its mean forward, and the verifier's
`*encode_seconds` its encoder runs' share: which side of a stack is the bottleneck (a worker near
100% busy is; one well below it waits on the others).

Libraries: grpc.aio with one channel (or a few, `channels`) and one asyncio task per request in
flight, no threads. Percentiles come from numpy (`numpy.percentile`, linear interpolation), which
the project already depends on. No load framework: locust, k6 and the like drive HTTP, and locust's
gevent workers do not mix with grpc.aio's event loop; the closed/open/wave loops are a few dozen
lines here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
import numpy as np

from core.errors import SpecdecError, StatusCode
from serving.auth import bearer_metadata
from serving.channels import channel_options
from serving.status import REQUEST_ID_KEY
from serving.tls import ClientTLS

CLIENT_ID_KEY = "x-client-id"  # gateway.admission.CLIENT_ID_KEY; the client does not import the gateway's server side
PERCENTILES = (50, 95, 99)
CONNECT_TIMEOUT_S = 15.0
PROGRESS_EVERY_S = 0.5


@dataclass(frozen=True)
class LoadSpec:
    """One load-test run against one gateway."""

    address: str
    inputs: Sequence[str]  # texts; request i sends inputs[i % len(inputs)]
    overrides: dict[str, Any] = field(default_factory=dict)  # DecodingConfig fields (None: unset)
    stream: bool = False  # GenerateStream instead of Generate
    concurrency: int = 1  # closed loop: clients (ignored when rate is set)
    rate: float | None = None  # open loop: requests per second
    waves: bool = False  # closed loop in waves of `concurrency` requests
    requests: int | None = None
    duration: float | None = None  # seconds
    timeout: float = 120.0  # per-request deadline
    warmup: int = 0  # requests sent (closed loop, unmeasured) before the run
    channels: int = 1
    client_id: str | None = None  # one x-client-id for every request; None: one per virtual client
    tls: ClientTLS | None = None
    token: str | None = None
    metrics_urls: Sequence[str] = ()
    record: bool = False  # keep every successful request's output ids (LoadReport.outputs)

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("no inputs to send")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive; got {self.rate}")
        if self.rate is None and self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1; got {self.concurrency}")
        if self.waves and self.rate is not None:
            raise ValueError("waves is a closed loop: give a concurrency, not a rate")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be at least 1; got {self.requests}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be positive; got {self.duration}")
        if self.channels < 1:
            raise ValueError(f"channels must be at least 1; got {self.channels}")

    @property
    def loop(self) -> str:
        return "open" if self.rate is not None else "waves" if self.waves else "closed"

    @property
    def max_requests(self) -> int | None:
        """The request cap: given, or one pass over the inputs when no duration bounds the run."""
        if self.requests is not None:
            return self.requests
        return None if self.duration is not None else len(self.inputs)


@dataclass(frozen=True)
class Outcome:
    """One request: its status ("OK" or a gRPC status name), times in seconds, tokens received."""

    code: str
    latency_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    batch_rows: dict[str, float] = field(default_factory=dict)  # DecodingStats *batch_rows fields


@dataclass
class LoadReport:
    address: str
    rpc: str
    loop: str
    concurrency: int | None
    rate: float | None
    config: dict[str, Any]
    requests: int
    ok: int
    errors: dict[str, int]
    wall_s: float
    output_tokens: int
    latency_ms: dict[str, float] | None
    ttft_ms: dict[str, float] | None
    mean_batch_rows: dict[str, float] = field(default_factory=dict)
    # Per `*forward_seconds` (and `*encode_seconds`) histogram: the share of the wall time its worker
    # spent in those runs, and the mean run in ms.
    worker_busy: dict[str, float] = field(default_factory=dict)
    mean_forward_ms: dict[str, float] = field(default_factory=dict)
    # With LoadSpec.record: request index i (input i % len(inputs)) -> its output ids, successful requests only.
    outputs: dict[int, list[int]] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        recorded = {"outputs": {str(i): ids for i, ids in sorted(self.outputs.items())}} if self.outputs else {}
        return {
            "address": self.address,
            "rpc": self.rpc,
            "loop": self.loop,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "config": self.config,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "latency_ms": self.latency_ms,
            "ttft_ms": self.ttft_ms,
            "mean_batch_rows": self.mean_batch_rows,
            "worker_busy": self.worker_busy,
            "mean_forward_ms": self.mean_forward_ms,
            **recorded,
        }


def run_load(spec: LoadSpec, progress: TextIO | None = None) -> LoadReport:
    """Run one load test (its own event loop); `progress`: a stream for a live status line."""
    return asyncio.run(run_load_async(spec, progress))


def run_sweep(spec: LoadSpec, concurrencies: Sequence[int], progress: TextIO | None = None) -> list[LoadReport]:
    """The same run at each closed-loop concurrency in turn."""
    from dataclasses import replace

    return [run_load(replace(spec, concurrency=c, rate=None), progress) for c in concurrencies]


async def run_load_async(spec: LoadSpec, progress: TextIO | None = None) -> LoadReport:
    async with _Client(spec) as client:
        await client.connect()
        if spec.warmup:
            warm = LoadSpecView(spec, requests=spec.warmup)
            await _closed_loop(client, warm, _Tally(), min(spec.concurrency, spec.warmup))
        before = _scrape_all(spec.metrics_urls)
        tally = _Tally()
        ticker = asyncio.create_task(_show_progress(tally, progress)) if progress is not None else None
        tally.t0 = time.perf_counter()
        try:
            view = LoadSpecView(spec, requests=spec.max_requests)
            if spec.rate is not None:
                await _open_loop(client, view, tally, spec.rate)
            elif spec.waves:
                await _waves(client, view, tally, spec.concurrency)
            else:
                await _closed_loop(client, view, tally, spec.concurrency)
        finally:
            tally.t1 = time.perf_counter()
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
                _print_progress(tally, progress, final=True)
        after = _scrape_all(spec.metrics_urls)
    return _report(spec, tally, before, after)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def format_report(report: LoadReport) -> str:
    """The human-readable summary of one run."""
    who = f"{report.concurrency} clients" if report.rate is None else f"{report.rate:g} requests/s offered"
    mode = report.config.get("mode") or "gateway default"
    lines = [
        f"{report.address}: {report.requests} requests ({report.ok} ok) in {report.wall_s:.2f} s; "
        f"{report.loop} loop, {who}, {report.rpc}, mode {mode}",
        f"  requests/s         {report.requests_per_s:.2f}",
        f"  output tokens/s    {report.output_tokens_per_s:.1f}  ({report.output_tokens} tokens)",
    ]
    if report.latency_ms:
        lines.append(f"  latency ms         {_percentiles_line(report.latency_ms)}")
    if report.ttft_ms:
        lines.append(f"  first token ms     {_percentiles_line(report.ttft_ms)}")
    for name, rows in report.mean_batch_rows.items():
        lines.append(f"  mean batch rows    {rows:.2f}  ({name})")
    for name, busy in report.worker_busy.items():
        forward_ms = report.mean_forward_ms[name]
        what = "encoder run" if name.endswith("encode_seconds") else "forward"
        lines.append(f"  worker busy        {100 * busy:.0f}%  (mean {what} {forward_ms:.2f} ms; {name})")
    if report.errors:
        lines.append("  errors             " + ", ".join(f"{code} {n}" for code, n in sorted(report.errors.items())))
    else:
        lines.append("  errors             none")
    return "\n".join(lines)


def format_sweep(reports: Sequence[LoadReport]) -> str:
    """A heading line, then one table row per run of a sweep."""
    first = reports[0]
    mode = first.config.get("mode") or "gateway default"
    heading = f"{first.address}: {first.loop} loop, {first.rpc}, mode {mode}, {first.requests} requests per run"
    ttft = any(r.ttft_ms for r in reports)
    head = ["clients", "requests", "errors", "requests/s", "tokens/s", "p50 ms", "p95 ms", "p99 ms"]
    if ttft:
        head += ["TTFT p50 ms", "TTFT p95 ms"]
    names = sorted({name for r in reports for name in r.mean_batch_rows})
    head += [f"batch rows ({n})" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in reports:
        lat = r.latency_ms or {}
        cells = [str(r.concurrency), str(r.requests), str(sum(r.errors.values())), f"{r.requests_per_s:.2f}",
                 f"{r.output_tokens_per_s:.1f}", _ms(lat.get("p50")), _ms(lat.get("p95")), _ms(lat.get("p99"))]
        if ttft:
            t = r.ttft_ms or {}
            cells += [_ms(t.get("p50")), _ms(t.get("p95"))]
        cells += [f"{r.mean_batch_rows[n]:.2f}" if n in r.mean_batch_rows else "-" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    return heading + "\n" + "\n".join(lines)


def reports_json(reports: Sequence[LoadReport], sweep: bool) -> str:
    """`--json`: one object; a sweep's runs are under "sweep"."""
    if sweep:
        return json.dumps({"sweep": [r.to_dict() for r in reports]}, ensure_ascii=False)
    return json.dumps(reports[0].to_dict(), ensure_ascii=False)


def ua_gec_texts(n: int, data_dir: str | None = None) -> list[str]:
    """The first `n` non-empty sources of the UA-GEC test split in corpus order, as `specdec bench`
    samples them (`training.data.load_test_set`)."""
    from training.data import load_test_set

    try:
        items = load_test_set(data_dir)
    except ModuleNotFoundError as exc:
        raise ValueError(f"the UA-GEC test split needs the ua-gec package (pip install -e '.[train]') or "
                         f"--data-dir with a prepared test.text.jsonl ({exc})") from None
    texts = [item.source for item in items if item.source.strip()][:n]
    if not texts:
        raise ValueError("the UA-GEC test split gave no sentences")
    return texts


def file_texts(path: str) -> list[str]:
    """One input text per non-empty line."""
    with open(path, encoding="utf-8") as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise ValueError(f"{path}: no input lines")
    return texts


# ----------------------------------------------------------------------------------------------
# The loops
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSpecView:
    """A spec with the request cap of one phase (warm-up or the measured run)."""

    spec: LoadSpec
    requests: int | None

    def take(self, tally: _Tally) -> int | None:
        """The next request's index, or None when the run's bound is reached."""
        if self.requests is not None and tally.issued >= self.requests:
            return None
        if self.spec.duration is not None and tally.t0 and time.perf_counter() - tally.t0 >= self.spec.duration:
            return None
        tally.issued += 1
        return tally.issued - 1


async def _closed_loop(client: _Client, view: LoadSpecView, tally: _Tally, clients: int) -> None:
    async def one_client(c: int) -> None:
        while (i := view.take(tally)) is not None:
            await client.send(i, tally, client_key=f"c{c}")

    await asyncio.gather(*(one_client(c) for c in range(clients)))


async def _waves(client: _Client, view: LoadSpecView, tally: _Tally, size: int) -> None:
    while True:
        wave = [i for i in (view.take(tally) for _ in range(size)) if i is not None]
        if not wave:
            return
        await asyncio.gather(*(client.send(i, tally, client_key=f"c{n}") for n, i in enumerate(wave)))


async def _open_loop(client: _Client, view: LoadSpecView, tally: _Tally, rate: float) -> None:
    pending: set[asyncio.Task] = set()
    for n in itertools.count():
        # A fixed schedule (arrival n at n / rate), so a late wake-up does not shift later arrivals.
        delay = tally.t0 + n / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        i = view.take(tally)
        if i is None:
            break
        task = asyncio.create_task(client.send(i, tally, client_key=f"r{i}"))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)


@dataclass
class _Tally:
    issued: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> output ids (record)

    @property
    def in_flight(self) -> int:
        return self.issued - len(self.outcomes)


class _Client:
    """The channels and the two calls; every outcome goes into a tally."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[Any] = []
        self.run_id = uuid.uuid4().hex[:8]
        from gateway.wire import overrides_to_wire
        from protos.specdec.v1 import gateway_pb2

        self._pb2 = gateway_pb2
        self.config = overrides_to_wire(spec.overrides)
        self._batch_fields = [f.name for f in gateway_pb2.DecodingStats.DESCRIPTOR.fields
                              if f.name.endswith("batch_rows")]

    async def __aenter__(self) -> _Client:
        from protos.specdec.v1 import gateway_pb2_grpc

        for _ in range(self.spec.channels):
            if self.spec.tls is None:
                channel = grpc.aio.insecure_channel(self.spec.address, options=channel_options())
            else:
                channel = grpc.aio.secure_channel(self.spec.address, self.spec.tls.credentials(), channel_options())
            self.channels.append(channel)
            self.stubs.append(gateway_pb2_grpc.GatewayServiceStub(channel))
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))

    async def connect(self) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in self.channels)), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise SpecdecError(StatusCode.UNAVAILABLE, f"no connection to the gateway at {self.spec.address} "
                               f"within {CONNECT_TIMEOUT_S:.0f} s") from None

    async def send(self, i: int, tally: _Tally, client_key: str) -> None:
        spec = self.spec
        request = self._pb2.GenerateRequest(text=spec.inputs[i % len(spec.inputs)], config=self.config)
        metadata = [(REQUEST_ID_KEY, uuid.uuid4().hex),
                    (CLIENT_ID_KEY, spec.client_id or f"loadtest-{self.run_id}-{client_key}")]
        if spec.token:
            metadata.append(bearer_metadata(spec.token))
        stub = self.stubs[i % len(self.stubs)]
        start = time.perf_counter()
        ttft = None
        ids: list[int] = []
        final = None
        try:
            if spec.stream:
                async for message in stub.GenerateStream(request, timeout=spec.timeout, metadata=metadata):
                    if ttft is None and (message.output_ids or message.final):
                        ttft = time.perf_counter() - start
                    ids += message.output_ids
                    if message.final:
                        final = message
            else:
                final = await stub.Generate(request, timeout=spec.timeout, metadata=metadata)
                ids = list(final.output_ids)
        except grpc.aio.AioRpcError as exc:
            tally.outcomes.append(Outcome(exc.code().name, time.perf_counter() - start))
            return
        latency = time.perf_counter() - start
        rows = {name: float(getattr(final.stats, name)) for name in self._batch_fields} if final is not None else {}
        if spec.record:
            tally.outputs[i] = ids
        tally.outcomes.append(Outcome("OK", latency, ttft, len(ids), rows))


# ----------------------------------------------------------------------------------------------
# Summary, progress, server metrics
# ----------------------------------------------------------------------------------------------


def _report(spec: LoadSpec, tally: _Tally, before: dict[str, tuple[float, float]],
            after: dict[str, tuple[float, float]]) -> LoadReport:
    ok = [o for o in tally.outcomes if o.code == "OK"]
    errors = Counter(o.code for o in tally.outcomes if o.code != "OK")
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    rows: dict[str, float] = {}
    for name in sorted({n for o in ok for n in o.batch_rows}):
        values = [o.batch_rows[name] for o in ok if name in o.batch_rows and o.batch_rows[name] > 0]
        if values:  # 0: the gateway did not fill it in
            rows[f"gateway {name}"] = float(np.mean(values))
    rows.update(_batch_rows_delta(before, after))
    wall_s = max(tally.t1 - tally.t0, 0.0)
    busy, forward_ms = _busy_delta(before, after, wall_s)
    return LoadReport(
        address=spec.address,
        rpc="GenerateStream" if spec.stream else "Generate",
        loop=spec.loop,
        concurrency=None if spec.rate is not None else spec.concurrency,
        rate=spec.rate,
        config={k: (v.value if hasattr(v, "value") else v) for k, v in spec.overrides.items() if v is not None},
        requests=len(tally.outcomes),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        wall_s=wall_s,
        output_tokens=sum(o.output_tokens for o in ok),
        latency_ms=_percentiles([o.latency_s for o in ok]),
        ttft_ms=_percentiles(ttfts) if spec.stream else None,
        mean_batch_rows=rows,
        worker_busy=busy,
        mean_forward_ms=forward_ms,
        outputs=dict(sorted(tally.outputs.items())),
    )


def _percentiles(seconds: Sequence[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    ms = np.asarray(seconds, dtype=float) * 1e3
    out = {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES), strict=True)}
    out["mean"] = float(ms.mean())
    out["max"] = float(ms.max())
    return out


def _percentiles_line(values: dict[str, float]) -> str:
    return "  ".join(f"{k} {values[k]:.1f}" for k in ("p50", "p95", "p99", "mean"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


async def _show_progress(tally: _Tally, stream: TextIO) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        _print_progress(tally, stream, final=False)


def _print_progress(tally: _Tally, stream: TextIO, final: bool) -> None:
    elapsed = max((tally.t1 if final else time.perf_counter()) - tally.t0, 1e-9)
    done = len(tally.outcomes)
    failed = sum(o.code != "OK" for o in tally.outcomes)
    line = (f"\rloadtest: {done} done, {tally.in_flight} in flight, {failed} failed, "
            f"{done / elapsed:.1f} requests/s, {elapsed:.1f} s ")
    stream.write(line + ("\n" if final else ""))
    stream.flush()


_SAMPLE = re.compile(
    r"^([A-Za-z_:][A-Za-z0-9_:]*(?:batch_rows|forward_seconds|encode_seconds))_(sum|count)(?:\{[^}]*\})?\s+(\S+)"
)


def _scrape_all(urls: Sequence[str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of every `*batch_rows` and `*forward_seconds` histogram at the given Prometheus
    endpoints, summed over label sets, keyed by the family's name; an unreachable endpoint is
    reported on stderr and skipped."""
    found: dict[str, tuple[float, float]] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                text = reply.read().decode()
        except OSError as exc:
            print(f"specdec loadtest: warning: metrics at {url}: {exc}", file=sys.stderr)
            continue
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m:
                name, part, value = m.groups()
                s, c = found.get(name, (0.0, 0.0))
                found[name] = (s + float(value), c) if part == "sum" else (s, c + float(value))
    return found


def _batch_rows_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
                      ) -> dict[str, float]:
    out = {}
    for name, (s, c) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c > c0 and name.endswith("batch_rows"):
            out[name] = (s - s0) / (c - c0)
    return out


def _busy_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], wall_s: float
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Per `*forward_seconds` (and the verifier's `*encode_seconds`) histogram with runs during the
    run: (its share of `wall_s`, its mean run in ms)."""
    busy, mean_ms = {}, {}
    for name, (s, c) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        if c > c0 and name.endswith(("forward_seconds", "encode_seconds")) and wall_s > 0:
            busy[name] = (s - s0) / wall_s
            mean_ms[name] = 1e3 * (s - s0) / (c - c0)
    return busy, mean_ms


def progress_stream(wanted: bool, stream: TextIO = sys.stderr) -> TextIO | None:
    """The stream for the progress line: stderr when it is a terminal or when asked for."""
    return stream if wanted or stream.isatty() else None

