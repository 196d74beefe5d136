"""The services' transport on one host: Unix-domain sockets against TCP loopback.

    python bench/bench_transport.py            # prints the table
    python bench/bench_transport.py --write    # also replaces "## Transport (one host)" in BENCHMARKS.md

Two `specdec serve all --processes` stacks on the bundled models (ONNX Runtime) are up at once: one
whose three services listen on TCP loopback ports, one on `unix:///...` sockets (the gateway's own
address too). For AR greedy and GAD k=10 the same UA-GEC test sentences go through each stack in
turn, one request in flight, over several interleaved rounds; the table gives ms per sentence and
per iteration (the best round of each), and the difference per iteration: what the transport costs
on every round trip of the accept loop.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, start_services, write_section
from evaluation.loadtest import ua_gec_texts
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Transport (one host)"
MODES = {"AR greedy": {"mode": "ar"}, "GAD k=10": {"mode": "gad", "k": 10}}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, ROOT, data_dir=False)
    p.add_argument("--sentences", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    texts = ua_gec_texts(args.sentences)
    with tempfile.TemporaryDirectory() as tmp:
        stacks = {"tcp": _start(args.bundle, "tcp", Path(tmp)), "unix": _start(args.bundle, "unix", Path(tmp))}
        try:
            rows = _measure(stacks, texts, args)
        finally:
            for proc, _ in stacks.values():
                proc.terminate()
                proc.wait(timeout=60)
    table = _table(rows)
    print(table)
    if args.write:
        stamp = machine_stamp("ONNX Runtime")
        note = (f"Bundle: {Path(args.bundle).name}; the first {len(texts)} UA-GEC test sentences, one Generate in "
                f"flight, max_new_tokens {args.max_new_tokens}; best of {args.rounds} interleaved rounds. Both stacks "
                "are `specdec serve all --processes`, up at once; outputs are identical on both.")
        write_section(args.output, SECTION, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _measure(stacks: dict, texts: list[str], args) -> list[dict]:
    rows = []
    for name, overrides in MODES.items():
        wire = overrides_to_wire({**overrides, "max_new_tokens": args.max_new_tokens})
        best: dict[str, float] = {}
        iterations: dict[str, int] = {}
        outputs: dict[str, list] = {}
        for _ in range(args.rounds):
            for transport, (_, address) in stacks.items():
                with grpc.insecure_channel(address) as channel:
                    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                    stub.Generate(gateway_pb2.GenerateRequest(text=texts[0], config=wire), timeout=120)  # warm
                    t0 = time.perf_counter()
                    replies = [stub.Generate(gateway_pb2.GenerateRequest(text=t, config=wire), timeout=120)
                               for t in texts]
                    elapsed = time.perf_counter() - t0
                best[transport] = min(best.get(transport, float("inf")), elapsed)
                iterations[transport] = sum(r.stats.iterations for r in replies)
                outputs[transport] = [list(r.output_ids) for r in replies]
        if outputs["tcp"] != outputs["unix"]:
            raise AssertionError(f"{name}: the two transports' outputs differ")
        n = iterations["tcp"]
        rows.append({"mode": name, "iterations": n / len(texts),
                     **{f"{t}_ms": 1000 * best[t] / len(texts) for t in stacks},
                     **{f"{t}_it_ms": 1000 * best[t] / n for t in stacks}})
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| mode | iterations / sentence | TCP ms / sentence | Unix ms / sentence | TCP ms / iteration | "
             "Unix ms / iteration | Unix - TCP ms / iteration |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['iterations']:.1f} | {r['tcp_ms']:.1f} | {r['unix_ms']:.1f} | "
                     f"{r['tcp_it_ms']:.3f} | {r['unix_it_ms']:.3f} | {r['unix_it_ms'] - r['tcp_it_ms']:+.3f} |")
    return "\n".join(lines)


def _start(bundle: str, transport: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    # The later address flags override start_services' TCP loopback ones.
    unix = [x for role in ("gateway", "verifier", "drafter") for x in (f"--{role}-addr", f"unix://{tmp}/{role}.sock")]
    flags = ("--processes", *(unix if transport == "unix" else ()))
    return start_services(Path(bundle), "onnxruntime", extra_args=flags)


if __name__ == "__main__":
    sys.exit(main())
