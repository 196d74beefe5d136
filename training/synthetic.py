"""Synthetic UA-GEC-style errors: clean sentences corrupted with the edits the corpus annotates, at its rates.

The standard recipe for GEC with little annotated data (pre-train on synthetic pairs, fine-tune on
the real ones). `learn_error_model` reads the annotations of UA-GEC's training documents (never the
validation or test documents) and keeps, per error type (Punctuation, Spelling, G/Case, F/Style, ...):

- its rate: edits per word of source text;
- `replace`: the corrections it made, reversed: correct text -> the erroneous texts it replaced
  (a comma the writer left out is `"," -> ""`, "в" written as "у" is `"в" -> "у"`);
- `insert`: text the corrections deleted (an extra comma or word), reinserted anywhere;
- `suffix`: one-word corrections that change only an ending, as rules (correct ending -> wrong
  ending), which carry agreement and case errors over to words the corpus never corrected;
- for Spelling, the letter substitutions the corrections undid, and plain typing noise.

`corrupt` then draws, for each type, a Poisson number of edits for the sentence's length and applies
each at a random site where one of the type's edits fits. Sentences that draw no edit stay clean:
they teach the model to copy, as the corpus' own correct sentences do.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.data import normalise

# Spelling edits that are not a learnt substitution: one of these typing slips, in these proportions (%).
TYPO_WEIGHTS = Counter({"delete": 30, "double": 15, "transpose": 20, "substitute": 35})
MAX_SUFFIX = 4  # longest ending a suffix rule changes
MIN_STEM = 3  # letters a word keeps in front of a rule's ending
_TOKEN = re.compile(r"\w+(?:['’ʼ-]\w+)*|[^\w\s]", re.UNICODE)


@dataclass
class ErrorModel:
    words: int = 0  # words of annotated source text the rates were counted over
    counts: Counter[str] = field(default_factory=Counter)  # error type -> edits
    replace: dict[str, dict[str, Counter[str]]] = field(default_factory=lambda: defaultdict(_counters))
    insert: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    suffix: dict[str, Counter[tuple[str, str]]] = field(default_factory=lambda: defaultdict(Counter))
    letters: Counter[tuple[str, str]] = field(default_factory=Counter)  # (correct, written) letters
    _cache: dict[str, tuple[dict[str, int], dict[str, list[tuple[str, int]]]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def kinds(self, error_type: str) -> dict[str, int]:
        """How many of the type's corrections were of each kind of edit (a spelling error is a typo as
        often as a learnt replacement)."""
        return self._derived(error_type)[0]

    def endings(self, error_type: str) -> dict[str, list[tuple[str, int]]]:
        """The type's suffix rules by correct ending."""
        return self._derived(error_type)[1]

    def _derived(self, error_type: str) -> tuple[dict[str, int], dict[str, list[tuple[str, int]]]]:
        # Built once per type from the tables (which do not change once learnt or loaded): corrupting
        # a corpus asks for them at every edit.
        if error_type not in self._cache:
            kinds = {
                "replace": sum(sum(c.values()) for c in self.replace.get(error_type, {}).values()),
                "insert": sum(self.insert.get(error_type, Counter()).values()),
                "suffix": sum(self.suffix.get(error_type, Counter()).values()),
            }
            if error_type == "Spelling":
                kinds["typo"] = kinds["replace"]
            endings: dict[str, list[tuple[str, int]]] = defaultdict(list)
            for (correct, wrong), n in self.suffix.get(error_type, Counter()).items():
                endings[correct].append((wrong, n))
            self._cache[error_type] = (kinds, dict(endings))
        return self._cache[error_type]

    def rate(self, error_type: str) -> float:
        return self.counts[error_type] / max(self.words, 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "words": self.words,
            "counts": dict(self.counts),
            "replace": {t: {c: dict(e) for c, e in m.items()} for t, m in self.replace.items()},
            "insert": {t: dict(c) for t, c in self.insert.items()},
            "suffix": {t: [[a, b, n] for (a, b), n in c.items()] for t, c in self.suffix.items()},
            "letters": [[a, b, n] for (a, b), n in self.letters.items()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ErrorModel:
        model = cls(words=data["words"], counts=Counter(data["counts"]))
        for t, m in data["replace"].items():
            for correct, errors in m.items():
                model.replace[t][correct].update(errors)
        for t, c in data["insert"].items():
            model.insert[t].update(c)
        for t, rules in data["suffix"].items():
            model.suffix[t].update({(a, b): n for a, b, n in rules})
        model.letters.update({(a, b): n for a, b, n in data["letters"]})
        return model


def _counters() -> defaultdict[str, Counter[str]]:
    return defaultdict(Counter)


def learn_error_model(edits: Iterable[tuple[str, str, str]], words: int) -> ErrorModel:
    """An error model from annotated edits (error type, erroneous text, correct text) found in
    `words` words of source text."""
    model = ErrorModel(words=words)
    for error_type, wrong, correct in edits:
        if wrong == correct:
            continue
        model.counts[error_type] += 1
        if correct:
            model.replace[error_type][correct][wrong] += 1
        else:
            model.insert[error_type][wrong] += 1
        rule = _suffix_rule(correct, wrong)
        if rule is not None:
            model.suffix[error_type][rule] += 1
        if error_type == "Spelling" and len(wrong) == len(correct):
            diffs = [(c, w) for c, w in zip(correct, wrong, strict=True) if c != w]
            if len(diffs) == 1:
                model.letters[diffs[0]] += 1
    return model


def ua_gec_edits(partition: str = "train", keep_doc=None) -> tuple[list[tuple[str, str, str]], int]:
    """The annotated edits of a ua-gec partition's documents (those `keep_doc(doc_id)` accepts) and
    the words of their source text."""
    from ua_gec import Corpus  # optional dependency (extra `train`)

    edits, words = [], 0
    for doc in Corpus(partition=partition):
        if keep_doc is not None and not keep_doc(str(doc.doc_id)):
            continue
        words += len(doc.source.split())
        for ann in doc.annotated.get_annotations():
            error_type = str(ann.meta.get("error_type") or "Other")
            edits.append((error_type, ann.source_text, ann.top_suggestion or ""))
    return edits, words


def corrupt(sentence: str, model: ErrorModel, rng: random.Random, scale: float = 1.0) -> str:
    """`sentence` with a Poisson number of each error type's edits for its length (module docstring)."""
    tokens = _Tokens(sentence)
    n_words = len(sentence.split())
    types = sorted(model.counts)
    rng.shuffle(types)
    for error_type in types:
        for _ in range(_poisson(rng, model.rate(error_type) * n_words * scale)):
            _apply_one(tokens, error_type, model, rng)
    return normalise(tokens.text())


def synthetic_pairs(
    sentences: Sequence[str], model: ErrorModel, copies: int, seed: int, scale: float = 1.0
) -> list[tuple[str, str]]:
    """(corrupted, clean) pairs: each sentence `copies` times with its own draws; reproducible."""
    pairs = []
    for copy in range(copies):
        for i, clean in enumerate(sentences):
            rng = random.Random(f"{seed}:{copy}:{i}")
            pairs.append((corrupt(clean, model, rng, scale), clean))
    return pairs


def _apply_one(tokens: _Tokens, error_type: str, model: ErrorModel, rng: random.Random) -> bool:
    """One edit of `error_type` at a random site where one fits; False where none does. The kind of
    edit is drawn in the proportions the type's corrections had."""
    order = _weighted_order(rng, model.kinds(error_type))
    # The drawn kind first; the others where it finds no site.
    return any(getattr(_Edits, kind)(tokens, error_type, model, rng) for kind in order)


class _Edits:
    """The kinds of edit; each returns whether it found a site."""

    @staticmethod
    def replace(tokens: _Tokens, error_type: str, model: ErrorModel, rng: random.Random) -> bool:
        table = model.replace.get(error_type, {})
        sites = [(i, n) for n in (1, 2) for i in range(len(tokens) - n + 1) if tokens.span_text(i, n) in table]
        sites += [(i, 1) for i in range(len(tokens)) if tokens.word(i) and tokens.items[i][0].lower() in table
                  and tokens.items[i][0] not in table]
        if not sites:
            return False
        i, n = rng.choice(sites)
        original = tokens.span_text(i, n)
        key = original if original in table else original.lower()
        wrong = _draw(rng, table[key])
        if key != original and original[:1].isupper():
            wrong = wrong[:1].upper() + wrong[1:]
        tokens.replace(i, n, wrong)
        return True

    @staticmethod
    def insert(tokens: _Tokens, error_type: str, model: ErrorModel, rng: random.Random) -> bool:
        table = model.insert.get(error_type)
        if not table or len(tokens) < 2:
            return False
        extra = _draw(rng, table)
        # Punctuation goes after a word, as writers put it; a word goes in front of one.
        words = [i for i in range(len(tokens)) if tokens.word(i)]
        if not words:
            return False
        i = rng.choice(words)
        if extra[:1].isalnum():
            tokens.insert_before(i, extra)
        else:
            tokens.attach_after(i, extra)
        return True

    @staticmethod
    def suffix(tokens: _Tokens, error_type: str, model: ErrorModel, rng: random.Random) -> bool:
        by_ending = model.endings(error_type)
        if not by_ending:
            return False
        sites: list[tuple[int, tuple[str, str]]] = []
        weights: list[int] = []
        for i in range(len(tokens)):
            if not tokens.word(i):
                continue
            word = tokens.items[i][0]
            for cut in range(min(MAX_SUFFIX, len(word) - MIN_STEM) + 1):
                ending = word[len(word) - cut:]
                for wrong, n in by_ending.get(ending, ()):
                    sites.append((i, (ending, wrong)))
                    weights.append(n)
        if not sites:
            return False
        i, (correct, wrong) = rng.choices(sites, weights)[0]
        word = tokens.items[i][0]
        tokens.replace(i, 1, word[: len(word) - len(correct)] + wrong)
        return True

    @staticmethod
    def typo(tokens: _Tokens, error_type: str, model: ErrorModel, rng: random.Random) -> bool:
        words = [i for i in range(len(tokens)) if tokens.word(i) and len(tokens.items[i][0]) >= 3]
        if not words:
            return False
        i = rng.choice(words)
        tokens.replace(i, 1, _typo(tokens.items[i][0], model.letters, rng))
        return True


def _typo(word: str, letters: Counter[tuple[str, str]], rng: random.Random) -> str:
    kind = _draw(rng, TYPO_WEIGHTS)
    j = rng.randrange(len(word))
    if kind == "delete":
        return word[:j] + word[j + 1:]
    if kind == "double":
        return word[: j + 1] + word[j:]
    if kind == "transpose" and j + 1 < len(word):
        return word[:j] + word[j + 1] + word[j] + word[j + 2:]
    # A substitution the corpus saw for a letter of this word, else a neighbouring letter of the word.
    options = Counter({(c, w): n for (c, w), n in letters.items() if c in word})
    if options:
        correct, wrong = _draw(rng, options)
        positions = [p for p, ch in enumerate(word) if ch == correct]
        j = rng.choice(positions)
        return word[:j] + wrong + word[j + 1:]
    return word[:j] + word[rng.randrange(len(word))] + word[j + 1:]


class _Tokens:
    """A sentence as tokens (words, punctuation marks) with the whitespace before each, so that edits
    keep the rest of its spacing."""

    def __init__(self, sentence: str) -> None:
        self.items: list[list[str]] = []  # [token, whitespace before it]
        last = 0
        for m in _TOKEN.finditer(sentence):
            self.items.append([m.group(), sentence[last:m.start()]])
            last = m.end()
        self.tail = sentence[last:]

    def __len__(self) -> int:
        return len(self.items)

    def word(self, i: int) -> bool:
        return self.items[i][0][:1].isalnum()

    def span_text(self, i: int, n: int) -> str:
        return "".join((space if k else "") + tok for k, (tok, space) in enumerate(self.items[i:i + n]))

    def replace(self, i: int, n: int, text: str) -> None:
        space = self.items[i][1]
        del self.items[i:i + n]
        if text:
            self.items.insert(i, [text, space])
        elif i < len(self.items) and space and not self.items[i][1]:
            self.items[i][1] = space  # "a, b" minus "," keeps "a b"; "a ,b" keeps "a b"

    def insert_before(self, i: int, text: str) -> None:
        space = self.items[i][1]
        self.items[i][1] = " "
        self.items.insert(i, [text, space])

    def attach_after(self, i: int, text: str) -> None:
        self.items.insert(i + 1, [text, ""])

    def text(self) -> str:
        return "".join(space + tok for tok, space in self.items) + self.tail


def _suffix_rule(correct: str, wrong: str) -> tuple[str, str] | None:
    """(correct ending, wrong ending) where both are one word that differ only in their last
    MAX_SUFFIX letters after a stem of at least MIN_STEM letters."""
    if not correct or not wrong or not correct.isalpha() or not wrong.isalpha():
        return None
    stem = 0
    while stem < min(len(correct), len(wrong)) and correct[stem] == wrong[stem]:
        stem += 1
    # A correct ending of at least two letters ("братом" -> "братові" is "ом" -> "ові", not "м" -> "ві"),
    # so that a rule fires only on words that end like the corrected one.
    stem = max(min(stem, len(correct) - 2), MIN_STEM) if stem >= MIN_STEM else stem
    if stem < MIN_STEM or max(len(correct), len(wrong)) - stem > MAX_SUFFIX:
        return None
    return correct[stem:], wrong[stem:]


def _poisson(rng: random.Random, mean: float) -> int:
    # Knuth's method: means here are a few edits at most.
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _draw(rng: random.Random, counts: Counter) -> Any:
    keys = list(counts)
    return rng.choices(keys, [counts[k] for k in keys])[0]


def _weighted_order(rng: random.Random, weights: dict[str, int]) -> list[str]:
    """The kinds in a random order where the first is drawn by weight."""
    kinds = [k for k, w in weights.items() if w > 0]
    if not kinds:
        return []
    first = rng.choices(kinds, [weights[k] for k in kinds])[0]
    return [first, *[k for k in kinds if k != first]]
