"""Input-guided aggressive decoding: draft by copying the source from where the output has got to."""

from __future__ import annotations

from collections.abc import Iterator

from core.interfaces import Draft

MAX_NGRAM = 3
# How far back a realignment looks for the output's last unique match with the source.
MAX_BACK = 8


class CopyDrafter:
    """Drafts the source tokens that follow where the output has got to in BOS + source + EOS.

    That place is after the longest (<= 3) suffix of BOS + output that occurs there exactly once.
    When no suffix does (the verifier just wrote a token the source lacks, or one it holds more than
    once), it is where the output would be had it gone on copying since its last unique match (an
    edit that replaced source tokens by as many others): after the suffix's occurrence nearest that
    place, or at that place when the last token is not in the source. An empty draft there would
    cost the row a forward of one token before its next copy (BENCHMARKS.md, "Bulk decoding:
    notes"); a wrong one costs no more. BOS lines the output start up with the source start; EOS
    lets a copy run end the sentence."""

    def __init__(self, source_ids: list[int], bos_id: int, eos_id: int, cap: int) -> None:
        self.seq = [bos_id, *source_ids, eos_id]
        self.bos_id = bos_id
        self.cap = cap
        self.occurrences: dict[tuple[int, ...], list[int]] = {}
        for n in range(1, MAX_NGRAM + 1):
            for start in range(len(self.seq) - n + 1):
                self.occurrences.setdefault(tuple(self.seq[start : start + n]), []).append(start)

    def propose(self, output: list[int], room: int) -> Draft:
        begin = self._after_unique(output, len(output))
        if begin is None:
            begin = self._realigned(output)
        if begin is None:
            return Draft(ids=[])
        return Draft(ids=self.seq[begin : begin + min(self.cap, room)])

    def _after_unique(self, output: list[int], end: int) -> int | None:
        """Where the source goes on after the longest suffix of BOS + output[:end] that it holds
        exactly once (None: no suffix does)."""
        return next((starts[0] + n for n, starts in self._suffixes(output, end) if len(starts) == 1), None)

    def _realigned(self, output: list[int]) -> int | None:
        """Where to copy from when no suffix of the output matches uniquely (see the class docstring)."""
        expected = self._expected(output)
        if expected is None:
            return None
        for n, starts in self._suffixes(output, len(output)):  # the longest held (several: none is unique)
            return min((start + n for start in starts), key=lambda end: (abs(end - expected), end))
        return expected

    def _suffixes(self, output: list[int], end: int) -> Iterator[tuple[int, list[int]]]:
        """(n, where it starts) for each suffix of BOS + output[:end] of n <= MAX_NGRAM tokens that the
        sequence holds, longest first."""
        context = [self.bos_id, *output[max(0, end - MAX_NGRAM) : end]]
        for n in range(min(MAX_NGRAM, len(context)), 0, -1):
            starts = self.occurrences.get(tuple(context[-n:]))
            if starts is not None:
                yield n, starts

    def _expected(self, output: list[int]) -> int | None:
        """Where the output would be in the sequence had it copied since its last unique match at most
        MAX_BACK tokens back (the output's start, BOS, always matches)."""
        for back in range(1, min(MAX_BACK, len(output)) + 1):
            begin = self._after_unique(output, len(output) - back)
            if begin is not None:
                return begin + back
        return None
