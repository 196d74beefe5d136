"""The two forms of the int8 quantization (seq2seq_models/onnx_quantize.py), graph by graph.

    python bench/bench_int8_forms.py            # print the table
    python bench/bench_int8_forms.py --write    # also replace the "int8 quantization forms (CPU)" section

Each int8 graph of the bundle's verifier is made in both forms from its fp32 export: the rows form
(activations reshaped to two axes, one per-row QuantizeLinear with a zero-point tensor per row, the
product reshaped back) and the lean form (no reshapes or zero-point tensors, one more pass over the
activations). Both run the inputs real forwards fed that graph, captured from bulk runs over the
first `--sentences` UA-GEC test sentences (IAD k=32 at batch 32: encoder and batched decoder; AR at
batch 32: the one-token step decoder; AR at batch 1: the one-row decoder), at most `--calls` of
them spread over the run, in one intra-op thread. Milliseconds per call: the mean over the calls,
the median over `--rounds` rounds in which the forms alternate. Checked: both forms' outputs are
identical on every call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## int8 quantization forms (CPU)"
GRAPHS = {  # runner session attribute: (file, the run that feeds it)
    "encoder": ("encoder.onnx", "IAD k=32, batch 32"),
    "batch_decoder": ("decoder_batch.onnx", "IAD k=32, batch 32"),
    "step_decoder": ("decoder_step.onnx", "AR, batch 32"),
    "decoder": ("decoder.onnx", "AR, batch 1"),
}
RUNS = {"IAD k=32, batch 32": ({"mode": "iad", "k": 32}, 32), "AR, batch 32": ({"mode": "ar"}, 32),
        "AR, batch 1": ({"mode": "ar"}, 1)}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, REPO, data_dir=False)
    p.add_argument("--sentences", type=int, default=100, help="UA-GEC test sentences (default: 100)")
    p.add_argument("--calls", type=int, default=60, help="captured calls timed per graph (default: 60)")
    p.add_argument("--rounds", type=int, default=7, help="rounds, the forms alternating (default: 7)")
    args = p.parse_args(argv)
    fp32_dir, captured = _captured(args)
    rows = [_graph_row(fp32_dir / file, name, run, feeds, args.rounds) for name, (file, run), feeds in captured]
    lines = ["| graph | feeding run | calls | activation rows per call | rows form, ms | lean form, ms | "
             "lean / rows | outputs identical |", "|---|---|---:|---:|---:|---:|---:|---|", *rows]
    body = "\n".join([
        machine_stamp("ONNX Runtime, one intra-op thread"), "",
        f"Verifier of `{Path(args.bundle).name}`, inputs captured from bulk runs over the first {args.sentences} "
        f"UA-GEC test sentences; ms per call, median of {args.rounds} rounds (module docstring of "
        "`bench/bench_int8_forms.py`). The export uses the lean form for the one-row and step decoders "
        "and the rows form for the others.", "", *lines,
    ])
    print(f"{SECTION}\n\n{body}")
    if args.write:
        write_section(args.output, SECTION, body)
    return 0


def _captured(args: argparse.Namespace) -> tuple[Path, list[tuple[str, tuple[str, str], list[dict[str, Any]]]]]:
    """The verifier's fp32 export directory, and every graph's session inputs as the bulk runs fed them."""
    import specdec
    from evaluation.loadtest import ua_gec_texts

    texts = ua_gec_texts(args.sentences, None)
    engine = specdec.Engine.load(args.bundle, precision="int8")
    runner = engine.verifier.engine.runner
    captured: dict[str, list[dict[str, Any]]] = {name: [] for name in GRAPHS}
    for run, (params, batch) in RUNS.items():  # one capture run each, for every graph it feeds
        names = [name for name, (_, feeding) in GRAPHS.items() if feeding == run]
        requests = [engine.request(x, "", {**params, "max_new_tokens": 200}) for x in texts]
        list(engine.generate_each(requests, batch_size=batch))  # warm: the pool's buffers, first calls
        for name in names:
            session = getattr(runner, name)
            session.run = _recording(session.run, captured[name])
        try:
            list(engine.generate_each(requests, batch_size=batch))
        finally:
            for name in names:
                del getattr(runner, name).run  # the class's own again
    out = []
    for name, (file, run) in GRAPHS.items():
        feeds = captured[name]
        step = max(1, len(feeds) // args.calls)
        out.append((name, (file, run), [_copied(f) for f in feeds[::step][: args.calls]]))
    return _fp32_source(Path(runner.encoder._model_path).parent), out


def _recording(run: Any, feeds: list[dict[str, Any]]) -> Any:
    """`run`, keeping each call's inputs in `feeds`."""
    def recorded(outputs: Any, inputs: dict[str, Any], *rest: Any) -> Any:
        feeds.append(dict(inputs))
        return run(outputs, inputs, *rest)

    return recorded


def _fp32_source(int8_dir: Path) -> Path:
    """The fp32 export an int8 export was made from (its manifest's "source")."""
    from seq2seq_models.onnx_cache import MANIFEST_FILE

    return int8_dir.parent / json.loads((int8_dir / MANIFEST_FILE).read_text())["source"]


def _copied(feeds: dict[str, Any]) -> dict[str, Any]:
    """The inputs as arrays of their own: the pool's views change as the run goes on."""
    import numpy as np

    return {k: np.array(v) for k, v in feeds.items()}


def _graph_row(fp32_graph: Path, name: str, run: str, feeds: list[dict[str, Any]], rounds: int) -> str:
    import numpy as np

    from seq2seq_models.onnx_quantize import quantize_graph
    from seq2seq_models.ort_runner import inference_session

    work = Path(tempfile.mkdtemp())  # not in the working tree
    sessions = {}
    for form in ("rows", "lean"):
        quantize_graph(fp32_graph, work / f"{form}.onnx", lean=form == "lean")
        sessions[form] = inference_session(work / f"{form}.onnx", 1, ["CPUExecutionProvider"])
    identical = all(
        np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
        for f in feeds
        for x, y in zip(sessions["rows"].run(None, f), sessions["lean"].run(None, f), strict=True))
    spent: dict[str, list[float]] = {"rows": [], "lean": []}
    for r in range(rounds):
        for form in (("rows", "lean") if r % 2 == 0 else ("lean", "rows")):
            started = time.perf_counter()
            for f in feeds:
                sessions[form].run(None, f)
            spent[form].append((time.perf_counter() - started) / len(feeds) * 1e3)
    rows_ms, lean_ms = statistics.median(spent["rows"]), statistics.median(spent["lean"])
    # Token ids [rows, positions] (the decoders' "tokens", the encoder's "src"): rows x positions
    # activation rows enter each weight matmul.
    per_call = statistics.mean(int(np.prod(f.get("tokens", f.get("src")).shape)) for f in feeds)
    return (f"| {name} | {run} | {len(feeds)} | {per_call:.1f} | {rows_ms:.3f} | {lean_ms:.3f} | "
            f"{lean_ms / rows_ms:.2f}x | {'yes' if identical else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
