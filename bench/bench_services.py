"""Round-trip overhead of the services: the same inputs decoded in-process and through the gateway.

    python bench/bench_services.py            # print the table
    python bench/bench_services.py --write    # also update "## Services round trip (CPU)" in BENCHMARKS.md
    python bench/bench_services.py --triton   # also: the Triton-hosted verifier against the native one

The three services run as `specdec serve all` in a separate process (as a user runs them); the
client calls `Generate` over loopback with one request in flight. In-process runs `decode()` on
the same bundle, the same verifier backend and the same decoding parameters, so both sides do the
same iterations (the script checks that the outputs are identical). The difference per iteration
is what the gRPC hops, serialisation and the gateway cost. By default the bundle is a tiny random
one (`specdec tiny-bundle`), which makes the model work small and the overhead stand out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.backends import BACKENDS, DEFAULT_BACKEND
from drafter_service.session import make_drafter
from gateway.decode import decode
from gateway.decoding_config import DecodingConfig
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from specdec.bench_report import cpu_name, start_services, write_section
from specdec.benchmark import quick_configs
from verifier_service.session import make_verifier

SECTION = "## Services round trip (CPU)"
TRITON_MODES = ("AR greedy", "IAD", "GAD k=")  # lossless rows: same tokens, so the same iterations
TEXTS = [
    "Я хочу подякувати вам за вашу допомогу.",
    "Вчора ми ходили до парку і бачили багато людей.",
    "We have been living in this city for ten years.",
    "Please send me the report before Monday morning.",
]
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", help="bundle directory (default: a tiny random bundle, seed 0)")
    parser.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5, help="passes over the inputs per mode (median taken)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--triton", action="store_true", help="add the Triton-hosted verifier rows "
                        "(tritonserver from deploy/triton/setup.sh; both verifiers on torch)")
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        bundle_dir = Path(args.bundle) if args.bundle else make_tiny_bundle(Path(tmp) / "bundle", seed=0)
        server, address = start_services(bundle_dir, args.backend)
        try:
            rows = _measure(bundle_dir, address, args)
        finally:
            server.terminate()
            server.wait(timeout=30)
    table = _table(rows)
    if args.triton:
        with tempfile.TemporaryDirectory() as tmp:
            bundle_dir = Path(args.bundle) if args.bundle else make_tiny_bundle(Path(tmp) / "bundle", seed=0)
            table += "\n\n" + _triton_table(_measure_triton(bundle_dir, Path(tmp), args))
    print(table)
    if args.write:
        stamp = (
            f"Machine: {cpu_name()}, {os.cpu_count()} cores; verifier and NAR drafter backend {args.backend}; "
            f"date {dt.date.today().isoformat()}; command `{shlex.join(['python', *sys.argv])}`"
        )
        bundle_note = args.bundle or "a tiny random bundle (`specdec tiny-bundle --seed 0`)"
        note = (
            f"Bundle: {bundle_note}; {len(TEXTS)} inputs, max_new_tokens {args.max_new_tokens}, median of "
            f"{args.repeats} passes. Services: `specdec serve all` in its own process, one request in flight "
            "over loopback. Outputs through the services are identical to in-process in every mode."
        )
        write_section(args.output, SECTION, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _measure(bundle_dir: Path, address: str, args) -> list[dict]:
    bundle = load_bundle(bundle_dir)
    verifier = make_verifier(bundle, args.backend)
    drafter = make_drafter(bundle, args.backend)
    sources = [bundle.tokenizer.encode(t) for t in TEXTS]
    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for bench_config in quick_configs():  # one configuration per mode, as `specdec bench --quick`
            mode = bench_config.name
            overrides = {**bench_config.overrides, "max_new_tokens": args.max_new_tokens, "seed": 1}
            config = DecodingConfig().with_overrides(overrides)
            wire = overrides_to_wire(overrides)
            local_s, remote_s, iterations = [], [], 0
            for _ in range(args.repeats + 1):  # the first pass warms both sides up and is dropped
                t0 = time.perf_counter()
                local = [decode(src, config, verifier, drafter) for src in sources]
                t1 = time.perf_counter()
                remote = [stub.Generate(gateway_pb2.GenerateRequest(text=t, config=wire), timeout=120) for t in TEXTS]
                t2 = time.perf_counter()
                for a, b in zip(local, remote, strict=True):
                    if a.output_ids != list(b.output_ids):
                        raise AssertionError(f"{mode}: services and in-process outputs differ")
                local_s.append(t1 - t0)
                remote_s.append(t2 - t1)
                iterations = sum(r.stats.iterations for r in local)
            local_ms = statistics.median(local_s) * 1000 / len(TEXTS)
            remote_ms = statistics.median(remote_s) * 1000 / len(TEXTS)
            per_request_iterations = iterations / len(TEXTS)
            rows.append(
                {
                    "mode": mode,
                    "iterations": per_request_iterations,
                    "local_ms": local_ms,
                    "remote_ms": remote_ms,
                    "overhead_per_iteration_ms": (remote_ms - local_ms) / per_request_iterations,
                }
            )
    return rows


def _measure_triton(bundle_dir: Path, tmp: Path, args) -> list[dict]:
    """Generate through two gateways: one on the native verifier (torch), one on the same verifier
    hosted by Triton (`verifier_url = triton://...`); per request, both with one request in flight."""
    from specdec.triton_export import export_triton
    from tests.triton.tritonserver import start_triton, why_not_runnable

    reason = why_not_runnable()
    if reason:
        raise SystemExit(f"--triton: {reason}")
    export_triton(bundle_dir, tmp / "repository")
    triton = start_triton(tmp / "repository", tmp / "tritonserver.log")
    native, native_address = start_services(bundle_dir, "torch")
    os.environ["SPECDEC__GATEWAY__VERIFIER_URL"] = triton.url("specdec_verifier")
    try:
        hosted, hosted_address = start_services(bundle_dir, "torch")
    finally:
        del os.environ["SPECDEC__GATEWAY__VERIFIER_URL"]
    rows = []
    try:
        with grpc.insecure_channel(native_address) as a, grpc.insecure_channel(hosted_address) as b:
            stubs = [gateway_pb2_grpc.GatewayServiceStub(a), gateway_pb2_grpc.GatewayServiceStub(b)]
            for bench_config in quick_configs():
                if not bench_config.name.startswith(TRITON_MODES):
                    continue
                overrides = {**bench_config.overrides, "max_new_tokens": args.max_new_tokens, "seed": 1}
                wire = overrides_to_wire(overrides)
                times: list[list[float]] = [[], []]
                for _ in range(args.repeats + 1):
                    outputs = []
                    for side, stub in enumerate(stubs):
                        t0 = time.perf_counter()
                        outputs.append([stub.Generate(gateway_pb2.GenerateRequest(text=t, config=wire), timeout=120)
                                        for t in TEXTS])
                        times[side].append(time.perf_counter() - t0)
                    for x, y in zip(*outputs, strict=True):
                        if list(x.output_ids) != list(y.output_ids):
                            raise AssertionError(f"{bench_config.name}: the Triton-hosted verifier's output differs")
                iterations = sum(r.stats.iterations for r in outputs[0]) / len(TEXTS)
                # The first pass warms both up and is dropped.
                native_ms, hosted_ms = (statistics.median(t[1:]) * 1000 / len(TEXTS) for t in times)
                rows.append({"mode": bench_config.name, "iterations": iterations, "native_ms": native_ms,
                             "triton_ms": hosted_ms, "extra_per_iteration_ms": (hosted_ms - native_ms) / iterations})
    finally:
        for proc in (hosted, native):
            proc.terminate()
            proc.wait(timeout=30)
        triton.stop()
    return rows


def _triton_table(rows: list[dict]) -> str:
    lines = [
        "| configuration (verifier on torch) | iterations / request | native verifier ms / request | "
        "Triton-hosted verifier ms / request | extra ms / iteration |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['iterations']:.1f} | {r['native_ms']:.1f} | {r['triton_ms']:.1f} | "
                     f"{r['extra_per_iteration_ms']:.2f} |")
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    lines = [
        "| configuration | iterations / request | in-process ms / request | services ms / request | ratio | "
        "overhead ms / iteration |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['iterations']:.1f} | {r['local_ms']:.1f} | {r['remote_ms']:.1f} | "
            f"{r['remote_ms'] / r['local_ms']:.2f}x | {r['overhead_per_iteration_ms']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
