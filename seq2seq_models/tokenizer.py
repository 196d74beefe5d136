"""SentencePiece tokenizer shared by the verifier and both drafters of a bundle."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from seq2seq_models.hf_tokenizer import FirstTokens

# Fixed special ids: every model of every bundle relies on them.
PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3, 4
MASK_PIECE = "<mask>"


class Tokenizer(FirstTokens):
    """specdec's own SentencePiece model: no forced first tokens, no target languages (the
    `FirstTokens` defaults)."""

    def __init__(self, model_bytes: bytes) -> None:
        self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.model_bytes = model_bytes
        self.fingerprint = hashlib.sha256(model_bytes).hexdigest()
        self.vocab_size = self._sp.get_piece_size()
        if self._sp.piece_to_id(MASK_PIECE) != MASK_ID or self._sp.eos_id() != EOS_ID:
            raise ValueError("tokenizer lacks specdec's special ids (pad 0, unk 1, bos 2, eos 3, mask 4)")
        self.special_ids = frozenset({PAD_ID, UNK_ID, BOS_ID, EOS_ID, MASK_ID})

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        return cls(Path(path).read_bytes())

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_target(self, text: str) -> list[int]:
        """`text` as output tokens: source and target share the model."""
        return self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        # Specials never appear in text; unknown pieces decode as SentencePiece's " ⁇ ".
        return self._sp.decode([i for i in ids if i not in self.special_ids or i == UNK_ID])


def train_tokenizer(lines: Iterable[str], vocab_size: int, model_type: str = "unigram") -> bytes:
    """Train a SentencePiece model with specdec's special ids; returns the model file's bytes."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=out,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        user_defined_symbols=[MASK_PIECE],
        hard_vocab_limit=False,
        num_threads=1,  # one thread keeps training deterministic
        minloglevel=2,
    )
    return out.getvalue()
