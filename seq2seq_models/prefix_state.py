"""One model's decoder cache over a source and the output prefix a client has sent it.

Both the verifier and the drafters keep their state this way; `sync` implements the session
protocol of `specdec.interfaces` (keep `committed_len` tokens, append the new final ones).
"""

from __future__ import annotations

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer
from specdec.errors import invalid, out_of_range, out_of_step


class PrefixState:
    def __init__(self, model: Seq2SeqTransformer, source_ids: list[int]) -> None:
        cfg = model.config
        check_source(source_ids, cfg)
        self.model = model
        self.device = model.embed.weight.device
        self.tokens: list[int] = []  # output tokens after BOS that the cache holds
        with torch.no_grad():
            src = torch.tensor([[*source_ids, cfg.eos_id]], device=self.device)
            self.cache = model.start(src)
            model.extend(self.cache, torch.tensor([[cfg.bos_id]], device=self.device))

    @property
    def max_tokens(self) -> int:
        return self.model.config.max_len - 1

    @property
    def cache_bytes(self) -> int:
        return self.cache.nbytes()

    def sync(self, committed_len: int, append_ids: list[int], lookahead: int = 0) -> None:
        """Keep `committed_len` tokens, append `append_ids`; `lookahead` more must still fit."""
        check_sync(committed_len, len(self.tokens), append_ids, lookahead, self.model.config)
        self.model.truncate(self.cache, 1 + committed_len)
        del self.tokens[committed_len:]
        if append_ids:
            self.extend(append_ids)

    @torch.no_grad()
    def extend(self, ids: list[int]) -> torch.Tensor:
        hidden = self.model.extend(self.cache, torch.tensor([ids], device=self.device))
        self.tokens.extend(ids)
        return hidden[0]


# The session checks, shared by every backend so that each refuses the same requests the same way.


def check_source(source_ids: list[int], config: ModelConfig) -> None:
    check_ids(source_ids, config.vocab_size, "source")
    if not source_ids:
        raise invalid("source is empty")
    if len(source_ids) + 1 > config.max_len:
        raise out_of_range(f"source has {len(source_ids)} tokens; the limit is {config.max_len - 1}")


def check_sync(committed_len: int, held: int, append_ids: list[int], lookahead: int, config: ModelConfig) -> None:
    """A step may keep at most the `held` tokens the session has seen, and must fit max_len."""
    if not 0 <= committed_len <= held:
        raise out_of_step(f"committed_len {committed_len} but the session holds {held} output tokens")
    check_ids(append_ids, config.vocab_size, "append_ids")
    total = committed_len + len(append_ids) + lookahead
    if total > config.max_len - 1:
        raise out_of_range(f"output would reach {total} tokens; the limit is {config.max_len - 1}")


def check_draft(draft_ids: list[int], top_k: int, config: ModelConfig) -> None:
    if not 1 <= top_k <= config.vocab_size:
        raise invalid(f"top_k must be in [1, {config.vocab_size}], got {top_k}")
    check_ids(draft_ids, config.vocab_size, "draft_ids")


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise invalid(f"{what} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
