"""Where GAD's blocks end on UA-GEC: how often a block is accepted in full, where the others are cut,
and whether the drafter could have guessed the verifier's token there. It bounds what overlapped
drafting can hit (decoding.policies.overlap): a pre-draft is used only when its block is accepted in
full and the drafter's guess of the verifier's next token is right. A second table gives how a
block ends by how the block before it ended: cuts come in runs, which is where pre-verify pays.

    python bench/bench_gad_verdicts.py                 # prints the tables
    python bench/bench_gad_verdicts.py --write         # also replaces its section of BENCHMARKS.md

In-process on eager torch (the bundle's verifier and NAR drafter, float32): each sentence's greedy
output (which GAD's equals), then GAD k's blocks over it, each drafted after the whole output (as
before realigned drafts, decoding.policies.drafter_sync: these tables are what showed the need).
For each block that is not the last (the last ends at EOS or the length limit, and nothing is
pre-drafted after it): the accepted length j, and the rank of the verifier's token at j among the
drafter's scores there (rank 0: the drafter's own choice; for a block accepted in full, the
position after it, as the pre-draft's 1-token guess drafts it).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, write_section
from evaluation.loadtest import ua_gec_texts
from seq2seq_models.bundle import load_bundle
from seq2seq_models.transformer import Seq2SeqTransformer

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## GAD verdicts (what overlap can hit)"
RANKS = 5  # ranks from here up are counted together


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, ROOT)
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    bundle = load_bundle(args.bundle, roles=("verifier", "nar_drafter"))
    verifier, drafter = bundle.verifier.eval(), bundle.nar_drafter.eval()
    texts = ua_gec_texts(args.sentences, args.data_dir)
    counts: Counter[tuple[str, int]] = Counter()
    follows: Counter[tuple[str, str]] = Counter()  # (the block before's group, this block's group)
    blocks = 0
    for text in texts:
        src = torch.tensor([[*bundle.tokenizer.encode(text), verifier.config.eos_id]])
        before = "start"
        for verdict in _verdicts(verifier, drafter, src, args.k, args.max_new_tokens):
            blocks += 1
            counts[verdict] += 1
            follows[(before, _group(verdict[0]))] += 1
            before = _group(verdict[0])
    table = (_table(counts, blocks, args.k) + "\n\n" + _bound(counts, blocks) + "\n\n"
             + _follows_table(follows, args.k))
    print(table)
    if args.write:
        note = (f"Bundle: {Path(args.bundle).name}; the first {len(texts)} UA-GEC test sentences, GAD k={args.k}, "
                f"max_new_tokens {args.max_new_tokens}, in process (eager torch, float32), every block drafted "
                "after the whole output (no realigned drafts). Blocks: every block but "
                "a sentence's last. Rank: of the verifier's token among the drafter's scores at the position "
                "where the block was cut (0: the drafter's own choice; for a block accepted in full, the "
                "pre-draft's guess of the token after it).")
        write_section(args.output, SECTION, f"{machine_stamp()}\n\n{note}\n\n{table}")
    return 0


@torch.no_grad()
def _verdicts(verifier: Seq2SeqTransformer, drafter: Seq2SeqTransformer, src: torch.Tensor, k: int,
              max_new_tokens: int):
    """(kind, rank) for each block of GAD k over the greedy output but the last; kind is "full"
    (accepted in full) or "cut j" (accepted j < k tokens)."""
    output = _greedy(verifier, src, max_new_tokens)
    done = 0
    while True:
        room = min(k, max_new_tokens - done - 1)
        if room <= 0:
            return
        scores = _nar_scores(drafter, src, output[:done], room)
        draft = scores.argmax(-1).tolist()
        j = 0
        while j < room and done + j < len(output) and draft[j] == output[done + j]:
            j += 1
        if done + j >= len(output) - 1:  # the block reaches the output's end: the last one
            return
        truth = output[done + j]
        if j == room:  # the pre-draft's guess: a 1-token draft after the accepted block
            scores = _nar_scores(drafter, src, output[: done + j], 1)[0]
            yield "full", min(int((scores > scores[truth]).sum()), RANKS)
        else:
            yield f"cut {j}", min(int((scores[j] > scores[j][truth]).sum()), RANKS)
        done += j + 1


def _greedy(model: Seq2SeqTransformer, src: torch.Tensor, max_new_tokens: int) -> list[int]:
    cfg = model.config
    cache = model.start(src)
    hidden = model.extend(cache, torch.tensor([[cfg.bos_id]]))
    output: list[int] = []
    while len(output) < max_new_tokens:
        token = int(model.logits(hidden[0, -1]).argmax())
        output.append(token)
        if token == cfg.eos_id:
            break
        hidden = model.extend(cache, torch.tensor([[token]]))
    return output


def _nar_scores(model: Seq2SeqTransformer, src: torch.Tensor, prefix: list[int], k: int) -> torch.Tensor:
    """The NAR drafter's scores [k, V] for the k positions after `prefix` (the block it drafts)."""
    cfg = model.config
    cache = model.start(src)
    model.extend(cache, torch.tensor([[cfg.bos_id, *prefix]]))
    masks = torch.full((1, k), cfg.mask_id, dtype=torch.long)
    return model.logits(model.extend(cache, masks, bidirectional=True)[0])


def _table(counts: Counter[tuple[str, int]], blocks: int, k: int) -> str:
    """Rows: accepted in full, cut at the first token, cut later; cells: share of all blocks by rank."""
    groups = [("accepted in full", lambda kind: kind == "full"),
              (f"cut after 0 of {k}", lambda kind: kind == "cut 0"),
              (f"cut after 1 to {k - 1} of {k}", lambda kind: kind not in ("full", "cut 0"))]
    head = "| block | share of blocks | " + " | ".join(f"rank {r}" for r in range(RANKS)) + f" | rank {RANKS}+ |"
    lines = [head, "|---|---:|" + "---:|" * (RANKS + 1)]
    for label, member in groups:
        by_rank = [sum(n for (kind, rank), n in counts.items() if rank == r and member(kind)) for r in range(RANKS + 1)]
        lines.append(_row(label, by_rank, blocks))
    return "\n".join(lines) + f"\n\n{blocks} blocks (each sentence's last left out)."


def _bound(counts: Counter[tuple[str, int]], blocks: int) -> str:
    """What the table bounds: the hit rate of overlapped drafting, today's and with more guesses."""
    hits = counts[("full", 0)]
    second = counts[("cut 0", 1)]
    cut0 = sum(n for (kind, _), n in counts.items() if kind == "cut 0")
    far = counts[("cut 0", RANKS)]
    return (f"Overlapped drafting pre-drafts after the guess that a block is accepted in full and that the "
            f"verifier's next token is the drafter's own: at most {100 * hits / blocks:.1f}% of blocks can use "
            f"their pre-draft (the first row's rank 0). {100 * cut0 / blocks:.0f}% of the blocks are cut at their "
            f"first token, {100 * far / blocks:.0f}% with the verifier's token outside the drafter's top {RANKS}; a "
            f"second pre-draft, on a cut at the first token with the drafter's runner-up there, would add "
            f"{100 * second / blocks:.1f}% of blocks, for a second drafter row every time.")


def _group(kind: str) -> str:
    return "full" if kind == "full" else "cut 0" if kind == "cut 0" else "cut later"


def _follows_table(follows: Counter[tuple[str, str]], k: int) -> str:
    """How the next block ends, by how the block before it ended (the first block: after "start").
    Cuts come in runs: why pre-verify runs only after a cut block (decoding.policies.loop), and why
    GAD's drafts are realigned after one (decoding.policies.drafter_sync)."""
    names = {"start": "none (a sentence's first block)", "full": "accepted in full",
             "cut 0": f"cut after 0 of {k}", "cut later": f"cut after 1 to {k - 1} of {k}"}
    lines = ["| block before | blocks | next accepted in full | next cut after 0 | next cut later |",
             "|---|---:|---:|---:|---:|"]
    for before, label in names.items():
        total = sum(n for (b, _), n in follows.items() if b == before)
        if total:
            cells = " | ".join(f"{100 * follows[(before, g)] / total:.0f}%" for g in ("full", "cut 0", "cut later"))
            lines.append(f"| {label} | {total} | {cells} |")
    return "What follows a block:\n\n" + "\n".join(lines)


def _row(label: str, by_rank: list[int], blocks: int) -> str:
    total = sum(by_rank)
    cells = " | ".join(f"{100 * n / blocks:.1f}%" for n in by_rank)
    return f"| {label} | {100 * total / blocks:.1f}% | {cells} |"


if __name__ == "__main__":
    sys.exit(main())
