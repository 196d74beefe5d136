"""Text quality of a training run's verifier on the validation split (`specdec evaluate`): GLEU
against the references beside the uncorrected sources' GLEU, while the run goes on or after it.

    specdec evaluate --out runs/ua-gec-base --preset base [--weights verifier/best.pt]
                     [--groups 500] [--beams 1]

Validation loss says how well the verifier predicts the references token by token; it does not say
whether its own outputs improve the text. A verifier can lower its loss while falling into
repetition on long inputs (the first base run did, past ~90 output tokens), and corpus GLEU weighs
long sentences most. So this decodes `--groups` validation sentences (with all their annotators'
references), spread evenly over the split, and reports GLEU overall, on short and long sources, and
the outputs that look degenerate (`specdec evaluate` prints it as one JSON object).
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the models load only when a run is scored: the CLI parser stays fast
    from seq2seq_models.tokenizer import Tokenizer
    from seq2seq_models.transformer import Seq2SeqTransformer
    from training.data import TestItem

SHORT_SOURCE_TOKENS = 64  # the split point of the short/long report: about the median of the long pairs' halves


@dataclass(frozen=True)
class QualityReport:
    weights: str
    groups: int
    beams: int
    gleu: float
    source_gleu: float
    short_groups: int  # sources of at most SHORT_SOURCE_TOKENS tokens
    short_gleu: float | None
    short_source_gleu: float | None
    long_gleu: float | None
    long_source_gleu: float | None
    degenerate: int
    examples: list[dict[str, str]]  # the degenerate outputs (first few), to look at


class RunError(ValueError):
    """What is wrong with a training run's files for scoring, in one line."""


def load_run_verifier(out: Path, preset: str, weights: str | Path | None = None
                      ) -> tuple[Seq2SeqTransformer, Tokenizer, Path]:
    """The verifier of run directory `out` (its `preset`'s shape) with `weights` loaded (relative to
    `out` or absolute; default verifier/best.pt), its tokenizer, and the weights' path; a RunError
    when a file is missing, is not torch weights, or holds another model's."""
    from seq2seq_models.tokenizer import Tokenizer
    from seq2seq_models.transformer import Seq2SeqTransformer
    from training.checkpoint import load_checkpoint
    from training.presets import get_preset
    from training.tokenizer import TOKENIZER_FILE

    path = Path(weights) if weights else Path("verifier/best.pt")
    path = path if path.is_absolute() else out / path
    for needed in (path, out / "data" / TOKENIZER_FILE, out / "data" / "valid.text.jsonl"):
        if not needed.is_file():
            raise RunError(f"{needed} does not exist (has the run reached that stage?)")
    tokenizer = Tokenizer.load(out / "data" / TOKENIZER_FILE)
    model = Seq2SeqTransformer(get_preset(preset).model_config("verifier", tokenizer.vocab_size))
    try:
        state = load_checkpoint(path)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise RunError(f"{path} is not a file of torch weights ({type(exc).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a training checkpoint (checkpoint.pt): score the weights it is at
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = state if isinstance(state, dict) else {}
    found = {name: tuple(t.shape) for name, t in state.items() if hasattr(t, "shape")}
    wrong = sum(found.get(name) != shape for name, shape in expected.items())
    if wrong:
        raise RunError(f"{path} does not hold the weights of the {preset!r} preset's verifier ({wrong} of its "
                       f"{len(expected)} tensors missing or of another shape)")
    model.load_state_dict(state)
    return model, tokenizer, path


def evaluate_quality(model: Seq2SeqTransformer, tokenizer: Tokenizer, items: Sequence[TestItem], beams: int = 1,
                     weights: str = "") -> QualityReport:
    """Decode every item's source (those over the model's source limit are left out) and score it."""
    import torch

    from evaluation.gec_metrics import gleu
    from seq2seq_models.batched_beam import beam_search_texts

    limit = model.config.max_len - 1  # room for the EOS the model appends
    encoded = [(item, ids) for item in items if 0 < len(ids := tokenizer.encode(item.source)) <= limit]
    if not encoded:
        raise ValueError("no validation source fits the verifier")
    with torch.no_grad():
        results = beam_search_texts(model, [ids for _, ids in encoded], num_beams=beams)
    hyps = [tokenizer.decode(r.tokens) for r in results]
    srcs = [item.source for item, _ in encoded]
    refs = [item.references for item, _ in encoded]
    short = [len(ids) <= SHORT_SOURCE_TOKENS for _, ids in encoded]
    degenerate = [i for i, ((_, ids), r) in enumerate(zip(encoded, results, strict=True))
                  if looks_degenerate(ids, r.tokens)]

    def subset(keep: bool) -> tuple[float | None, float | None]:
        idx = [i for i, s in enumerate(short) if s == keep]
        if not idx:
            return None, None
        pick = [srcs[i] for i in idx], [hyps[i] for i in idx], [refs[i] for i in idx]
        return round(gleu(pick[0], pick[1], pick[2]), 2), round(gleu(pick[0], pick[0], pick[2]), 2)

    (short_gleu, short_source), (long_gleu, long_source) = subset(True), subset(False)
    return QualityReport(
        weights=weights, groups=len(encoded), beams=beams, gleu=round(gleu(srcs, hyps, refs), 2),
        source_gleu=round(gleu(srcs, srcs, refs), 2), short_groups=sum(short), short_gleu=short_gleu,
        short_source_gleu=short_source, long_gleu=long_gleu, long_source_gleu=long_source,
        degenerate=len(degenerate), examples=[{"source": srcs[i], "output": hyps[i]} for i in degenerate[:5]],
    )


def validation_groups(path: Path) -> list[TestItem]:
    """Validation pairs grouped by (document, sentence, source), one reference per annotator, in
    file order (as the test split is grouped for `specdec bench`)."""
    from training.data import group_references, load_text_pairs

    return group_references(load_text_pairs(path))


def spread(items: Sequence[TestItem], n: int) -> list[TestItem]:
    """`n` items evenly spaced over the sequence (all of them when there are fewer): consecutive
    sentences share a document, so the first n would measure a few documents."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def looks_degenerate(source: Sequence[int], output: Sequence[int]) -> bool:
    """Repetition, the failure mode of an under-trained verifier on long inputs: an output much longer
    than its source, or one 4-gram of tokens four times or more where the source has it at most once."""
    if len(output) > 1.5 * len(source) + 10:
        return True
    grams = Counter(tuple(output[i : i + 4]) for i in range(len(output) - 3))
    if not grams:
        return False
    gram, count = grams.most_common(1)[0]
    in_source = sum(tuple(source[i : i + 4]) == gram for i in range(len(source) - 3))
    return count >= 4 and in_source <= 1
