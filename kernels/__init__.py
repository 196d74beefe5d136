"""The verifier's output head (bias + log-softmax + top-k + drafted-token log-prob), and the
model's attention kernels.

Four implementations of the head honour the contract in `kernels.reference`:

* `reference.py`: plain torch, the definition the others are tested against;
* `cpu.py`: the fast CPU path (oneDNN projection, fused in-place epilogue);
* `triton_head.py`: a fused Triton kernel for CUDA tensors;
* `graph_head.py`: the version traced into the verifier's ONNX decoder (`seq2seq_models.onnx_export`),
  written with a tensor `k` and standard ONNX ops; it runs inside ONNX Runtime, not through `output_head`.

`output_head` picks among the first three at run time. `attention.py` holds the two attention
kernels the layers take as a parameter: SDPA for eager torch, matmul-softmax for the ONNX export.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from core.logits_processors import Processing
from kernels.cpu import output_head_cpu
from kernels.graph_head import output_head_graph
from kernels.reference import HeadOutput, acts, output_head_reference
from kernels.triton_head import MAX_K as TRITON_MAX_K
from kernels.triton_head import output_head_triton, triton_available, warm_up_triton_head

__all__ = [
    "Backend",
    "HeadOutput",
    "output_head",
    "output_head_cpu",
    "output_head_graph",
    "output_head_reference",
    "output_head_triton",
    "triton_available",
    "warm_up_head",
]

Backend = Literal["auto", "reference", "cpu", "triton"]


def output_head(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    k: int,
    targets: Tensor,
    backend: Backend = "auto",
    processing: Processing | None = None,
) -> HeadOutput:
    """hidden [R, D], weight [V, D], bias [V] | None, targets [R] (-1 = none) -> top-k and target log-probs.

    "auto" runs the Triton kernel on CUDA tensors when Triton is usable (and k fits it), else the
    CPU path (which is plain torch, so it also serves CUDA tensors when Triton is missing).
    `processing`: the rows' logits processors (`kernels.reference`); the Triton kernel has none
    yet, so a forward whose processors change a score runs the CPU path.
    """
    if backend == "auto":
        use_triton = hidden.is_cuda and k <= TRITON_MAX_K and triton_available() and not acts(processing)
        backend = "triton" if use_triton else "cpu"
    if backend == "reference":
        return output_head_reference(hidden, weight, bias, k, targets, processing)
    if backend == "cpu":
        return output_head_cpu(hidden, weight, bias, k, targets, processing)
    if acts(processing):
        raise ValueError("the Triton head does not apply logits processors: use backend auto, cpu or reference")
    if backend == "triton":
        return output_head_triton(hidden, weight, bias, k, targets)
    raise ValueError(f"unknown backend {backend!r}; expected auto, reference, cpu or triton")


def warm_up_head(weight: Tensor, bias: Tensor | None, max_rows: int) -> int:
    """Compile ahead what `output_head(backend="auto")` will run for up to `max_rows` rows over these
    weights: the Triton kernel's variants on a GPU (`triton_head.warm_up_triton_head`), nothing on
    the CPU. Returns the launches it took (0: nothing to compile)."""
    if not (weight.is_cuda and triton_available()):
        return 0
    return warm_up_triton_head(weight, bias, max_rows)
