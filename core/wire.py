"""The conventions of the specdec wire (protos/specdec/v1) where they differ from the in-process
interfaces of `core.interfaces`, written once so every server and client converts the same way.

Lengths: the interfaces count tokens the client sends or receives (`Verifier.max_source_len`
excludes the source's EOS the server appends, `max_target_len` excludes the decoder start token),
while `ModelInfo.max_source_len` counts that EOS and `ModelInfo.max_target_len` counts BOS, so a
model config's `max_len` is the wire value of both. Hence the +1 / -1 below.

top_k of a VerifyStep: 0 means "report only top-1 and the draft's log-probs, no candidate lists";
a session always computes at least top-1, so its own `top_k` is in [1, vocab_size].

top_p of a SampleDraft: 0 (proto3's unset) means off, as 1 does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.sampling import SamplingParams

if TYPE_CHECKING:
    from protos.specdec.v1 import common_pb2

# The ModelInfo fields (and model config attributes) of the special token ids. With vocab_size and
# tokenizer_fingerprint they say how ids are numbered: a drafter and a verifier must agree on all.
SPECIAL_ID_FIELDS = ("pad_id", "unk_id", "bos_id", "eos_id", "mask_id")

# VerifyStep.top_k that asks for no candidate lists (only top1 and draft_logprob).
TOP1_ONLY = 0


def source_len_to_wire(max_source_len: int) -> int:
    """ModelInfo.max_source_len for an interface limit that excludes the source's EOS."""
    return max_source_len + 1


def source_len_from_wire(wire_max_source_len: int) -> int:
    """The interface's max_source_len (source tokens without EOS) from ModelInfo.max_source_len."""
    return wire_max_source_len - 1


def target_len_to_wire(max_target_len: int) -> int:
    """ModelInfo.max_target_len for an interface limit that excludes the decoder start token."""
    return max_target_len + 1


def target_len_from_wire(wire_max_target_len: int) -> int:
    """The interface's max_target_len (output tokens without BOS) from ModelInfo.max_target_len."""
    return wire_max_target_len - 1


def session_top_k(wire_top_k: int) -> int:
    """The top_k a verifier session computes for a VerifyStep.top_k (TOP1_ONLY still needs top-1)."""
    return max(wire_top_k, 1)


def sends_candidates(wire_top_k: int) -> bool:
    """Whether the response carries topk_ids / topk_logprobs for a VerifyStep.top_k."""
    return wire_top_k != TOP1_ONLY


def sampling_from_wire(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    """SamplingParams from a SampleDraft's fields; top_p 0 (unset) means off."""
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p or 1.0)


class ServedVerifier:
    """Base of a gateway-side `Verifier` over a served model (the VerifierService, Triton): the
    interface's vocabulary, special ids and length limits read from the model's ModelInfo, and how
    many AR steps one round trip may run, for a request and for a streaming one (0: no limit)."""

    def __init__(self, info: common_pb2.ModelInfo, greedy_chunk: int, stream_greedy_chunk: int) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.bos_id = info.bos_id
        self.eos_id = info.eos_id
        self.max_source_len = source_len_from_wire(info.max_source_len)
        self.max_target_len = target_len_from_wire(info.max_target_len)
        self.greedy_chunk = greedy_chunk
        self.stream_greedy_chunk = stream_greedy_chunk
