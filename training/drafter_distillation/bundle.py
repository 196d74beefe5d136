"""The bundle `specdec distill` writes: a copy of the old one, the new drafters added, the verifier's
tokenizer and special ids kept, and a MODEL_CARD.md section saying how the drafters were made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from training.drafter_distillation.work import duration

CARD_FILE = "MODEL_CARD.md"

SECTION = """
## Distilled drafters (`specdec distill`)

Sequence-level knowledge distillation: the verifier decoded {lines} source lines of `{file}`
(sha256 `{sha256_short}`{dropped}) greedily{first}, and the drafters learnt its outputs: {split}.
Labelling took {labelling}.

| role | use | layers (enc+dec) | width | heads | ffn | parameters | steps | epochs | valid loss | valid acc. | time |
|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

{notes}
Device {device} ({hardware}), torch {torch_version}.

```
{command}
```
"""

_USES = {"nar_drafter": "GAD / GAD++ drafter", "ar_drafter": "MJSD / spec. sampling drafter"}


def write_distilled_bundle(src: Path, out: Path, drafters: dict[str, Any], info: dict[str, Any],
                           name: str | None = None) -> Path:
    """Write `out`: the bundle at `src` with `drafters` (role -> model) added or replaced, its
    config's metadata and MODEL_CARD.md extended with `info`. Written beside `out` and renamed, so
    an interrupted write leaves no half bundle."""
    from seq2seq_models.bundle import CONFIG_FILE, TOKENIZER_FILE, load_bundle, save_bundle, save_imported_bundle

    config = json.loads((src / CONFIG_FILE).read_text())
    old = load_bundle(src)
    models = {role: old.models[role] for role in old.models if role not in drafters} | drafters
    metadata = {**config.get("metadata", {}), "distill": _metadata(info)}
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    tokenizer = config["tokenizer"]
    bundle_name = name or config["name"]
    if tokenizer.get("kind", "sentencepiece") == "sentencepiece":  # the project's own bundles
        dtype = config["models"]["verifier"].get("dtype", "float32")
        save_bundle(tmp, (src / TOKENIZER_FILE).read_bytes(), models, bundle_name, metadata, weights_dtype=dtype)
    else:
        spec = None if tokenizer["kind"] == "none" else {k: v for k, v in tokenizer.items() if k != "fingerprint"}
        save_imported_bundle(tmp, models, bundle_name, spec, metadata)
    card = tmp / CARD_FILE
    before = card.read_text() if card.is_file() else f"# {bundle_name}\n"
    card.write_text(before.rstrip("\n") + "\n" + render_section(info))
    if out.exists():  # an empty directory (distill refuses a non-empty one)
        out.rmdir()
    tmp.replace(out)
    return out


def render_section(info: dict[str, Any]) -> str:
    """The MODEL_CARD.md section for `info` (`run.distill`'s record of the run)."""
    s = info["sources"]
    rows = [_row(role, r) for role, r in info["roles"].items()]
    dropped = f"; {s['dropped_too_long']} longer than the verifier takes left out" if s["dropped_too_long"] else ""
    first = f" after the forced first token {s['first_tokens'][0]}" if s.get("first_tokens") else ""
    if s["valid_pairs"] == s["labelled"]:
        split = f"{s['labelled']} pairs, too few to hold any out (validated on the training pairs)"
    else:
        split = (f"{s['train_pairs']} pairs trained on, {s['valid_pairs']} (every {s['valid_every']}th) held out for "
                 f"validation")
    notes = []
    for role, r in info["roles"].items():
        note = f"- **{role}**: token embeddings {r['embeddings']}, rescaled to the drafter's initial scale."
        if r.get("k_max"):
            note += (f" Trained on blocks of 1 to {r['k_max']} masks after a random prefix of the verifier's output, "
                     f"with glancing (ratio {r['glat']}); its validation scores are on blocks of {r['k_max']}.")
        notes.append(note)
    return SECTION.format(
        lines=s["lines"], file=s["file"], sha256_short=s["sha256"][:16], dropped=dropped, split=split, first=first,
        labelling=duration(s["labelling_seconds"]), rows="\n".join(rows), notes="\n".join(notes) + "\n",
        device=info["device"], hardware=info["hardware"], torch_version=info["torch_version"],
        command=info["command"],
    )


def _row(role: str, r: dict[str, Any]) -> str:
    a = r["architecture"]
    return (f"| {role} | {_USES[role]} | {a['encoder_layers']}+{a['decoder_layers']} | {a['d_model']} | "
            f"{a['n_heads']} | {a['ffn_dim']} | {r['params'] / 1e6:.2f}M | {r['steps']} | {r['epochs']:.1f} | "
            f"{r['valid_loss']:.3f} | {r['valid_acc']:.3f} | {duration(r['seconds'])} |")


def _metadata(info: dict[str, Any]) -> dict[str, Any]:
    """The run's record for config.json: everything but the architectures (the models' entries have them)."""
    roles = {role: {k: v for k, v in r.items() if k != "architecture"} for role, r in info["roles"].items()}
    return {**{k: v for k, v in info.items() if k != "roles"}, "roles": roles}


