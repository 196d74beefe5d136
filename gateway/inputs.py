"""The gateway's request input: sizes checked before any work, then tokenised off the event loop.

A request's bytes are bounded by gRPC itself (`[gateway] max_request_bytes`, refused as
RESOURCE_EXHAUSTED before the request is parsed). Then, before tokenising: the text's characters
(`max_text_chars`) and the number of input ids against the verifier's source limit, both O(1).
Only a text under the character limit is encoded, and on a worker thread, so one large text can
neither hold the event loop (every other client's requests) nor allocate millions of tokens.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from core.checks import check_length
from core.errors import invalid, out_of_range
from decoding.config import DecodingConfig
from protos.specdec.v1 import gateway_pb2
from seq2seq_models.tokenizer import Tokenizer


def check_input_size(request: gateway_pb2.GenerateRequest, max_text_chars: int, max_source_len: int) -> None:
    """The checks that cost nothing, made before any per-token work."""
    # Each read of a string field builds a new str (10 MB of copying for a 10 MB text): read it once.
    chars = len(request.text)
    if chars and request.input_ids:
        raise invalid("set either text or input_ids, not both")
    if chars > max_text_chars:
        raise out_of_range(f"text has {chars} characters; the limit is {max_text_chars}")
    check_length(request.input_ids, max_source_len, "input")


async def source_ids(
    request: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, pool: Executor, max_source_len: int
) -> list[int]:
    """The request's source ids: its input_ids, or its text encoded on `pool` (sizes checked first
    by `check_input_size`). The ids themselves are checked by `decode()`, on the worker."""
    if not request.text:
        return list(request.input_ids)
    ids = await asyncio.get_running_loop().run_in_executor(pool, tokenizer.encode, request.text)
    check_length(ids, max_source_len, "input")
    return ids


def forced_first_tokens(tokenizer: Any, target_lang: str, config: DecodingConfig) -> list[int]:
    """The output's forced first tokens: the code of the request's target language, or the model's
    default (an imported many-to-many checkpoint's forced_bos_token_id); INVALID_ARGUMENT for a
    code the model does not have."""
    try:
        first = tokenizer.first_tokens(target_lang)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if first and len(first) >= config.max_new_tokens:
        raise out_of_range(f"max_new_tokens {config.max_new_tokens} leaves no room after the forced first token")
    return first
