"""The two small interfaces the accept loop is written against (ARCHITECTURE.md section 1).

The same policy code runs over in-process implementations (tests, offline jobs) and over gRPC
(serving). Nothing here is a tensor: only token ids, log-probs and probability rows.

Session protocol (verifier and drafter alike): the session holds the tokens it has seen after
BOS. Each step says `committed_len`, how many of those the client keeps (the rest are rolled
back), and `append_ids`, final tokens the session has not seen yet. Rolling back below an
earlier commit is allowed (beam search re-targets sessions that way); keeping more than it has
seen is out of step (FAILED_PRECONDITION).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from core.sampling import SamplingParams


@dataclass(frozen=True)
class VerifyResult:
    """The verifier's view of `draft_ids` d_1..d_n: n + 1 positions, the last one past the draft."""

    top1: list[int]  # v_i = argmax p(. | o, d_<i), i = 1..n+1
    topk_ids: list[list[int]]  # top-k ids per position, best first
    topk_logprobs: list[list[float]]
    draft_logprobs: list[float]  # log p(d_i | o, d_<i), i = 1..n


@dataclass(frozen=True)
class Draft:
    ids: list[int]
    # Beam drafts: log q(d_1..d_i) for every i.
    cum_logq: list[float] = field(default_factory=list)
    # Sampled drafts: the warped q the token at each position was drawn from, as (ids, probs).
    q_rows: list[tuple[list[int], list[float]]] = field(default_factory=list)


class VerifierSession(Protocol):
    def step(
        self, committed_len: int, append_ids: list[int], draft_ids: list[int], top_k: int
    ) -> VerifyResult: ...

    def close(self) -> None: ...


class Verifier(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    max_source_len: int  # source tokens, excluding the EOS the verifier adds
    max_target_len: int  # output tokens, excluding BOS

    def open(self, source_ids: list[int]) -> VerifierSession: ...


class DrafterSession(Protocol):
    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft: ...

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft: ...

    def draft_sample(
        self, committed_len: int, append_ids: list[int], gamma: int, params: SamplingParams
    ) -> Draft: ...

    def close(self) -> None: ...


class Drafter(Protocol):
    vocab_size: int

    def open(self, source_ids: list[int], seed: int = 0) -> DrafterSession: ...
