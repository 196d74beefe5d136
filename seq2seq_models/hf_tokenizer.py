"""An imported model's own tokenizer, run without `transformers`.

`specdec import-hf` stores what the checkpoint's tokenizer is made of and how it frames a source:

* `tokenizers` kind: the tokenizer.json that `transformers`' fast tokenizer runs (BART's byte-level
  BPE, T5's and mBART's SentencePiece-as-Unigram, NLLB), run here by the `tokenizers` library;
* `spm-vocab` kind: a SentencePiece model whose pieces are mapped to ids by a vocab.json (Marian's
  source.spm / target.spm, M2M100's sentencepiece.bpe.model), run by `sentencepiece`;
* no files: the bundle serves ids only.

A source is framed as the checkpoint's tokenizer frames it (`prefix` ids, the text's ids, `suffix`
ids, e.g. BART's `<s> ... </s>` or M2M100's `__en__ ... </s>`); the final EOS is left to the
decoder, which appends it to every source, so encode returns the framing without it. Decoding
skips the special tokens, as `decode(..., skip_special_tokens=True)` does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class FirstTokens:
    """The target's forced first tokens: a many-to-many model (NLLB, M2M100, mBART-50) starts its
    output with the target language's code, by default the checkpoint's `forced_bos_token_id`."""

    forced_bos_id: int | None = None
    languages: dict[str, int] = {}  # noqa: RUF012 - read-only default, replaced per instance

    def first_tokens(self, target_lang: str = "") -> list[int]:
        """The ids every output starts with: the code of `target_lang`, else the default."""
        if target_lang:
            if not self.languages:
                raise ValueError("this model has no target languages: leave target_lang unset")
            if target_lang not in self.languages:
                known = ", ".join(sorted(self.languages)[:8])
                more = "..." if len(self.languages) > 8 else ""
                raise ValueError(f"unknown target language {target_lang!r}; this model's codes: {known}{more}")
            return [self.languages[target_lang]]
        return [] if self.forced_bos_id is None else [self.forced_bos_id]


class IdsOnlyTokenizer(FirstTokens):
    """A bundle imported without tokenizer files: requests must send ids."""

    kind = "none"

    def __init__(self, vocab_size: int, forced_bos_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.forced_bos_id = forced_bos_id
        self.languages = {}
        self.fingerprint = hashlib.sha256(f"ids-only:{vocab_size}:{forced_bos_id}".encode()).hexdigest()
        self.special_ids: frozenset[int] = frozenset()

    def encode(self, text: str) -> list[int]:
        raise ValueError("this bundle has no tokenizer: send token ids (input_ids, or --ids on the command line)")

    def encode_target(self, text: str) -> list[int]:
        raise ValueError("this bundle has no tokenizer: send a target prefix as token ids (target_prefix_ids)")

    def decode(self, ids: Iterable[int]) -> str:
        """The ids as text ("5 17 3"): the bundle has no pieces to join."""
        return " ".join(str(i) for i in ids)


class HFTokenizer(FirstTokens):
    """The `tokenizers` and `spm-vocab` kinds (see the module docstring)."""

    def __init__(self, root: Path, spec: dict[str, Any]) -> None:
        self.kind = spec["kind"]
        self.forced_bos_id = spec.get("forced_bos_token_id")
        self.languages = dict(spec.get("languages", {}))
        self.prefix: list[int] = list(spec.get("prefix", []))
        self.suffix: list[int] = list(spec.get("suffix", []))
        self.eos_id: int = spec["eos_id"]
        self.special_ids = frozenset(spec.get("special_ids", []))
        self.clean_up_spaces = bool(spec.get("clean_up_tokenization_spaces", False))
        files = [root / name for name in spec["files"]]
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
        for path in files:
            digest.update(path.read_bytes())
        self.fingerprint = digest.hexdigest()
        if self.kind == "tokenizers":
            from tokenizers import Tokenizer as FastTokenizer

            self._fast = FastTokenizer.from_file(str(files[0]))
            # A bundle imported before import-hf dropped them may carry a fine-tuning script's
            # settings; transformers' generate path applies neither, and a source is never cut.
            self._fast.no_truncation()
            self._fast.no_padding()
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        elif self.kind == "spm-vocab":
            import sentencepiece as spm

            self._source = spm.SentencePieceProcessor(model_file=str(root / spec["source_spm"]))
            self._target = spm.SentencePieceProcessor(model_file=str(root / spec["target_spm"]))
            self._src_vocab: dict[str, int] = json.loads((root / spec["source_vocab"]).read_text())
            target_vocab: dict[str, int] = json.loads((root / spec["target_vocab"]).read_text())
            added = {int(i): piece for i, piece in spec.get("added_pieces", {}).items()}
            self._pieces = {**added, **{i: piece for piece, i in target_vocab.items()}}
            self._tgt_vocab = target_vocab
            self._unk = spec["unk_id"]
            self.vocab_size = max(target_vocab.values()) + 1
        else:
            raise ValueError(f"unknown tokenizer kind {self.kind!r}")

    def encode(self, text: str) -> list[int]:
        if self.kind == "tokenizers":
            body = self._fast.encode(text, add_special_tokens=False).ids
        else:
            body = [self._src_vocab.get(piece, self._unk) for piece in self._source.encode(text, out_type=str)]
        framed = [*self.prefix, *body, *self.suffix]
        return framed[:-1] if framed and framed[-1] == self.eos_id else framed

    def encode_target(self, text: str) -> list[int]:
        """`text` as output tokens, unframed (`tokenizer(text_target=..., add_special_tokens=False)`)."""
        if self.kind == "tokenizers":
            return self._fast.encode(text, add_special_tokens=False).ids
        return [self._tgt_vocab.get(piece, self._unk) for piece in self._target.encode(text, out_type=str)]

    def decode(self, ids: Iterable[int]) -> str:
        kept = [i for i in ids if i not in self.special_ids]
        if self.kind == "tokenizers":
            text = self._fast.decode(kept, skip_special_tokens=True)
        else:
            # Marian's and M2M100's tokenizers strip the joined pieces.
            text = self._target.decode_pieces([self._pieces[i] for i in kept if i in self._pieces]).strip()
        return clean_up_tokenization(text) if self.clean_up_spaces else text


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and English contractions."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
        (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
