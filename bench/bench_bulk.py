"""Bulk decoding: a file of sentences through specdec and through CTranslate2's translate_batch,
each engine at its best settings on this host, in one run.

    python bench/bench_bulk.py                      # UA-GEC, the bundled model, int8; print the tables
    python bench/bench_bulk.py --services           # also `serve all --processes` at 32 clients
    python bench/bench_bulk.py --marian             # also the imported Marian-base-sized checkpoint
    python bench/bench_bulk.py --services --marian --write   # the "Bulk decoding" section
    python bench/bench_bulk.py --profile --write    # the "Bulk decoding: where the time goes" section

Output tokens per second (EOS not counted, model loading excluded) over the first `--sentences`
UA-GEC test sentences. First each engine's grid, one pass per cell: CTranslate2 int8 at
(inter_threads x intra_threads) x max_batch_size x batch_type, and its other compute types at 2x1
threads, batch 32; specdec's `Engine.bulk` per mode x batch size x workers (model workers, each its
own rows over one copy of the models, with its intra-op threads: specdec's inter_threads). Then
each engine's best cell per row is timed again in `--rounds` interleaved rounds (every row in turn,
so drift of the machine hits all alike) and the best round is kept; ratios are against
CTranslate2's best. Checked: every lossless row's outputs equal specdec's greedy of the same
precision, and its greedy equals itself at batch 1 (batch invariance). With `--services`, 32
closed-loop clients (`evaluation.loadtest`) against `specdec serve all --processes` per mode and
verifier model workers (`--verifier-model-workers`, 1 or 2: the services' own grid), against the
in-process best of that mode. With `--marian`, the Marian-base-sized checkpoint of
bench/bench_hf_ctranslate2.py (random weights: every output runs to `MARIAN_STEPS` tokens) imported with
`specdec import-hf` and converted with CTranslate2's own converter, AR greedy only.

`--profile` splits a batch-32 in-process run (one model worker) instead: the model worker's wall time
into the decoder's forwards (ONNX Runtime), the encoder's runs, the rest of its steps (planning,
feeding the pool, writing the block's K/V into it, building results: Python and numpy) and the
scheduler's own work and waiting (gathering steps, continuing runs of AR steps, closing sessions,
waiting for the rows' steps); one captured 32-row decoder forward into ONNX Runtime's op types
(its profiler), grouped; and cohorts against continuous admission at batch 32, 2 model workers.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Bulk decoding"
PROFILE_SECTION = "## Bulk decoding: where the time goes"
# ONNX Runtime op types by what they do in the decoder (the rest: "other").
OP_GROUPS = {
    "int8 GEMMs (weights)": ("MatMulIntegerToFloat", "MatMulInteger", "Gemm"),
    "attention and float matmuls": ("MatMul", "FusedMatMul", "Softmax"),
    "activation quantization": ("QuantizeLinear", "DynamicQuantizeLinear", "ReduceMax", "Abs", "Div", "Round",
                                "Cast", "Max", "Clip", "ConstantOfShape"),
    "copies (gather, concat, split, transpose, slice)": ("Gather", "Concat", "Split", "Transpose", "Slice",
                                                         "Reshape", "Unsqueeze", "Squeeze", "Expand"),
    "elementwise and norms": ("Add", "Mul", "Sub", "Where", "BiasGelu", "LayerNormalization", "Erf", "Pow", "Sqrt"),
    "head (log-softmax, top-k)": ("LogSoftmax", "TopK", "GatherElements"),
}
MAX_NEW_TOKENS = 200
MARIAN_STEPS = 64
CLIENTS = 32
# specdec's rows: (label, decoding parameters, lossless).
MODES: list[tuple[str, dict[str, Any], bool]] = [
    ("AR greedy", {"mode": "ar"}, True),
    ("IAD k=32", {"mode": "iad", "k": 32}, True),
    ("IAD adaptive k<=32", {"mode": "iad", "k": 32, "adaptive": True}, True),
    ("GAD k=10", {"mode": "gad", "k": 10}, True),
    ("GAD adaptive k<=10", {"mode": "gad", "k": 10, "adaptive": True}, True),
    ("GAD++ k=25 beta=3 tau=1", {"mode": "gad++", "k": 25, "beta": 3, "tau": 1.0}, False),
]
BATCH_SIZES = (32, 64)
WORKERS = (1, 2)
# int8_float32 is int8 on a CPU; float32 is slower than int8 wherever the CPU has AVX-512 VNNI (and it is
# one cell of the grid, so a CPU without it is still compared at its best).
CT2_COMPUTE = ("int8", "float32")
CT2_THREADS = ((1, 1), (1, 2), (2, 1))
CT2_BATCH = (32, 64)
CT2_TOKENS_PER_EXAMPLE = 32  # a "tokens" batch of max_batch_size examples' worth of source tokens


@dataclass
class Cell:
    engine: str
    row: str
    setting: str
    run: Callable[[], tuple[int, float, list[list[int]] | None]]  # -> (output tokens, seconds, outputs)
    best: float = 0.0  # tokens/s
    outputs: list[list[int]] | None = None
    lossless: bool = False
    notes: list[str] = field(default_factory=list)

    def time(self) -> float:
        tokens, seconds, outputs = self.run()
        rate = tokens / seconds
        self.best = max(self.best, rate)
        if outputs is not None:
            self.outputs = outputs
        return rate


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from evaluation.loadtest import ua_gec_texts

    texts = ua_gec_texts(args.sentences, args.data_dir)
    if args.profile:
        body = profile_section(args, texts)
        print(body)
        if args.write:
            from evaluation.bench_report import write_section

            write_section(REPO / "BENCHMARKS.md", PROFILE_SECTION, body)
        return 0
    lines: list[str] = []
    uagec = ua_gec_table(args, texts, lines)
    marian = marian_table(args) if args.marian else ""
    body = section_body(args, uagec, marian, lines)
    print(body)
    if args.write:
        from evaluation.bench_report import write_section

        write_section(REPO / "BENCHMARKS.md", SECTION, body)
    return 0


def ua_gec_table(args: argparse.Namespace, texts: list[str], notes: list[str]) -> str:
    import specdec
    from seq2seq_models.bundle import load_bundle

    ct2_dir, vocab, ct2_tokens = ct2_inputs(load_bundle(args.bundle), texts)
    engine = specdec.Engine.load(args.bundle, precision=args.precision)
    ct2_cells = [_ct2_cell(ct2_dir, ct2_tokens, vocab, "int8", threads, size, kind, MAX_NEW_TOKENS)
                 for threads in CT2_THREADS for size in CT2_BATCH for kind in ("examples", "tokens")]
    ct2_cells += [_ct2_cell(ct2_dir, ct2_tokens, vocab, compute, (2, 1), 32, "examples", MAX_NEW_TOKENS)
                  for compute in CT2_COMPUTE[1:]]
    ct2_best = _best_of_grid("CTranslate2 translate_batch", ct2_cells)
    rows = [ct2_best]
    for label, params, lossless in MODES:
        cells = [_specdec_cell(engine, texts, label, params, size, workers, lossless)
                 for size in BATCH_SIZES for workers in WORKERS]
        rows.append(_best_of_grid(label, cells))
    one = _specdec_cell(engine, texts, "AR greedy", {"mode": "ar"}, 1, 1, True)
    one.row = "AR greedy, batch 1"
    rows.append(one)
    _interleave(rows, args.rounds)
    notes += _checks(rows)
    services = _services_rows(args, texts, rows) if args.services else []
    return _table(rows, services, ct2_best.best)


def marian_table(args: argparse.Namespace) -> str:
    """AR greedy on the imported Marian-base-sized checkpoint: specdec's best bulk cell against
    CTranslate2's best, every output MARIAN_STEPS tokens long."""
    import specdec
    from bench.bench_hf_ctranslate2 import MARIAN_BASE, Ct2Model, build_once, prepare, random_sources
    from seq2seq_models.bundle import load_bundle

    work = Path(tempfile.gettempdir()) / "specdec-bench-bulk-marian"
    hf_dir = build_once("marian", work / "hf", MARIAN_BASE)
    bundle_dir, ct2_dir = prepare(hf_dir, work)
    bundle = load_bundle(bundle_dir)
    cfg = bundle.config("verifier")
    vocab = Ct2Model(ct2_dir).source_vocab
    sources = random_sources(bundle, len(vocab), args.sentences)
    tokens = [[vocab[i] for i in s] + [vocab[cfg.eos_id]] for s in sources]
    ct2_cells = [_ct2_cell(ct2_dir, tokens, vocab, compute, threads, size, "examples", MARIAN_STEPS, fixed=True)
                 for compute in CT2_COMPUTE for threads in CT2_THREADS for size in CT2_BATCH]
    ct2_best = _best_of_grid("translate_batch (Marian-base)", ct2_cells)
    engine = specdec.Engine.load(bundle_dir, precision=args.precision)
    cells = [_specdec_cell(engine, sources, "AR greedy", {"mode": "ar"}, size, workers, True,
                           max_new=MARIAN_STEPS) for size in BATCH_SIZES for workers in WORKERS]
    rows = [ct2_best, _best_of_grid("AR greedy (Marian-base)", cells)]
    _interleave(rows, args.rounds)
    return _table(rows, [], ct2_best.best)


def profile_section(args: argparse.Namespace, texts: list[str]) -> str:
    import specdec
    from evaluation.bench_report import machine_stamp

    engine = specdec.Engine.load(args.bundle, precision=args.precision)
    rows = []
    for label, params in (("AR greedy", {"mode": "ar"}), ("IAD k=32", {"mode": "iad", "k": 32}),
                          ("GAD k=10", {"mode": "gad", "k": 10})):
        split = _worker_split(engine, texts, params)
        rows.append(f"| {label} | {split['tokens/s']:.0f} | {split['forwards']:.0f} | {split['rows/forward']:.1f} | "
                    f"{split['decoder']:.0%} | {split['encoder']:.0%} | {split['steps other']:.0%} | "
                    f"{split['drafter']:.0%} | {split['scheduler and idle']:.0%} |")
    split_table = "\n".join([
        "| mode (batch 32) | tokens/s | verifier forwards | rows / forward | decoder forwards | encoder runs | "
        "rest of the steps | drafter | scheduler and idle |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
    admission = _admission_table(engine, texts, args.rounds)
    ops = _op_profile(engine)
    op_table = "\n".join(["| op group | share of a 32-row AR forward |", "|---|---:|",
                           *(f"| {group} | {share:.0%} |" for group, share in ops)])
    stamp = machine_stamp(f"{args.precision} (ONNX Runtime), one model worker")
    return "\n\n".join([
        stamp,
        f"UA-GEC test split, first {len(texts)} sentences, `Engine.bulk` at batch 32 (module docstring of "
        "`bench/bench_bulk.py`, `--profile`). The model worker's wall time:", split_table,
        "One 32-row AR decoder forward (past 30, source 30 positions) by ONNX Runtime op type:", op_table,
        f"Admission at batch 32, 2 model workers: a worker's next rows all at once when its last is done "
        f"(cohorts, the default) or each finished row's place taken at once (continuous); output tokens/s, "
        f"best of {args.rounds} interleaved rounds:", admission,
    ])


def _admission_table(engine: Any, texts: list[str], rounds: int) -> str:
    """Cohorts against continuous admission (`specdec.bulk`), per mode, interleaved rounds."""
    lines = ["| mode (batch 32, 2 workers) | cohorts | continuous | cohorts / continuous |", "|---|---:|---:|---:|"]
    for label, params in (("AR greedy", {"mode": "ar"}), ("IAD k=32", {"mode": "iad", "k": 32}),
                          ("GAD k=10", {"mode": "gad", "k": 10})):
        requests = [engine.request(x, "", {**params, "max_new_tokens": MAX_NEW_TOKENS}) for x in texts]
        best = {True: 0.0, False: 0.0}
        list(engine.bulk(requests[:32], 32, workers=2))  # warm: the workers' models and pools
        for _ in range(rounds):
            for cohorts in best:
                started = time.perf_counter()
                tokens = sum(len(o.output_ids) for _, o in engine.bulk(requests, 32, workers=2, cohorts=cohorts))
                best[cohorts] = max(best[cohorts], tokens / (time.perf_counter() - started))
        lines.append(f"| {label} | {best[True]:.0f} | {best[False]:.0f} | {best[True] / best[False]:.2f}x |")
    return "\n".join(lines)


def _worker_split(engine: Any, texts: list[str], params: dict[str, Any]) -> dict[str, float]:
    """Wall time of a batch-32 run, and the worker's shares: decoder forwards, encoder runs, the rest
    of its verifier steps, drafter calls, and the rest of its time (the scheduler's own work: gathering
    steps, continuing runs of AR steps, closing sessions; and waiting for steps)."""
    verifier = engine.verifier
    spent = {"decoder": 0.0, "encoder": 0.0, "encoder in steps": 0.0, "steps": 0.0, "drafter": 0.0,
             "forwards": 0.0, "rows": 0.0}
    in_step = [False]  # inside a verifier step (one worker: no other step runs meanwhile)

    def timed(obj: Any, name: str, key: str, count: bool = False) -> Callable[[], None]:
        original = getattr(obj, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            outer = in_step[0]
            in_step[0] = outer or count
            try:
                return original(*a, **k)
            finally:
                in_step[0] = outer
                took = time.perf_counter() - started
                spent[key] += took
                if key == "encoder" and outer:  # a step that meets an unencoded source encodes it first
                    spent["encoder in steps"] += took
                if count:
                    spent["forwards"] += 1
                    spent["rows"] += len(a[0]) if a and isinstance(a[0], list) else 0

        setattr(obj, name, wrapper)
        return lambda: setattr(obj, name, original)

    restore = [timed(verifier.engine, "forward", "decoder"), timed(verifier.engine, "forward_one", "decoder"),
               timed(verifier.engine, "encode_batch", "encoder"), timed(verifier, "step_batch", "steps", count=True)]
    if engine.drafter is not None:
        restore.append(timed(engine.drafter, "draft_batch", "drafter"))
    try:
        requests = [engine.request(x, "", {**params, "max_new_tokens": MAX_NEW_TOKENS}) for x in texts]
        # A whole run first: the pool's buffers grow to the run's largest layout on the first pass
        # (memory touched for the first time), which the table is not about.
        list(engine.generate_each(requests, batch_size=32))
        for key in spent:
            spent[key] = 0.0
        started = time.perf_counter()
        outputs = [o.output_ids for _, o in engine.generate_each(requests, batch_size=32)]
        wall = time.perf_counter() - started
    finally:
        for undo in restore:
            undo()
    # The rest of the steps: the verifier steps' time that is neither the decoder nor an encoder run.
    other = max(spent["steps"] - spent["decoder"] - spent["encoder in steps"], 0.0)
    busy = spent["steps"] + spent["drafter"] + spent["encoder"] - spent["encoder in steps"]
    return {"tokens/s": sum(len(o) for o in outputs) / wall, "forwards": spent["forwards"],
            "rows/forward": spent["rows"] / max(spent["forwards"], 1), "decoder": spent["decoder"] / wall,
            "encoder": spent["encoder"] / wall, "steps other": other / wall,
            "drafter": spent["drafter"] / wall, "scheduler and idle": max(wall - busy, 0.0) / wall}


def _op_profile(engine: Any) -> list[tuple[str, float]]:
    """One 32-row AR step's decoder call (the graph the runner picks for it: the step graph) through
    ONNX Runtime's profiler, by op group, in a session made as the runner's are."""
    import json

    from seq2seq_models.ort_runner import inference_session

    feeds = captured_ar_step(engine)
    runner = engine.verifier.engine.runner
    graph = runner.step_decoder if runner.step_decoder is not None else runner.batch_decoder
    prefix = Path(tempfile.mkdtemp()) / "decoder_batch"  # not in the working tree
    session = inference_session(Path(graph._model_path), 1, ["CPUExecutionProvider"], profile_to=prefix)
    for _ in range(20):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    by_op: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node":
            op = event["args"].get("op_name", "")
            by_op[op] = by_op.get(op, 0.0) + event["dur"]
    total = sum(by_op.values())
    groups = {group: 0.0 for group in OP_GROUPS} | {"other": 0.0}
    for op, dur in by_op.items():
        group = next((g for g, ops in OP_GROUPS.items() if op in ops), "other")
        groups[group] += dur
    return [(group, dur / total) for group, dur in sorted(groups.items(), key=lambda kv: -kv[1])]


def captured_ar_step(engine: Any, rows: int = 32) -> dict[str, Any]:
    """The decoder inputs of one `rows`-row AR step of `engine`'s verifier (past and source 30
    positions, random ids), per layer, as its runner feeds them to the step graph."""
    import random

    from core.interfaces import StepCall
    from seq2seq_models.row_cache import per_layer

    verifier = engine.verifier
    rng = random.Random(0)
    sessions = [verifier.open([rng.randrange(10, 7000) for _ in range(30)]) for _ in range(rows)]
    verifier.encode(sessions)
    verifier.step_batch([(s, StepCall(0, [rng.randrange(10, 7000) for _ in range(30)], [], 1)) for s in sessions])
    runner = verifier.engine.runner
    captured: dict[str, Any] = {}
    original = runner.decode_batch
    runner.decode_batch = lambda feeds: captured.update(feeds) or original(feeds)
    try:
        verifier.step_batch([(s, StepCall(30, [rng.randrange(10, 7000)], [], 1)) for s in sessions])  # AR steps
    finally:
        runner.decode_batch = original
    for s in sessions:
        s.close()
    return per_layer(captured)


def ct2_inputs(bundle: Any, texts: list[str]) -> tuple[Path, list[str], list[list[str]]]:
    """The bundle converted for CTranslate2 (once), its vocabulary, and `texts` as its source tokens
    (the bundle's tokenizer's ids, EOS appended)."""
    from bench.ct2_convert import convert, default_dir, vocabulary

    eos = bundle.config("verifier").eos_id
    vocab = vocabulary(bundle)
    tokens = [[vocab[i] for i in bundle.tokenizer.encode(t)] + [vocab[eos]] for t in texts]
    return convert(bundle, default_dir(bundle)), vocab, tokens


# ---- cells ----------------------------------------------------------------------------------------


def _ct2_cell(ct2_dir: Path, tokens: list[list[str]], vocab: list[str], compute: str, threads: tuple[int, int],
              size: int, kind: str, max_new: int, fixed: bool = False) -> Cell:
    inter, intra = threads
    batch = size if kind == "examples" else size * CT2_TOKENS_PER_EXAMPLE

    def run() -> tuple[int, float, None]:
        translator = _translator(ct2_dir, compute, inter, intra)
        started = time.perf_counter()
        results = translator.translate_batch(
            tokens, max_batch_size=batch, batch_type=kind, beam_size=1, max_decoding_length=max_new,
            min_decoding_length=max_new if fixed else 0, return_end_token=False)
        seconds = time.perf_counter() - started
        return sum(len(r.hypotheses[0]) for r in results), seconds, None

    return Cell("CTranslate2", "translate_batch", f"{compute}, {inter}x{intra} threads, max_batch_size {size} {kind}",
                run)


_TRANSLATORS: dict[tuple, Any] = {}


def _translator(ct2_dir: Path, compute: str, inter: int, intra: int) -> Any:
    """One translator per model, compute type and threads (loading one is not what is timed)."""
    import ctranslate2

    key = (str(ct2_dir), compute, inter, intra)
    if key not in _TRANSLATORS:
        _TRANSLATORS[key] = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=compute,
                                                   inter_threads=inter, intra_threads=intra)
    return _TRANSLATORS[key]


def _specdec_cell(engine: Any, inputs: list, label: str, params: dict[str, Any], size: int, workers: int,
                  lossless: bool, max_new: int = MAX_NEW_TOKENS) -> Cell:
    requests = [engine.request(x, "", {**params, "max_new_tokens": max_new}) for x in inputs]

    def run() -> tuple[int, float, list[list[int]]]:
        started = time.perf_counter()
        outputs = [o.output_ids for _, o in engine.generate_each(requests, batch_size=size, workers=workers)]
        seconds = time.perf_counter() - started
        return sum(len(o) for o in outputs), seconds, outputs

    setting = f"batch {size}, {workers} worker{'s' if workers > 1 else ''}" if size > 1 else "batch 1"
    return Cell("specdec", label, setting, run, lossless=lossless)


GRID: list[str] = []  # every grid cell's line, for the section


def _best_of_grid(row: str, cells: list[Cell]) -> Cell:
    """One pass over every cell, each after an unmeasured warm-up run (loading, first calls); the fastest."""
    for cell in cells:
        cell.run()
        rate = cell.time()
        _progress(f"grid {cell.engine} {row} [{cell.setting}]: {rate:.0f} tok/s")
        GRID.append(f"{cell.engine} {row}, {cell.setting}: {rate:.0f}")
    best = max(cells, key=lambda c: c.best)
    best.row = row
    best.best = 0.0  # timed again in the interleaved rounds
    return best


def _interleave(rows: list[Cell], rounds: int) -> None:
    for r in range(rounds):
        for cell in rows:
            rate = cell.time()
            _progress(f"round {r + 1}/{rounds} {cell.engine} {cell.row} [{cell.setting}]: {rate:.0f} tok/s")


def _checks(rows: list[Cell]) -> list[str]:
    greedy = next(c for c in rows if c.engine == "specdec" and c.row == "AR greedy")
    alone = next(c for c in rows if c.row == "AR greedy, batch 1")
    lines = [f"- AR greedy at {greedy.setting} equals AR greedy at batch 1 on "
             f"{_same(greedy.outputs, alone.outputs)} of {len(alone.outputs or [])} sentences."]
    for cell in rows:
        if cell.engine == "specdec" and cell.lossless and cell not in (greedy, alone):
            lines.append(f"- {cell.row} ({cell.setting}): {_same(cell.outputs, greedy.outputs)} of "
                         f"{len(greedy.outputs or [])} outputs equal AR greedy's.")
    return lines


def _same(a: list[list[int]] | None, b: list[list[int]] | None) -> int:
    return sum(x == y for x, y in zip(a or [], b or [], strict=False))


def _services_rows(
    args: argparse.Namespace, texts: list[str], rows: list[Cell]
) -> list[tuple[str, str, float, float]]:
    """(mode, best setting, tokens/s through `serve all --processes` at CLIENTS clients, the
    in-process best), the services' own grid being the verifier's model workers (`WORKERS`)."""
    from evaluation.bench_report import start_services
    from evaluation.loadtest import LoadSpec, run_load

    best: dict[str, tuple[float, str]] = {}
    config = Path(tempfile.mkdtemp()) / "bulk.toml"
    config.write_text(_services_toml(args.precision))
    cells = [cell for cell in rows if cell.engine == "specdec" and cell.row != "AR greedy, batch 1"]
    for workers in WORKERS:
        setting = f"serve all --processes, {workers} verifier model worker{'s' if workers > 1 else ''}"
        proc, address = start_services(Path(args.bundle), "onnxruntime", extra_args=(
            "--config", str(config), "--processes", "--verifier-model-workers", str(workers)))
        try:
            for cell in cells:
                params = next(p for label, p, _ in MODES if label == cell.row)
                spec = LoadSpec(address=address, inputs=texts,
                                overrides={**params, "max_new_tokens": MAX_NEW_TOKENS},
                                concurrency=CLIENTS, requests=len(texts), warmup=CLIENTS, timeout=600.0)
                for _ in range(args.rounds):
                    report = run_load(spec)
                    rate = report.output_tokens / report.wall_s
                    best[cell.row] = max(best.get(cell.row, (0.0, "")), (rate, setting))
                    _progress(f"services {cell.row}, {setting}: {rate:.0f} tok/s")
        finally:
            proc.terminate()
            proc.wait(60)
    return [(cell.row, best[cell.row][1], best[cell.row][0], cell.best) for cell in cells]


def _services_toml(precision: str) -> str:
    sessions = CLIENTS * 4
    return "\n".join([
        "[gateway]", f"workers = {CLIENTS}", f"max_queued = {CLIENTS * 4}", f"max_per_client = {CLIENTS * 2}",
        "request_timeout_s = 600.0", "",
        "[verifier]", f"max_sessions = {sessions}", f'precision = "{precision}"', f"max_batch_rows = {CLIENTS}",
        f"max_batch_tokens = {CLIENTS * 96}", "",
        "[drafter]", f"max_sessions = {sessions}", f'precision = "{precision}"', f"max_batch_rows = {CLIENTS}",
        f"max_batch_tokens = {CLIENTS * 96}", "",
    ])


# ---- report ---------------------------------------------------------------------------------------


def _table(rows: list[Cell], services: list[tuple[str, str, float, float]], reference: float) -> str:
    lines = ["| engine | row | best setting | output tokens/s | vs CTranslate2's best |", "|---|---|---|---:|---:|"]
    for cell in rows:
        ratio = cell.best / reference
        lines.append(f"| {cell.engine} | {cell.row} | {cell.setting} | {cell.best:.0f} | {ratio:.2f}x |")
    for mode, setting, rate, in_process in services:
        lines.append(f"| specdec services, {CLIENTS} clients | {mode} | {setting} | {rate:.0f} | "
                     f"{rate / reference:.2f}x ({rate / in_process:.2f}x in-process) |")
    return "\n".join(lines)


def section_body(args: argparse.Namespace, uagec: str, marian: str, notes: list[str]) -> str:
    from evaluation.bench_report import machine_stamp

    stamp = machine_stamp(f"{args.precision} (specdec: ONNX Runtime)")
    parts = [
        stamp,
        f"UA-GEC test split, first {args.sentences} sentences, bundled model, max_new_tokens {MAX_NEW_TOKENS}; "
        f"best of {args.rounds} interleaved rounds after a one-pass grid per engine (module docstring of "
        "`bench/bench_bulk.py`).",
        uagec,
        "\n".join(notes),
    ]
    parts.append("The grid (one pass each, output tokens/s): " + "; ".join(GRID) + ".")
    if marian:
        parts += [f"Imported Marian-base-sized checkpoint (random weights, every output {MARIAN_STEPS} tokens), "
                  "AR greedy:", marian]
    return "\n\n".join(parts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"), help="the bundle (default: the shipped one)")
    p.add_argument("--data-dir", help="prepared data whose test.text.jsonl to use (default: the ua-gec package)")
    p.add_argument("--sentences", type=int, default=200, help="UA-GEC test sentences (default: 200)")
    p.add_argument("--precision", default="int8", choices=["int8", "fp32"], help="specdec's (default: int8)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the best cells (default: 3)")
    p.add_argument("--services", action="store_true", help="also serve all --processes at 32 clients")
    p.add_argument("--marian", action="store_true", help="also the imported Marian-base-sized checkpoint")
    p.add_argument("--profile", action="store_true", help="where a batch-32 run's time goes, instead of the tables")
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    return p


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
