"""A checkpoint's generation settings as the bundle's decoding defaults.

`generate()` decodes with the checkpoint's `generation_config` in force; so does specdec: every
setting it honours becomes a default of the bundle (`decoding.config.DecodingConfig` field names),
which each door applies under its own defaults and each request's overrides. What it does not honour
is reported, with the reason, when the bundle is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# generate()'s setting -> the DecodingConfig field that honours it.
TAKEN = {
    "repetition_penalty": "repetition_penalty",
    "no_repeat_ngram_size": "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size": "encoder_no_repeat_ngram_size",
    "bad_words_ids": "bad_words_ids",
    "min_length": "min_length",
    "min_new_tokens": "min_new_tokens",
    "forced_eos_token_id": "forced_eos_token_id",
    "suppress_tokens": "suppress_tokens",
    "begin_suppress_tokens": "begin_suppress_tokens",
    "num_beams": "num_beams",
    "length_penalty": "length_penalty",
    "early_stopping": "early_stopping",
    "num_return_sequences": "num_return_sequences",
    "max_new_tokens": "max_new_tokens",
}
# Settings that are not decoding defaults but the model's own: its token ids (read into the bundle's
# special ids and tokenizer), the forced first token (the default target language), bookkeeping.
MODEL_OWN = {
    "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_bos_token_id",
    "transformers_version", "_from_model_config", "is_assistant", "max_length",
}
# Settings that change how generate() runs or what else it returns, never the tokens: nothing to say.
NO_EFFECT = {
    "use_cache", "output_attentions", "output_hidden_states", "output_logits", "cache_implementation",
    "cache_config", "return_legacy_cache", "low_memory", "compile_config", "disable_compile",
    "prefill_chunk_size", "assistant_confidence_threshold",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_early_exit", "assistant_lookbehind",
    "target_lookbehind", "prompt_lookup_num_tokens", "max_matching_ngram_size", "generation_kwargs",
}
# Settings specdec does not honour, and why.
SAMPLING = "sampling: specdec decodes deterministically unless a request asks for mode spec"
NOT_HONOURED = {
    "do_sample": SAMPLING, "temperature": SAMPLING, "top_k": SAMPLING, "top_p": SAMPLING, "min_p": SAMPLING,
    "typical_p": SAMPLING, "epsilon_cutoff": SAMPLING, "eta_cutoff": SAMPLING,
    "num_beam_groups": "group (diverse) beam search is not supported",
    "diversity_penalty": "group (diverse) beam search is not supported",
    "penalty_alpha": "contrastive search is not supported",
    "renormalize_logits": "the log-probs are always those of the processed scores, renormalised",
    "exponential_decay_length_penalty": "not supported",
    "sequence_bias": "not supported",
    "force_words_ids": "constrained beam search is not supported",
    "constraints": "constrained beam search is not supported",
    "guidance_scale": "not supported",
    "output_scores": "a request asks for log-probs (output_logprobs)",
    "return_dict_in_generate": "a request's answer has its own shape",
    "max_time": "a request's deadline bounds its time",
    "stop_strings": "not supported",
    "dola_layers": "DoLa decoding is not supported",
    "token_healing": "not supported",
}


@dataclass
class GenerationDefaults:
    """The decoding defaults taken from a checkpoint, and the settings left with the reason."""

    defaults: dict[str, Any] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """What `specdec import-hf` prints about them."""
        out = []
        if self.defaults:
            taken = ", ".join(f"{k}={_shown(v)}" for k, v in self.defaults.items())
            out.append(f"decoding defaults from the checkpoint's generation config: {taken}")
        for name, why in self.ignored.items():
            out.append(f"generation setting {name} not taken: {why}")
        return out


def generation_defaults(generation_config: Any) -> GenerationDefaults:
    """The settings of a transformers `GenerationConfig` that differ from generate()'s own defaults,
    as decoding defaults (and those left, with why). max_length, which counts the decoder start
    token, becomes max_new_tokens (when max_new_tokens is not set itself)."""
    given = generation_config.to_diff_dict() if generation_config is not None else {}
    out = GenerationDefaults()
    for name, value in given.items():
        if value is None:
            continue
        if name in TAKEN:
            out.defaults[TAKEN[name]] = _plain(value)
        elif name in NOT_HONOURED:
            out.ignored[name] = NOT_HONOURED[name]
        elif name not in MODEL_OWN and name not in NO_EFFECT:
            out.ignored[name] = "not a setting specdec honours"
    max_length = given.get("max_length")
    if max_length and "max_new_tokens" not in out.defaults:
        out.defaults["max_new_tokens"] = int(max_length) - 1  # the decoder start token is the first place
    return out


def _plain(value: Any) -> Any:
    """A setting as JSON keeps it (lists of lists for the token sequences)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
