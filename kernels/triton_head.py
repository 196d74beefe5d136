"""Triton version of the output head (same contract as `kernels.reference`).

The kernel (`kernels._triton_kernels`) fuses the projection h·Wᵀ+b with an online log-sum-exp and a
running top-k, so the [rows, vocab] logits never reach device memory; each program handles a
slice of the vocabulary, and a second small kernel merges the per-slice partials (a few numbers
per row) into the outputs.

Triton is imported lazily: this module imports fine without triton or a GPU. The kernel also runs
under the Triton interpreter (`TRITON_INTERPRET=1` set before triton is imported, tensors on the
CPU), which is how it is tested on machines without a GPU.

Differences from the reference: NaN logits are not supported (they give unspecified top-k), and a
target id >= vocab gives NaN instead of an index error (checking it would cost a device sync).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.reference import HeadOutput

__all__ = ["LaunchPlan", "launch_plan", "output_head_triton", "triton_available", "warm_up_triton_head"]

MAX_K = 16


def triton_available() -> bool:
    """True when the Triton path can run here: triton imports, and there is a GPU or the interpreter is on."""
    try:
        _kernels()
    except Exception:  # missing or broken triton must not take the CPU path down with it
        return False
    return _interpreting() or torch.cuda.is_available()


def output_head_triton(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    k: int,
    targets: Tensor,
    *,
    num_splits: int | None = None,
    block_v: int | None = None,
) -> HeadOutput:
    """Fused head on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1); k <= 16.

    `num_splits` (vocabulary slices, i.e. programs per row block) and `block_v` (vocabulary tile)
    are tuning knobs; the defaults fill the GPU and keep the interpreter quick.
    """
    rows, dim = hidden.shape
    vocab = weight.shape[0]
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in 1..{MAX_K} for the Triton head, got {k}")
    if weight.shape[1] != dim or (bias is not None and bias.shape != (vocab,)) or targets.shape != (rows,):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"bias {None if bias is None else tuple(bias.shape)}, targets {tuple(targets.shape)}"
        )
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two >= 16 (tl.dot's minimum), got {block_v}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    k = min(k, vocab)
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    device = hidden.device
    if rows == 0:
        return HeadOutput(
            topk_ids=torch.empty(0, k, dtype=torch.long, device=device),
            topk_logprobs=torch.empty(0, k, dtype=hidden.dtype, device=device),
            target_logprobs=torch.empty(0, dtype=hidden.dtype, device=device),
        )

    tk = _kernels()
    bias = bias.contiguous() if bias is not None else None  # the kernel reads both with stride 1
    targets = targets.contiguous()
    plan = launch_plan(rows, vocab, dim, k, _programs(device), block_v, num_splits, on_gpu=device.type == "cuda")
    block_r, block_v, kp, splits, split_size = plan.block_r, plan.block_v, plan.kp, plan.splits, plan.split_size
    row_blocks = plan.row_blocks

    part_max = torch.empty(rows, splits, dtype=acc_dtype, device=device)
    part_sum = torch.empty_like(part_max)
    part_vals = torch.empty(rows, splits, kp, dtype=acc_dtype, device=device)
    part_ids = torch.empty(rows, splits, kp, dtype=torch.int32, device=device)
    tgt_logit = torch.empty(rows, dtype=acc_dtype, device=device)
    tk.head_partials_kernel[(row_blocks, splits)](
        hidden, weight, bias if bias is not None else hidden, targets,
        part_max, part_sum, part_vals, part_ids, tgt_logit,
        rows, vocab, dim, split_size,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_D=plan.block_d, KP=kp,
        ACC_DTYPE=tk.tl.float64 if acc_dtype == torch.float64 else tk.tl.float32,
        # fp32 logits in full precision: TF32 would cost ~1e-3 relative error in the log-probs.
        PRECISION="ieee" if hidden.dtype in (torch.float32, torch.float64) else None,
        NO_ID_C=tk.NO_ID,
        enable_fp_fusion=True,  # explicit: triton 3.9 warns when left to its changing default
    )  # fmt: skip

    topk_ids = torch.empty(rows, k, dtype=torch.long, device=device)
    topk_lp = torch.empty(rows, k, dtype=hidden.dtype, device=device)
    target_lp = torch.empty(rows, dtype=hidden.dtype, device=device)
    tk.merge_partials_kernel[(rows,)](
        part_max, part_sum, part_vals, part_ids, tgt_logit,
        topk_ids, topk_lp, target_lp,
        splits, k,
        S_P=plan.s_p, C_P=plan.c_p, KP=kp, NO_ID_C=tk.NO_ID,
        enable_fp_fusion=True,
    )  # fmt: skip
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


class LaunchPlan(NamedTuple):
    """How `output_head_triton` launches its two kernels for one shape. The constexpr fields
    (`variant`) pick the compiled kernels; the rest only size the grid."""

    block_r: int
    block_v: int
    block_d: int
    kp: int  # top-k slots per candidate list: k rounded up to a power of two, at least 2
    row_blocks: int
    splits: int  # vocabulary slices, i.e. programs per row block
    split_size: int
    s_p: int  # splits rounded up to a power of two (the merge kernel's block)
    c_p: int  # splits * kp rounded up likewise

    @property
    def variant(self) -> tuple[int, ...]:
        return (self.block_r, self.block_v, self.block_d, self.kp, self.s_p, self.c_p)


def launch_plan(
    rows: int, vocab: int, dim: int, k: int, programs: int, block_v: int | None = None,
    num_splits: int | None = None, on_gpu: bool = True,
) -> LaunchPlan:
    """The launch of `rows` head rows over `vocab` x `dim` weights for top-`k`: `programs` is the
    number of programs to aim for per launch (a few per SM, `_programs`), or 0 for the interpreter's
    fixed two splits; `block_v` and `num_splits` override the vocabulary tile and the split count."""
    k = min(k, vocab)
    block_r = 16 if rows <= 16 else 32
    block_v = block_v or (128 if on_gpu else 64)
    block_d = min(64, max(16, _next_pow2(dim)))
    kp = max(2, _next_pow2(k))
    row_blocks = -(-rows // block_r)
    n_tiles = -(-vocab // block_v)
    # The merge kernel holds a row's splits * kp candidates in one block: keep that <= 8192.
    max_splits = max(1, 8192 // kp)
    # Enough programs for a few per SM: with a handful of rows the head is a stream over W, and one
    # program per SM cannot keep HBM busy. Untuned. The interpreter runs programs one by one: few
    # splits, but still a merge to test.
    wanted = num_splits or (max(1, programs // row_blocks) if programs else 2)
    splits = min(n_tiles, max_splits, wanted)
    split_size = -(-n_tiles // splits) * block_v
    splits = -(-vocab // split_size)  # every split gets at least one column
    return LaunchPlan(block_r, block_v, block_d, kp, row_blocks, splits, split_size,
                      max(2, _next_pow2(splits)), _next_pow2(splits * kp))


def warm_up_triton_head(
    weight: Tensor, bias: Tensor | None, max_rows: int, ks: tuple[int, ...] = (1, 4, 8, 16)
) -> int:
    """Compile, by running each once on zeros, every kernel variant that a head call of 1..`max_rows`
    rows over `weight` can launch for a top-k in `ks` (one k per `kp`, the only way k reaches a
    variant). Returns how many launches it took. A variant first met under load is compiled inside
    the verifier's worker thread, seconds in which every session waits; the verifier calls this
    before it reports SERVING (Triton caches compiled kernels on disk, so later starts are quick)."""
    vocab, dim = weight.shape
    device = weight.device
    variants = head_variants(max_rows, vocab, dim, ks, _programs(device), on_gpu=device.type == "cuda")
    for rows, k in variants:
        hidden = torch.zeros(rows, dim, dtype=weight.dtype, device=device)
        output_head_triton(hidden, weight, bias, k, torch.zeros(rows, dtype=torch.long, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(variants)


def head_variants(
    max_rows: int, vocab: int, dim: int, ks: tuple[int, ...], programs: int, on_gpu: bool = True
) -> list[tuple[int, int]]:
    """One (rows, k) per distinct kernel variant over rows 1..max_rows and k in `ks`, fewest rows first."""
    seen: dict[tuple[int, ...], tuple[int, int]] = {}
    for k in ks:
        for rows in range(1, max_rows + 1):
            variant = launch_plan(rows, vocab, dim, k, programs, on_gpu=on_gpu).variant
            seen.setdefault(variant, (rows, k))
    return list(seen.values())


def _programs(device: torch.device) -> int:
    """Programs per launch to aim for on `device`: four per SM on a GPU, 0 (two splits) in the interpreter."""
    if device.type != "cuda":
        return 0
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels() -> ModuleType:
    from kernels import _triton_kernels

    return _triton_kernels
