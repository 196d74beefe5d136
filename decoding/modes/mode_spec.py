"""What one mode declares: its names, whether it is lossless, what it needs of the drafter, how it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from core.interfaces import Verifier
from decoding.config import DecodingConfig, Mode
from decoding.policies.adaptive import LoadModel
from decoding.policies.drafter_sync import DrafterSync
from decoding.policies.loop import Accept, DecodeStats, Hypothesis, Propose
from decoding.policies.preverify import FirstPasses


class DrafterMethod(StrEnum):
    """The DrafterSession call a mode drafts with; NONE: the mode needs no drafter service."""

    NONE = "none"
    BLOCK = "block"  # draft_block: k tokens at once (the NAR drafter)
    BEAM = "beam"  # draft_beam: gamma tokens by beam search (the AR drafter)
    SAMPLE = "sample"  # draft_sample: gamma sampled tokens and their q rows (the AR drafter)


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a draft-verify mode's factory may build its policy from, for one request."""

    config: DecodingConfig
    source_ids: list[int]
    verifier: Verifier
    drafter: DrafterSync | None  # set exactly when the spec's drafter method is not NONE
    rng: np.random.Generator  # the request's stream, for modes that sample
    load: LoadModel  # what adaptive speculation reads and learns (the verifier's, unless the caller chose)


# build(inputs) -> (propose, accept) for the draft-verify loop.
BuildPolicy = Callable[[PolicyInputs], tuple[Propose, Accept]]
# top_k(config, vocabulary size) -> candidates per position the verifier must return.
TopK = Callable[[DecodingConfig, int], int]
# sessions(config) -> verifier sessions one request of the mode holds at once (gateway admission).
Sessions = Callable[[DecodingConfig], int]
# preverify(config) -> the mode's rule at one position, for pre-verify (decoding.policies.preverify).
FirstRule = Callable[[DecodingConfig], FirstPasses]
# run(source_ids, config, verifier, stats, prefix) -> the finished hypotheses, best first (each with
# the committed prefix first), for a mode outside the draft-verify loop.
RunMode = Callable[[list[int], DecodingConfig, Verifier, DecodeStats, list[int] | None], list[Hypothesis]]


def one_session(config: DecodingConfig) -> int:
    """The draft-verify loop holds one verifier session."""
    return 1


def top_1(config: DecodingConfig, vocab_size: int) -> int:
    """The top_k rule of the modes that only compare drafts with the verifier's argmax."""
    return 1


# The DecodingConfig fields every mode reads (the logits processors' among them).
PROCESSOR_PARAMS = frozenset({
    "repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length",
    "min_new_tokens", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
})
COMMON_PARAMS = frozenset({"mode", "seed", "max_new_tokens", "output_logprobs"}) | PROCESSOR_PARAMS


@dataclass(frozen=True)
class ModeSpec:
    """One mode, declared once: `build` (draft-verify modes) or `run` (beam search), never both."""

    mode: Mode
    wire: str  # the value's name in gateway.proto's Mode enum, e.g. "MODE_GAD"
    lossless: bool  # the output is, by construction, exactly the verifier's greedy output
    drafter: DrafterMethod
    build: BuildPolicy | None = None
    top_k: TopK = top_1
    run: RunMode | None = None
    verifier_sessions: Sessions = one_session
    title: str = ""  # how error messages name the mode; default: "mode <value>"
    # Overlapped drafting may draft the next block during the verifier's step
    # (decoding.policies.overlap): only for a drafter call that depends on the output alone.
    overlap: bool = False
    # Pre-verify may check a block's first position during its drafting (decoding.policies.preverify):
    # for a block-drafting mode whose accept rule decides each position alone, that rule at one.
    preverify: FirstRule | None = None
    # Block drafts follow the verifier's insertions and deletions (decoding.policies.drafter_sync,
    # `realign`): only where any draft gives the same output (a lossless mode); other modes' outputs
    # depend on their drafts.
    realign: bool = False
    # Block drafts are drafted one position longer than they are verified; that last token is the
    # guess overlapped drafting drafts ahead from (`Draft.lookahead`). A mode whose output depends
    # on its drafts would change with it: only where any draft gives the same output.
    lookahead: bool = False
    # Every step is a plain AR step (an empty draft, exact accept): a verifier session that runs
    # several per call (core.interfaces.GreedySession) may take them a run at a time.
    greedy: bool = False
    # Its drafts are copies of the source (IAD): a verifier session that runs copy-drafted greedy
    # runs itself (core.interfaces.CopyRunSession) may take a request of fixed k a run at a time.
    copy_runs: bool = False
    # The DecodingConfig fields the mode reads besides those of every mode (COMMON_PARAMS) and
    # overlap / preverify (which follow from the fields above): a request that sets another is refused.
    params: frozenset[str] = frozenset()

    @property
    def applicable(self) -> frozenset[str]:
        """Every DecodingConfig field a request of this mode may set."""
        ahead = {"overlap"} if self.overlap else set()
        if self.preverify is not None:
            ahead.add("preverify")
        return COMMON_PARAMS | self.params | ahead

    def __post_init__(self) -> None:
        if (self.build is None) == (self.run is None):
            raise TypeError(f"mode {self.mode.value}: declare exactly one of build and run")
        if self.run is not None and self.drafter != DrafterMethod.NONE:
            raise TypeError(f"mode {self.mode.value}: a run function gets no drafter")
        if self.overlap and self.drafter not in (DrafterMethod.BLOCK, DrafterMethod.BEAM):
            raise TypeError(f"mode {self.mode.value}: only block and beam drafts are deterministic enough to overlap")
        if self.preverify is not None and self.drafter != DrafterMethod.BLOCK:
            raise TypeError(f"mode {self.mode.value}: pre-verify is for block drafts")
        if (self.realign or self.lookahead) and not (self.lossless and self.drafter == DrafterMethod.BLOCK):
            raise TypeError(f"mode {self.mode.value}: realigned and lookahead drafts are for lossless block modes")

    @property
    def needs_drafter(self) -> bool:
        return self.drafter != DrafterMethod.NONE

    @property
    def name(self) -> str:
        return self.title or f"mode {self.mode.value}"
