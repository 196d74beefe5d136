"""What every family's import shares: the special ids, the activation names, the one-line error, and
the copying of a linear layer, a norm and an attention block onto `Seq2SeqTransformer`'s names."""

from __future__ import annotations

from typing import Any

from seq2seq_models.config import ModelConfig

# transformers' activation names -> ours (`seq2seq_models.layers.ACTIVATIONS`).
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "swish": "silu",
    "silu": "silu",
}


class UnsupportedModel(ValueError):
    """A checkpoint outside the supported families, or with a setting specdec does not run."""


def first(gen: Any, c: Any, name: str) -> Any:
    """A setting from generation_config.json, else config.json (as generate reads them)."""
    value = getattr(gen, name, None)
    return getattr(c, name, None) if value is None else value


def special_ids(c: Any, gen: Any, vocab: int, mask_id: int | None, default_start: int | None = None) -> dict[str, int]:
    """specdec's special ids: BOS is the decoder start token (else the BOS token, as `generate` falls
    back to, else `default_start`); the NAR drafter's mask defaults to the unknown token (any id
    works, the drafter is trained with it)."""
    start = first(gen, c, "decoder_start_token_id")
    if start is None:
        start = first(gen, c, "bos_token_id")
    if start is None:
        start = default_start
    eos = first(gen, c, "eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    pad = first(gen, c, "pad_token_id")
    pad = eos if pad is None else pad
    unk = getattr(c, "unk_token_id", None)
    unk = pad if unk is None else unk
    ids = {"pad_id": pad, "unk_id": unk, "bos_id": start, "eos_id": eos}
    ids["mask_id"] = unk if mask_id is None else mask_id
    for name, value in ids.items():
        if value is None or not 0 <= value < vocab:
            raise UnsupportedModel(f"{name} {value} is not a token of the {vocab}-token vocabulary")
    return ids


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not supported (one of {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    return ModelConfig.from_dict({**cfg.to_dict(), **changes})


def copy_linear(ours: dict, dst: str, w: dict, src: str, scale: float = 1.0) -> None:
    ours[f"{dst}.weight"] = w[f"{src}.weight"] * scale if scale != 1.0 else w[f"{src}.weight"]
    if f"{src}.bias" in w:
        ours[f"{dst}.bias"] = w[f"{src}.bias"] * scale if scale != 1.0 else w[f"{src}.bias"]


def copy_norm(ours: dict, dst: str, w: dict, src: str) -> None:
    ours[f"{dst}.weight"] = w[f"{src}.weight"]
    if f"{src}.bias" in w:
        ours[f"{dst}.bias"] = w[f"{src}.bias"]


def copy_attention(
    ours: dict, dst: str, w: dict, src: str, names: tuple[str, str, str, str], q_scale: float = 1.0
) -> None:
    """An attention block's projections; `names` are the checkpoint's (query, key, value, output)."""
    q, k, v, o = names
    copy_linear(ours, f"{dst}.q_proj", w, f"{src}.{q}", q_scale)
    copy_linear(ours, f"{dst}.k_proj", w, f"{src}.{k}")
    copy_linear(ours, f"{dst}.v_proj", w, f"{src}.{v}")
    copy_linear(ours, f"{dst}.out_proj", w, f"{src}.{o}")
