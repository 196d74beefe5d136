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

import torch
from torch import Tensor

from kernels.reference import HeadOutput

__all__ = ["output_head_triton", "triton_available"]

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
    block_r = 16 if rows <= 16 else 32
    block_v = block_v or (128 if device.type == "cuda" else 64)
    block_d = min(64, max(16, _next_pow2(dim)))
    kp = max(2, _next_pow2(k))
    row_blocks = -(-rows // block_r)
    n_tiles = -(-vocab // block_v)
    # The merge kernel holds a row's splits * kp candidates in one block: keep that <= 8192.
    max_splits = max(1, 8192 // kp)
    splits = min(n_tiles, max_splits, num_splits or _default_splits(device, row_blocks))
    split_size = -(-n_tiles // splits) * block_v
    splits = -(-vocab // split_size)  # every split gets at least one column

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
        BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_D=block_d, KP=kp,
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
        S_P=max(2, _next_pow2(splits)), C_P=_next_pow2(splits * kp), KP=kp, NO_ID_C=tk.NO_ID,
        enable_fp_fusion=True,
    )  # fmt: skip
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


def _default_splits(device: torch.device, row_blocks: int) -> int:
    if device.type != "cuda":
        return 2  # the interpreter runs programs one by one: few splits, but still a merge to test
    # Enough programs for a few per SM: with a handful of rows the head is a stream over W, and
    # one program per SM cannot keep HBM busy. Untuned: no GPU was at hand when this was written.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, (4 * sms) // row_blocks)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels() -> ModuleType:
    from kernels import _triton_kernels

    return _triton_kernels
