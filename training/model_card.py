"""MODEL_CARD.md for a trained bundle, filled from the run's recorded results."""

from __future__ import annotations

from typing import Any

TEMPLATE = """# {name}: speculative-decoding models for Ukrainian grammatical error correction

Three encoder-decoder Transformers sharing one SentencePiece tokenizer ({vocab} pieces, unigram):

| role | use | layers (enc+dec) | width | heads | ffn | parameters | valid loss | valid ppl | valid token acc. |
|---|---|---|---|---|---|---|---|---|---|
{rows}

- **verifier**: AR model trained with teacher forcing on the references (label smoothing 0.1).
- **nar_drafter**: NAR block drafter (BOS + prefix, then k <= {k_max} `<mask>` tokens attending to
  the prefix and the whole block), trained with glancing (GLAT, ratio {glat}) on
  sequence-level-distilled targets (the verifier's {distill_search} outputs on the training sources).
  Its validation scores are on distilled targets, block length {k_max}.
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

## How it was made

```
{command}
```

Preset `{preset}`, seed {seed}, device {device}, torch {torch_version}, {finished}.
Optimiser AdamW (betas 0.9/0.98, weight decay 0.01), inverse-square-root schedule with warm-up,
token-based batches by length buckets, gradient clipping at 1.0. Steps per role:
{steps}.

## Licence

Weights: Apache-2.0 (this repository). Training data: UA-GEC, CC-BY-4.0; cite the UA-GEC paper
when you use these models.

## Limitations

Small models trained on about 30k sentence pairs: they fix frequent spelling, punctuation and
agreement errors and copy the rest. They are meant for measuring decoding speed-ups (IAD, GAD,
GAD++, MJSD), not as a production grammar checker.
"""


def render_model_card(info: dict[str, Any]) -> str:
    rows = []
    uses = {"verifier": "AR verifier", "nar_drafter": "GAD / GAD++ drafter", "ar_drafter": "MJSD / spec. sampling"}
    for role, r in info["roles"].items():
        a = r["architecture"]
        rows.append(
            f"| {role} | {uses[role]} | {a['encoder_layers']}+{a['decoder_layers']} | {a['d_model']} | {a['n_heads']} "
            f"| {a['ffn_dim']} | {r['params'] / 1e6:.2f}M | {r['valid_loss']:.3f} | {r['valid_ppl']:.2f} "
            f"| {r['valid_acc']:.3f} |"
        )
    steps = ", ".join(f"{role} {r['steps']}" for role, r in info["roles"].items())
    search = "greedy" if info["beams"] == 1 else f"beam-{info['beams']}"
    fields = {k: v for k, v in info.items() if k != "roles"}
    return TEMPLATE.format(rows="\n".join(rows), steps=steps, distill_search=search, **fields)
