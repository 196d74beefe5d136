"""Input-guided aggressive decoding: draft by copying the source after a unique suffix match."""

from __future__ import annotations

from core.interfaces import Draft

MAX_NGRAM = 3


class CopyDrafter:
    """Drafts the source tokens that follow the longest (<= 3) suffix of BOS + output that occurs
    exactly once in BOS + source + EOS. BOS lines the output start up with the source start; EOS
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
        context = [self.bos_id, *output[-MAX_NGRAM:]]
        for n in range(min(MAX_NGRAM, len(context)), 0, -1):
            starts = self.occurrences.get(tuple(context[-n:]))
            if starts is not None and len(starts) == 1:
                begin = starts[0] + n
                return Draft(ids=self.seq[begin : begin + min(self.cap, room)])
        return Draft(ids=[])
