"""torch's intra-op threads for a service's torch models (the torch backend, the AR drafter)."""

from __future__ import annotations


def set_torch_threads(threads: int | None) -> None:
    """torch.set_num_threads(threads) when given; None or 0 leaves torch's own choice (OMP_NUM_THREADS,
    else the CPUs). Process-wide: where both model services run in one process on torch
    (`serve all` without --processes), the one made last sets it for both."""
    if threads:
        import torch

        torch.set_num_threads(threads)
