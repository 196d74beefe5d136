"""Per-request decoding parameters, their defaults and their bounds."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from core.checks import check_bounded
from core.errors import invalid
from core.logits_processors import NONE, Processors
from core.sampling import SamplingParams, check_sampling


class Mode(StrEnum):
    """The decoding modes; each is described once, by its module in `decoding.modes`."""

    AR = "ar"
    BEAM = "beam"
    IAD = "iad"
    GAD = "gad"
    GAD_PLUS_PLUS = "gad++"
    MJSD = "mjsd"
    SPECULATIVE = "spec"


class EarlyStopping(StrEnum):
    """When beam search ends (`generate()`'s early_stopping; decoding.policies.beam says exactly)."""

    TRUE = "true"  # once num_beams hypotheses are finished
    FALSE = "false"  # once no running hypothesis, scored at its present length, can beat a finished one
    NEVER = "never"  # likewise, scored at the length limit when length_penalty > 0

    @classmethod
    def _missing_(cls, value: object) -> EarlyStopping | None:
        # generate()'s own values are booleans: a config file's `early_stopping = true` means "true".
        if isinstance(value, bool):
            return cls.TRUE if value else cls.FALSE
        return None


def about(help_text: str, *, flag: str | None = None, wire: str | None = None) -> dict[str, Any]:
    """A DecodingConfig field's metadata, from which its CLI flag and wire field are derived:
    `flag` where the flag is not --name-with-dashes, `wire` where the gateway.proto DecodingConfig
    field is named otherwise."""
    return {"help": help_text, "flag": flag, "wire": wire}


@dataclass(frozen=True)
class DecodingConfig:
    mode: Mode = field(default=Mode.GAD, metadata=about("decoding mode (default: gad)"))
    k: int = field(default=10, metadata=about("GAD block size / IAD copy cap", wire="block_size"))
    beta: int = field(default=3, metadata=about("GAD++ top-beta", wire="top_beta"))
    tau: float = field(default=1.0, metadata=about("GAD++ log-prob gap"))
    num_beams: int = field(default=4, metadata=about("beam width (beam) / drafter beams (mjsd)", flag="--beams"))
    gamma: int = field(default=4, metadata=about("draft length (mjsd, spec)"))
    threshold: float = field(
        default=0.1, metadata=about("MJSD joint likelihood-ratio threshold in (0, 1]", wire="mjsd_threshold")
    )
    beam_delta: float | None = field(default=None, metadata=about("variable-width beam: absolute score threshold"))
    beam_max_candidates: int | None = field(default=None, metadata=about("variable-width beam: candidates per parent"))
    length_penalty: float = field(
        default=1.0, metadata=about("beam: a finished hypothesis scores its log-prob sum over its length ** this"),
    )
    early_stopping: EarlyStopping = field(
        default=EarlyStopping.FALSE, metadata=about("beam: when the search ends (true, false, never; as generate())"),
    )
    output_logprobs: bool = field(
        default=False,
        metadata=about("return each output token's log-prob (the verifier's, after the logits processors)"),
    )
    num_return_sequences: int = field(
        default=1, metadata=about("beam: hypotheses returned, best first, each with its score (<= beams)",
                                  flag="--n-best"),
    )
    temperature: float = field(default=1.0, metadata=about("sampling temperature (spec); 0 = argmax"))
    top_k: int = field(default=0, metadata=about("sampling top-k (spec); 0 = off"))
    top_p: float = field(default=1.0, metadata=about("sampling top-p (spec); 1 = off"))
    seed: int = field(default=0, metadata=about("sampling seed"))
    max_new_tokens: int = field(default=128, metadata=about("output length limit"))
    adaptive: bool = field(
        default=False,
        metadata=about("choose the block length per step for the load, up to k (gad, gad++, iad)", wire="adaptive_k"),
    )
    # Overlap and pre-verify: off by default, because adaptive requests cannot pre-verify (they choose
    # each block's length before drafting it), and with both on by default adaptive GAD at one client
    # fell behind fixed-k GAD (BENCHMARKS.md, "Overlapped drafting and pre-verify: notes"). They are
    # held back while other requests decode (decoding.decode.AHEAD_MAX_IN_FLIGHT).
    overlap: bool = field(
        default=False,
        metadata=about("draft the next block while the verifier verifies this one (gad, gad++, mjsd)"),
    )
    preverify: bool = field(
        default=False,
        metadata=about("after a cut block, check the next block's first position with the verifier while drafting it "
                       "(gad, gad++)"),
    )
    # generate()'s logits processors (core.logits_processors), every mode: lengths count the decoder
    # input as generate()'s do (the start token, then the output).
    repetition_penalty: float = field(
        default=1.0,
        metadata=about("scale the scores of tokens already in the output (> 1 discourages them; 1e-30 to 1e30)"),
    )
    no_repeat_ngram_size: int = field(default=0, metadata=about("never repeat an n-gram of the output this long"))
    encoder_no_repeat_ngram_size: int = field(
        default=0, metadata=about("never take an n-gram of the input this long into the output"),
    )
    bad_words_ids: tuple[tuple[int, ...], ...] = field(
        default=(), metadata=about("token sequences never to emit: ids by spaces or commas, sequences by ;"),
    )
    min_length: int = field(default=0, metadata=about("no EOS before the decoder input is this long (start token in)"))
    min_new_tokens: int = field(default=0, metadata=about("no EOS before this many output tokens"))
    forced_eos_token_id: int | None = field(
        default=None, metadata=about("the token forced at the length limit's last place (an EOS)"),
    )
    suppress_tokens: tuple[int, ...] = field(default=(), metadata=about("tokens never to emit (ids)"))
    begin_suppress_tokens: tuple[int, ...] = field(
        default=(), metadata=about("tokens never to emit first (after any forced first tokens)"),
    )

    def __post_init__(self) -> None:
        # Token lists arrive as lists (a config file, the Python API, the wire): held as tuples.
        for name, depth in ID_LISTS.items():
            object.__setattr__(self, name, parse_ids(name, getattr(self, name), depth))

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def with_overrides(self, overrides: dict[str, Any]) -> DecodingConfig:
        """A copy with the given fields replaced (None values are ignored)."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise invalid(f"unknown decoding parameters: {sorted(unknown)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if "mode" in given:
            given["mode"] = parse_mode(given["mode"])
        for name, kind in CHOICES.items():
            if name in given:
                given[name] = parse_choice(name, kind, given[name])
        return replace(self, **given)

    def processors(self, forced_first: int = 0) -> Processors:
        """The session's logits processors (`core.logits_processors`) for a request whose output
        starts with `forced_first` forced tokens (a target language's code, a target prefix):
        begin_suppress_tokens apply after them. Beam search of width > 1 processes log-probs."""
        return Processors(
            repetition_penalty=self.repetition_penalty, no_repeat_ngram_size=self.no_repeat_ngram_size,
            encoder_no_repeat_ngram_size=self.encoder_no_repeat_ngram_size, bad_words_ids=self.bad_words_ids,
            min_length=self.min_length, min_new_tokens=self.min_new_tokens,
            forced_eos_token_id=NONE if self.forced_eos_token_id is None else self.forced_eos_token_id,
            max_length=self.max_new_tokens + 1, suppress_tokens=self.suppress_tokens,
            begin_suppress_tokens=self.begin_suppress_tokens, begin_index=1 + forced_first,
            logprob_space=self.mode == Mode.BEAM and self.num_beams > 1,
        )


@dataclass(frozen=True)
class DecodingLimits:
    max_k: int = 64
    max_beta: int = 64
    max_beams: int = 16
    max_gamma: int = 32
    max_new_tokens: int = 256


def changed_fields(config: DecodingConfig) -> dict[str, Any]:
    """The fields of `config` that differ from DecodingConfig's own defaults."""
    base = DecodingConfig()
    return {f.name: getattr(config, f.name) for f in fields(config) if getattr(config, f.name) != getattr(base, f.name)}


def layered_defaults(*layers: Mapping[str, Any]) -> DecodingConfig:
    """DecodingConfig's own defaults under each layer in turn (later layers win): a bundle's decoding
    defaults, then a door's configured defaults ([defaults], the Python API's)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    return DecodingConfig().with_overrides(merged)


def cli_flag(f: Field) -> str:
    """The command-line flag of a DecodingConfig field (`specdec decode`, `specdec generate`)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def wire_name(f: Field) -> str:
    """The name of a DecodingConfig field in gateway.proto's DecodingConfig message."""
    return f.metadata.get("wire") or f.name


# The fields whose values are one of a few names (besides the mode): field -> its enum.
CHOICES: dict[str, type[StrEnum]] = {"early_stopping": EarlyStopping}


# The fields holding token ids, and how deep: 1 a list of ids, 2 a list of id sequences.
ID_LISTS = {"bad_words_ids": 2, "suppress_tokens": 1, "begin_suppress_tokens": 1}


def parse_ids(name: str, value: Any, depth: int) -> tuple:
    """Token ids as tuples: from a list (of lists), or a string of ids separated by spaces or
    commas, sequences by ";" (the CLI's and KServe's form); INVALID_ARGUMENT naming the field."""
    try:
        if isinstance(value, str):
            groups = [g for g in value.split(";") if g.strip()] if depth == 2 else [value]
            value = [[int(t) for t in g.replace(",", " ").split()] for g in groups]
            return tuple(map(tuple, value)) if depth == 2 else tuple(value[0])
        if depth == 2:
            return tuple(tuple(int(t) for t in seq) for seq in value)
        return tuple(int(t) for t in value)
    except (TypeError, ValueError):
        form = "sequences of token ids" if depth == 2 else "token ids"
        raise invalid(f"{name} must be {form}, got {str(value)[:80]!r}") from None


def parse_choice(name: str, kind: type[StrEnum], value: Any) -> Any:
    """`value` as a member of `kind`, or INVALID_ARGUMENT naming the field and its choices."""
    try:
        return kind(value.lower() if isinstance(value, str) else value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise invalid(f"unknown {name} {value!r}; choose one of {choices}") from None


def parse_mode(value: str | Mode) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        choices = ", ".join(m.value for m in Mode)
        raise invalid(f"unknown mode {value!r}; choose one of {choices}") from None


def validate(
    cfg: DecodingConfig, limits: DecodingLimits, max_target_len: int, vocab_size: int | None = None
) -> None:
    """Raise INVALID_ARGUMENT for malformed values, OUT_OF_RANGE for values over a limit. Every
    count a client controls has a ceiling here; top_k's is the vocabulary (when given)."""
    check_bounded("k", cfg.k, 1, limits.max_k)
    check_bounded("beta", cfg.beta, 1, limits.max_beta)
    check_bounded("num_beams", cfg.num_beams, 1, limits.max_beams)
    check_bounded("gamma", cfg.gamma, 1, limits.max_gamma)
    check_bounded("max_new_tokens", cfg.max_new_tokens, 1, min(limits.max_new_tokens, max_target_len))
    if not (math.isfinite(cfg.tau) and cfg.tau >= 0):
        raise invalid(f"tau must be a finite number >= 0, got {cfg.tau}")
    if not (0 < cfg.threshold <= 1):
        raise invalid(f"threshold must be in (0, 1], got {cfg.threshold}")
    if cfg.beam_delta is not None and not cfg.beam_delta >= 0:
        raise invalid(f"beam_delta must be >= 0, got {cfg.beam_delta}")
    if cfg.beam_max_candidates is not None and cfg.beam_max_candidates < 1:
        raise invalid(f"beam_max_candidates must be >= 1, got {cfg.beam_max_candidates}")
    if not math.isfinite(cfg.length_penalty):
        raise invalid(f"length_penalty must be a finite number, got {cfg.length_penalty}")
    if not 1 <= cfg.num_return_sequences <= cfg.num_beams:
        raise invalid(f"num_return_sequences must be in 1..num_beams ({cfg.num_beams}), got {cfg.num_return_sequences}")
    check_sampling(cfg.sampling, vocab_size)
    try:
        cfg.processors().check(vocab_size if vocab_size is not None else 2**31)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if cfg.seed < 0:
        raise invalid(f"seed must be >= 0, got {cfg.seed}")


