"""The output head's fast paths against the plain torch reference (kernels.reference).

Inputs are fresh every run: hypothesis draws shapes and seeds (it prints the failing example), and
fixed-shape tests use SEED, taken from KERNELS_TEST_SEED or drawn at random and shown in every
assertion message. The Triton kernel runs under the Triton interpreter in a child pytest process
(tests/test_kernels_triton.py) so that TRITON_INTERPRET=1 is set before triton is imported and
does not leak into the rest of this session.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from kernels import HeadOutput, output_head, output_head_cpu, output_head_graph, output_head_reference, warm_up_head
from kernels.attention import EAGER, GRAPH
from kernels.cpu import topk_lowest_id_first
from kernels.reference import _topk_lowest_id_first as _reference_topk
from kernels.triton_head import MAX_K as TRITON_MAX_K
from kernels.triton_head import head_variants, launch_plan

SEED = int(os.environ.get("KERNELS_TEST_SEED") or random.SystemRandom().randrange(2**31))
REPO = Path(__file__).resolve().parents[1]
ATOL = {torch.float32: 1e-5, torch.float64: 1e-9}

# Vocab sizes around and off the Triton block sizes (64/128), plus tiny ones where k > vocab.
VOCABS = st.sampled_from([1, 2, 7, 63, 64, 65, 129, 1000, 8191]) | st.integers(1, 3000)
HEAD_CASES = st.fixed_dictionaries(
    {
        "rows": st.integers(1, 64),
        "vocab": VOCABS,
        "dim": st.sampled_from([8, 16, 33, 64]),
        "k": st.integers(1, 16),
        "dtype": st.sampled_from([torch.float32, torch.float64]),
        "masked": st.booleans(),
        "seed": st.integers(0, 2**31 - 1),
    }
)


# ---------------------------------------------------------------------------------------------
# Helpers shared with tests/test_kernels_triton.py (names without the test_ prefix on purpose).


def make_inputs(
    gen: torch.Generator,
    rows: int,
    vocab: int,
    dim: int,
    dtype: torch.dtype = torch.float32,
    *,
    exact_ties: bool = False,
    masked: bool = False,
    device: str = "cpu",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden, weight, bias, targets (about a third of them -1)."""
    if exact_ties:
        # Small integers: every logit is an exact integer whatever order a GEMM sums in, and
        # duplicated weight rows make many logits tie exactly, in every backend alike.
        hidden = torch.randint(-1, 2, (rows, dim), generator=gen).to(dtype)
        distinct = torch.randint(-1, 2, (max(1, vocab // 3), dim), generator=gen).to(dtype)
        weight = distinct[torch.randint(0, distinct.shape[0], (vocab,), generator=gen)]
        bias = torch.randint(-1, 2, (vocab,), generator=gen).to(dtype)
    else:
        # Logits of a few units, as a trained head gives. Some words are copies of others (weight
        # row and bias), so their logits tie too, though a GEMM may round the copies differently.
        hidden = torch.randn(rows, dim, generator=gen, dtype=dtype)
        weight = torch.randn(vocab, dim, generator=gen, dtype=dtype) * (2.0 / dim**0.5)
        bias = torch.randn(vocab, generator=gen, dtype=dtype) * 0.5
        src = torch.randint(0, vocab, (vocab // 8,), generator=gen)
        dst = torch.randint(0, vocab, (vocab // 8,), generator=gen)
        weight[dst], bias[dst] = weight[src], bias[src]
    if masked:  # masked-out vocabulary entries, as a constrained decoder would pass; never all of them
        mask = torch.rand(vocab, generator=gen) < 0.2
        mask[torch.randint(0, vocab, (1,), generator=gen)] = False
        bias[mask] = float("-inf")
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < 0.35] = -1
    return hidden.to(device), weight.to(device), bias.to(device), targets.to(device)


def assert_head_matches(
    out: HeadOutput,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    k: int,
    targets: Tensor,
    *,
    exact_ids: bool,
    context: str = "",
) -> None:
    """`out` agrees with the reference on the same inputs.

    Values: top-k log-probs within `head_atol` of the reference's (so the set is a true top-k up to
    that), and each returned value is the reference's log-prob of the returned id. Ids: exactly
    equal when `exact_ids` (exact-arithmetic inputs, where ties are real ties in both), else exactly
    equal at every position whose value is more than twice that away from its neighbours in the
    full ranking (a near-tie may legitimately flip between two GEMMs' roundings).
    """
    msg = f"seed={SEED} {context}"
    atol = head_atol(hidden.dtype, hidden.shape[1])
    ref = output_head_reference(hidden, weight, bias, k, targets)
    full = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    rows, kk = hidden.shape[0], min(k, weight.shape[0])

    assert out.topk_ids.shape == (rows, kk) and out.topk_ids.dtype == torch.long, msg
    assert out.topk_logprobs.shape == (rows, kk) and out.topk_logprobs.dtype == hidden.dtype, msg
    assert out.target_logprobs.shape == (rows,) and out.target_logprobs.dtype == hidden.dtype, msg
    torch.testing.assert_close(
        out.topk_logprobs, ref.topk_logprobs, atol=atol, rtol=0, msg=lambda m: f"{msg}\n{m}"
    )
    torch.testing.assert_close(
        out.topk_logprobs, full.gather(1, out.topk_ids), atol=atol, rtol=0, msg=lambda m: f"{msg}\n{m}"
    )
    ids_sorted = out.topk_ids.sort(dim=1).values
    assert bool((ids_sorted[:, 1:] != ids_sorted[:, :-1]).all()), f"duplicate ids: {msg}"

    if exact_ids:
        assert torch.equal(out.topk_ids, ref.topk_ids), f"{msg}\n{out.topk_ids}\n{ref.topk_ids}"
    else:
        ranked = full.sort(dim=1, descending=True, stable=True).values
        inf = torch.full((rows, 1), float("inf"), dtype=ranked.dtype, device=ranked.device)
        gaps = torch.cat([inf, ranked[:, :-1] - ranked[:, 1:], inf], dim=1)  # gap above / below each rank
        clear = torch.minimum(gaps[:, :kk], gaps[:, 1 : kk + 1]) > 2 * atol
        assert torch.equal(out.topk_ids[clear], ref.topk_ids[clear]), f"{msg}\n{out.topk_ids}\n{ref.topk_ids}"

    none = targets < 0
    assert torch.equal(torch.isnan(out.target_logprobs), none), msg
    torch.testing.assert_close(
        out.target_logprobs[~none], ref.target_logprobs[~none], atol=atol, rtol=0, msg=lambda m: f"{msg}\n{m}"
    )


def head_atol(dtype: torch.dtype, dim: int) -> float:
    """ATOL for hidden sizes up to 64, growing as sqrt(dim) beyond.

    Two correct fp32 GEMMs that sum dim products in different orders differ by about
    sqrt(dim) * ulp(logit): oneDNN's and MKL's logits for the same D=512 head differ by up to
    ~1.3e-5 (and each is within ~1e-5 of the float64 truth), so a flat 1e-5 would test rounding luck.
    """
    return ATOL.get(dtype, 1e-5) * max(1.0, (dim / 64) ** 0.5)


def case_generator(*parts: object) -> torch.Generator:
    """A generator seeded from SEED and the case, so each case differs but a run replays from SEED."""
    # crc32, not hash(): str hashes change from process to process.
    return torch.Generator().manual_seed(zlib.crc32(repr((SEED, *parts)).encode()))


# ---------------------------------------------------------------------------------------------
# CPU path


@settings(max_examples=60, deadline=None)
@given(case=HEAD_CASES)
def test_cpu_matches_reference_random(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    hidden, weight, bias, targets = make_inputs(
        gen, case["rows"], case["vocab"], case["dim"], case["dtype"], masked=case["masked"]
    )
    out = output_head_cpu(hidden, weight, bias, case["k"], targets)
    assert_head_matches(out, hidden, weight, bias, case["k"], targets, exact_ids=False, context=str(case))


@settings(max_examples=60, deadline=None)
@given(case=HEAD_CASES)
def test_cpu_exact_ties_go_to_lower_id(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    hidden, weight, bias, targets = make_inputs(
        gen, case["rows"], case["vocab"], case["dim"], case["dtype"], exact_ties=True, masked=case["masked"]
    )
    out = output_head_cpu(hidden, weight, bias, case["k"], targets)
    assert_head_matches(out, hidden, weight, bias, case["k"], targets, exact_ids=True, context=str(case))


@pytest.mark.parametrize("vocab", [8192, 32000])
@pytest.mark.parametrize("dim", [256, 512])
@pytest.mark.parametrize("rows", [1, 5, 25])
def test_cpu_matches_reference_at_product_sizes(rows: int, dim: int, vocab: int) -> None:
    # The sizes the benchmark times; fp32 goes through oneDNN's GEMM here, not F.linear's.
    hidden, weight, bias, targets = make_inputs(case_generator("product", rows, dim, vocab), rows, vocab, dim)
    out = output_head_cpu(hidden, weight, bias, 8, targets)
    assert_head_matches(
        out, hidden, weight, bias, 8, targets, exact_ids=False, context=f"{rows}x{dim}x{vocab}"
    )


def test_cpu_without_bias_and_with_noncontiguous_inputs() -> None:
    hidden, weight, _, targets = make_inputs(case_generator("noncontig"), 9, 500, 32)
    hidden_t = hidden.t().contiguous().t()  # same values, column-major strides
    weight_t = weight.t().contiguous().t()
    out = output_head_cpu(hidden_t, weight_t, None, 5, targets)
    assert_head_matches(out, hidden, weight, None, 5, targets, exact_ids=False)


def test_cpu_zero_rows() -> None:
    weight = torch.randn(50, 16)
    out = output_head_cpu(torch.empty(0, 16), weight, None, 4, torch.empty(0, dtype=torch.long))
    assert out.topk_ids.shape == (0, 4) and out.topk_logprobs.shape == (0, 4)
    assert out.target_logprobs.shape == (0,)


def test_cpu_rejects_k_below_one() -> None:
    with pytest.raises(ValueError):
        output_head_cpu(torch.randn(2, 8), torch.randn(10, 8), None, 0, torch.tensor([0, -1]))


@pytest.mark.parametrize("k", [1, 3, 11])
@pytest.mark.parametrize("rows", [3, 40])  # 3 rows: the tie check runs on a Python list
def test_topk_tie_fix_matches_stable_sort(rows: int, k: int) -> None:
    gen = case_generator("ties", rows, k)
    values = torch.randint(-3, 3, (rows, 50), generator=gen).float()
    values[0] = 0.0  # one row all tied
    values[1, ::2] = float("nan")  # NaNs rank first (torch.sort's order) and tie among themselves
    values[2, :] = float("-inf")
    got = topk_lowest_id_first(values, k)
    want = _reference_topk(values, k)
    assert torch.equal(got[1], want[1]), f"seed={SEED}"
    torch.testing.assert_close(got[0], want[0], equal_nan=True)


def test_outputs_do_not_scale_with_vocab() -> None:
    # The head's point: a few numbers per row cross to the host, never [R, V].
    for vocab in (100, 5000):
        hidden, weight, bias, targets = make_inputs(case_generator("size", vocab), 3, vocab, 16)
        out = output_head_cpu(hidden, weight, bias, 4, targets)
        assert out.topk_ids.numel() + out.topk_logprobs.numel() + out.target_logprobs.numel() == 3 * 4 * 2 + 3


# ---------------------------------------------------------------------------------------------
# Dispatcher


@pytest.mark.parametrize("backend", ["auto", "reference", "cpu"])
def test_dispatcher_backends_agree_on_cpu(backend: str) -> None:
    hidden, weight, bias, targets = make_inputs(case_generator("dispatch", backend), 6, 777, 24)
    out = output_head(hidden, weight, bias, 7, targets, backend=backend)  # type: ignore[arg-type]
    assert_head_matches(out, hidden, weight, bias, 7, targets, exact_ids=False, context=backend)


def test_graph_head_matches_reference_in_eager_torch() -> None:
    # The head traced into the verifier's ONNX decoder, run here in eager torch with a tensor k as
    # the graph gets it (ids compared loosely: eager torch.topk does not promise the tie order).
    hidden, weight, bias, targets = make_inputs(case_generator("graph"), 5, 777, 24)
    out = output_head_graph(hidden, weight, bias, torch.tensor([6]), targets)
    assert_head_matches(out, hidden, weight, bias, 6, targets, exact_ids=False, context="graph")


def test_attention_kernels_agree_on_one_sequence() -> None:
    # The eager (SDPA) and export (matmul-softmax) kernels compute the same attention for batch 1.
    gen = case_generator("attention")
    heads, head_dim = 4, 8
    x = torch.randn(1, 5, heads * head_dim, generator=gen)
    k = torch.randn(1, heads, 7, head_dim, generator=gen)
    v = torch.randn(1, heads, 7, head_dim, generator=gen)
    mask = torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2
    outs = []
    for kernel in (EAGER, GRAPH):
        q = kernel.split_heads(x, heads, head_dim)
        outs.append(kernel.merge_heads(kernel.attend(q, k, v, mask, head_dim, 0.0), heads, head_dim))
    assert outs[0].shape == outs[1].shape == x.shape
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_dispatcher_rejects_unknown_backend() -> None:
    hidden, weight, targets = torch.randn(1, 4), torch.randn(5, 4), torch.tensor([1])
    with pytest.raises(ValueError, match="unknown backend"):
        output_head(hidden, weight, None, 2, targets, backend="gpu")  # type: ignore[arg-type]


def test_kernels_import_and_run_without_triton() -> None:
    # A child process where `import triton` fails: the package must import and fall back to CPU.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "assert not kernels.triton_available()\n"
        "out = kernels.output_head(torch.randn(2, 8), torch.randn(30, 8), None, 3, torch.tensor([4, -1]))\n"
        "assert out.topk_ids.shape == (2, 3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# Triton


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter() -> None:
    """Runs tests/test_kernels_triton.py in a child pytest with TRITON_INTERPRET=1, on CPU tensors."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "KERNELS_TEST_SEED": str(SEED), "CUDA_VISIBLE_DEVICES": ""}
    # -n 0: one process (pyproject's addopts would otherwise start xdist workers for the child too).
    cmd = [sys.executable, "-m", "pytest", "tests/test_kernels_triton.py", "-q", "-p", "no:cacheprovider", "-n", "0"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"seed={SEED}\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 5, 25, 64])
def test_cuda_auto_dispatch_matches_reference(rows: int) -> None:
    hidden, weight, bias, targets = make_inputs(
        case_generator("cuda", rows), rows, 32000, 512, device="cuda", masked=rows == 5
    )
    out = output_head(hidden, weight, bias, 8, targets)
    assert_head_matches(out, hidden, weight, bias, 8, targets, exact_ids=False, context=f"rows={rows}")


@pytest.mark.parametrize("programs", [0, 4 * 132, 4 * 108])
def test_head_variants_cover_every_launch(programs: int) -> None:
    """Every (rows, k) a forward can bring, rows up to the verifier's default max_batch_tokens and
    any k the Triton head takes, launches a kernel variant the warm-up compiled."""
    vocab, dim, max_rows = 8000, 512, 512
    on_gpu = programs > 0
    warmed = {launch_plan(rows, vocab, dim, k, programs, on_gpu=on_gpu).variant
              for rows, k in head_variants(max_rows, vocab, dim, (1, 4, 8, 16), programs, on_gpu=on_gpu)}
    for k in range(1, TRITON_MAX_K + 1):
        for rows in range(1, max_rows + 1):
            assert launch_plan(rows, vocab, dim, k, programs, on_gpu=on_gpu).variant in warmed, (rows, k)


def test_warm_up_head_compiles_nothing_for_cpu_weights() -> None:
    """On the CPU `output_head` runs no Triton kernel, so the verifier's warm-up has nothing to do."""
    weight = torch.randn(50, 16)
    assert warm_up_head(weight, torch.zeros(50), max_rows=64) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_warm_up_leaves_nothing_to_compile_under_load() -> None:
    """After the warm-up, heads of any row count and k compile no new Triton kernel (a compile
    under load stalls every session on the verifier's worker)."""
    from kernels import _triton_kernels as tk

    gen = case_generator("cuda-warm-up")
    weight = torch.randn(8000, 512, generator=gen).cuda() * 0.05
    bias = torch.randn(8000, generator=gen).cuda()
    warm_up_head(weight, bias, max_rows=512)
    device = torch.cuda.current_device()

    def compiled() -> int:
        kernels = (tk.head_partials_kernel, tk.merge_partials_kernel)
        return sum(len(kernel.device_caches[device][0]) for kernel in kernels)

    before = compiled()
    rnd = random.Random(SEED)
    for rows, k in [(1, 1), (16, 1), (17, 3), (32, 5), (48, 16), (255, 2), (256, 8), (300, 1), (512, 16)] + [
        (rnd.randint(1, 512), rnd.randint(1, 16)) for _ in range(20)
    ]:
        hidden = torch.randn(rows, 512, generator=gen).cuda()
        output_head(hidden, weight, bias, k, torch.zeros(rows, dtype=torch.long, device="cuda"))
    assert compiled() == before


def test_launch_plan_takes_the_tuning_knobs() -> None:
    """`num_splits` and `block_v` reach the launch (the interpreter tests use them to put split
    edges where they want: 100 columns in 7 splits of 16, the last one 4 wide)."""
    plan = launch_plan(6, 100, 16, 16, programs=0, block_v=16, num_splits=7, on_gpu=False)
    assert (plan.block_v, plan.splits, plan.split_size, plan.s_p, plan.c_p) == (16, 7, 16, 8, 128)
    assert launch_plan(6, 100, 16, 16, programs=0, on_gpu=False).splits == 2


@pytest.mark.parametrize("space", ["logits", "logprobs", "mixed"])
def test_heads_apply_the_logits_processors_alike(space: str) -> None:
    """With processors (penalised, banned and forced tokens, rows in either space), the reference,
    CPU and graph heads give the same top-k and target log-probs, and the reference's are
    `core.logits_processors.apply_processing` on the raw logits (logit space: then normalised)."""
    import numpy as np

    from core.logits_processors import RowPlan, processing, processing_feeds
    from decoding.config import DecodingConfig

    rows, vocab = 6, 50
    hidden, weight, bias, targets = make_inputs(case_generator("processed", space), rows, vocab, 24)
    rng = random.Random(space)
    beam = DecodingConfig(mode="beam", num_beams=4, repetition_penalty=1.4).processors()
    greedy = DecodingConfig(mode="ar", repetition_penalty=0.8).processors()
    settings = [beam if space == "logprobs" or (space == "mixed" and r % 2) else greedy for r in range(rows)]
    plans = [RowPlan(tuple(rng.sample(range(vocab), 5)), tuple(rng.sample(range(vocab), 4)),
                     rng.randrange(vocab) if r == 2 else -1) for r in range(rows)]
    p = processing(plans, settings)
    assert p is not None
    reference = output_head_reference(hidden, weight, bias, 7, targets, p)
    for out in (output_head_cpu(hidden, weight, bias, 7, targets, p), output_head(hidden, weight, bias, 7, targets,
                                                                                   processing=p)):
        assert torch.equal(out.topk_ids, reference.topk_ids)
        assert torch.allclose(out.topk_logprobs, reference.topk_logprobs, atol=1e-6)
    feeds = processing_feeds(p, rows)
    graph = output_head_graph(hidden, weight, bias, torch.tensor([7]), targets,
                              [torch.from_numpy(np.asarray(feeds[name])) for name in feeds])
    assert torch.allclose(graph.topk_logprobs, reference.topk_logprobs, atol=1e-5)
    assert torch.allclose(graph.target_logprobs, reference.target_logprobs, atol=1e-5, equal_nan=True)
    assert reference.topk_ids[2, 0] == plans[2].forced and reference.topk_logprobs[2, 0] == 0
    for r in (0, 1, 3, 4, 5):  # a banned token is never among the top 7 of 50
        assert not set(plans[r].banned) & set(reference.topk_ids[r].tolist()), r
