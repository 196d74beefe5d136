"""Convert a bundle's verifier into a CTranslate2 model directory (the reference engine of
bench/bench_ctranslate2.py), and decode with it the way specdec's greedy decodes.

    python bench/ct2_convert.py                          # bundles/ua-gec -> bundles/ua-gec/ct2
    python bench/ct2_convert.py --bundle B --out DIR     # any bundle, any directory
    python bench/ct2_convert.py --check 50               # and compare greedy on 50 UA-GEC sentences

The mapping (seq2seq_models/transformer.py and layers.py): a pre-LN encoder-decoder with a final
LayerNorm on both stacks (torch's eps 1e-5, CTranslate2's default is 1e-6), learnt positions added
to the token embedding scaled by sqrt(d_model) (`scale_embeddings`, positions as a table per stack:
`src_pos`, `tgt_pos`), exact-erf GELU, one embedding matrix shared by encoder input, decoder input
and the output projection, which also has a bias (`out_bias`). Self-attention's Q/K/V projections
are fused into one linear, cross-attention's K/V into another (CTranslate2's layout). The
vocabulary is the tokenizer's pieces in id order, so CTranslate2's token ids are ours.

The source is `ids + [EOS]` (as `OrtRunner.encode` feeds it) and decoding starts from BOS.
CTranslate2 (`ctranslate2` is the `bench` extra of pyproject.toml) is imported lazily, so this
module loads without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

if TYPE_CHECKING:
    from seq2seq_models.bundle import ModelBundle
    from seq2seq_models.transformer import Seq2SeqTransformer

REPO = Path(__file__).resolve().parents[1]
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which every norm of the model uses
QUANTIZATIONS = ("float32", "int8")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"))
    p.add_argument("--out", type=Path, help="model directory (default: BUNDLE/ct2, beside the ONNX exports)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="compare fp32 greedy with specdec's on the first N UA-GEC test sentences")
    args = p.parse_args()
    from seq2seq_models.bundle import load_bundle

    bundle = load_bundle(args.bundle, roles=("verifier",))
    out = convert(bundle, args.out or default_dir(bundle))
    print(out)
    if args.check:
        return _check(bundle, out, args.check)
    return 0


def default_dir(bundle: ModelBundle) -> Path:
    """Where a bundle's conversion is kept (gitignored, like its ONNX exports): `convert` reuses it
    only when it was made from this bundle's fingerprint."""
    return Path(bundle.path) / "ct2"


def convert(bundle: ModelBundle, out_dir: Path, force: bool = False) -> Path:
    """Write the CTranslate2 model of `bundle`'s verifier to `out_dir` (float32 weights; int8 is a
    `compute_type` at load time); an existing conversion is kept unless `force`."""
    out_dir = Path(out_dir)
    stamp = out_dir / "specdec_fingerprint"
    if not force and (out_dir / "model.bin").exists() and stamp.exists() and stamp.read_text() == bundle.fingerprint:
        return out_dir
    spec = model_spec(bundle.verifier, vocabulary(bundle))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    stamp.write_text(bundle.fingerprint)
    return out_dir


def vocabulary(bundle: ModelBundle) -> list[str]:
    """The tokenizer's pieces in id order: CTranslate2 maps tokens to ids by this list."""
    sp = bundle.tokenizer._sp  # the SentencePiece processor; its pieces are unique by construction
    pieces = [sp.id_to_piece(i) for i in range(bundle.tokenizer.vocab_size)]
    if len(set(pieces)) != len(pieces):
        raise ValueError("the tokenizer's pieces are not unique: cannot be a CTranslate2 vocabulary")
    return pieces


def model_spec(model: Seq2SeqTransformer, vocab: list[str]) -> Any:
    """The `ctranslate2.specs.TransformerSpec` holding `model`'s weights (float32 numpy)."""
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.config
    if len(vocab) != cfg.vocab_size:
        raise ValueError(f"vocabulary of {len(vocab)} pieces for a model of {cfg.vocab_size}")
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.n_heads, pre_norm=True,
        activation=common_spec.Activation.GELU)  # F.gelu's default is the exact (erf) GELU
    w = {name: t.detach().float().cpu().numpy() for name, t in model.state_dict().items()}
    embed = w["embed.weight"]
    _set_stack_inputs(spec.encoder, embed, w["src_pos.weight"])
    _set_norm(spec.encoder.layer_norm, w, "encoder_norm")
    for i, layer in enumerate(spec.encoder.layer):
        scope = f"encoder_layers.{i}"
        _set_self_attention(layer.self_attention, w, f"{scope}.attn", f"{scope}.attn_norm")
        _set_ffn(layer.ffn, w, scope)
    _set_stack_inputs(spec.decoder, embed, w["tgt_pos.weight"])
    _set_norm(spec.decoder.layer_norm, w, "decoder_norm")
    for i, layer in enumerate(spec.decoder.layer):
        scope = f"decoder_layers.{i}"
        _set_self_attention(layer.self_attention, w, f"{scope}.self_attn", f"{scope}.self_norm")
        _set_cross_attention(layer.attention, w, f"{scope}.cross_attn", f"{scope}.cross_norm")
        _set_ffn(layer.ffn, w, scope)
    spec.decoder.projection.weight = embed
    spec.decoder.projection.bias = w["out_bias"]
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.decoder_start_token = vocab[cfg.bos_id]
    spec.config.bos_token = vocab[cfg.bos_id]
    spec.config.eos_token = vocab[cfg.eos_id]
    spec.config.unk_token = vocab[cfg.unk_id]
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.validate()
    return spec


def open_translator(model_dir: Path, compute_type: str = "float32", threads: int = 1) -> Any:
    """A CPU `ctranslate2.Translator`: `threads` intra-op threads (one translation at a time)."""
    import ctranslate2

    return ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                  inter_threads=1, intra_threads=threads)


def greedy(translator: Any, vocab: list[str], source_ids: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """CTranslate2's greedy output ids for one source, as specdec's AR greedy returns them: at most
    `max_new_tokens` tokens, without the EOS that ended them."""
    [result] = translator.translate_batch(
        [[vocab[i] for i in source_ids] + [vocab[eos_id]]],
        beam_size=1, max_decoding_length=max_new_tokens, length_penalty=0.0, repetition_penalty=1.0,
        no_repeat_ngram_size=0, disable_unk=False, return_end_token=False, use_vmap=False)
    index = _index(vocab)
    return [index[t] for t in result.hypotheses[0]]


def token_log_probs(translator: Any, vocab: list[str], source_ids: list[int], target_ids: list[int],
                    eos_id: int) -> list[float]:
    """log p of every token of `target_ids` (BOS not included) given the source, teacher-forced."""
    [result] = translator.score_batch([[vocab[i] for i in source_ids] + [vocab[eos_id]]],
                                      [[vocab[i] for i in target_ids]])
    return list(result.log_probs)


_INDEXES: dict[int, dict[str, int]] = {}


def _index(vocab: list[str]) -> dict[str, int]:
    key = id(vocab)
    if key not in _INDEXES:
        _INDEXES[key] = {t: i for i, t in enumerate(vocab)}
    return _INDEXES[key]


def _set_stack_inputs(stack: Any, embed: Any, positions: Any) -> None:
    embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
    embeddings.weight = embed
    stack.scale_embeddings = True  # x = embed(ids) * sqrt(d_model) + pos(positions)
    stack.position_encodings.encodings = positions


def _set_self_attention(spec: Any, w: dict[str, Any], scope: str, norm: str) -> None:
    import numpy as np

    _set_norm(spec.layer_norm, w, norm)
    spec.linear[0].weight = np.concatenate([w[f"{scope}.{p}_proj.weight"] for p in "qkv"])
    spec.linear[0].bias = np.concatenate([w[f"{scope}.{p}_proj.bias"] for p in "qkv"])
    _set_linear(spec.linear[1], w, f"{scope}.out_proj")


def _set_cross_attention(spec: Any, w: dict[str, Any], scope: str, norm: str) -> None:
    import numpy as np

    _set_norm(spec.layer_norm, w, norm)
    _set_linear(spec.linear[0], w, f"{scope}.q_proj")
    spec.linear[1].weight = np.concatenate([w[f"{scope}.{p}_proj.weight"] for p in "kv"])
    spec.linear[1].bias = np.concatenate([w[f"{scope}.{p}_proj.bias"] for p in "kv"])
    _set_linear(spec.linear[2], w, f"{scope}.out_proj")


def _set_ffn(spec: Any, w: dict[str, Any], scope: str) -> None:
    _set_norm(spec.layer_norm, w, f"{scope}.ffn_norm")
    _set_linear(spec.linear_0, w, f"{scope}.ffn.up")
    _set_linear(spec.linear_1, w, f"{scope}.ffn.down")


def _set_linear(spec: Any, w: dict[str, Any], scope: str) -> None:
    spec.weight = w[f"{scope}.weight"]
    spec.bias = w[f"{scope}.bias"]


def _set_norm(spec: Any, w: dict[str, Any], scope: str) -> None:
    spec.gamma = w[f"{scope}.weight"]
    spec.beta = w[f"{scope}.bias"]


def _check(bundle: ModelBundle, model_dir: Path, n: int) -> int:
    """fp32 CTranslate2 greedy against specdec's in-process greedy (ONNX Runtime fp32)."""
    from decoding.config import DecodingConfig, Mode
    from decoding.decode import decode
    from evaluation.benchmark import DEFAULT_MAX_NEW_TOKENS, select_sentences
    from training.data import load_test_set
    from verifier_service.session import make_verifier

    verifier = make_verifier(bundle, "onnxruntime", device="cpu")
    sentences = select_sentences(load_test_set(), bundle.tokenizer, verifier.max_source_len, n)
    vocab = vocabulary(bundle)
    translator = open_translator(model_dir)
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    eos_id = bundle.verifier.config.eos_id
    same = 0
    for s in sentences:
        ours = decode(s.source_ids, config, verifier, None).output_ids
        same += ours == greedy(translator, vocab, s.source_ids, DEFAULT_MAX_NEW_TOKENS, eos_id)
    print(f"fp32 greedy identical on {same}/{len(sentences)} sentences")
    return 0 if same == len(sentences) else 1


if __name__ == "__main__":
    sys.exit(main())
