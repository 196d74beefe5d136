"""What HTTP costs over gRPC per request: the same requests to one `specdec serve all`, as gRPC
`Generate`, as KServe v2 REST `infer` and as OpenAI-style `/v1/completions`, at 1 and 32 clients.

    python bench/bench_http.py                # the shipped UA-GEC bundle
    python bench/bench_http.py --write        # also update "## HTTP endpoints: overhead" in BENCHMARKS.md

Two requests: a real one (GAD, up to 64 tokens) and the smallest there is (one AR step), where the
protocol's own cost is the largest share. Each client is a thread with its own connection (a gRPC
channel, or a keep-alive HTTP connection) and its own `x-client-id` (so the gateway's per-client share
does not refuse 32 clients on one host); it sends its texts one after another. Every pass runs the
protocols in turn (interleaved), so all are measured under the same load; the ratio to gRPC is within
one run. Outputs are checked equal.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, start_services, write_section
from evaluation.loadtest import ua_gec_texts
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.services.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## HTTP endpoints: overhead"
# The request decoded: a real one, and the smallest there is (one AR step), where the protocol's own
# cost is the largest share of a request.
WORKLOADS = {"gad k=10, <= 64 tokens": {"mode": "gad", "k": 10, "max_new_tokens": 64},
             "ar, 1 token": {"mode": "ar", "max_new_tokens": 1}}
PROTOCOLS = ("gRPC Generate", "KServe v2 REST", "/v1/completions")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, ROOT)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests", type=int, default=48, help="requests per protocol and pass, split over clients")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--backend", default="onnxruntime")
    args = parser.parse_args(argv)
    texts = ua_gec_texts(16, args.data_dir)
    http_address = f"127.0.0.1:{free_port()}"
    proc, grpc_address = start_services(Path(args.bundle), args.backend,
                                        extra_args=("--http-addr", http_address))
    try:
        rows = _measure(grpc_address, http_address, texts, args)
    finally:
        proc.terminate()
        proc.wait(60)
    print(_table(rows))
    if args.write:
        write_section(args.output, SECTION, f"{machine_stamp()}\n\n{_note(args, len(texts))}\n\n{_table(rows)}")
    return 0


def _note(args, texts: int) -> str:
    return (f"`specdec serve all` on {Path(args.bundle).name} (backend {args.backend}, gateway defaults: 8 workers), "
            f"the first {texts} UA-GEC test sources cycled, each workload's settings {list(WORKLOADS.values())}; "
            f"{args.requests} requests per protocol, workload and "
            "pass spread over the clients (each a thread with its own connection and client id, sending one request "
            f"after another), {args.passes} interleaved passes. Latency is per request, as the client sees it "
            "(admission wait included); every output equals gRPC's.")


def _measure(grpc_address: str, http_address: str, texts: list[str], args) -> dict:
    calls = {"gRPC Generate": (_grpc_connect(grpc_address), _grpc_call),
             "KServe v2 REST": (_http_connect(http_address), _kserve_call),
             "/v1/completions": (_http_connect(http_address), _completion_call)}
    check = _grpc_connect(grpc_address)("check")
    latencies: dict[tuple, list[float]] = {}
    walls: dict[tuple, float] = {}
    for workload, settings in WORKLOADS.items():
        expected = {text: _grpc_call(check, text, settings) for text in texts}
        for _ in range(args.passes):
            for clients in args.clients:
                for protocol, (connect, call) in calls.items():
                    key = (workload, clients, protocol)
                    samples, wall = _run(clients, args.requests, texts, connect,
                                         lambda c, t, call=call, s=settings: call(c, t, s), expected)
                    latencies.setdefault(key, []).extend(samples)
                    walls[key] = walls.get(key, 0.0) + wall
    return {key: (samples, walls[key]) for key, samples in latencies.items()}


def _run(clients: int, requests: int, texts: list[str], connect, call, expected: dict[str, str]):
    """`requests` requests from `clients` threads; each request's latency, and the wall time of all."""
    per_client = max(1, requests // clients)
    samples: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        connection = connect(f"bench-{index}")
        mine = []
        start.wait()
        try:
            for i in range(per_client):
                text = texts[(index * per_client + i) % len(texts)]
                began = time.perf_counter()
                out = call(connection, text)
                mine.append(time.perf_counter() - began)
                if out != expected[text]:
                    raise AssertionError(f"output differs from gRPC's for {text!r}")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join(600)
    wall = time.perf_counter() - began
    if errors:
        raise errors[0]
    return samples, wall


def _grpc_connect(address: str):
    def connect(client_id: str):
        channel = grpc.insecure_channel(address)
        return gateway_pb2_grpc.GatewayServiceStub(channel), (("x-client-id", client_id),)

    return connect


def _grpc_call(connection, text: str, settings: dict) -> str:
    stub, metadata = connection
    request = gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(settings))
    return stub.Generate(request, timeout=300, metadata=metadata).text


def _http_connect(address: str):
    host, _, port = address.rpartition(":")

    def connect(client_id: str):
        return http.client.HTTPConnection(host, int(port), timeout=300), client_id

    return connect


def _post(connection, path: str, body: dict) -> dict:
    conn, client_id = connection
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "x-client-id": client_id})
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise AssertionError(f"{path}: {response.status} {data[:200]!r}")
    return json.loads(data)


def _kserve_call(connection, text: str, settings: dict) -> str:
    body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [text]}],
            "outputs": [{"name": "TEXT"}], "parameters": settings}
    return _post(connection, "/v2/models/specdec/infer", body)["outputs"][0]["data"][0]


def _completion_call(connection, text: str, settings: dict) -> str:
    body = {"model": "specdec", "prompt": text, "max_tokens": settings["max_new_tokens"],
            "specdec": {k: v for k, v in settings.items() if k != "max_new_tokens"}}
    return _post(connection, "/v1/completions", body)["choices"][0]["text"]


def _table(rows: dict) -> str:
    lines = ["| request | clients | protocol | requests | mean ms / request | median ms | p90 ms | requests / s | "
             "mean vs gRPC |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (workload, clients, protocol), (samples, wall) in rows.items():
        base = statistics.fmean(rows[(workload, clients, PROTOCOLS[0])][0])
        mean = statistics.fmean(samples)
        p90 = statistics.quantiles(samples, n=10)[-1] if len(samples) > 1 else samples[0]
        lines.append(f"| {workload} | {clients} | {protocol} | {len(samples)} | {mean * 1e3:.1f} | "
                     f"{statistics.median(samples) * 1e3:.1f} | {p90 * 1e3:.1f} | {len(samples) / wall:.1f} | "
                     f"{mean / base:.3f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
