"""Random-weight Hugging Face checkpoints built locally, shaped as the hub's are where CTranslate2's
Transformers converter reads them: bench/bench_hf_ctranslate2.py and tests/test_hf_ct2.py compare
specdec's import of them with CTranslate2's conversion.

Every checkpoint is a `save_pretrained` directory with its tokenizer files (the converter takes the
vocabulary from the tokenizer). Three details of hub checkpoints that a model built from a config
lacks, and the converter relies on, are reproduced:

* Marian: the padding row of the embedding is zero (opus-mt's conversion appends it so); HF starts
  the decoder from that row, CTranslate2 from a zero embedding. `bad_words_ids` forbids the padding
  token, as opus-mt's generation config does (CTranslate2 drops it from the vocabulary).
* BART / mBART: config.json carries `normalize_before` (fairseq-era configs do; the converter reads
  it and transformers no longer writes it).
* M2M100: the vocabulary holds the tokenizer's made-up words (the converter appends them).

Weights are drawn at the tests' scale (std 0.3 at width 32), kept per fan-in so a 512-wide model's
activations stay in range: random models at the default init give flat logits and float32 near-ties.

`transformers`, `sentencepiece` and `tokenizers` are imported lazily, so this module loads without them.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "seq2seq_models" / "data" / "tiny_corpus.txt"
# The tests' weight std at width 32, as a multiple of 1/sqrt(fan_in).
WEIGHT_SCALE = 0.3 * math.sqrt(32)
FAMILIES = ("marian", "bart", "mbart", "m2m100", "t5", "t5-v1.1")


@dataclass(frozen=True)
class Shape:
    d_model: int = 32
    layers: int = 2  # the encoder's, and the decoder's unless decoder_layers is set
    heads: int = 4  # likewise (T5 configs have one head count for both stacks)
    ffn: int = 64  # likewise (T5 configs have one width for both stacks)
    vocab: int = 0  # 0: the tokenizer's own size; else padded with dummy pieces to this size (Marian)
    max_len: int = 256
    decoder_layers: int = 0  # 0: `layers`
    decoder_heads: int = 0  # 0: `heads`
    decoder_ffn: int = 0  # 0: `ffn`


MARIAN_BASE = Shape(d_model=512, layers=6, heads=8, ffn=2048, vocab=32000, max_len=512)


def build(family: str, out: Path, shape: Shape = Shape(), seed: int = 0) -> Path:
    """Write a `family` checkpoint of `shape` with its tokenizer to `out`; returns `out`."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model, tokenizer, config_extra = _model(family, out, shape)
    scaled(model, seed)
    if family == "marian":
        pad = model.config.pad_token_id
        with torch.no_grad():
            model.get_input_embeddings().weight[pad].zero_()
            model.get_output_embeddings().weight[pad].zero_()
            model.final_logits_bias[0, pad] = 0.0
        model.generation_config.bad_words_ids = [[pad]]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if config_extra:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_extra}, indent=2))
    return out


def build_and_import(family: str, root: Path, seed: int = 0, edit: Any = None) -> tuple[Any, Path]:
    """`build` a `family` checkpoint under root/hf (then `edit(model)` and save it again, if given)
    and import it with `specdec import-hf` to root/bundle: (the model as transformers loads it back,
    the bundle's directory)."""
    import transformers

    from specdec.cli import main as cli_main

    build(family, root / "hf", Shape(), seed=seed)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(root / "hf")).eval()
    if edit is not None:
        edit(model)
        model.save_pretrained(root / "hf")
    if cli_main(["import-hf", "--model", str(root / "hf"), "--out", str(root / "bundle")]) != 0:
        raise RuntimeError(f"import-hf failed on the {family} checkpoint in {root / 'hf'}")
    return model, root / "bundle"


def random_sources(config: Any, seed: int, count: int, longest: int = 14) -> list[list[int]]:
    """`count` random sources of 1..`longest` tokens for an imported model (its `ModelConfig`), drawn
    from its source vocabulary without the special ids."""
    import random

    specials = {config.pad_id, config.eos_id, config.bos_id, config.unk_id}
    words = [i for i in range(config.source_vocab_size) if i not in specials]
    rng = random.Random(seed)
    return [[rng.choice(words) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def scaled(model: Any, seed: int) -> Any:
    """Weights well above the default init, per fan-in; norms' gains near 1, small biases."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_SCALE / math.sqrt(p.shape[-1]))
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g) * 0.1)
    return model.eval()


def _model(family: str, root: Path, s: Shape) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, keys to add to config.json) of one family."""
    import transformers as t

    decoder_layers = s.decoder_layers or s.layers
    bart_shape = dict(
        d_model=s.d_model, encoder_layers=s.layers, decoder_layers=decoder_layers, encoder_attention_heads=s.heads,
        decoder_attention_heads=s.decoder_heads or s.heads, encoder_ffn_dim=s.ffn,
        decoder_ffn_dim=s.decoder_ffn or s.ffn,
        max_position_embeddings=s.max_len, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        forced_eos_token_id=None,
    )
    t5_shape = dict(d_model=s.d_model, d_kv=s.d_model // s.heads, num_heads=s.heads, num_layers=s.layers,
                    num_decoder_layers=decoder_layers, d_ff=s.ffn, dropout_rate=0.0, decoder_start_token_id=0)
    if family == "marian":
        tok = _marian_tokenizer(root, s.vocab)
        cfg = t.MarianConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             decoder_start_token_id=tok.pad_token_id, **bart_shape)
        return t.MarianMTModel(cfg), tok, {}
    if family == "bart":
        tok = _bart_tokenizer(root)
        cfg = t.BartConfig(vocab_size=len(tok), **bart_shape)
        return t.BartForConditionalGeneration(cfg), tok, {"normalize_before": False}
    if family == "mbart":
        tok = _mbart_tokenizer()
        cfg = t.MBartConfig(vocab_size=len(tok), scale_embedding=True, **bart_shape)
        return t.MBartForConditionalGeneration(cfg), tok, {"normalize_before": True}
    if family == "m2m100":
        tok = _m2m100_tokenizer(root)
        cfg = t.M2M100Config(vocab_size=len(tok) + tok.num_madeup_words, **bart_shape)
        return t.M2M100ForConditionalGeneration(cfg), tok, {}
    if family in ("t5", "t5-v1.1"):
        tok = _t5_tokenizer()
        v11 = family == "t5-v1.1"
        cfg = t.T5Config(vocab_size=len(tok), feed_forward_proj="gated-gelu" if v11 else "relu",
                         tie_word_embeddings=not v11, **t5_shape)
        return t.T5ForConditionalGeneration(cfg), tok, {}
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def _spm(vocab_size: int = 150, **ids: int) -> Any:
    """A SentencePiece model trained on the repository's small corpus (no download)."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.read_text().splitlines()), model_writer=out, vocab_size=vocab_size,
        hard_vocab_limit=False, minloglevel=2, num_threads=1, **ids,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def _marian_tokenizer(root: Path, size: int) -> Any:
    """Marian's source/target .spm and vocab.json; `size` > 0 pads the vocabulary with dummy pieces
    (never produced by the .spm) to that many ids, `<pad>` last as opus-mt's."""
    import transformers

    sp = _spm()
    for name in ("source.spm", "target.spm"):
        (root / name).write_bytes(sp.serialized_model_proto())
    pieces = ["</s>", "<unk>"]
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if piece not in pieces and piece != "<s>":
            pieces.append(piece)
    pieces += [f"<dummy{i}>" for i in range(max(0, size - 1 - len(pieces)))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    vocab["<pad>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    return transformers.MarianTokenizer(
        source_spm=str(root / "source.spm"), target_spm=str(root / "target.spm"), vocab=str(root / "vocab.json")
    )


def _bart_tokenizer(root: Path) -> Any:
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS.read_text().splitlines(), vocab_size=300,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(root))
    return transformers.BartTokenizer(vocab=str(root / "vocab.json"), merges=str(root / "merges.txt"))


def _mbart_tokenizer() -> Any:
    import transformers

    sp = _spm(bos_id=0, pad_id=1, eos_id=2, unk_id=3)  # fairseq's order, as MBartConfig's ids
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return transformers.MBartTokenizer(vocab=vocab)


def _m2m100_tokenizer(root: Path) -> Any:
    import transformers

    sp = _spm()
    (root / "sentencepiece.bpe.model").write_bytes(sp.serialized_model_proto())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        vocab.setdefault(sp.id_to_piece(i), len(vocab))
    (root / "vocab.json").write_text(json.dumps(vocab))
    return transformers.M2M100Tokenizer(vocab_file=str(root / "vocab.json"),
                                        spm_file=str(root / "sentencepiece.bpe.model"))


def _t5_tokenizer() -> Any:
    import transformers

    sp = _spm(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=4)
