"""The Triton head against the reference.

Runs where the kernel can: on a CUDA device, or under the Triton interpreter with CPU tensors. On a
machine without a GPU, tests/test_kernels.py::test_triton_kernel_under_interpreter runs this file in
a child pytest with TRITON_INTERPRET=1 (it must be set before triton is imported); collected in a
normal session without a GPU it skips as a whole. Sizes stay small: the interpreter is slow.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernels.triton_head import head_variants, output_head_triton, triton_available, warm_up_triton_head
from tests.test_kernels import SEED, assert_head_matches, case_generator, make_inputs

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
if not (INTERPRETING or torch.cuda.is_available()) or not triton_available():
    pytest.skip(
        "Triton head needs a CUDA device or TRITON_INTERPRET=1 "
        "(tests/test_kernels.py runs this file under the interpreter)",
        allow_module_level=True,
    )
DEVICE = "cpu" if INTERPRETING else "cuda"

# rows, vocab, dim, k, num_splits, block_v
FIXED_CASES = [
    (1, 1, 16, 1, None, None),  # a one-word vocabulary
    (3, 7, 16, 16, None, None),  # k > vocab: clamped to 7
    (5, 1000, 32, 8, 2, None),  # 1000 = 15 tiles of 64 + 40
    (2, 257, 40, 16, 3, 32),  # dim not a multiple of the 64-wide D block either
    (17, 130, 24, 16, 4, 16),  # one 32-row block with 15 rows masked; splits of 2-3 tiles
    (64, 200, 16, 4, 2, None),  # two 32-row blocks
    (6, 100, 16, 16, 7, 16),  # last split has 4 columns < k: its empty slots must lose the merge
    (4, 8191, 16, 16, 3, 128),  # large vocab, last tile 127 wide
]


# Exact ties on every case but the big one, which the interpreter is slowest on.
KINDS_AND_CASES = [(kind, *case) for case in FIXED_CASES for kind in ("random", "exact_ties")][:-1]


@pytest.mark.parametrize(("kind", "rows", "vocab", "dim", "k", "splits", "block_v"), KINDS_AND_CASES)
def test_triton_matches_reference(
    kind: str, rows: int, vocab: int, dim: int, k: int, splits: int | None, block_v: int | None
) -> None:
    exact = kind == "exact_ties"
    gen = case_generator("triton", rows, vocab, dim, k, kind)
    hidden, weight, bias, targets = make_inputs(gen, rows, vocab, dim, exact_ties=exact, device=DEVICE)
    out = output_head_triton(hidden, weight, bias, k, targets, num_splits=splits, block_v=block_v)
    assert_head_matches(
        out, hidden, weight, bias, k, targets, exact_ids=exact, context=f"{kind} {rows}x{vocab}"
    )


@pytest.mark.parametrize("case", range(6))
def test_triton_matches_reference_random_shapes(case: int) -> None:
    rnd = random.Random(SEED * 1000 + case)
    rows, vocab, dim, k = (
        rnd.randint(1, 64),
        rnd.randint(1, 1000),
        rnd.choice([8, 16, 33, 64]),
        rnd.randint(1, 16),
    )
    splits, block_v = rnd.randint(1, 5), rnd.choice([32, 64, 128])
    dtype = rnd.choice([torch.float32, torch.float64])
    exact, masked = rnd.random() < 0.5, rnd.random() < 0.3
    context = f"rows={rows} vocab={vocab} dim={dim} k={k} splits={splits} block_v={block_v} {dtype} {exact=}"
    gen = case_generator("triton-random", case)
    hidden, weight, bias, targets = make_inputs(
        gen, rows, vocab, dim, dtype, exact_ties=exact, masked=masked, device=DEVICE
    )
    bias_or_none = None if rnd.random() < 0.2 else bias
    out = output_head_triton(hidden, weight, bias_or_none, k, targets, num_splits=splits, block_v=block_v)
    assert_head_matches(out, hidden, weight, bias_or_none, k, targets, exact_ids=exact, context=context)


def test_triton_masked_vocabulary() -> None:
    # -inf biases: the online log-sum-exp must not produce NaN, and -inf entries still rank by id.
    hidden, weight, bias, targets = make_inputs(
        case_generator("masked"), 5, 300, 16, masked=True, device=DEVICE
    )
    bias[:250] = float("-inf")
    targets[0] = 3  # a masked target: log-prob -inf
    out = output_head_triton(hidden, weight, bias, 16, targets, num_splits=3)
    assert_head_matches(out, hidden, weight, bias, 16, targets, exact_ids=False)
    assert out.target_logprobs[0] == float("-inf")


def test_triton_rejects_k_above_16() -> None:
    with pytest.raises(ValueError):
        output_head_triton(
            torch.randn(1, 16, device=DEVICE), torch.randn(40, 16, device=DEVICE), None, 17,
            torch.tensor([0], device=DEVICE),
        )  # fmt: skip


def test_triton_zero_rows() -> None:
    out = output_head_triton(
        torch.empty(0, 16, device=DEVICE), torch.randn(40, 16, device=DEVICE), None, 4,
        torch.empty(0, dtype=torch.long, device=DEVICE),
    )  # fmt: skip
    assert out.topk_ids.shape == (0, 4) and out.target_logprobs.shape == (0,)


@pytest.mark.skipif(INTERPRETING, reason="full-size shapes are too slow for the interpreter")
@pytest.mark.parametrize("rows", [1, 5, 25, 64])
@pytest.mark.parametrize(("vocab", "dim"), [(8192, 256), (32000, 512)])
def test_triton_full_size_on_cuda(rows: int, vocab: int, dim: int) -> None:
    hidden, weight, bias, targets = make_inputs(case_generator("cuda-full", rows, vocab), rows, vocab, dim,
                                                device=DEVICE)  # fmt: skip
    out = output_head_triton(hidden, weight, bias, 8, targets)
    assert_head_matches(
        out, hidden, weight, bias, 8, targets, exact_ids=False, context=f"{rows}x{dim}x{vocab}"
    )


def test_warm_up_launches_one_call_per_variant_and_leaves_results_alone() -> None:
    """The verifier's start-up warm-up runs the head once per kernel variant a forward of up to
    max_rows rows can need (under the interpreter: the two row blocks times the four top-k slot
    counts), and the head still matches the reference afterwards."""
    gen = case_generator("triton-warm-up", 40)
    hidden, weight, bias, targets = make_inputs(gen, 40, 160, 32, device=DEVICE)
    launches = warm_up_triton_head(weight, bias, max_rows=40)
    programs = 0 if INTERPRETING else 4 * torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert launches == len(head_variants(40, 160, 32, (1, 4, 8, 16), programs, on_gpu=not INTERPRETING))
    if INTERPRETING:
        assert launches == 8
    out = output_head_triton(hidden, weight, bias, 5, targets)
    assert_head_matches(out, hidden, weight, bias, 5, targets, exact_ids=False, context="after warm-up")
