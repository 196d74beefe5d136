"""Round-trip overhead of the services: the same inputs decoded in-process and through the gateway.

    python bench/bench_services.py                          # print the table (tiny bundle)
    python bench/bench_services.py --bundle bundles/ua-gec  # the trained bundle
    python bench/bench_services.py --modes "AR greedy"      # only the configurations named so
    python bench/bench_services.py --write    # also update "## Services round trip (CPU)" in BENCHMARKS.md
    python bench/bench_services.py --triton   # also: the Triton-hosted verifier against the native one
    python bench/bench_services.py --greedy-chunks 0,16,1   # AR: one run per request, runs of 16, one step per trip

The services run as `specdec serve all` in a separate process (as a user runs them; `--processes`:
each service in its own process); the client calls `Generate` over loopback with one request in
flight. There is one such stack per AR run length (`--greedy-chunks`, `[gateway] greedy_chunk`: AR
steps per verifier round trip; 0, the default, is a request's whole output in one run, 1 is one round
trip per token; only AR greedy differs, so other modes run on the first value only), and every input
runs in-process and then through each stack in turn, so all are measured under the same load.
In-process runs `decode()` on the same bundle, the same verifier backend and the same decoding
parameters, so every side does the same iterations (the script checks that the outputs are
identical). The difference is what the gRPC hops, serialisation and the gateway cost; with inputs of
different lengths (`--sentences N`, UA-GEC test sentences) the table also splits it into a fixed cost
per request and a cost per iteration. By default the bundle is a tiny random one (`specdec
tiny-bundle`), which makes the model work small and the overhead stand out.

    python bench/bench_services.py --bundle bundles/ua-gec --sentences 24 --max-new-tokens 200
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.backends import BACKENDS, DEFAULT_BACKEND
from core.config import DEVICE_HELP, device_arg
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.session import make_drafter
from evaluation.bench_report import accelerator_note, cpu_name, start_services, write_section
from evaluation.benchmark import quick_configs
from evaluation.loadtest import ua_gec_texts
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from verifier_service.session import make_verifier

SECTION = "## Services round trip (CPU)"  # the tiny bundle; a --bundle run gets its own section
TRAINED_SECTION = "## Services round trip (CPU, trained bundle)"
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
    parser.add_argument("--device", type=device_arg, default="auto",
                        help=f"where the models run, in-process and in the services alike: {DEVICE_HELP}")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sentences", type=int, help="the first N UA-GEC test sentences as inputs (default: four "
                        "fixed sentences); their different lengths let the table split the overhead per request "
                        "and per iteration")
    parser.add_argument("--data-dir", help="prepared data dir whose test.text.jsonl to use (default: ua-gec)")
    parser.add_argument("--repeats", type=int, default=5, help="passes over the inputs per mode (median taken)")
    parser.add_argument("--greedy-chunks", default="0,1",
                        help="[gateway] greedy_chunk values to measure AR greedy with (default: %(default)s)")
    parser.add_argument("--processes", action="store_true", help="serve all --processes (one process per service)")
    parser.add_argument("--modes", help="only the configurations whose name starts with one of these, comma-separated")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--triton", action="store_true", help="add the Triton-hosted verifier rows "
                        "(tritonserver from deploy/triton/setup.sh; both verifiers on torch)")
    parser.add_argument("--output", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    args = parser.parse_args(argv)
    try:
        chunks = [int(c) for c in args.greedy_chunks.split(",") if c.strip()]
    except ValueError:
        chunks = []
    if not chunks or min(chunks) < 0:
        parser.error("--greedy-chunks: comma-separated integers >= 0 (0: no limit)")

    texts = ua_gec_texts(args.sentences, args.data_dir) if args.sentences else TEXTS
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        bundle_dir = Path(args.bundle) if args.bundle else make_tiny_bundle(Path(tmp) / "bundle", seed=0)
        extra = ("--processes",) if args.processes else ()
        addresses = {}
        for chunk in chunks:
            env = {"SPECDEC__GATEWAY__GREEDY_CHUNK": str(chunk)}
            server, addresses[chunk] = start_services(
                bundle_dir, args.backend, env=env, extra_args=(*extra, "--device", args.device)
            )
            stack.callback(_stop, server)
        rows, device = _measure(bundle_dir, addresses, texts, args)
    table = _table(rows)
    if args.triton:
        with tempfile.TemporaryDirectory() as tmp:
            bundle_dir = Path(args.bundle) if args.bundle else make_tiny_bundle(Path(tmp) / "bundle", seed=0)
            table += "\n\n" + _triton_table(_measure_triton(bundle_dir, Path(tmp), args))
    print(table)
    if args.write:
        stamp = (
            f"Machine: {cpu_name()}, {os.cpu_count()} cores{accelerator_note({'models': device})}; "
            f"verifier and NAR drafter backend {args.backend}; "
            f"date {dt.date.today().isoformat()}; command `{shlex.join(['python', *sys.argv])}`"
        )
        bundle_note = args.bundle or "a tiny random bundle (`specdec tiny-bundle --seed 0`)"
        layout = "`specdec serve all --processes` (one process per service)" if args.processes else (
            "`specdec serve all` in its own process"
        )
        note = (
            f"Bundle: {bundle_note}; {_inputs_note(args)}, max_new_tokens {args.max_new_tokens}; every input "
            f"in-process then through each stack, request after request, in {args.repeats} timed passes (after "
            "one to warm up); ms / request: the mean over the inputs of each one's median. Overhead ms / "
            "iteration: (services - in-process) / iterations. The fit splits the same extra time into a fixed "
            "cost per request and a cost per iteration: least squares over the inputs of each input's median "
            "paired difference against its iterations (- where all inputs took the same number). "
            f"Services: {layout}, one request in flight over loopback; "
            "AR steps / trip: the gateway's `greedy_chunk`, the most AR "
            "steps the verifier runs per round trip (`VerifyStep.greedy_steps`; all: the whole output in one "
            f"run; other modes run on {chunks[0] or 'all'}). Outputs through the services are identical to "
            "in-process in every mode."
        )
        section = TRAINED_SECTION if args.bundle else SECTION
        write_section(args.output, section, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _inputs_note(args) -> str:
    if args.sentences:
        return f"the first {args.sentences} UA-GEC test sentences as inputs"
    return f"{len(TEXTS)} fixed inputs"


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=30)


def _measure(
    bundle_dir: Path, addresses: dict[int, str], texts: list[str], args
) -> tuple[list[dict], str]:
    """Per configuration and input: in-process, then through each stack, request after request, in
    `repeats` + 1 passes (the first dropped). Interleaving per request rather than per pass keeps
    slow drifts of the machine out of the differences. Returns the rows and where the in-process
    verifier ran ("cpu", "cuda:0": what --device resolved to)."""
    bundle = load_bundle(bundle_dir)
    verifier = make_verifier(bundle, args.backend, device=args.device)
    drafter = make_drafter(bundle, args.backend, device=args.device)
    sources = [bundle.tokenizer.encode(t) for t in texts]
    wanted = tuple(m.strip() for m in args.modes.split(",")) if args.modes else None
    rows = []
    with contextlib.ExitStack() as stack:
        stubs = {
            key: gateway_pb2_grpc.GatewayServiceStub(stack.enter_context(grpc.insecure_channel(address)))
            for key, address in addresses.items()
        }
        first_chunk = next(iter(addresses))
        for bench_config in quick_configs():  # one configuration per mode, as `specdec bench --quick`
            mode = bench_config.name
            if wanted is not None and not mode.startswith(wanted):
                continue
            overrides = {**bench_config.overrides, "max_new_tokens": args.max_new_tokens, "seed": 1}
            config = DecodingConfig().with_overrides(overrides)
            wire = overrides_to_wire(overrides)
            # Only AR greedy takes runs of steps: the other modes are the same on every chunk.
            mode_stubs = {k: s for k, s in stubs.items() if k == first_chunk or config.mode == Mode.AR}
            local_s: list[list[float]] = [[] for _ in texts]
            remote_s = {key: [[] for _ in texts] for key in mode_stubs}
            iterations = [0] * len(texts)
            for rep in range(args.repeats + 1):
                for i, (src, text) in enumerate(zip(sources, texts, strict=True)):
                    t0 = time.perf_counter()
                    local = decode(src, config, verifier, drafter)
                    elapsed = time.perf_counter() - t0
                    iterations[i] = local.stats.iterations
                    for key, stub in mode_stubs.items():
                        t1 = time.perf_counter()
                        remote = stub.Generate(gateway_pb2.GenerateRequest(text=text, config=wire), timeout=120)
                        if rep:  # the first pass warms every side up
                            remote_s[key][i].append(time.perf_counter() - t1)
                        if local.output_ids != list(remote.output_ids):
                            raise AssertionError(f"{mode} ({key}): services and in-process outputs differ")
                    if rep:
                        local_s[i].append(elapsed)
            local_ms = 1000 * statistics.fmean(statistics.median(t) for t in local_s)
            per_request_iterations = statistics.fmean(iterations)
            for chunk, times in remote_s.items():
                remote_ms = 1000 * statistics.fmean(statistics.median(t) for t in times)
                # Per input, the median of its paired differences; then the line through them.
                diffs_ms = [1000 * statistics.median(r - x for r, x in zip(rs, ls, strict=True))
                            for rs, ls in zip(times, local_s, strict=True)]
                rows.append(
                    {
                        "mode": mode,
                        "chunk": chunk if config.mode == Mode.AR else None,
                        "iterations": per_request_iterations,
                        "local_ms": local_ms,
                        "remote_ms": remote_ms,
                        "overhead_per_iteration_ms": (remote_ms - local_ms) / per_request_iterations,
                        "fit": _fixed_and_per_iteration(iterations, diffs_ms),
                    }
                )
    return rows, str(getattr(verifier, "device", "cpu"))


def _fixed_and_per_iteration(iterations: list[int], diffs_ms: list[float]) -> tuple[float, float] | None:
    """The services' extra time per request split as `fixed + per_iteration * iterations`, by least
    squares over the inputs (None when every input took the same number of iterations)."""
    if len(set(iterations)) < 2:
        return None
    per_iteration, fixed = np.polyfit(np.asarray(iterations, dtype=float), np.asarray(diffs_ms), 1)
    return float(fixed), float(per_iteration)


def _measure_triton(bundle_dir: Path, tmp: Path, args) -> list[dict]:
    """Generate through two gateways: one on the native verifier (torch), one on the same verifier
    hosted by Triton (`verifier_url = triton://...`); per request, both with one request in flight."""
    from tests.triton.tritonserver import start_triton, why_not_runnable
    from verifier_service.triton_export import export_triton

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
        "| configuration | AR steps / trip | iterations / request | in-process ms / request "
        "| services ms / request | ratio | overhead ms / iteration | fit: fixed ms / request | "
        "fit: ms / iteration |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        chunk = "" if r["chunk"] is None else str(r["chunk"] or "all")
        fixed, per_iteration = (f"{r['fit'][0]:.2f}", f"{r['fit'][1]:.3f}") if r["fit"] else ("-", "-")
        lines.append(
            f"| {r['mode']} | {chunk} | {r['iterations']:.1f} | {r['local_ms']:.1f} | "
            f"{r['remote_ms']:.1f} | {r['remote_ms'] / r['local_ms']:.2f}x | {r['overhead_per_iteration_ms']:.2f} | "
            f"{fixed} | {per_iteration} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
