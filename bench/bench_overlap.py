"""Overlapped drafting and pre-verify through the services: each mode with both off, then each on, in one run.

    python bench/bench_overlap.py                   # prints the table
    python bench/bench_overlap.py --write           # also replaces "## Overlapped drafting" in BENCHMARKS.md
    python bench/bench_overlap.py --sentences 60    # a short check
    python bench/bench_overlap.py --precision int8 --write   # int8 models: "## Overlapped drafting (int8)"

The services on the bundled models (ONNX Runtime, TCP loopback), in two layouts (`--layouts`):
`shared`, one `specdec serve all --processes` stack whose verifier and drafter each take every core,
and `own-cores`, verifier and drafter each pinned to a core of its own with one thread, as on
devices of their own. A machine with a GPU has a third, `gpu-verifier`: the verifier on CUDA
(torch) and the drafter on four CPU cores of its own, two devices that really work at once (two
services on one GPU take turns on it). For GAD k=10, GAD++ and MJSD the same UA-GEC test sentences
go through the gateway one request in flight, plain, with overlap (the per-request `overlap` field, so the same
servers serve all), with pre-verify (`preverify`; GAD and GAD++) and with both: each sentence
through every variant in turn, the order turning from one sentence to the next, over several
rounds; the table gives ms per sentence (the sum of each sentence's best time), the speed-ups,
the pre-draft hit rate (pre-drafted blocks used / started: a hit needs the block accepted in full
and the drafter's guess of the verifier's token right), pre-verify's share of blocks cut at their
first token (never verified), and whether the outputs are identical to the plain loop's.

It also gives the most overlap could save at the hit rate it had: a used pre-draft ran beside a
verifier call, so it takes the shorter of the two, a drafter call (GAD) or a verifier call (MJSD,
whose beam drafts cost more), off the critical path, nothing more; the ceiling is
off / (off - used pre-drafts x min(drafter, verifier) ms per iteration), with the verifier's ms per
iteration and the drafter's per iteration after a sentence's first from the gateway's stats of the
overlap-off run (`verifier_time_ms`, `drafter_time_ms` less `first_draft_ms`, round trips included):
a pre-draft is never a sentence's first draft, whose wait includes the drafter's encoder run.
Overlap that runs drafter and verifier on the same cores stays below it, as each slows the other.
And the most it could save at all: every block but a sentence's first drafted ahead and used
(nothing is verified yet beside the first), off / (off - (iterations - 1) x min(drafter, verifier)
ms per iteration) a sentence.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.backends import BACKENDS
from evaluation.bench_report import bench_parser, machine_stamp, start_services, write_section
from evaluation.loadtest import ua_gec_texts
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Overlapped drafting"
MODES = {"GAD k=10": {"mode": "gad", "k": 10}, "GAD++ k=10": {"mode": "gad++", "k": 10}, "MJSD": {"mode": "mjsd"}}
PREVERIFY_MODES = ("gad", "gad++")  # modes whose accept rule decides each position alone


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, ROOT)
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    p.add_argument("--precision", default="fp32", choices=("fp32", "int8"),
                   help="the verifier's and the NAR drafter's precision (int8: ONNX Runtime only)")
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--layouts", default="shared,own-cores",
                   help="comma-separated: shared (serve all --processes, every core for each model), own-cores "
                        "(verifier and drafter each pinned to a core of its own, one thread: their own devices), "
                        "gpu-verifier (the verifier on CUDA, the drafter on four CPU cores of its own)")
    args = p.parse_args(argv)
    if "gpu-verifier" in args.layouts.split(",") and args.precision != "fp32":
        p.error("gpu-verifier runs the verifier on torch: --precision fp32 only")
    texts = ua_gec_texts(args.sentences, args.data_dir)
    tables = []
    for layout in args.layouts.split(","):
        procs, address = LAYOUTS[layout](Path(args.bundle), args.backend, ("--precision", args.precision))
        try:
            rows = _measure(address, texts, args)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
        tables.append(f"{LAYOUT_TITLES[layout]}:\n\n{_table(rows)}")
        print(tables[-1], flush=True)
    table = "\n\n".join(tables)
    if args.write:
        stamp = machine_stamp(f"backend {args.backend}, {args.precision}")
        note = (f"Bundle: {Path(args.bundle).name}; the first {len(texts)} UA-GEC test sentences through "
                "the services (TCP loopback; the layouts below), one Generate in flight, max_new_tokens "
                f"{args.max_new_tokens}; each sentence through plain, overlap, pre-verify and both in turn (the "
                f"order turning sentence by sentence), {args.rounds} rounds, the sum of each sentence's best time. "
                "Overlap: the next block drafted while the verifier verifies this one; hit rate: "
                "pre-drafted blocks used / started. Pre-verify: after a cut block, the verifier's plain AR step "
                "for the next block's first position runs while the drafter drafts that block; a block whose "
                "first token fails there is never verified (pre-verified blocks cut at the first token: their "
                "share). Both: overlap and pre-verify at once. GAD's outputs are identical by construction "
                "(asserted). Drafter and verifier ms: the gateway's stats of the plain run, round trips included; "
                "first draft: the wait for a sentence's first draft, with the drafter's encoder run (nothing is "
                "verified beside it, so nothing can hide it); drafter ms / later iteration: the mean wait for the "
                "others. Ceiling: what overlap would give at its hit rate if it cost nothing, each used pre-draft "
                "taking the shorter of a later drafter call and the verifier call it ran beside off the critical "
                "path: off / (off - used pre-drafts x min(drafter, verifier) ms / iteration); at every hit: every "
                "block but a sentence's first drafted ahead, off / (off - (iterations - 1) x min(drafter, "
                "verifier) ms / iteration).")
        heading = SECTION if args.precision == "fp32" else f"{SECTION} ({args.precision})"
        write_section(args.output, heading, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _shared(bundle: Path, backend: str, flags: tuple[str, ...]) -> tuple[list[subprocess.Popen], str]:
    proc, address = start_services(bundle, backend, extra_args=("--processes", *flags))
    return [proc], address


def _own_cores(bundle: Path, backend: str, flags: tuple[str, ...]) -> tuple[list[subprocess.Popen], str]:
    """Verifier on CPU 0 and drafter on CPU 1, one intra-op thread each; the gateway and this client
    on whatever the scheduler gives them. Drafter and verifier then work at the same time without
    taking each other's cores, as on devices of their own (the gateway still shares them)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("own-cores needs two CPUs")
    return _separate(bundle, flags, _Place(backend, {cpus[0]}, 1), _Place(backend, {cpus[1]}, 1), None)


def _gpu_verifier(bundle: Path, backend: str, flags: tuple[str, ...]) -> tuple[list[subprocess.Popen], str]:
    """The verifier on the GPU (torch on CUDA, two cores to drive it) and the drafter on CPU cores of
    its own (`backend`, four threads): the two models on devices of their own with one accelerator,
    so their work overlaps for real (two processes on one GPU take turns on it). The gateway and
    this client get the other cores."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu-verifier needs a CUDA device")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 8:
        raise SystemExit("gpu-verifier needs eight CPUs (two for the verifier, four for the drafter, the rest)")
    verifier = _Place("torch", set(cpus[:2]), 2, {"SPECDEC__VERIFIER__DEVICE": "cuda"})
    drafter = _Place(backend, set(cpus[2:6]), 4, {"SPECDEC__DRAFTER__DEVICE": "cpu"})
    return _separate(bundle, flags, verifier, drafter, set(cpus[6:]))


@dataclass
class _Place:
    """Where one model service runs: its backend, the CPUs it is pinned to, its intra-op threads."""

    backend: str
    cpus: set[int]
    threads: int
    env: dict[str, str] = field(default_factory=dict)


def _separate(bundle: Path, flags: tuple[str, ...], verifier: _Place, drafter: _Place,
              gateway_cpus: set[int] | None) -> tuple[list[subprocess.Popen], str]:
    """Verifier, drafter and gateway as three `specdec serve` processes placed as given."""
    procs: list[subprocess.Popen] = []

    def serve(role: str, place: _Place, *role_flags: str) -> str:
        proc, address = start_services(bundle, place.backend, env=place.env,
                                       extra_args=(f"--{role}-threads", str(place.threads), *role_flags, *flags),
                                       role=role, cpus=place.cpus)
        procs.append(proc)
        return address

    try:
        verifier_address = serve("verifier", verifier)
        drafter_address = serve("drafter", drafter)
        # The gateway loads no model: neither backend nor precision applies to it.
        proc, gateway = start_services(bundle, drafter.backend, role="gateway", cpus=gateway_cpus, extra_args=(
            "--verifier-addr", verifier_address, "--drafter-addr", drafter_address))
        procs.append(proc)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    return procs, gateway


LAYOUTS = {"shared": _shared, "own-cores": _own_cores, "gpu-verifier": _gpu_verifier}
LAYOUT_TITLES = {
    "shared": "`specdec serve all --processes`, verifier and drafter each on every core (the default threads)",
    "own-cores": "Verifier and drafter each pinned to a core of its own, one thread each (their own devices, "
                 "emulated); the gateway and the client unpinned",
    "gpu-verifier": "Verifier on the GPU (torch, CUDA), drafter on four CPU cores of its own (four threads); "
                    "the gateway and the client on the other cores",
}


def _measure(address: str, texts: list[str], args) -> list[dict]:
    rows = []
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for name, overrides in MODES.items():
            # Every flag set: both are on by default.
            variants = {"off": {"overlap": False, "preverify": False}, "overlap": {"overlap": True, "preverify": False}}
            if overrides["mode"] not in PREVERIFY_MODES:  # a mode without pre-verify refuses the parameter
                variants = {variant: {"overlap": extra["overlap"]} for variant, extra in variants.items()}
            else:
                variants["preverify"] = {"overlap": False, "preverify": True}
                variants["both"] = {"overlap": True, "preverify": True}
            wires = {variant: overrides_to_wire({**overrides, "max_new_tokens": args.max_new_tokens, **extra})
                     for variant, extra in variants.items()}
            for wire in wires.values():  # warm
                stub.Generate(gateway_pb2.GenerateRequest(text=texts[0], config=wire), timeout=120)
            # Each sentence through every variant in turn (the order turning from one sentence to the
            # next), its best time over the rounds: variants compared on the same moments of a host
            # whose speed drifts, not on passes minutes apart.
            fastest = {variant: [float("inf")] * len(texts) for variant in variants}
            replies: dict[str, list] = {variant: [None] * len(texts) for variant in variants}
            names = list(variants)
            for round_ in range(args.rounds):
                for i, text in enumerate(texts):
                    turn = (i + round_) % len(names)
                    for variant in names[turn:] + names[:turn]:
                        t0 = time.perf_counter()
                        replies[variant][i] = stub.Generate(
                            gateway_pb2.GenerateRequest(text=text, config=wires[variant]), timeout=120)
                        fastest[variant][i] = min(fastest[variant][i], time.perf_counter() - t0)
            best = {variant: sum(times) for variant, times in fastest.items()}
            plain = replies["off"]
            same = sum(all(list(r[i].output_ids) == list(plain[i].output_ids) for r in replies.values())
                       for i in range(len(texts)))
            if overrides["mode"] == "gad" and same != len(texts):
                raise AssertionError(f"{name}: overlap or pre-verify changed {len(texts) - same} outputs")
            started = sum(r.stats.predrafts for r in replies["overlap"])
            used = sum(r.stats.predrafts_used for r in replies["overlap"])
            iterations_off = max(1, sum(r.stats.iterations for r in plain))
            # A pre-draft is never a sentence's first draft, whose wait includes the drafter's
            # encoder run: what one can hide is a later draft's cost.
            first_total = sum(r.stats.first_draft_ms for r in plain)
            later = max(1, iterations_off - len(texts))
            drafter_ms = (sum(r.stats.drafter_time_ms for r in plain) - first_total) / later
            verifier_ms = sum(r.stats.verifier_time_ms for r in plain) / iterations_off
            hidden_ms = min(drafter_ms, verifier_ms)  # a used pre-draft ran beside one verifier call
            off_ms = 1000 * best["off"] / len(texts)
            row = {
                "mode": name, "off_ms": off_ms, "on_ms": 1000 * best["overlap"] / len(texts),
                "first_ms": first_total / len(texts), "drafter_ms": drafter_ms, "verifier_ms": verifier_ms,
                "ceiling": _ceiling(off_ms, used / len(texts), hidden_ms),
                # Every block but a sentence's first could be drafted ahead: all hits hide that many calls.
                "all_hits": _ceiling(off_ms, (iterations_off - len(texts)) / len(texts), hidden_ms),
                "iterations": iterations_off / len(texts),
                "hit_rate": used / started if started else 0.0, "identical": same / len(texts),
                "degraded": sum(r.stats.degraded for rs in replies.values() for r in rs),
            }
            if "preverify" in replies:
                pre = replies["preverify"]
                row["pre_ms"] = 1000 * best["preverify"] / len(texts)
                checked = max(1, sum(r.stats.preverified for r in pre))
                row["cut_rate"] = sum(r.stats.preverify_cuts for r in pre) / checked
                row["both_ms"] = 1000 * best["both"] / len(texts)
            rows.append(row)
    return rows


def _ceiling(off_ms: float, hidden_calls: float, hidden_ms: float) -> float:
    """The speed-up if `hidden_calls` calls of `hidden_ms` a sentence left the critical path at no cost."""
    return off_ms / max(off_ms - hidden_calls * hidden_ms, 1e-9)


def _table(rows: list[dict]) -> str:
    lines = ["| mode | iterations / sentence | off ms / sentence | overlap ms / sentence | overlap speed-up | "
             "pre-draft hit rate | ceiling at this hit rate | ceiling at every hit | pre-verify ms / sentence | "
             "pre-verify speed-up | "
             "pre-verified blocks cut at the first token | both ms / sentence | both speed-up | identical outputs | "
             "first draft ms | drafter ms / later iteration | verifier ms / iteration |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pre = (f"{r['pre_ms']:.1f} | {r['off_ms'] / r['pre_ms']:.2f}x | {100 * r['cut_rate']:.0f}% | "
               f"{r['both_ms']:.1f} | {r['off_ms'] / r['both_ms']:.2f}x" if "pre_ms" in r else "- | - | - | - | -")
        lines.append(f"| {r['mode']} | {r['iterations']:.1f} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | "
                     f"{r['off_ms'] / r['on_ms']:.2f}x | {100 * r['hit_rate']:.0f}% | {r['ceiling']:.2f}x | "
                     f"{r['all_hits']:.2f}x | {pre} | {100 * r['identical']:.1f}% | {r['first_ms']:.1f} | "
                     f"{r['drafter_ms']:.1f} | {r['verifier_ms']:.1f} |")
    if any(r["degraded"] for r in rows):
        lines.append(f"\n{sum(r['degraded'] for r in rows)} requests fell back to AR (drafter failures).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
