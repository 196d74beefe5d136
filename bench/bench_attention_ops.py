"""One-query attention on ONNX Runtime: the matmuls of an AR step's scores and values, by op and by
how many positions they run over.

    python bench/bench_attention_ops.py            # print the table
    python bench/bench_attention_ops.py --write    # also replace the "Attention matmuls (CPU)" section

A batched AR step scores each row's query [B, H, 1, hd] against its keys stored transposed
[B, H, hd, P] (`kernels.attention.KeysT`) and weights its values [B, H, P, hd]. Timed here, one
intra-op thread, median of interleaved calls:

* scores as MatMul, as FusedMatMul with the scale folded in (what ONNX Runtime's MatMulScaleFusion
  makes of a MatMul followed by a Mul by a constant), and as MatMul then Mul;
* values as MatMul;
* `hot`: the same keys every call (they stay in cache); `cold`: each call a different one of enough
  buffers to outgrow the last-level cache, as a forward meets each layer's K/V once (each cell
  cycling through the buffers from its own starting point);
* each cell in bursts of calls back to back, the cells' bursts interleaved;
* P: the positions a row holds, and the capacity a pool rounds them up to (its padding is read like
  the rest).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import machine_stamp, write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Attention matmuls (CPU)"
HEADS, HEAD_DIM = 8, 64  # the bundled verifier's
COLD_BYTES = 96 << 20  # buffers cycled through for the cold columns: more than a server CPU's L3
BURST = 10  # calls of one cell back to back (the hot ones keep their keys in cache)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="rows of the batch (default: 32)")
    p.add_argument("--positions", type=int, nargs="+", default=[33, 48, 64], help="P values (default: 33 48 64)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per cell (default: 200)")
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = p.parse_args(argv)
    sessions = _sessions()
    cells = {positions: _cells(sessions, args.rows, positions) for positions in args.positions}
    times: dict[tuple[int, str], list[float]] = {(p, name): [] for p, named in cells.items() for name in named}
    calls = 0
    while calls < args.calls:  # bursts of every cell of every P in turn: a noisy neighbour hits all alike
        for p, named in cells.items():
            for name, fn in named.items():
                for i in range(calls, calls + BURST):
                    started = time.perf_counter()
                    fn(i)
                    times[p, name].append(time.perf_counter() - started)
        calls += BURST
    rows = []
    for p in args.positions:
        us = {name: statistics.median(times[p, name]) * 1e6 for name in cells[p]}
        rows.append(f"| {p} | {us['mm hot']:.0f} | {us['mm cold']:.0f} | {us['fused hot']:.0f} | "
                    f"{us['fused cold']:.0f} | {us['mul cold']:.0f} | {us['v hot']:.0f} | {us['v cold']:.0f} |")
    body = "\n".join([
        machine_stamp("ONNX Runtime, one intra-op thread"), "",
        f"B={args.rows} rows, H={HEADS} heads of {HEAD_DIM}; microseconds per call (median); module docstring "
        "of `bench/bench_attention_ops.py`.", "",
        "| P | scores MatMul hot | cold | scores FusedMatMul (scale folded in) hot | cold | "
        "scores MatMul + Mul cold | values MatMul hot | cold |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])
    print(f"{SECTION}\n\n{body}")
    if args.write:
        write_section(REPO / "BENCHMARKS.md", SECTION, body)
    return 0


def _cells(sessions: dict[str, Callable], rows: int, positions: int) -> dict[str, Callable[[int], object]]:
    """The calls timed at `positions`, each of its call number (the cold ones take buffer i in turn),
    every buffer touched once already."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((rows, HEADS, 1, HEAD_DIM), dtype=np.float32)
    w = rng.standard_normal((rows, HEADS, 1, positions), dtype=np.float32)
    size = rows * HEADS * HEAD_DIM * positions * 4
    count = max(2, COLD_BYTES // size)
    keys = [rng.standard_normal((rows, HEADS, HEAD_DIM, positions), dtype=np.float32) for _ in range(count)]
    values = [rng.standard_normal((rows, HEADS, positions, HEAD_DIM), dtype=np.float32) for _ in range(count)]
    third = count // 3
    cells: dict[str, Callable[[int], object]] = {
        "mm hot": lambda i: sessions["scores"]({"q": q, "k": keys[0]}),
        "mm cold": lambda i: sessions["scores"]({"q": q, "k": keys[i % count]}),
        "fused hot": lambda i: sessions["fused"]({"q": q, "k": keys[0]}),
        "fused cold": lambda i: sessions["fused"]({"q": q, "k": keys[(i + third) % count]}),
        "mul cold": lambda i: sessions["scaled"]({"q": q, "k": keys[(i + 2 * third) % count]}),
        "v hot": lambda i: sessions["values"]({"w": w, "v": values[0]}),
        "v cold": lambda i: sessions["values"]({"w": w, "v": values[i % count]}),
    }
    for i in range(count):  # warm-up, and every buffer touched once
        for fn in cells.values():
            fn(i)
    return cells


def _sessions() -> dict[str, Callable]:
    """Each graph as a function of its feeds, with no graph optimisation of ONNX Runtime's (so each
    runs the op it names)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def value(name: str, shape: list) -> object:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [HEAD_DIM ** -0.5])
    q, k = value("q", ["B", HEADS, 1, HEAD_DIM]), value("k", ["B", HEADS, HEAD_DIM, "P"])
    graphs = {
        "scores": ([helper.make_node("MatMul", ["q", "k"], ["s"])], [q, k], []),
        "fused": ([helper.make_node("FusedMatMul", ["q", "k"], ["s"], domain="com.microsoft", alpha=HEAD_DIM ** -0.5)],
                  [q, k], []),
        "scaled": ([helper.make_node("MatMul", ["q", "k"], ["u"]), helper.make_node("Mul", ["u", "scale"], ["s"])],
                   [q, k], [scale]),
        "values": ([helper.make_node("MatMul", ["w", "v"], ["s"])],
                   [value("w", ["B", HEADS, 1, "P"]), value("v", ["B", HEADS, "P", HEAD_DIM])], []),
    }
    out = {}
    for name, (nodes, inputs, inits) in graphs.items():
        graph = helper.make_graph(nodes, name, inputs, [value("s", None)], initializer=inits)
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        out[name] = lambda feeds, session=session: session.run(None, feeds)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
