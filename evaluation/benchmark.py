"""The UA-GEC benchmark (`specdec bench`): every decoding mode on the UA-GEC test split, in-process and
through the services.

Sample: the first N sentences of the UA-GEC test split in corpus order (`training.data.load_test_set`:
documents in ua-gec order, sentences in document order, each with both annotators' references),
skipping sources that tokenise to nothing or past the verifier's source limit. No randomness: the
same N gives the same sentences on every machine.

Timing: per stack, the configurations run in one process on the same inputs; each first decodes a
few sentences untimed (warm-up: ONNX/torch kernels, allocator, gRPC channel), then the sample is
decoded once by every configuration, in ROUNDS interleaved rounds (each round every ROUNDS-th
sentence, every configuration in turn), so slow drift of a shared machine skews all rows alike.
A row's wall time is the sum of its rounds. Speed-ups divide the greedy (or beam 5) row's wall
time of the *same stack* by the row's own.

Quality: GLEU (Napoles et al. 2015/2016, see `evaluation.gec_metrics`) against both references,
exact match with any reference, % of sentences identical to greedy, and the verifier's perplexity
of the outputs (teacher-forced, EOS scored when the output ended with it).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evaluation.bench_report import cpu_name, start_services, write_section
from evaluation.gec_metrics import exact_match, gleu

SECTION = "## UA-GEC benchmark"
DEFAULT_SAMPLE = 500
QUICK_SAMPLE = 20
DEFAULT_MAX_NEW_TOKENS = 200
QUICK_MAX_NEW_TOKENS = 32
WARMUP_SENTENCES = 3
ROUNDS = 5
IAD_CAP = 32
GAD_PLUS_PLUS_K = 25
SEED = 0
STACKS = {"in-process": ("in-process",), "services": ("services",), "both": ("in-process", "services")}
GREEDY, BEAM5 = "AR greedy", "AR beam 5"
LOSSLESS_PREFIXES = ("IAD", "GAD ")  # "GAD k=..." rows, not "GAD++"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    overrides: dict[str, Any]


@dataclass(frozen=True)
class Sentence:
    source: str
    references: list[str]
    source_ids: list[int]


# Decodes one sentence on one stack with one configuration: (output ids, DecodeStats).
Decode = Callable[[Sentence], tuple[list[int], Any]]


@dataclass
class Run:
    """One configuration over the sample on one stack."""

    stack: str
    config: BenchConfig
    outputs: list[list[int]]
    iterations: list[int]
    wall_s: float
    drafter_s: float = 0.0  # drafter and verifier calls as the accept loop timed them, summed
    verifier_s: float = 0.0


@dataclass
class Row:
    stack: str
    name: str
    iterations: float  # per sentence
    tokens_per_iteration: float
    gleu: float
    exact: float
    identical: float  # % of sentences identical to greedy on the same stack
    perplexity: float
    wall_s: float
    ms_per_sentence: float
    draft_ms: float  # per sentence: time in drafter calls, verifier calls, everything else
    verify_ms: float
    other_ms: float
    speedup_greedy: float | None = None
    speedup_beam: float | None = None


@dataclass
class BenchResult:
    rows: list[Row]
    sentences: int
    source_gleu: float  # GLEU of the uncorrected sources: the "do nothing" baseline
    bundle_name: str = ""
    bundle_fingerprint: str = ""
    max_new_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    lossless_ok: bool = True
    device: str = "cpu"  # where the verifier ran ("cpu", "cuda:0")


def full_configs() -> list[BenchConfig]:
    configs = [BenchConfig(BEAM5, {"mode": "beam", "num_beams": 5}), BenchConfig(GREEDY, {"mode": "ar"})]
    configs.append(BenchConfig(f"IAD k={IAD_CAP}", {"mode": "iad", "k": IAD_CAP}))
    configs += [BenchConfig(f"GAD k={k}", {"mode": "gad", "k": k}) for k in (5, 10, 15, 20, 25)]
    # The paper's two settings, (3, 1.0) and (5, 3.0), lie on this grid.
    configs += [
        BenchConfig(f"GAD++ k={GAD_PLUS_PLUS_K} beta={b} tau={t:.1f}",
                    {"mode": "gad++", "k": GAD_PLUS_PLUS_K, "beta": b, "tau": t})
        for b in (3, 4, 5)
        for t in (1.0, 2.0, 3.0)
    ]
    configs += [
        BenchConfig(f"MJSD gamma=4 beams={n} thr=0.1", {"mode": "mjsd", "gamma": 4, "num_beams": n, "threshold": 0.1})
        for n in (4, 8)
    ]
    configs.append(BenchConfig("Spec. sampling gamma=4 T=1", {"mode": "spec", "gamma": 4, "temperature": 1.0}))
    return configs


def quick_configs() -> list[BenchConfig]:
    """One row per mode: a smoke run of the whole pipeline."""
    wanted = {BEAM5, GREEDY, f"IAD k={IAD_CAP}", "GAD k=10", f"GAD++ k={GAD_PLUS_PLUS_K} beta=3 tau=1.0",
              "MJSD gamma=4 beams=4 thr=0.1", "Spec. sampling gamma=4 T=1"}
    return [c for c in full_configs() if c.name in wanted]


def run_benchmark(
    bundle_dir: Path,
    items: Sequence[Any],
    configs: Sequence[BenchConfig],
    stacks: Sequence[str] = ("in-process",),
    backend: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Callable[[str], None] | None = None,
    limit: int | None = None,
    threads: int | None = None,
    warmup: int = WARMUP_SENTENCES,
    device: str = "auto",
) -> BenchResult:
    """Decode the first `limit` usable `items` (anything with .source and .references) with every
    config on every stack, the models on `device` in-process and in the services (as `serve`, "auto"
    is the first GPU where the backend can use one)."""
    from core.backends import DEFAULT_BACKEND
    from seq2seq_models.bundle import load_bundle

    backend = backend or DEFAULT_BACKEND
    if threads:
        import torch

        # On a shared CPU an intra-op pool wider than the free cores stalls at every barrier.
        torch.set_num_threads(threads)
    bundle = load_bundle(bundle_dir)
    configs = _runnable(configs, bundle, progress)
    verifier = _make_verifier(bundle, backend, device)
    max_new_tokens = min(max_new_tokens, verifier.max_target_len)
    sentences = select_sentences(items, bundle.tokenizer, verifier.max_source_len, limit)
    if not sentences:
        raise ValueError("no test sentence fits the verifier's source limit")
    runs: list[Run] = []
    for stack in stacks:
        if stack == "in-process":
            drafter = _make_drafter(bundle, backend, device)
            runs += _run_in_process(verifier, drafter, sentences, configs, max_new_tokens, progress, warmup)
        elif stack == "services":
            runs += _run_services(bundle_dir, backend, sentences, configs, max_new_tokens, progress, warmup, threads,
                                  device)
        else:
            raise ValueError(f"unknown stack {stack!r}")
    result = summarise(bundle, sentences, runs, max_new_tokens)
    result.device = str(getattr(verifier, "device", "cpu"))
    return result


def select_sentences(items: Sequence[Any], tokenizer, max_source_len: int, limit: int | None = None) -> list[Sentence]:
    """The first `limit` items whose source fits; a skipped item does not shrink the sample."""
    out: list[Sentence] = []
    for item in items:
        if limit is not None and len(out) >= limit:
            break
        ids = tokenizer.encode(item.source)
        if ids and len(ids) <= max_source_len:
            out.append(Sentence(item.source, list(item.references), ids))
    return out


def summarise(bundle, sentences: list[Sentence], runs: list[Run], max_new_tokens: int) -> BenchResult:
    from evaluation.perplexity import output_nll

    tokenizer, model = bundle.tokenizer, bundle.verifier
    sources = [s.source for s in sentences]
    refs = [s.references for s in sentences]
    nll_cache: dict[tuple[int, tuple[int, ...]], float] = {}

    def nll(i: int, out: list[int]) -> float:
        # Many rows share outputs (every lossless mode equals greedy): score each output once.
        key = (i, tuple(out))
        if key not in nll_cache:
            nll_cache[key] = output_nll(model, sentences[i].source_ids, out, len(out) < max_new_tokens)
        return nll_cache[key]

    result = BenchResult(rows=[], sentences=len(sentences), source_gleu=gleu(sources, sources, refs),
                         bundle_name=bundle.name, bundle_fingerprint=bundle.fingerprint,
                         max_new_tokens=max_new_tokens)
    by_stack: dict[str, dict[str, Run]] = {}
    for run in runs:
        by_stack.setdefault(run.stack, {})[run.config.name] = run
    for stack, named in by_stack.items():
        greedy, beam = named.get(GREEDY), named.get(BEAM5)
        for run in named.values():
            texts = [tokenizer.decode(o) for o in run.outputs]
            scored = sum(len(o) + int(len(o) < max_new_tokens) for o in run.outputs)
            total_nll = sum(nll(i, o) for i, o in enumerate(run.outputs))
            same = _identical(run.outputs, greedy.outputs) if greedy else float("nan")
            iterations = sum(run.iterations)
            result.rows.append(
                Row(
                    stack=stack,
                    name=run.config.name,
                    iterations=iterations / len(sentences),
                    tokens_per_iteration=sum(map(len, run.outputs)) / max(iterations, 1),
                    gleu=gleu(sources, texts, refs),
                    exact=exact_match(texts, refs),
                    identical=same,
                    perplexity=math.exp(total_nll / max(scored, 1)),
                    wall_s=run.wall_s,
                    ms_per_sentence=1000 * run.wall_s / len(sentences),
                    draft_ms=1000 * run.drafter_s / len(sentences),
                    verify_ms=1000 * run.verifier_s / len(sentences),
                    other_ms=1000 * max(run.wall_s - run.drafter_s - run.verifier_s, 0.0) / len(sentences),
                    speedup_greedy=greedy.wall_s / run.wall_s if greedy else None,
                    speedup_beam=beam.wall_s / run.wall_s if beam else None,
                )
            )
            if run.config.name.startswith(LOSSLESS_PREFIXES) and greedy and same < 100.0:
                result.lossless_ok = False
                result.notes.append(f"LOSSLESS CHECK FAILED: {stack} {run.config.name} is identical to greedy "
                                    f"on {same:.1f}% of sentences (target 100%).")
    if "in-process" in by_stack and "services" in by_stack:
        result.notes.append(_cross_stack_note(by_stack["in-process"], by_stack["services"]))
    return result


def format_table(result: BenchResult) -> str:
    lines = [
        "| stack | configuration | iterations / sentence | tokens / iteration | GLEU | exact match % | "
        "% identical to greedy | verifier ppl | wall s | ms / sentence | draft / verify / other ms | "
        "speed-up vs greedy | speed-up vs beam 5 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.stack} | {r.name} | {r.iterations:.1f} | {r.tokens_per_iteration:.2f} | {r.gleu:.2f} | "
            f"{r.exact:.1f} | {r.identical:.1f} | {r.perplexity:.3f} | {r.wall_s:.2f} | {r.ms_per_sentence:.1f} | "
            f"{r.draft_ms:.1f} / {r.verify_ms:.1f} / {r.other_ms:.1f} | {_x(r.speedup_greedy)} | {_x(r.speedup_beam)} |"
        )
    return "\n".join(lines)


def write_report(path: Path, result: BenchResult, backend: str, command: str) -> None:
    """Replace this benchmark's own section of BENCHMARKS.md (`path`) with the table and its setting."""
    import torch

    stamp = (
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; "
        f"verifier and NAR drafter backend {backend} on {result.device}; date {dt.date.today().isoformat()}; "
        f"command `{command}`"
    )
    note = (
        f"Bundle: `{result.bundle_name}` (fingerprint `{result.bundle_fingerprint[:16]}`). Data: UA-GEC test "
        f"split, the first {result.sentences} sentences in corpus order (both annotators' references), batch 1, "
        f"max_new_tokens {result.max_new_tokens}, fp32. Scorer: GLEU (Napoles et al. 2015, revised 2016; "
        f"corpus level, "
        f"x100, words and punctuation split, averaged over 500 seeded draws of one reference per sentence); "
        f"GLEU of the uncorrected sources: {result.source_gleu:.2f}. Verifier ppl = exp(mean token NLL of the "
        "outputs under the verifier, teacher-forced, EOS included). Each row: warm-up on "
        f"{WARMUP_SENTENCES} sentences, then one timed pass over the sample, interleaved with the other rows in "
        f"{ROUNDS} rounds (round r: every {ROUNDS}th sentence from the r-th, each row in turn, the order rotated "
        "each round); speed-ups are against the greedy and beam 5 rows "
        "of the same stack in the same run. Services: `specdec serve all` in its own process, one `Generate` "
        "in flight over loopback. Speculative sampling uses temperature 1 and seed 0 per request."
    )
    body = "\n\n".join([stamp, note, *result.notes, format_table(result)])
    write_section(path, SECTION, body)


# ----------------------------------------------------------------------------------------------
# The two stacks
# ----------------------------------------------------------------------------------------------


def _make_verifier(bundle, backend: str, device: str = "auto"):
    from verifier_service.session import make_verifier

    return make_verifier(bundle, backend, device=device)


def _runnable(configs: Sequence[BenchConfig], bundle, progress: Callable[[str], None] | None) -> list[BenchConfig]:
    """The configurations the bundle can run: without a drafter (an imported checkpoint), the
    drafter modes are left out, and said so."""
    from decoding.config import Mode
    from decoding.modes import DRAFTER_MODES

    if any(role in bundle.models for role in ("nar_drafter", "ar_drafter")):
        return list(configs)
    kept = [c for c in configs if Mode(c.overrides.get("mode", "ar")) not in DRAFTER_MODES]
    skipped = [c.name for c in configs if c not in kept]
    if skipped and progress is not None:
        progress(f"{bundle.path} has no drafter: skipping {', '.join(skipped)}")
    return kept


def _make_drafter(bundle, backend: str, device: str = "auto"):
    from drafter_service.session import make_drafter

    return make_drafter(bundle, backend, device=device)


def _decoding_config(config: BenchConfig, max_new_tokens: int):
    from decoding.config import DecodingConfig

    return DecodingConfig().with_overrides(_overrides(config, max_new_tokens))


def _overrides(config: BenchConfig, max_new_tokens: int) -> dict[str, Any]:
    return {"seed": SEED, "max_new_tokens": max_new_tokens, **config.overrides}


def _run_in_process(verifier, drafter, sentences, configs, max_new_tokens, progress, warmup) -> list[Run]:
    from decoding.decode import decode

    def decoder(config: BenchConfig) -> Decode:
        cfg = _decoding_config(config, max_new_tokens)

        def one(s: Sentence) -> tuple[list[int], Any]:
            res = decode(s.source_ids, cfg, verifier, drafter)
            return res.output_ids, res.stats

        return one

    return _timed("in-process", [(c, decoder(c)) for c in configs], sentences, progress, warmup)


def _run_services(
    bundle_dir, backend, sentences, configs, max_new_tokens, progress, warmup, threads, device: str = "auto"
) -> list[Run]:
    import grpc

    from gateway.wire import overrides_to_wire, stats_from_wire
    from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
    from serving.channels import channel_options

    server, address = start_services(bundle_dir, backend, threads, extra_args=("--device", device))
    try:
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)

            def decoder(config: BenchConfig) -> Decode:
                wire = overrides_to_wire(_overrides(config, max_new_tokens))

                def one(s: Sentence) -> tuple[list[int], Any]:
                    # input_ids, not text: both stacks decode exactly the same token ids.
                    request = gateway_pb2.GenerateRequest(input_ids=s.source_ids, config=wire)
                    response = stub.Generate(request, timeout=600)
                    return list(response.output_ids), stats_from_wire(response.stats, len(response.output_ids))

                return one

            return _timed("services", [(c, decoder(c)) for c in configs], sentences, progress, warmup)
    finally:
        server.terminate()
        server.wait(timeout=30)


def _timed(stack: str, decoders: list[tuple[BenchConfig, Decode]], sentences, progress, warmup: int) -> list[Run]:
    """Every configuration over every sentence, in ROUNDS interleaved rounds.

    Round r decodes every ROUNDS-th sentence (r, r + ROUNDS, ...) with each configuration in turn,
    the order rotated each round. A machine that slows down or speeds up during the run (a shared
    CPU does, over minutes) then skews every configuration alike, so the speed-ups stay
    ratios of the same conditions. Configurations switch only between rounds, so one mode's
    leftovers (torch's OpenMP pool still spinning after an AR-drafter call) reach another only
    once per round.
    """
    for _, one in decoders:
        for s in sentences[:warmup]:
            one(s)
    n = len(sentences)
    outputs: list[list[Any]] = [[None] * n for _ in decoders]
    iterations: list[list[int]] = [[0] * n for _ in decoders]
    wall = [0.0] * len(decoders)
    drafter_s = [0.0] * len(decoders)
    verifier_s = [0.0] * len(decoders)
    for r in range(ROUNDS):
        indices = range(r, n, ROUNDS)
        for j in range(len(decoders)):
            c = (j + r) % len(decoders)
            one = decoders[c][1]
            t0 = time.perf_counter()
            for i in indices:
                out, stats = one(sentences[i])
                outputs[c][i] = out
                iterations[c][i] = stats.iterations
                drafter_s[c] += stats.drafter_time_s
                verifier_s[c] += stats.verifier_time_s
            wall[c] += time.perf_counter() - t0
    runs = []
    for c, (config, _) in enumerate(decoders):
        if progress is not None:
            progress(f"{stack:>10} | {config.name:<36} {wall[c]:8.2f} s")
        runs.append(Run(stack, config, outputs[c], iterations[c], wall[c], drafter_s[c], verifier_s[c]))
    return runs


# ----------------------------------------------------------------------------------------------


def _identical(a: list[list[int]], b: list[list[int]]) -> float:
    return 100.0 * sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def _cross_stack_note(local: dict[str, Run], remote: dict[str, Run]) -> str:
    parts = []
    for name, run in local.items():
        if name in remote:
            parts.append(f"{name} {_identical(run.outputs, remote[name].outputs):.0f}%")
    return "Outputs through the services identical to in-process: " + ", ".join(parts) + "."


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


