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

A second table asks whether ONNX Runtime's CPU kernels can attend over each row's own length: the
whole one-query attention (scores, scale, mask, softmax, values) as the exported graphs run it over
the pool's capacity for every row, against the contrib op GroupQueryAttention (keys not transposed,
as it takes them; its past K/V bound in place as its present through I/O binding, so the past is
never copied), given
* each row's own length (`seqlens_k`): it attends over that many positions only;
* every row the whole capacity, the positions a row does not hold masked by an `attention_bias` of
  -inf (the new token's K/V written into the capacity's last position, which a pool would keep free).
Rows all of one length, and rows of every length from 1 to the capacity (a service's rows, of every
age); cold buffers as above, each call through a binding made once per buffer.
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
    p.add_argument("--capacities", type=int, nargs="+", default=[32, 48, 64],
                   help="pool capacities of the second table (default: 32 48 64)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per cell (default: 200)")
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = p.parse_args(argv)
    sessions = _sessions()
    cells = {positions: _cells(sessions, args.rows, positions) for positions in args.positions}
    times = _interleaved(cells, args.calls)
    ragged = {case: _ragged_cells(args.rows, *case) for case in _length_cases(args.capacities)}
    ragged_times = _interleaved(ragged, args.calls)
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
        "",
        "Whole one-query attention, cold, microseconds per call (median); GQA: GroupQueryAttention:",
        "",
        "| capacity | rows' lengths | mean length | graph, over the capacity | GQA, each row's length | "
        "GQA, the capacity masked | GQA masked / graph |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *(_ragged_row(args.rows, case, ragged_times) for case in ragged),
    ])
    print(f"{SECTION}\n\n{body}")
    if args.write:
        write_section(REPO / "BENCHMARKS.md", SECTION, body)
    return 0


def _interleaved(cells: dict, calls_per_cell: int) -> dict[tuple, list[float]]:
    """Seconds of each call of every cell (`cells`: key -> name -> fn(call number)), in bursts of
    every cell in turn: a noisy neighbour hits all alike."""
    times: dict[tuple, list[float]] = {(key, name): [] for key, named in cells.items() for name in named}
    calls = 0
    while calls < calls_per_cell:
        for key, named in cells.items():
            for name, fn in named.items():
                for i in range(calls, calls + BURST):
                    started = time.perf_counter()
                    fn(i)
                    times[key, name].append(time.perf_counter() - started)
        calls += BURST
    return times


def _length_cases(capacities: list[int]) -> list[tuple[int, int | None]]:
    """The second table's (capacity, every row's length, the new position included; None: each row
    its own, spread over 1..capacity - 1, the last position being the masked variant's scratch)."""
    return [case for c in capacities for case in ((c, c - 1), (c, c // 2), (c, None))]


def _ragged_row(rows: int, case: tuple[int, int | None], times: dict[tuple, list[float]]) -> str:
    graph, own, masked = (statistics.median(times[case, name]) * 1e6 for name in ("graph", "gqa own", "gqa masked"))
    capacity, length = case
    label = f"all {length}" if length is not None else f"1 to {capacity - 1}, uniform"
    mean = float(_row_lengths(rows, capacity, length).mean())
    return f"| {capacity} | {label} | {mean:.1f} | {graph:.0f} | {own:.0f} | {masked:.0f} | {masked / graph:.2f}x |"


def _row_lengths(rows: int, capacity: int, length: int | None) -> np.ndarray:
    """Each row's positions, the new one included."""
    if length is not None:
        return np.full(rows, length, np.int64)
    return np.random.default_rng(1).integers(1, capacity, rows)


def _ragged_cells(rows: int, capacity: int, length: int | None) -> dict[str, Callable[[int], object]]:
    """The second table's three calls for one case, each cycling through cold buffers through I/O
    bindings made once per buffer (every buffer run once already)."""
    graph, gqa_own, gqa_masked = _attention_sessions(capacity)
    rng = np.random.default_rng(0)
    held = _row_lengths(rows, capacity, length)
    count = max(2, COLD_BYTES // (rows * HEADS * HEAD_DIM * capacity * 4 * 2))
    q = rng.standard_normal((rows, HEADS, 1, HEAD_DIM), dtype=np.float32)
    visible = np.arange(capacity)[None, None, None, :] < held[:, None, None, None]
    # The masked variant attends over the held positions but the new one, and the last (the new one's K/V).
    scratch = np.arange(capacity)[None, None, None, :] == capacity - 1
    bias = np.where((np.arange(capacity)[None, None, None, :] < held[:, None, None, None] - 1) | scratch,
                    0.0, -np.inf).astype(np.float32)
    new = q.reshape(rows, 1, HEADS * HEAD_DIM)
    feeds = {
        "gqa own": {"seqlens_k": (held - 1).astype(np.int32), "total": np.array(int(held.max()), np.int32)},
        "gqa masked": {"seqlens_k": np.full(rows, capacity - 1, np.int32), "total": np.array(capacity, np.int32),
                       "bias": bias},
    }
    bound: dict[str, list] = {"graph": [], "gqa own": [], "gqa masked": []}
    for _ in range(count):
        keys = rng.standard_normal((rows, HEADS, HEAD_DIM, capacity), dtype=np.float32)
        values = rng.standard_normal((rows, HEADS, capacity, HEAD_DIM), dtype=np.float32)
        bound["graph"].append(_bound(graph, {"q": q, "k": keys, "v": values, "visible": visible}))
        for name, session in (("gqa own", gqa_own), ("gqa masked", gqa_masked)):
            past = {"past_k": np.ascontiguousarray(np.swapaxes(keys, 2, 3)), "past_v": values.copy()}
            bound[name].append(_bound(session, {"q": new, "k": new, "v": new, **feeds[name]}, in_place=past))
    _check_masked(graph, gqa_masked, q, feeds["gqa masked"], capacity)
    offsets = {"graph": 0, "gqa own": count // 3, "gqa masked": 2 * count // 3}
    cells: dict[str, Callable[[int], object]] = {
        name: (lambda i, name=name: bound[name][(i + offsets[name]) % count]()) for name in bound
    }
    for i in range(count):
        for fn in cells.values():
            fn(i)
    return cells


def _check_masked(graph: object, gqa_masked: object, q: np.ndarray, feeds: dict[str, np.ndarray], capacity: int
                  ) -> None:
    """Raise unless the masked GroupQueryAttention (its lengths and bias `feeds`) computes the graph's
    attention: the same keys and values, the new token's K/V (here its query) in the last position,
    the same positions visible."""
    rng = np.random.default_rng(2)
    rows = q.shape[0]
    keys = rng.standard_normal((rows, HEADS, HEAD_DIM, capacity), dtype=np.float32)
    values = rng.standard_normal((rows, HEADS, capacity, HEAD_DIM), dtype=np.float32)
    new = q.reshape(rows, 1, HEADS * HEAD_DIM)
    past = {"past_k": np.ascontiguousarray(np.swapaxes(keys, 2, 3)), "past_v": values.copy()}
    got = gqa_masked.run(None, {"q": new, "k": new, "v": new, **past, **feeds})[0]  # type: ignore[attr-defined]
    keys[..., capacity - 1], values[:, :, capacity - 1] = q[:, :, 0], q[:, :, 0]
    want = graph.run(None, {"q": q, "k": keys, "v": values, "visible": feeds["bias"] == 0})[0]  # type: ignore[attr-defined]
    gap = float(np.abs(want[:, :, 0] - got.reshape(rows, HEADS, HEAD_DIM)).max())
    if gap > 1e-4:
        raise AssertionError(f"GroupQueryAttention (masked) differs from the graph's attention by {gap}")


def _bound(session: object, inputs: dict[str, np.ndarray], in_place: dict[str, np.ndarray] | None = None
           ) -> Callable[[], object]:
    """A call of `session` through an I/O binding of `inputs`; `in_place`: past buffers bound as
    their present outputs too (present_k for past_k, present_v for past_v)."""
    import onnxruntime as ort

    binding = session.io_binding()
    for name, array in inputs.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("o")
    kept = []
    for name, array in (in_place or {}).items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        kept.append(value)
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past", "present"), value)
    return lambda: (session.run_with_iobinding(binding), kept)


def _attention_sessions(capacity: int) -> tuple[object, object, object]:
    """The graphs' one-query attention (scores, scale, mask, softmax, values over the capacity),
    GroupQueryAttention's without a bias and with one, as ONNX Runtime sessions of one thread."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def value(name: str, shape: list | None, kind: int = TensorProto.FLOAT) -> object:
        return helper.make_tensor_value_info(name, kind, shape)

    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [HEAD_DIM ** -0.5])
    masked = helper.make_tensor("masked", TensorProto.FLOAT, [], [float("-inf")])
    attention = helper.make_graph(
        [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["u"]),
         helper.make_node("Where", ["visible", "u", "masked"], ["w"]),
         helper.make_node("Softmax", ["w"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["o"])],
        "attention",
        [value("q", ["B", HEADS, 1, HEAD_DIM]), value("k", ["B", HEADS, HEAD_DIM, capacity]),
         value("v", ["B", HEADS, capacity, HEAD_DIM]), value("visible", ["B", 1, 1, capacity], TensorProto.BOOL)],
        [value("o", None)], initializer=[scale, masked])
    width = HEADS * HEAD_DIM
    gqa_inputs = [value("q", ["B", 1, width]), value("k", ["B", 1, width]), value("v", ["B", 1, width]),
                  value("past_k", ["B", HEADS, capacity, HEAD_DIM]), value("past_v", ["B", HEADS, capacity, HEAD_DIM]),
                  value("seqlens_k", ["B"], TensorProto.INT32), value("total", [], TensorProto.INT32)]
    outputs = [value("o", None), value("present_k", None), value("present_v", None)]

    def gqa(bias: bool) -> object:
        names = ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total", *(["", "", "", "bias"] if bias else [])]
        node = helper.make_node("GroupQueryAttention", names, ["o", "present_k", "present_v"],
                                domain="com.microsoft", num_heads=HEADS, kv_num_heads=HEADS)
        extra = [value("bias", ["B", 1, 1, capacity])] if bias else []
        return helper.make_graph([node], "gqa", gqa_inputs + extra, outputs)

    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    graphs = (attention, gqa(False), gqa(True))
    return tuple(ort.InferenceSession(helper.make_model(g, opset_imports=opsets).SerializeToString(), opts,
                                      providers=["CPUExecutionProvider"]) for g in graphs)


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
