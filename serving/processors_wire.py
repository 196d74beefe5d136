"""A session's logits processors (`core.logits_processors.Processors`) on the wire (LogitsProcessors,
VerifyOpen.processors): the gateway's clients send them, the verifier service reads them."""

from __future__ import annotations

from core.logits_processors import NONE, Processors
from protos.specdec.v1 import common_pb2


def processors_to_wire(p: Processors) -> common_pb2.LogitsProcessors:
    message = common_pb2.LogitsProcessors(
        repetition_penalty=p.repetition_penalty, no_repeat_ngram_size=p.no_repeat_ngram_size,
        encoder_no_repeat_ngram_size=p.encoder_no_repeat_ngram_size,
        bad_words_ids=[common_pb2.TokenSequence(ids=ids) for ids in p.bad_words_ids],
        min_length=p.min_length, min_new_tokens=p.min_new_tokens, max_length=p.max_length,
        suppress_tokens=p.suppress_tokens, begin_suppress_tokens=p.begin_suppress_tokens, begin_index=p.begin_index,
        logprob_space=p.logprob_space,
    )
    if p.forced_bos_token_id != NONE:
        message.forced_bos_token_id = p.forced_bos_token_id
    if p.forced_eos_token_id != NONE:
        message.forced_eos_token_id = p.forced_eos_token_id
    return message


def processors_from_wire(m: common_pb2.LogitsProcessors) -> Processors:
    """The message's processors (zero values off; the caller checks the ids against its vocabulary)."""
    return Processors(
        repetition_penalty=m.repetition_penalty or 1.0, no_repeat_ngram_size=m.no_repeat_ngram_size,
        encoder_no_repeat_ngram_size=m.encoder_no_repeat_ngram_size,
        bad_words_ids=tuple(tuple(seq.ids) for seq in m.bad_words_ids), min_length=m.min_length,
        min_new_tokens=m.min_new_tokens,
        forced_bos_token_id=m.forced_bos_token_id if m.HasField("forced_bos_token_id") else NONE,
        forced_eos_token_id=m.forced_eos_token_id if m.HasField("forced_eos_token_id") else NONE,
        max_length=m.max_length, suppress_tokens=tuple(m.suppress_tokens),
        begin_suppress_tokens=tuple(m.begin_suppress_tokens), begin_index=m.begin_index or 1,
        logprob_space=m.logprob_space,
    )
