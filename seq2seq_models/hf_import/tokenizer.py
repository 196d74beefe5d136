"""A checkpoint's tokenizer written into the bundle, described for
`seq2seq_models.hf_tokenizer.HFTokenizer`: a fast tokenizer's tokenizer.json, or the SentencePiece
models and vocab.json files of Marian and M2M100, with the ids a source is framed by and the
target-language codes. A checkpoint without tokenizer files gives an ids-only bundle; one whose
tokenizer_config.json names a tokenizer that cannot be loaded is refused. Truncation and padding
settings a tokenizer.json was saved with are dropped: transformers does not apply them when it
encodes a source for generate(), and a source is never cut silently."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer

from seq2seq_models.hf_import.common import BadCheckpoint, UnsupportedModel, first_line
from seq2seq_models.hf_import.files import read_json

TOKENIZER_CONFIG = "tokenizer_config.json"


def import_tokenizer(
    model_dir: str | Path, out: Path, eos_id: int, forced_bos_id: int | None = None
) -> dict[str, Any] | None:
    """Write the checkpoint's tokenizer into the bundle directory `out` and return its spec for
    `seq2seq_models.hf_tokenizer.HFTokenizer`; None when the checkpoint has no tokenizer files."""
    model_dir = Path(model_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. Marian's "pip install sacremoses": not the user's concern
            tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # whatever transformers raises, the user gets one line
        if (model_dir / TOKENIZER_CONFIG).is_file():
            raise _unloadable(model_dir, exc) from None
        return None  # no tokenizer: the bundle serves ids
    spec: dict[str, Any] = {
        "eos_id": eos_id,
        "forced_bos_token_id": forced_bos_id,
        "languages": _languages(tok),
        "special_ids": sorted(set(tok.all_special_ids)),
        "clean_up_tokenization_spaces": bool(getattr(tok, "clean_up_tokenization_spaces", False)),
    }
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
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


def _unloadable(model_dir: Path, exc: Exception) -> BadCheckpoint:
    """The one line for a tokenizer that tokenizer_config.json names and transformers cannot load:
    the files its class reads that are missing, else transformers' reason."""
    path = model_dir / TOKENIZER_CONFIG
    config = read_json(path)
    name = str(config.get("tokenizer_class") or "tokenizer")
    files = getattr(getattr(transformers, name, None), "vocab_files_names", {})
    optional = {"tokenizer_config_file"} | (set() if config.get("separate_vocabs") else {"target_vocab_file"})
    missing = [file for key, file in files.items() if key not in optional and not (model_dir / file).is_file()]
    if missing:
        return BadCheckpoint(f"{path}: names a {name}, whose files are missing: {', '.join(missing)}")
    return BadCheckpoint(f"{path}: names a {name}, which cannot be loaded ({first_line(exc)})")


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
