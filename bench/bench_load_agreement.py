"""Outputs under batching on the trained bundle: how often a loaded, batching `serve all` gives
exactly the unbatched greedy output, and that every difference is a near-tie.

    python bench/bench_load_agreement.py                  # 64 UA-GEC test sentences, 32 clients
    python bench/bench_load_agreement.py --write          # also replace the section in BENCHMARKS.md
    python bench/bench_load_agreement.py --sentences 16 --modes gad   # a quick check

`specdec serve all --processes` runs on the bundle (ONNX Runtime by default) with batching on (the
services' default batching keys; the gateway's workers and limits raised so every client decodes at
once). Each mode (AR greedy, GAD k=10, IAD k=32) sends the first `--sentences` usable UA-GEC test
sentences, one request each, from `--clients` closed-loop clients (`evaluation.loadtest` with `record`).
The same sentences are decoded in-process, one at a time, with AR greedy on the same backend: the
reference that lossless modes must reproduce.

Batched float32 arithmetic differs from one-row arithmetic in the last bits (other reduction
orders, padded rows), so an argmax between two almost equal log-probs can flip. For every output
that differs from the reference, the first differing position is found and the in-process,
unbatched verifier scores it given the common prefix: the gap between its top-2 log-probs there,
and which two tokens the outputs chose (EOS where one output ended). A mismatch counts as a
near-tie when the gap is below `--near-tie` (default 1e-3 nats).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench_load import MODES as LOAD_MODES

from core.backends import BACKENDS
from evaluation.bench_report import cpu_name, start_services, write_section
from evaluation.loadtest import LoadReport, LoadSpec, run_load, ua_gec_texts

SECTION = "## Load: outputs under batching (agreement)"
ROOT = Path(__file__).resolve().parents[1]
# The modes as the load benchmark names them (its beam 5 is no lossless mode to compare with greedy).
MODES = {key: LOAD_MODES[key] for key in ("ar", "gad", "iad")}
WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class Mismatch:
    sentence: int
    position: int  # first differing output position
    served: int  # token the served output has there (EOS: it ended)
    greedy: int  # token the unbatched greedy output has there
    gap: float  # top-1 minus top-2 log-prob at that position, given the common prefix
    chosen_gap: float  # log p(greedy's token) - log p(served's token) there
    top2: tuple[int, int]


@dataclass
class ModeResult:
    name: str
    report: LoadReport
    agree: int
    total: int
    mismatches: list[Mismatch]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from seq2seq_models.bundle import load_bundle
    from verifier_service.session import make_verifier

    bundle = load_bundle(args.bundle)
    verifier = make_verifier(bundle, args.backend)
    texts, sources = _usable(ua_gec_texts(args.sentences * 2, args.data_dir), bundle.tokenizer,
                             verifier.max_source_len, args.sentences)
    max_new = min(args.max_new_tokens, verifier.max_target_len)
    print(f"bench_load_agreement: {len(texts)} sentences; unbatched in-process greedy ...", file=sys.stderr)
    greedy = [_greedy(verifier, src, max_new) for src in sources]

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server, address, metrics_url = _start(args, Path(tmp))
        try:
            for key in args.modes.split(","):
                name, overrides = MODES[key]
                spec = LoadSpec(address, texts, {**overrides, "max_new_tokens": max_new}, concurrency=args.clients,
                                requests=len(texts), timeout=600, warmup=WARMUP_REQUESTS, metrics_urls=[metrics_url],
                                record=True)
                report = run_load(spec)
                results.append(_compare(name, report, greedy, sources, verifier, bundle.verifier.config.eos_id))
                r = results[-1]
                print(f"{name:>10}: {r.agree}/{r.total} equal greedy, {report.output_tokens_per_s:.1f} tokens/s, "
                      f"batch rows {_rows(report)}, errors {report.errors or 'none'}", file=sys.stderr, flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)

    table = format_table(results, args.near_tie)
    details = format_mismatches(results, args.near_tie)
    print(table)
    print()
    print(details)
    if args.write:
        write_section(args.output, SECTION, _section_body(args, len(texts), max_new, table, details))
    ok = all(r.report.ok == r.report.requests for r in results)
    return 0 if ok and all(m.gap < args.near_tie for r in results for m in r.mismatches) else 1


def format_table(results: list[ModeResult], near_tie: float) -> str:
    lines = ["| mode | requests | equal to greedy | agreement | mismatches | near-ties (gap < "
             f"{near_tie:g}) | largest gap | mean batch rows | output tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gaps = [m.gap for m in r.mismatches]
        near = sum(g < near_tie for g in gaps)
        largest = f"{max(gaps):.2e}" if gaps else "-"
        rate = r.agree / r.total if r.total else 0.0
        lines.append(f"| {r.name} | {r.total} | {r.agree} | {100 * rate:.1f}% | {len(gaps)} | {near} | {largest} | "
                     f"{_rows(r.report)} | {r.report.output_tokens_per_s:.1f} |")
    return "\n".join(lines)


def format_mismatches(results: list[ModeResult], near_tie: float) -> str:
    rows = [(r.name, m) for r in results for m in r.mismatches]
    if not rows:
        return "No output differed from the unbatched greedy output: no mismatch to score."
    lines = ["Every mismatch, at its first differing position (given the common prefix, unbatched verifier):", "",
             "| mode | sentence | position | served token | greedy token | top-2 gap | log p(greedy) - log p(served) "
             "| near-tie |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, m in rows:
        lines.append(f"| {name} | {m.sentence} | {m.position} | {m.served} | {m.greedy} | {m.gap:.2e} | "
                     f"{m.chosen_gap:.2e} | {'yes' if m.gap < near_tie else 'NO'} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------


def _compare(name: str, report: LoadReport, greedy: list[list[int]], sources: list[list[int]], verifier,
             eos_id: int) -> ModeResult:
    mismatches = []
    agree = 0
    for i, want in enumerate(greedy):
        got = report.outputs.get(i)
        if got is None:  # failed: counted in the report's errors, not as agreement
            continue
        if got == want:
            agree += 1
            continue
        p = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        served = got[p] if p < len(got) else eos_id
        reference = want[p] if p < len(want) else eos_id
        mismatches.append(_score(i, p, served, reference, sources[i], want[:p], verifier))
    return ModeResult(name, report, agree, len(report.outputs), mismatches)


def _score(sentence: int, position: int, served: int, reference: int, source: list[int], prefix: list[int],
           verifier) -> Mismatch:
    """The unbatched verifier's log-probs at `position` given the common prefix."""
    session = verifier.open(source)
    try:
        # The prefix is appended, nothing drafted: the one position returned is the next token's.
        full = session.step(0, prefix, [], verifier.vocab_size)
    finally:
        session.close()
    ids, logprobs = full.topk_ids[-1], full.topk_logprobs[-1]
    lp = dict(zip(ids, logprobs, strict=True))
    return Mismatch(sentence, position, served, reference, float(logprobs[0] - logprobs[1]),
                    float(lp[reference] - lp[served]), (int(ids[0]), int(ids[1])))


def _greedy(verifier, source: list[int], max_new: int) -> list[int]:
    from decoding.config import DecodingConfig
    from decoding.decode import decode

    config = DecodingConfig().with_overrides({"mode": "ar", "max_new_tokens": max_new})
    return decode(source, config, verifier).output_ids


def _usable(texts: list[str], tokenizer, max_source_len: int, n: int) -> tuple[list[str], list[list[int]]]:
    """The first `n` texts whose encoding fits the verifier (the gateway refuses the others)."""
    kept = [(t, ids) for t in texts if (ids := tokenizer.encode(t)) and len(ids) <= max_source_len][:n]
    return [t for t, _ in kept], [ids for _, ids in kept]


def _rows(report: LoadReport) -> str:
    rows = [v for name, v in report.mean_batch_rows.items() if "verifier" in name]
    return f"{rows[0]:.2f}" if rows else "-"


def _start(args, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    """`specdec serve all --processes`, batching on with the services' defaults, room for every client."""
    metrics = {s: f"127.0.0.1:{_free_port()}" for s in ("verifier", "drafter")}
    clients = args.clients
    config = tmp / "agreement.toml"
    config.write_text("\n".join([
        "[gateway]", f"workers = {clients}", f"max_queued = {max(64, 4 * clients)}",
        f"max_per_client = {max(16, 2 * clients)}", "request_timeout_s = 600.0", "",
        *(line for s in ("verifier", "drafter")
          for line in (f"[{s}]", f"max_sessions = {max(64, 8 * clients)}", f'metrics_address = "{metrics[s]}"', "")),
    ]))
    proc, address = start_services(Path(args.bundle), args.backend, args.threads,
                                   extra_args=("--processes", "--config", str(config)), log=tmp / "serve.log")
    return proc, address, f"http://{metrics['verifier']}/metrics"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _section_body(args, n: int, max_new: int, table: str, details: str) -> str:
    stamp = (f"Machine: {cpu_name()}, {os.cpu_count()} cores; backend {args.backend}; "
             f"date {dt.date.today().isoformat()}; command `{shlex.join(['python', *sys.argv])}`")
    what = (f"Bundle: {Path(args.bundle).name}; the first {n} usable UA-GEC test sentences, one Generate request "
            f"each, max_new_tokens {max_new}, through `specdec serve all --processes` with batching on (the "
            f"services' default batching keys) at {args.clients} closed-loop clients; each output compared with "
            "the same sentence decoded in-process, one at a time, by AR greedy on the same backend. For every "
            "mismatch the unbatched verifier scores the first differing position given the common prefix: the "
            f"top-2 log-prob gap there (a near-tie: below {args.near_tie:g} nats). Batched float32 forwards "
            "(other reduction orders, padded rows) can flip such a near-tie; on the tiny bundle "
            "tests/services/test_load_lossless.py checks exact equality under load.")
    return "\n\n".join(filter(None, [stamp, what, table, details]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "ua-gec", help="default: bundles/ua-gec")
    p.add_argument("--backend", default="onnxruntime", choices=BACKENDS)
    p.add_argument("--sentences", type=int, default=64, help="UA-GEC test sentences (one request each)")
    p.add_argument("--data-dir", help="prepared training data dir whose test.text.jsonl to use (default: ua-gec)")
    p.add_argument("--clients", type=int, default=32, help="closed-loop clients")
    p.add_argument("--modes", default="gad,iad,ar", help=f"a comma-separated subset of {','.join(MODES)}")
    p.add_argument("--max-new-tokens", type=int, default=200, help="as `specdec bench` (default 200)")
    p.add_argument("--near-tie", type=float, default=1e-3, help="top-2 log-prob gap below which a flip is a near-tie")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the services (default: unset)")
    p.add_argument("--write", action="store_true", help=f"replace the '{SECTION}' section of --output")
    p.add_argument("--output", type=Path, default=ROOT / "BENCHMARKS.md")
    return p


if __name__ == "__main__":
    sys.exit(main())
