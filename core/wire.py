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

from core.sampling import SamplingParams

# The ModelInfo fields (and model config attributes) of the special token ids. With vocab_size and
# tokenizer_fingerprint they say how ids are numbered: a drafter and a verifier must agree on all.
SPECIAL_ID_FIELDS = ("pad_id", "unk_id", "bos_id", "eos_id", "mask_id")

# VerifyStep.top_k that asks for no candidate lists (only top1 and draft_logprob).
TOP1_ONLY = 0


def source_vocab_from_wire(source_vocab_size: int, vocab_size: int) -> int:
    """The source vocabulary's size from ModelInfo's two sizes (`source_vocab_size` 0: the target's)."""
    return source_vocab_size or vocab_size


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
