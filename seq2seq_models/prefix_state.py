"""One model's decoder cache over a source and the output prefix a client has sent it.

Both the verifier and the drafters keep their state this way; `sync` implements the session
protocol of `core.interfaces` (keep `committed_len` tokens, append the new final ones).
"""

from __future__ import annotations

import torch

from core.checks import check_session_step
from seq2seq_models.transformer import Seq2SeqTransformer


class PrefixState:
    def __init__(self, model: Seq2SeqTransformer, source_ids: list[int]) -> None:
        cfg = model.config
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
        check_session_step(committed_len, len(self.tokens), len(append_ids), lookahead, self.model.config)
        self.model.truncate(self.cache, 1 + committed_len)
        del self.tokens[committed_len:]
        if append_ids:
            self.extend(append_ids)

    @torch.no_grad()
    def extend(self, ids: list[int]) -> torch.Tensor:
        hidden = self.model.extend(self.cache, torch.tensor([ids], device=self.device))
        self.tokens.extend(ids)
        return hidden[0]
