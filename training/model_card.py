"""MODEL_CARD.md for a trained bundle, filled from the run's recorded results."""

from __future__ import annotations

from typing import Any

TEMPLATE = """# {name}: speculative-decoding models for Ukrainian grammatical error correction

Three encoder-decoder Transformers sharing one SentencePiece tokenizer ({vocab} pieces, unigram):

| role | use | layers (enc+dec) | width | heads | ffn | parameters | valid loss | valid ppl | valid token acc. |
|---|---|---|---|---|---|---|---|---|---|
{rows}

- **verifier**: {verifier_recipe}
- **nar_drafter**: NAR block drafter (BOS + prefix, then k <= {k_max} `<mask>` tokens attending to
  the prefix and the whole block), trained with glancing (GLAT, ratio {glat}) on
  sequence-level-distilled targets (the verifier's {distill_search} outputs on the training sources).
  Its validation scores are on distilled targets, block length {k_max}.{nar_init}
- **ar_drafter**: small AR drafter for MJSD / speculative sampling, on the same distilled targets.

## Data

UA-GEC (`ua-gec` package, {ua_gec_version}), licence **CC-BY-4.0**
(Syvokon et al., "UA-GEC: Grammatical Error Correction and Fluency Corpus for the Ukrainian
Language"). Source = the annotated text with its errors, target = the corrected text, aligned
sentence by sentence; whitespace normalised; pairs longer than {max_tokens} tokens dropped.

| split | from | pairs |
|---|---|---|
| train | ua-gec train, documents whose sha256(doc_id) % 100 >= 5 | {n_train} |
| valid | ua-gec train, the other documents (5%) | {n_valid} |
| test | ua-gec test (evaluation only, never trained on) | {n_test} |

Distilled training targets: {n_distilled} pairs.
{synthetic}
## How it was made

```
{command}
```

Preset `{preset}`, seed {seed}, device {device}, torch {torch_version}, {finished}.
Optimiser AdamW (betas 0.9/0.98, weight decay 0.01), inverse-square-root schedule with warm-up,
token-based batches by length buckets, gradient clipping at 1.0. Steps per role:
{steps}. Weights stored in {weights_dtype} (loaded as float32).

Hardware: {hardware}. Training forward: {precision} (weights, optimiser state and evaluation
in float32). Wall time per stage (summed over interrupted and resumed runs):
{stage_times}.

## Licence

Weights: Apache-2.0 (this repository). Training data: UA-GEC, CC-BY-4.0; cite the UA-GEC paper
when you use these models.

## Limitations

Small models trained on about 30k sentence pairs: they fix frequent spelling, punctuation and
agreement errors and copy the rest. They are meant for measuring decoding speed-ups (IAD, GAD,
GAD++, MJSD), not as a production grammar checker.
"""


SYNTHETIC = """
Synthetic pre-training pairs (`training/synthetic.py`): the {clean_sentences} unique corrected
training sentences, each corrupted {copies} times with the errors UA-GEC annotates, at the rates
counted in its training documents ({annotated_edits} edits in {annotated_words} words of source
text): the corrections reversed (a comma put back is a comma left out, "в" corrected from "у" is
"в" written as "у"), text the corrections deleted put back, one-word corrections that change only
an ending turned into ending rules that reach words the corpus never corrected, and for spelling
the letter substitutions the corrections undid plus typing slips (deletion, doubling,
transposition). Edits per type are Poisson with the type's rate per word times the sentence's
length; {changed:.0%} of the pairs differ from their clean side (UA-GEC's own training pairs:
about half). {pairs} pairs. The most frequent types, edits per 100 words: {top_rates}.
"""


def render_model_card(info: dict[str, Any]) -> str:
    rows = [role_row(role, r) for role, r in info["roles"].items()]
    steps = ", ".join(f"{role} {r['steps']}" for role, r in info["roles"].items())
    synthetic = info.get("synthetic") or {}
    if synthetic.get("pairs"):
        pretrain = info["pretrain"]
        steps = f"verifier pre-training {pretrain['steps']}, {steps}"
        recipe = (f"AR model pre-trained with teacher forcing on the synthetic pairs and the real ones "
                  f"({pretrain['steps']} steps; valid loss {pretrain['valid_loss']:.3f}), then fine-tuned from "
                  f"those weights on the real pairs alone (label smoothing 0.1).")
        rates = sorted(synthetic["rates"].items(), key=lambda kv: -kv[1])[:6]
        synthetic_text = SYNTHETIC.format(
            copies=info["synthetic_copies"], top_rates=", ".join(f"{t} {100 * r:.2f}" for t, r in rates),
            **{k: synthetic[k] for k in ("clean_sentences", "annotated_edits", "annotated_words", "changed", "pairs")},
        )
    else:
        recipe = "AR model trained with teacher forcing on the references (label smoothing 0.1)."
        synthetic_text = ""
    concat = info.get("concat") or {}
    if concat.get("pairs"):
        recipe += (f" Its fine-tuning pairs include {concat['pairs']} long ones: two or more consecutive "
                   f"sentences of a document joined, up to {concat['max_tokens']} tokens (median "
                   f"{concat['median_source_tokens']} source tokens), so that long inputs are ones it has been "
                   f"trained on.")
    average = info["roles"]["verifier"].get("average")
    if average and average["kept"]:
        recipe += (f" The shipped weights are the average of the weights at steps "
                   f"{', '.join(map(str, average['steps']))} (valid loss {average['valid_loss']:.3f}, below every "
                   f"single evaluated step's).")
    search = "greedy" if info["beams"] == 1 else f"beam-{info['beams']}"
    nar_init = ""
    if info.get("nar_from_ar_drafter"):
        nar_init = ("\n  It started from the AR drafter's best weights (the AR-to-NAR transfer of Guo et al. "
                    "2020), each AR layer filling a run of neighbouring layers of its deeper stacks, so that its "
                    "source representations and cross-attention start aligned.")
    stage_times = ", ".join(f"{stage} {_duration(seconds)}" for stage, seconds in info["stage_seconds"].items())
    rendered = ("roles", "synthetic", "pretrain", "concat", "stage_seconds", "nar_from_ar_drafter")
    fields = {k: v for k, v in info.items() if k not in rendered}
    return TEMPLATE.format(rows="\n".join(rows), steps=steps, distill_search=search, verifier_recipe=recipe,
                           synthetic=synthetic_text, stage_times=stage_times, nar_init=nar_init, **fields)


def role_row(role: str, r: dict[str, Any]) -> str:
    """The card's table row for one role: its shape, size and validation scores."""
    a = r["architecture"]
    return (
        f"| {role} | {_USES[role]} | {a['encoder_layers']}+{a['decoder_layers']} | {a['d_model']} | {a['n_heads']} "
        f"| {a['ffn_dim']} | {r['params'] / 1e6:.2f}M | {r['valid_loss']:.3f} | {r['valid_ppl']:.2f} "
        f"| {r['valid_acc']:.3f} |"
    )


_USES = {"verifier": "AR verifier", "nar_drafter": "GAD / GAD++ drafter", "ar_drafter": "MJSD / spec. sampling"}


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
