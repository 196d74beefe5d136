"""UA-GEC sentence pairs (source = erroneous, target = corrected) and their cached jsonl files.

Splits: `valid` is carved from the ua-gec train partition by a hash of the document id (so a
document's sentences never straddle train and valid, and the split does not depend on package
order; documents annotated twice share their doc id, so both copies land on the same side);
`test` is the ua-gec test partition, used only by the benchmark (`load_test_set`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from seq2seq_models.tokenizer import Tokenizer

VALID_PERCENT = 5
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class TextPair:
    doc_id: str
    index: int  # sentence number inside the document
    source: str
    target: str
    annotator: int = 0  # ua-gec has some documents annotated twice (every test document)


@dataclass(frozen=True)
class TestItem:
    doc_id: str
    index: int
    source: str
    references: list[str]  # one per annotator


@dataclass(frozen=True)
class IdPair:
    source: list[int]  # without EOS
    target: list[int]  # without BOS/EOS


def prepare_text_splits(data_dir: str | Path, max_pairs: int | None = None) -> dict[str, Path]:
    """Write train/valid/test text pairs as jsonl under `data_dir` (skipped when present).

    `max_pairs` keeps the first pairs of each split (smoke runs); the valid and test splits get a
    proportional share so that they stay non-empty but small.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: data_dir / f"{name}.text.jsonl" for name in ("train", "valid", "test")}
    if all(p.is_file() for p in paths.values()):
        return paths
    train, valid = split_train_valid(iter_pairs("train"))
    test = list(iter_pairs("test"))
    if max_pairs is not None:
        share = max(8, max_pairs // 10)
        train, valid, test = train[:max_pairs], valid[:share], test[:share]
    for name, pairs in (("train", train), ("valid", valid), ("test", test)):
        write_jsonl(paths[name], (asdict(p) for p in pairs))
    return paths


def iter_pairs(partition: str) -> Iterator[TextPair]:
    """Whitespace-normalised pairs of one ua-gec partition; misaligned documents and pairs with an
    empty side are skipped."""
    from ua_gec import Corpus  # optional dependency (extra `train`); imported only here

    for doc in Corpus(partition=partition):
        sources, targets = doc.source_sentences, doc.target_sentences
        if len(sources) != len(targets):
            continue
        for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
            s, t = normalise(s), normalise(t)
            if s and t:
                annotator = int(getattr(doc.meta, "annotator_id", 0) or 0)
                yield TextPair(doc_id=str(doc.doc_id), index=i, source=s, target=t, annotator=annotator)


def normalise(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def is_valid_doc(doc_id: str, percent: int = VALID_PERCENT) -> bool:
    # A stable hash (not Python's salted hash()) so the split is the same in every process.
    digest = hashlib.sha256(doc_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def split_train_valid(pairs: Iterable[TextPair], percent: int = VALID_PERCENT) -> tuple[list[TextPair], list[TextPair]]:
    train, valid = [], []
    for p in pairs:
        (valid if is_valid_doc(p.doc_id, percent) else train).append(p)
    return train, valid


def load_text_pairs(path: str | Path) -> list[TextPair]:
    return [TextPair(**row) for row in read_jsonl(path)]


def load_test_pairs(data_dir: str | Path | None = None) -> list[TextPair]:
    """The UA-GEC test split for evaluation: from a prepared data dir's cache, else from ua-gec."""
    if data_dir is not None and (Path(data_dir) / "test.text.jsonl").is_file():
        return load_text_pairs(Path(data_dir) / "test.text.jsonl")
    return list(iter_pairs("test"))


def load_test_set(data_dir: str | Path | None = None) -> list[TestItem]:
    """Test sentences with all their references: each ua-gec test document is annotated by two
    annotators, so its sentence pairs come twice. Grouped by (document, sentence, source text);
    in first-seen order."""
    return group_references(load_test_pairs(data_dir))


def group_references(pairs: Iterable[TextPair]) -> list[TestItem]:
    """Pairs grouped by (document, sentence, source text), one reference per annotator, in first-seen order."""
    groups: dict[tuple[str, int, str], list[str]] = {}
    for p in pairs:
        groups.setdefault((p.doc_id, p.index, p.source), []).append(p.target)
    return [TestItem(doc, i, src, refs) for (doc, i, src), refs in groups.items()]


def encode_pairs(pairs: Iterable[TextPair], tokenizer: Tokenizer, max_tokens: int) -> list[IdPair]:
    """Tokenise; drop pairs whose source + EOS or BOS + target exceeds `max_tokens`."""
    out = []
    for p in pairs:
        src, tgt = tokenizer.encode(p.source), tokenizer.encode(p.target)
        if src and tgt and len(src) + 1 <= max_tokens and len(tgt) + 1 <= max_tokens:
            out.append(IdPair(src, tgt))
    return out


def concatenate_pairs(
    pairs: Iterable[TextPair], tokenizer: Tokenizer, max_tokens: int, seed: int
) -> list[IdPair]:
    """Long training pairs made of consecutive sentences of one annotated document, joined by a space
    on both sides, so that a model whose sentence pairs are mostly short learns to correct (and copy)
    long inputs too. Each document's runs of consecutive sentences are cut into chunks of two or more
    sentences, each chunk up to a length drawn uniformly from max_tokens/4 .. max_tokens (source + EOS
    and BOS + target both within it), so that the lengths spread over the whole range.

    Why: a Transformer trained on sentences degrades past the lengths it saw often (Varis & Bojar,
    "Sequence Length is a Domain", 2021). The base verifier fine-tuned on UA-GEC's sentences alone
    corrected sentences of up to ~60 tokens well but fell into repetition past ~90, and those few
    long sentences weigh most in corpus GLEU."""
    rng = random.Random(seed)
    docs: dict[tuple[str, int], list[TextPair]] = {}
    for p in pairs:
        docs.setdefault((p.doc_id, p.annotator), []).append(p)

    def encoded(chunk: list[TextPair]) -> IdPair:
        return IdPair(tokenizer.encode(" ".join(p.source for p in chunk)),
                      tokenizer.encode(" ".join(p.target for p in chunk)))

    def fits(ids: IdPair, budget: int) -> bool:
        return max(len(ids.source), len(ids.target)) + 1 <= budget

    out: list[IdPair] = []
    for key in sorted(docs):
        chunk: list[TextPair] = []
        ids: IdPair | None = None  # the chunk's encoding, once it holds two sentences or more
        budget = rng.randint(max_tokens // 4, max_tokens)
        for p in sorted(docs[key], key=lambda p: p.index):
            grown = encoded([*chunk, p]) if chunk and p.index == chunk[-1].index + 1 else None
            if grown is None or not fits(grown, budget):
                if ids is not None:
                    out.append(ids)
                chunk, ids, budget = [p], None, rng.randint(max_tokens // 4, max_tokens)
            else:
                chunk, ids = [*chunk, p], grown
        if ids is not None:
            out.append(ids)
    return out


def write_id_pairs(path: str | Path, pairs: Iterable[IdPair]) -> None:
    write_jsonl(path, ({"source": p.source, "target": p.target} for p in pairs))


def load_id_pairs(path: str | Path) -> list[IdPair]:
    return [IdPair(row["source"], row["target"]) for row in read_jsonl(path)]


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Atomic: a half-written file never looks finished to a resumed pipeline."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
