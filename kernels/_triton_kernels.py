"""Triton kernel of the fused output head. Imported only by `kernels.triton_head`, on demand,
because importing it imports triton (and `TRITON_INTERPRET` is read when `@triton.jit` runs).

One program owns BLOCK_R rows and one contiguous slice ("split") of the vocabulary. It walks its
slice tile by tile: logits of a [BLOCK_R, BLOCK_V] tile are computed in registers from h and W,
folded into an online log-sum-exp (running max, running sum rescaled when the max moves, as in
Marian/Amun's fused softmax + k-best) and into a running top-KP kept in a small register block.
Only per-split partials leave the program (max, sum, KP candidates, and the target's logit), so
the [rows, vocab] logits never reach memory. A second, one-program-per-row kernel merges the
splits' partials into the outputs, so a call is two launches whatever the shape.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Id of an empty top-k slot / an extracted or out-of-range column: above every real id.
NO_ID = 2**31 - 1


# The row count and the split count are not specialised on (Triton would otherwise compile a variant for
# counts of 1 and multiples of 16): a serving verifier sees every row count, and a compile stalls every
# session waiting on its worker. The variants left are the constexprs' (kernels.triton_head.launch_plan).
@triton.jit(do_not_specialize=["R"])
def head_partials_kernel(
    h_ptr, w_ptr, b_ptr, tgt_ptr,
    part_max_ptr, part_sum_ptr, part_vals_ptr, part_ids_ptr, tgt_logit_ptr,
    R, V, D, split_size,
    stride_hr, stride_hd, stride_wv, stride_wd,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, KP: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr, NO_ID_C: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)

    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    v_start = pid_s * split_size
    v_end = tl.minimum(v_start + split_size, V)
    slots = tl.arange(0, KP)
    if pid_s == 0:
        # Rows without a target (-1, or an id outside the vocabulary) report NaN; every other row's
        # logit is written by the one split that holds its target.
        no_tgt = row_ok & ((tgt < 0) | (tgt >= V))
        tl.store(tgt_logit_ptr + rows, tl.full([BLOCK_R], float("nan"), ACC_DTYPE), mask=no_tgt)

    run_max = tl.full([BLOCK_R], float("-inf"), ACC_DTYPE)
    run_sum = tl.zeros([BLOCK_R], ACC_DTYPE)
    top_vals = tl.full([BLOCK_R, KP], float("-inf"), ACC_DTYPE)
    top_ids = tl.full([BLOCK_R, KP], NO_ID_C, tl.int32)

    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        logits = _tile_logits(
            h_ptr, w_ptr, b_ptr, rows, row_ok, cols, col_ok, D,
            stride_hr, stride_hd, stride_wv, stride_wd,
            HAS_BIAS, BLOCK_R, BLOCK_V, BLOCK_D, ACC_DTYPE, PRECISION,
        )  # fmt: skip

        # The drafted token's logit, from the one tile (of one split) that holds it.
        hit = cols[None, :] == tgt[:, None]
        tgt_here = row_ok & (tgt >= v0) & (tgt < v0 + BLOCK_V) & (tgt < v_end)
        tl.store(tgt_logit_ptr + rows, tl.sum(tl.where(hit, logits, 0.0), axis=1), mask=tgt_here)

        # Online log-sum-exp. A row whose values so far are all -inf (masked vocab) keeps a zero
        # sum; shifting by 0 instead of -inf avoids -inf - -inf = NaN.
        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(logits - shift[:, None]), axis=1)
        run_max = new_max

        top_vals, top_ids = _merge_tile_topk(
            logits, tl.where(col_ok, cols, NO_ID_C), row_ok, top_vals, top_ids, slots, KP, NO_ID_C
        )

    part = rows * n_splits + pid_s
    tl.store(part_max_ptr + part, run_max, mask=row_ok)
    tl.store(part_sum_ptr + part, run_sum, mask=row_ok)
    slot_offs = part[:, None] * KP + slots[None, :]
    tl.store(part_vals_ptr + slot_offs, top_vals, mask=row_ok[:, None])
    tl.store(part_ids_ptr + slot_offs, top_ids, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["S", "k"])
def merge_partials_kernel(
    part_max_ptr, part_sum_ptr, part_vals_ptr, part_ids_ptr, tgt_logit_ptr,
    out_ids_ptr, out_lp_ptr, out_tgt_ptr,
    S, k,
    S_P: tl.constexpr, C_P: tl.constexpr, KP: tl.constexpr, NO_ID_C: tl.constexpr,
):  # fmt: skip
    """One row: the splits' log-sum-exps into one, then the top-k of their S*KP candidates."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_P)
    s_ok = s < S
    part_max = tl.load(part_max_ptr + r * S + s, mask=s_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + r * S + s, mask=s_ok, other=0.0)
    top = tl.max(part_max, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    lse = shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift), axis=0))

    c = tl.arange(0, C_P)
    c_ok = c < S * KP
    vals = tl.load(part_vals_ptr + r * S * KP + c, mask=c_ok, other=float("-inf"))
    ids = tl.load(part_ids_ptr + r * S * KP + c, mask=c_ok, other=NO_ID_C)
    # Splits cover disjoint ids, so candidate ids are unique (bar empty slots, which rank last).
    for j in range(0, k):
        best = tl.max(vals, axis=0)
        best_id = tl.min(tl.where(vals == best, ids, NO_ID_C), axis=0)
        tl.store(out_lp_ptr + r * k + j, (best - lse).to(out_lp_ptr.dtype.element_ty))
        tl.store(out_ids_ptr + r * k + j, best_id.to(tl.int64))
        taken = ids == best_id
        vals = tl.where(taken, float("-inf"), vals)
        ids = tl.where(taken, NO_ID_C, ids)
    tgt_logit = tl.load(tgt_logit_ptr + r)
    tl.store(out_tgt_ptr + r, (tgt_logit - lse).to(out_tgt_ptr.dtype.element_ty))


@triton.jit
def _tile_logits(
    h_ptr, w_ptr, b_ptr, rows, row_ok, cols, col_ok, D,
    stride_hr, stride_hd, stride_wv, stride_wd,
    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """h[rows] · W[cols]ᵀ + b[cols] as a [BLOCK_R, BLOCK_V] block; out-of-range columns are -inf."""
    acc = tl.zeros([BLOCK_R, BLOCK_V], ACC_DTYPE)
    w_rows = cols.to(tl.int64) * stride_wv
    h_rows = rows.to(tl.int64) * stride_hr
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < D
        h = tl.load(
            h_ptr + h_rows[:, None] + ds[None, :] * stride_hd, mask=row_ok[:, None] & d_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + w_rows[:, None] + ds[None, :] * stride_wd, mask=col_ok[:, None] & d_ok[None, :], other=0.0
        )
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION, out_dtype=ACC_DTYPE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(ACC_DTYPE)[None, :]
    return tl.where(col_ok[None, :], acc, float("-inf"))


@triton.jit
def _merge_tile_topk(
    logits, col_ids, row_ok, top_vals, top_ids, slots, KP: tl.constexpr, NO_ID_C: tl.constexpr
):
    """Fold a tile into the running top-KP (an unsorted set of KP slots per row).

    Order is (value descending, id ascending). Each step extracts the tile's best remaining entry
    and, where it beats the set's worst slot, overwrites that slot; KP steps always suffice. Most
    tiles after the first few hold nothing better than the worst slot and are skipped outright
    (padding rows are left out of that test, or their bias-only logits would keep it busy).
    """
    ids = tl.broadcast_to(col_ids[None, :], logits.shape)
    worst = tl.min(top_vals, axis=1)
    worst_id = tl.max(tl.where(top_vals == worst[:, None], top_ids, -1), axis=1)
    beats = (logits > worst[:, None]) | ((logits == worst[:, None]) & (ids < worst_id[:, None]))
    beats = beats & row_ok[:, None]
    if tl.max(beats.to(tl.int32)) > 0:
        cand = logits
        for _ in range(KP):
            best = tl.max(cand, axis=1)
            best_id = tl.min(tl.where(cand == best[:, None], ids, NO_ID_C), axis=1)
            worst = tl.min(top_vals, axis=1)
            worst_id = tl.max(tl.where(top_vals == worst[:, None], top_ids, -1), axis=1)
            take = (best > worst) | ((best == worst) & (best_id < worst_id))
            worst_slot = tl.max(
                tl.where((top_vals == worst[:, None]) & (top_ids == worst_id[:, None]), slots[None, :], -1),
                axis=1,
            )
            put = take[:, None] & (slots[None, :] == worst_slot[:, None])
            top_vals = tl.where(put, best[:, None], top_vals)
            top_ids = tl.where(put, best_id[:, None], top_ids)
            taken = ids == best_id[:, None]
            cand = tl.where(taken, float("-inf"), cand)
            ids = tl.where(taken, NO_ID_C, ids)
    return top_vals, top_ids


__all__ = ["NO_ID", "head_partials_kernel", "merge_partials_kernel", "triton"]
