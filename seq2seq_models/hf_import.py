"""Hugging Face seq2seq checkpoints as specdec models: `specdec import-hf`.

A `save_pretrained` directory of one of the supported families is read with `transformers` (the
only place that library is needed), its architecture is described by `ModelConfig`'s fields and its
weights are renamed onto `Seq2SeqTransformer`'s. Nothing is re-implemented per family at run time:
the differences are data (norm placement and kind, positions, activation, embedding scale and
norm, head tying), and the layers in `seq2seq_models.layers` read them.

Per family:

* Marian: post-LN, sinusoidal positions (sin half, then cos half), SiLU, embeddings scaled by
  sqrt(d), a logits bias; the source embedding is its own when the vocabularies are separate.
  Its `bad_words_ids` (the padding token) become a very low output bias, as for any family.
* BART: post-LN, learnt positions with offset 2, a LayerNorm on the embeddings, GELU.
* mBART: as BART but pre-LN with a final LayerNorm on each stack.
* M2M100 / NLLB: pre-LN with final LayerNorms, sinusoidal positions (fairseq's layout) offset by
  the padding id plus one, ReLU.
* T5 / mT5 / flan-T5: RMSNorm, bucketed relative position bias shared by a stack's layers, no
  attention scaling (folded into the query projection here), ReLU or gated GELU, and a tied head
  scaled by d_model^-0.5 (folded into the final norm's gain) or a head of its own.

Positions are imported as tables for the model's `max_len`, so a sinusoid, an offset and a learnt
table all run as the same lookup.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seq2seq_models.config import ModelConfig

if TYPE_CHECKING:
    import torch

SUPPORTED = ("marian", "bart", "mbart", "m2m_100", "t5", "mt5")
# Longest source / target a T5 bundle takes (relative positions set no limit of their own).
T5_MAX_LEN = 512
# The output bias of a token `generate` never emits: far below any real logit, and finite in float16.
SUPPRESSED_LOGIT = -1e4

_ACTIVATIONS = {
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


@dataclass
class ImportedModel:
    config: ModelConfig
    state: dict[str, torch.Tensor]
    model_type: str
    # Decoding settings from config.json / generation_config.json (forced first token, ...).
    generation: dict[str, Any]


def read_model_type(model_dir: str | Path) -> str:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a save_pretrained directory (no config.json)")
    model_type = json.loads(path.read_text()).get("model_type", "")
    if model_type not in SUPPORTED:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; import-hf reads {', '.join(SUPPORTED)}"
        )
    return model_type


def import_checkpoint(model_dir: str | Path, mask_id: int | None = None) -> ImportedModel:
    """Read `model_dir` with transformers and return specdec's config and float32 state dict."""
    model_type = read_model_type(model_dir)
    import torch
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging as hf_logging

    # The command's own output is one line; transformers' progress bars and notices are not.
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf_cfg = hf.config
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    if model_type in ("t5", "mt5"):
        config, ours = _t5(hf_cfg, hf.generation_config, state, mask_id)
    else:
        config, ours = _bart_like(model_type, hf_cfg, hf.generation_config, state, mask_id)
    _suppress_bad_words(ours, _first(hf.generation_config, hf_cfg, "bad_words_ids"))
    return ImportedModel(config=config, state=ours, model_type=model_type, generation=_generation(hf))


def import_tokenizer(
    model_dir: str | Path, out: Path, eos_id: int, forced_bos_id: int | None = None
) -> dict[str, Any] | None:
    """Write the checkpoint's tokenizer into the bundle directory `out` and return its spec for
    `seq2seq_models.hf_tokenizer.HFTokenizer`; None when the checkpoint has no tokenizer files."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError):
        return None
    spec: dict[str, Any] = {
        "eos_id": eos_id,
        "forced_bos_token_id": forced_bos_id,
        "languages": _languages(tok),
        "special_ids": sorted(set(tok.all_special_ids)),
        "clean_up_tokenization_spaces": bool(getattr(tok, "clean_up_tokenization_spaces", False)),
    }
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        backend.save(str(out / "tokenizer.json"))
        spec.update(kind="tokenizers", files=["tokenizer.json"])
    else:
        source_spm, target_spm, source_vocab, target_vocab = _spm_vocab_files(model_dir)
        names = sorted({source_spm, target_spm, source_vocab, target_vocab})
        for name in names:
            shutil.copyfile(model_dir / name, out / name)
        spec.update(
            kind="spm-vocab", files=names, source_spm=source_spm, target_spm=target_spm,
            source_vocab=source_vocab, target_vocab=target_vocab, unk_id=tok.unk_token_id,
            added_pieces=_added_pieces(tok),
        )
    spec["prefix"], spec["suffix"] = _framing(tok)
    return spec


def _languages(tok: Any) -> dict[str, int]:
    """Target language code -> its token id: mBART's and M2M100's own tables, else the special
    tokens shaped like NLLB's codes (eng_Latn)."""
    table = getattr(tok, "lang_code_to_id", None)
    if table:
        return {str(code): int(i) for code, i in table.items()}
    codes = [t for t in getattr(tok, "all_special_tokens", []) if re.fullmatch(r"[a-z]{3}_[A-Z][a-z]{3}", str(t))]
    return {code: int(tok.convert_tokens_to_ids(code)) for code in codes}


def _added_pieces(tok: Any) -> dict[str, str]:
    """Tokens outside vocab.json (M2M100's language codes): id -> the token, decoded as a piece."""
    added = {int(i): str(t) for t, i in tok.get_added_vocab().items()}
    added.update({int(i): str(t) for i, t in getattr(tok, "id_to_lang_token", {}).items()})
    return {str(i): t for i, t in sorted(added.items())}


def _spm_vocab_files(model_dir: Path) -> tuple[str, str, str, str]:
    """Marian's source.spm / target.spm with vocab.json (and target_vocab.json when the
    vocabularies are separate), or M2M100's one sentencepiece.bpe.model with vocab.json."""
    if (model_dir / "source.spm").is_file():
        target_vocab = "target_vocab.json" if (model_dir / "target_vocab.json").is_file() else "vocab.json"
        return "source.spm", "target.spm", "vocab.json", target_vocab
    spm_files = sorted(p.name for p in model_dir.glob("*.model"))
    if not spm_files or not (model_dir / "vocab.json").is_file():
        raise UnsupportedModel(f"{model_dir}: no tokenizer.json, and no SentencePiece model with vocab.json")
    return spm_files[0], spm_files[0], "vocab.json", "vocab.json"


def _framing(tok: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text's own (BART's <s> and </s>, M2M100's
    language code and </s>), found by encoding a probe with and without special tokens."""
    probe = "framing probe 123"
    framed = tok(probe)["input_ids"]
    body = tok(probe, add_special_tokens=False)["input_ids"]
    for start in range(len(framed) - len(body) + 1):
        if framed[start : start + len(body)] == body:
            return framed[:start], framed[start + len(body) :]
    raise UnsupportedModel("cannot tell how the tokenizer frames a source (its special tokens)")


def check_same_vocabulary(verifier: ImportedModel, drafter: ImportedModel, drafter_dir: str | Path) -> None:
    """An AR drafter must speak the verifier's token ids: same vocabulary size and special ids."""
    v, d = verifier.config, drafter.config
    keys = ("vocab_size", "source_vocab_size", "pad_id", "bos_id", "eos_id")
    differ = [k for k in keys if getattr(v, k) != getattr(d, k)]
    if differ:
        detail = ", ".join(f"{k} {getattr(d, k)} vs {getattr(v, k)}" for k in differ)
        raise UnsupportedModel(f"{drafter_dir} has another vocabulary than the verifier ({detail})")


def build_model(imported: ImportedModel):  # -> Seq2SeqTransformer
    from seq2seq_models.transformer import Seq2SeqTransformer

    model = Seq2SeqTransformer(imported.config)
    missing, unexpected = model.load_state_dict(imported.state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Families
# ----------------------------------------------------------------------------------------------


def _bart_like(model_type: str, c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    import torch

    d = c.d_model
    shared = not (model_type == "marian" and not getattr(c, "share_encoder_decoder_embeddings", True))
    vocab = c.vocab_size
    if model_type == "marian":
        vocab = getattr(c, "decoder_vocab_size", None) or c.vocab_size
    if not shared and c.vocab_size != vocab:
        # The services check source ids against one vocabulary size, the target's.
        raise UnsupportedModel(
            f"separate source and target vocabularies of different sizes ({c.vocab_size} and {vocab}) "
            "are not supported"
        )
    activation = _activation(c.activation_function)
    if c.encoder_attention_heads != c.decoder_attention_heads or c.encoder_ffn_dim != c.decoder_ffn_dim:
        raise UnsupportedModel("encoder and decoder of different widths are not supported")
    pre = model_type in ("mbart", "m2m_100")
    max_len = c.max_position_embeddings
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_heads=c.encoder_attention_heads,
        encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers,
        ffn_dim=c.encoder_ffn_dim,
        max_len=max_len,
        dropout=0.0,
        **_special_ids(c, gen, vocab, mask_id),
        norm_position="pre" if pre else "post",
        final_norm=pre,
        embed_norm=model_type in ("bart", "mbart"),
        embed_scale=math.sqrt(d) if c.scale_embedding else 1.0,
        activation=activation,
        src_vocab_size=0 if shared else c.vocab_size,
    )
    p = "model."
    ours: dict[str, torch.Tensor] = {}
    dec_embed = w.get(f"{p}decoder.embed_tokens.weight", w.get(f"{p}shared.weight"))
    ours["embed.weight"] = dec_embed
    if not shared:
        ours["src_embed.weight"] = w[f"{p}encoder.embed_tokens.weight"]
    if model_type == "marian":
        table = _marian_sinusoids(max_len, d)
        ours["src_pos.weight"] = table
        ours["tgt_pos.weight"] = table.clone()
    elif model_type == "m2m_100":
        offset = c.pad_token_id + 1
        table = _fairseq_sinusoids(max_len + offset, d, c.pad_token_id)[offset:]
        ours["src_pos.weight"] = table
        ours["tgt_pos.weight"] = table.clone()
    else:  # learnt, offset 2
        ours["src_pos.weight"] = w[f"{p}encoder.embed_positions.weight"][2 : 2 + max_len]
        ours["tgt_pos.weight"] = w[f"{p}decoder.embed_positions.weight"][2 : 2 + max_len]
    if cfg.embed_norm:
        _copy_norm(ours, "src_embed_norm", w, f"{p}encoder.layernorm_embedding")
        _copy_norm(ours, "tgt_embed_norm", w, f"{p}decoder.layernorm_embedding")
    if pre:
        _copy_norm(ours, "encoder_norm", w, f"{p}encoder.layer_norm")
        _copy_norm(ours, "decoder_norm", w, f"{p}decoder.layer_norm")
    for i in range(cfg.encoder_layers):
        src, dst = f"{p}encoder.layers.{i}.", f"encoder_layers.{i}."
        _copy_attention(ours, dst + "attn", w, src + "self_attn", "q_proj", "k_proj", "v_proj", "out_proj")
        _copy_norm(ours, dst + "attn_norm", w, src + "self_attn_layer_norm")
        _copy_linear(ours, dst + "ffn.up", w, src + "fc1")
        _copy_linear(ours, dst + "ffn.down", w, src + "fc2")
        _copy_norm(ours, dst + "ffn_norm", w, src + "final_layer_norm")
    for i in range(cfg.decoder_layers):
        src, dst = f"{p}decoder.layers.{i}.", f"decoder_layers.{i}."
        _copy_attention(ours, dst + "self_attn", w, src + "self_attn", "q_proj", "k_proj", "v_proj", "out_proj")
        _copy_norm(ours, dst + "self_norm", w, src + "self_attn_layer_norm")
        _copy_attention(ours, dst + "cross_attn", w, src + "encoder_attn", "q_proj", "k_proj", "v_proj", "out_proj")
        _copy_norm(ours, dst + "cross_norm", w, src + "encoder_attn_layer_norm")
        _copy_linear(ours, dst + "ffn.up", w, src + "fc1")
        _copy_linear(ours, dst + "ffn.down", w, src + "fc2")
        _copy_norm(ours, dst + "ffn_norm", w, src + "final_layer_norm")
    head = w.get("lm_head.weight", dec_embed)
    if not torch.equal(head, dec_embed):
        cfg = _replace(cfg, tied_head=False)
        ours["lm_head.weight"] = head
    bias = w.get("final_logits_bias")
    ours["out_bias"] = bias.reshape(-1) if bias is not None else torch.zeros(vocab)
    return cfg, ours


def _t5(c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    import torch

    gated = c.feed_forward_proj.startswith("gated-")
    act_name = c.feed_forward_proj.split("-")[-1]
    if gated and act_name == "gelu":
        act_name = "gelu_new"  # transformers maps gated-gelu to the tanh approximation
    tied = getattr(c, "tie_word_embeddings", True) is not False
    d, hd = c.d_model, c.d_kv
    cfg = ModelConfig(
        vocab_size=c.vocab_size,
        d_model=d,
        n_heads=c.num_heads,
        head_dim=hd,
        encoder_layers=c.num_layers,
        decoder_layers=c.num_decoder_layers or c.num_layers,
        ffn_dim=c.d_ff,
        max_len=T5_MAX_LEN,
        dropout=0.0,
        **_special_ids(c, gen, c.vocab_size, mask_id),
        norm_kind="rms",
        norm_eps=c.layer_norm_epsilon,
        embed_scale=1.0,
        positions="relative",
        relative_buckets=c.relative_attention_num_buckets,
        relative_max_distance=c.relative_attention_max_distance,
        activation=_activation(act_name),
        gated_ffn=gated,
        linear_bias=False,
        tied_head=tied,
    )
    # T5 does not scale its attention scores; the kernels divide by sqrt(head_dim), so the query
    # projection is multiplied by it here.
    q_scale = math.sqrt(hd)
    ours: dict[str, torch.Tensor] = {"embed.weight": w["shared.weight"]}
    ours["src_rel_bias.weight"] = w["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    ours["tgt_rel_bias.weight"] = w["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    ours["encoder_norm.weight"] = w["encoder.final_layer_norm.weight"]
    decoder_norm = w["decoder.final_layer_norm.weight"]
    # The tied head scales the final states by d_model^-0.5; the final norm's gain carries it.
    ours["decoder_norm.weight"] = decoder_norm * d**-0.5 if tied else decoder_norm
    for i in range(cfg.encoder_layers):
        src, dst = f"encoder.block.{i}.layer.", f"encoder_layers.{i}."
        _copy_attention(ours, dst + "attn", w, src + "0.SelfAttention", "q", "k", "v", "o", q_scale)
        ours[dst + "attn_norm.weight"] = w[src + "0.layer_norm.weight"]
        _copy_t5_ffn(ours, dst + "ffn", w, src + "1.DenseReluDense", gated)
        ours[dst + "ffn_norm.weight"] = w[src + "1.layer_norm.weight"]
    for i in range(cfg.decoder_layers):
        src, dst = f"decoder.block.{i}.layer.", f"decoder_layers.{i}."
        _copy_attention(ours, dst + "self_attn", w, src + "0.SelfAttention", "q", "k", "v", "o", q_scale)
        ours[dst + "self_norm.weight"] = w[src + "0.layer_norm.weight"]
        _copy_attention(ours, dst + "cross_attn", w, src + "1.EncDecAttention", "q", "k", "v", "o", q_scale)
        ours[dst + "cross_norm.weight"] = w[src + "1.layer_norm.weight"]
        _copy_t5_ffn(ours, dst + "ffn", w, src + "2.DenseReluDense", gated)
        ours[dst + "ffn_norm.weight"] = w[src + "2.layer_norm.weight"]
    if not tied:
        ours["lm_head.weight"] = w["lm_head.weight"]
    ours["out_bias"] = torch.zeros(c.vocab_size)
    return cfg, ours


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _first(gen: Any, c: Any, name: str) -> Any:
    """A setting from generation_config.json, else config.json (as generate reads them)."""
    value = getattr(gen, name, None)
    return getattr(c, name, None) if value is None else value


def _special_ids(c: Any, gen: Any, vocab: int, mask_id: int | None) -> dict[str, int]:
    """specdec's special ids: BOS is the decoder start token; the NAR drafter's mask defaults to
    the unknown token (any id works, the drafter is trained with it)."""
    start = _first(gen, c, "decoder_start_token_id")
    if start is None:  # transformers' generate falls back to the BOS token
        start = _first(gen, c, "bos_token_id")
    if start is None and c.model_type in ("t5", "mt5"):  # T5 checkpoints start from the padding token
        start = _first(gen, c, "pad_token_id")
    eos = _first(gen, c, "eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    pad = _first(gen, c, "pad_token_id")
    pad = eos if pad is None else pad
    unk = getattr(c, "unk_token_id", None)
    unk = pad if unk is None else unk
    ids = {"pad_id": pad, "unk_id": unk, "bos_id": start, "eos_id": eos}
    ids["mask_id"] = unk if mask_id is None else mask_id
    for name, value in ids.items():
        if value is None or not 0 <= value < vocab:
            raise UnsupportedModel(f"{name} {value} is not a token of the {vocab}-token vocabulary")
    return ids


def _suppress_bad_words(ours: dict, bad_words_ids: Any) -> None:
    """Single-token `bad_words_ids` (opus-mt's padding token) folded into the output bias, so that
    greedy, and every mode, never emits them, as `generate` and CTranslate2 do."""
    single = [ids[0] for ids in bad_words_ids or [] if len(ids) == 1]
    if single:
        ours["out_bias"] = ours["out_bias"].clone()
        ours["out_bias"][single] = SUPPRESSED_LOGIT


def _generation(hf: Any) -> dict[str, Any]:
    """The decoding settings greedy must honour (a forced first token)."""
    forced = getattr(hf.generation_config, "forced_bos_token_id", None)
    if forced is None:
        forced = getattr(hf.config, "forced_bos_token_id", None)
    return {"forced_bos_token_id": forced}


def _activation(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not supported (one of {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    return ModelConfig.from_dict({**cfg.to_dict(), **changes})


def _copy_linear(ours: dict, dst: str, w: dict, src: str, scale: float = 1.0) -> None:
    ours[f"{dst}.weight"] = w[f"{src}.weight"] * scale if scale != 1.0 else w[f"{src}.weight"]
    if f"{src}.bias" in w:
        ours[f"{dst}.bias"] = w[f"{src}.bias"] * scale if scale != 1.0 else w[f"{src}.bias"]


def _copy_norm(ours: dict, dst: str, w: dict, src: str) -> None:
    ours[f"{dst}.weight"] = w[f"{src}.weight"]
    if f"{src}.bias" in w:
        ours[f"{dst}.bias"] = w[f"{src}.bias"]


def _copy_attention(
    ours: dict, dst: str, w: dict, src: str, q: str, k: str, v: str, o: str, q_scale: float = 1.0
) -> None:
    _copy_linear(ours, f"{dst}.q_proj", w, f"{src}.{q}", q_scale)
    _copy_linear(ours, f"{dst}.k_proj", w, f"{src}.{k}")
    _copy_linear(ours, f"{dst}.v_proj", w, f"{src}.{v}")
    _copy_linear(ours, f"{dst}.out_proj", w, f"{src}.{o}")


def _copy_t5_ffn(ours: dict, dst: str, w: dict, src: str, gated: bool) -> None:
    if gated:
        ours[f"{dst}.up.weight"] = w[f"{src}.wi_0.weight"]
        ours[f"{dst}.gate.weight"] = w[f"{src}.wi_1.weight"]
    else:
        ours[f"{dst}.up.weight"] = w[f"{src}.wi.weight"]
    ours[f"{dst}.down.weight"] = w[f"{src}.wo.weight"]


def _marian_sinusoids(length: int, dim: int):
    """Marian's table: sines of the even frequencies in the first half, cosines in the second."""
    import numpy as np
    import torch

    pos = np.arange(length, dtype=np.float64)[:, None]
    j = np.arange(dim)[None, :]
    enc = pos / np.power(10000, 2 * (j // 2) / dim)
    half = dim // 2 + dim % 2
    table = np.zeros((length, dim))
    table[:, :half] = np.sin(enc[:, 0::2])
    table[:, half:] = np.cos(enc[:, 1::2])
    return torch.tensor(table, dtype=torch.float32)


def _fairseq_sinusoids(length: int, dim: int, padding_idx: int):
    """fairseq's table (M2M100, NLLB): sines then cosines of dim/2 frequencies, the padding row zero."""
    import torch

    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(length, dtype=torch.int64).float()[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(length, 1)], dim=1)
    table[padding_idx] = 0
    return table
