"""What every family's import shares: the special ids, the activation names, the one-line error, and
the copying of a linear layer, a norm and an attention block onto `Seq2SeqTransformer`'s names."""

from __future__ import annotations

from typing import Any

import torch

from seq2seq_models.config import ModelConfig

# transformers' activation names (ACT2FN) -> ours (`seq2seq_models.config.ACTIVATIONS`): every
# parameter-free one. The five spellings of GELU's tanh approximation are one function.
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_10": "gelu_10",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "relu2": "relu2",
    "relu6": "relu6",
    "leaky_relu": "leaky_relu",
    "swish": "silu",
    "silu": "silu",
    "mish": "mish",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "hardswish": "hardswish",
    "laplace": "laplace",
    "sqrtsoftplus": "sqrt_softplus",
    "linear": "linear",
}
# ACT2FN's activations with weights of their own, which no checkpoint of these families carries.
LEARNT_ACTIVATIONS = ("prelu", "xielu")


class UnsupportedModel(ValueError):
    """A checkpoint outside the supported families, or with a setting specdec does not run."""


class BadCheckpoint(ValueError):
    """A checkpoint whose files are broken or do not fit each other; the message is one line that
    names the file and the problem."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (the command's errors are one line)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


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
    if name in LEARNT_ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} has learnt parameters, which these families' layers do not have")
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not one of transformers' ({', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


def replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    return ModelConfig.from_dict({**cfg.to_dict(), **changes})


def token_embeddings(w: dict, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder's token embedding, and the encoder's where it is a table of its own (None where the
    encoder reads the decoder's): separate vocabularies (Marian), or a checkpoint saved with
    `tie_word_embeddings` false, which transformers unties from `shared` in both stacks."""
    shared = w.get(f"{prefix}shared.weight")
    decoder = w.get(f"{prefix}decoder.embed_tokens.weight", shared)
    encoder = w.get(f"{prefix}encoder.embed_tokens.weight", shared)
    same = encoder.shape == decoder.shape and torch.equal(encoder, decoder)
    return decoder, None if same else encoder


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
