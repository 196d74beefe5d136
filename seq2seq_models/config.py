"""Architecture hyper-parameters of one encoder-decoder model, as stored in a bundle."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    encoder_layers: int = 6
    decoder_layers: int = 6
    ffn_dim: int = 1024
    # Longest source (including its EOS) and longest target (including BOS) the model takes.
    max_len: int = 256
    dropout: float = 0.1
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3
    mask_id: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        for name in ("pad_id", "unk_id", "bos_id", "eos_id", "mask_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} {getattr(self, name)} is outside the vocabulary")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)
