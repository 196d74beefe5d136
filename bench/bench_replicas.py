"""Verifier replicas under load: one gateway over one verifier replica against one over two, same run.

    python bench/bench_replicas.py                    # prints the table
    python bench/bench_replicas.py --write            # also replaces "## Verifier replicas" in BENCHMARKS.md
    python bench/bench_replicas.py --sentences 32     # a short check

Two `specdec serve verifier` processes and one `specdec serve drafter` run on loopback, each with
`--verifier-threads` / `--drafter-threads` intra-op threads (1 by default), and two `specdec serve
gateway` processes: "1 replica" lists the first verifier, "2 replicas" both (the gateway's replica
set places each session on the replica with the most free sessions). Every cell is a closed-loop
`specdec loadtest` run of the first `--sentences` UA-GEC test sentences at `--clients` clients
(32), one Generate each, for AR greedy and GAD k=10; the two layouts alternate within each mode
and round, and the table keeps each cell's best round. The "sessions on replica 2" column is the
share of the 2-replica gateway's verifier sessions the second replica took
(`specdec_gateway_replica_requests_total`).
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import machine_stamp, start_services, write_section
from evaluation.loadtest import LoadReport, LoadSpec, run_load, ua_gec_texts

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Verifier replicas"
MODES = {"AR greedy": {"mode": "ar"}, "GAD k=10": {"mode": "gad", "k": 10}}
LAYOUTS = ("1 replica", "2 replicas")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(ROOT / "bundles" / "ua-gec"))
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--sentences", type=int, default=96)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--verifier-threads", type=int, default=1)
    p.add_argument("--drafter-threads", type=int, default=1)
    p.add_argument("--write", action="store_true", help=f"replace {SECTION!r} in BENCHMARKS.md")
    args = p.parse_args(argv)
    texts = ua_gec_texts(args.sentences)
    bundle = Path(args.bundle)
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            verifiers = []
            for i in range(2):
                proc, address = start_services(
                    bundle, args.backend, role="verifier", log=Path(tmp) / f"verifier-{i}.log",
                    extra_args=("--verifier-threads", str(args.verifier_threads)),
                )
                procs.append(proc)
                verifiers.append(address)
            proc, drafter = start_services(bundle, args.backend, role="drafter", log=Path(tmp) / "drafter.log",
                                           extra_args=("--drafter-threads", str(args.drafter_threads)))
            procs.append(proc)
            gateways, metrics = {}, {}
            for layout, listed in zip(LAYOUTS, (verifiers[:1], verifiers), strict=True):
                metrics[layout] = _free_port()
                env = {"SPECDEC__GATEWAY__WORKERS": str(args.clients), "SPECDEC__GATEWAY__MAX_QUEUED": "256",
                       "SPECDEC__GATEWAY__METRICS_ADDRESS": f"127.0.0.1:{metrics[layout]}"}
                proc, gateways[layout] = start_services(
                    bundle, args.backend, role="gateway", env=env, log=Path(tmp) / f"gateway-{len(listed)}.log",
                    extra_args=("--verifier-addr", ",".join(listed), "--drafter-addr", drafter),
                )
                procs.append(proc)
            best: dict[tuple[str, str], LoadReport] = {}
            for name, overrides in MODES.items():
                for round_ in range(args.rounds):
                    order = LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]
                    for layout in order:
                        spec = LoadSpec(gateways[layout], texts, {**overrides, "max_new_tokens": 200},
                                        concurrency=args.clients, requests=len(texts), warmup=8)
                        report = run_load(spec)
                        print(f"{name:10} {layout:10} round {round_}: {report.requests_per_s:.2f} req/s, "
                              f"errors {sum(report.errors.values())}", file=sys.stderr)
                        key = (name, layout)
                        if key not in best or report.requests_per_s > best[key].requests_per_s:
                            best[key] = report
            share = _second_share(metrics["2 replicas"], verifiers)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    body = _table(args, best, share)
    print(body)
    if args.write:
        write_section(ROOT / "BENCHMARKS.md", SECTION, body)
    return 0


def _table(args, best: dict[tuple[str, str], LoadReport], share: float) -> str:
    stamp = machine_stamp(f"backend {args.backend}", f"verifier threads {args.verifier_threads} per replica",
                          f"drafter threads {args.drafter_threads}")
    lines = [
        stamp, "",
        f"Bundle: {Path(args.bundle).name}; the first {args.sentences} UA-GEC test sentences, one Generate each, "
        f"max_new_tokens 200, {args.clients} clients (closed loop), best of {args.rounds} rounds; two `serve "
        "verifier` processes, one `serve drafter`, two `serve gateway` (one over the first verifier, one over "
        "both), all on this host. Speed-up: 2 replicas over 1.", "",
        "| mode | verifier replicas | requests/s | output tokens/s | p50 ms | p95 ms | errors | speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in MODES:
        one = best[(name, LAYOUTS[0])].requests_per_s
        for layout in LAYOUTS:
            r = best[(name, layout)]
            lat = r.latency_ms or {}
            speed = f"{r.requests_per_s / one:.2f}x" if layout == LAYOUTS[1] and one else ""
            lines.append(f"| {name} | {layout.split()[0]} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
                         f"{lat.get('p50', 0):.1f} | {lat.get('p95', 0):.1f} | {sum(r.errors.values())} | {speed} |")
    lines += ["", f"Sessions on replica 2 (2-replica gateway, all cells): {share:.0%}."]
    return "\n".join(lines)


def _second_share(port: int, verifiers: list[str]) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    placed = {}
    for line in body.splitlines():
        if line.startswith("specdec_gateway_replica_requests_total{") and 'role="verifier"' in line:
            labels, _, value = line.rpartition(" ")
            placed[next(v for v in verifiers if f'replica="{v}"' in labels)] = float(value)
    total = sum(placed.values())
    return placed.get(verifiers[1], 0.0) / total if total else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
