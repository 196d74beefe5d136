"""Architecture hyper-parameters of one encoder-decoder model, as stored in a bundle.

The defaults describe the project's own architecture (pre-LN, learnt positions, GELU, tied head
with a bias, embeddings scaled by sqrt(d_model)). The other fields say how an imported checkpoint
differs (`seq2seq_models.hf_import`): the layer math in `seq2seq_models.layers` reads them, so one
implementation serves every family for eager torch and the ONNX export alike. Sinusoidal and
offset positions are imported as tables, so "learnt" covers every absolute position scheme.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int = 256
    n_heads: int = 4  # the encoder's attention heads, and the decoder's unless `decoder_heads` says otherwise
    encoder_layers: int = 6
    decoder_layers: int = 6
    ffn_dim: int = 1024  # the encoder's feed-forward width, and the decoder's unless `decoder_ffn_dim` does
    # Longest source (including its EOS) and longest target (including BOS) the model takes.
    max_len: int = 256
    dropout: float = 0.1
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3
    mask_id: int = 4
    # Per-head width; 0 means d_model // heads (T5 and mT5 may use another, e.g. 6 heads of 64 in 512).
    head_dim: int = 0
    # The decoder's own head count and feed-forward width, where a checkpoint's differ from its
    # encoder's (BART-style configs allow it); 0: the encoder's.
    decoder_heads: int = 0
    decoder_ffn_dim: int = 0
    norm_position: str = "pre"  # "pre": x + f(norm(x)); "post": norm(x + f(x)) (Marian, BART)
    norm_kind: str = "layer"  # "layer" (LayerNorm) or "rms" (T5's RMSNorm: no mean, no bias)
    norm_eps: float = 1e-5
    final_norm: bool = True  # a norm after the last encoder and decoder layer
    embed_norm: bool = False  # a LayerNorm on the embedded input of both stacks (BART, mBART)
    embed_scale: float = 0.0  # token embeddings are multiplied by this; 0 means sqrt(d_model)
    positions: str = "learnt"  # "learnt" tables (also imported sinusoids), or T5's "relative" bias
    relative_buckets: int = 32
    relative_max_distance: int = 128
    activation: str = "gelu"  # one of ACTIVATIONS
    gated_ffn: bool = False  # act(x W0) * (x W1), as T5 v1.1's gated-GELU
    linear_bias: bool = True  # biases in attention and feed-forward projections (none in T5)
    tied_head: bool = True  # the output projection is the target embedding matrix
    # Rows of a source embedding of its own: a source vocabulary of its own (Marian's separate ones, of
    # any size), or a checkpoint whose stacks' embeddings are untied; 0: the target embedding serves both.
    src_vocab_size: int = 0

    def __post_init__(self) -> None:
        for name in ("n_heads", "decoder_heads"):
            heads = getattr(self, name)
            if heads and not self.head_dim and self.d_model % heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by {name} {heads}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, not {getattr(self, name)!r}")
        for name in ("pad_id", "unk_id", "bos_id", "eos_id", "mask_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} {getattr(self, name)} is outside the vocabulary")

    @property
    def encoder_shape(self) -> StackShape:
        return StackShape(self.n_heads, self.head_dim or self.d_model // self.n_heads, self.ffn_dim)

    @property
    def decoder_shape(self) -> StackShape:
        """The decoder's self- and cross-attention heads (and so its KV cache's), and its feed-forward."""
        heads = self.decoder_heads or self.n_heads
        return StackShape(heads, self.head_dim or self.d_model // heads, self.decoder_ffn_dim or self.ffn_dim)

    @property
    def token_scale(self) -> float:
        return self.embed_scale or math.sqrt(self.d_model)

    @property
    def source_vocab_size(self) -> int:
        return self.src_vocab_size or self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class StackShape:
    """One stack's attention and feed-forward widths."""

    heads: int
    head_dim: int
    ffn_dim: int

    @property
    def attn_dim(self) -> int:
        """Width of the attention projections (heads x head width)."""
        return self.heads * self.head_dim


# The element-wise activations `seq2seq_models.layers` implements: every parameter-free one the
# supported families' configs can name (transformers' ACT2FN, the tanh-approximated GELUs as one).
ACTIVATIONS = (
    "gelu", "gelu_tanh", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "leaky_relu", "silu", "mish",
    "tanh", "sigmoid", "hardswish", "laplace", "sqrt_softplus", "linear",
)

_CHOICES = {
    "norm_position": {"pre", "post"},
    "norm_kind": {"layer", "rms"},
    "positions": {"learnt", "relative"},
    "activation": set(ACTIVATIONS),
}
