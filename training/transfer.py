"""Starting weights from another trained model of the same width: a pre-trained verifier for its
fine-tuning (the same shape), or the AR drafter for the NAR drafter (fewer layers).

Why the NAR drafter starts from the AR drafter: trained from scratch, every model here first sits on
a plateau where it predicts the unigram distribution. An AR model leaves it by content (the previous
token says where in the source it is); a block of MASK tokens has to learn to align with the source
by position first, and the base preset's NAR drafter (6+2 layers of width 256) was still on the
plateau after 1000 steps. Starting from a trained AR model's embeddings, encoder and decoder layers
(the AR-to-NAT transfer of Guo et al. 2020, "Fine-Tuning by Curriculum Learning for Non-Autoregressive
Neural Machine Translation") gives it source representations and cross-attention that already align.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

_LAYER = re.compile(r"^(encoder_layers|decoder_layers)\.(\d+)\.(.+)$")


def load_initial_weights(model: torch.nn.Module, source: Mapping[str, Tensor]) -> dict[str, list[int]]:
    """Load `source` into `model`; where the model has more layers in a stack than the source, layer
    i of n takes the source's layer i * m // n of m (each source layer fills a run of neighbours, so
    the stack keeps its bottom-to-top order). Every other tensor must match by name and shape.
    Returns the layer map used, per stack: for each of the model's layers, its source layer."""
    target = model.state_dict()
    source_depth = _depths(source)
    target_depth = _depths(target)
    layer_map: dict[str, list[int]] = {}
    for stack, depth in target_depth.items():
        have = source_depth.get(stack, 0)
        if not 0 < have <= depth:
            raise ValueError(f"cannot initialise {depth} {stack} from {have}: the source needs 1 to {depth}")
        layer_map[stack] = [i * have // depth for i in range(depth)]
    loaded = {}
    for name, tensor in target.items():
        match = _LAYER.match(name)
        source_name = (f"{match[1]}.{layer_map[match[1]][int(match[2])]}.{match[3]}" if match else name)
        if source_name not in source:
            raise ValueError(f"the initial weights have no {source_name!r} (for {name!r})")
        if source[source_name].shape != tensor.shape:
            raise ValueError(f"{source_name!r} has shape {tuple(source[source_name].shape)}, "
                             f"{name!r} needs {tuple(tensor.shape)}: the models' widths differ")
        loaded[name] = source[source_name]
    model.load_state_dict(loaded)
    return layer_map


def _depths(state: Mapping[str, Tensor]) -> dict[str, int]:
    depths: dict[str, int] = {}
    for name in state:
        match = _LAYER.match(name)
        if match:
            depths[match[1]] = max(depths.get(match[1], 0), int(match[2]) + 1)
    return depths
