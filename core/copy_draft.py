"""Input-guided aggressive decoding (IAD): draft by copying the source from where the output has got to.

`CopyDrafter` is IAD's drafter wherever the loop runs: in the gateway's and the in-process policy
(`decoding.modes.iad`), and in the verifier service, which runs a whole copy-drafted greedy run in one
call (`VerifyStep.copy_draft`, `CopyRun`): the drafter needs nothing but the source and the output,
which the verifier holds, so IAD through the services costs one round trip per run, as AR's greedy
runs do, instead of one per iteration.
"""

from __future__ import annotations

from collections.abc import Iterator

from core.errors import invalid, out_of_range
from core.interfaces import Draft, StepCall, VerifyResult

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


def check_copy_draft(k: int, steps: int, max_draft_len: int) -> None:
    """A VerifyStep's copy_draft: 0 (no copy drafts), or a block of at most `max_draft_len` tokens in a
    greedy run (greedy_steps > 1, whose own checks rule out drafts and rows)."""
    if k < 0:
        raise invalid(f"copy_draft must be >= 0, got {k}")
    if k and steps <= 1:
        raise invalid("copy_draft needs greedy_steps > 1")
    if k > max_draft_len:
        raise out_of_range(f"copy_draft is {k}; the limit is {max_draft_len}")


class CopyRun:
    """A greedy run whose forwards each verify a copy draft (IAD): the same tokens as `steps` plain AR
    steps (`core.greedy`), in fewer forwards. `first(call)` gives the run's first step its draft;
    after each forward, on the model worker, `next(call, result)` keeps what the verifier's top-1
    agrees with plus its own next token, and names the next step (the accepted prefix kept, that
    token appended, a new draft) or ends the run (`steps` tokens, EOS, or the session full). `tokens`
    and `blocks` are then the run's greedy tokens (the last not yet appended in the session, as after
    any step) and its forwards: what each drafted, and how many of those it kept (the verifier's
    top-1 agreed, up to the run's end)."""

    def __init__(self, drafter: CopyDrafter, output: list[int], steps: int, eos_id: int, max_output_len: int) -> None:
        self.drafter = drafter
        self.output = list(output)  # the session's final tokens: before the run, then its tokens
        self.start = len(output)
        self.steps = steps
        self.eos_id = eos_id
        self.max_output_len = max_output_len
        self.positions: list[tuple[VerifyResult, int]] = []  # (a forward's result, positions of it kept)
        self.blocks: list[tuple[int, int]] = []  # each forward's tokens drafted, and those kept

    @property
    def tokens(self) -> list[int]:
        return self.output[self.start :]

    def first(self, call: StepCall) -> StepCall:
        committed = call.committed_len + len(call.append_ids)
        return StepCall(call.committed_len, call.append_ids, self._draft(committed), call.top_k)

    def next(self, call: StepCall, result: VerifyResult) -> StepCall | None:
        draft = call.draft_ids
        accepted = next((i for i, (d, v) in enumerate(zip(draft, result.top1, strict=False)) if d != v), len(draft))
        new = result.top1[: accepted + 1][: self.steps - self._done()]
        if self.eos_id in new:
            new = new[: new.index(self.eos_id) + 1]
        self.output += new
        self.positions.append((result, len(new)))
        self.blocks.append((len(draft), min(accepted, len(new))))
        committed = call.committed_len + len(call.append_ids) + len(new) - 1  # the last not appended yet
        if self._done() >= self.steps or new[-1] == self.eos_id or committed + 1 > self.max_output_len:
            return None
        return StepCall(committed, [new[-1]], self._draft(committed + 1), call.top_k)

    def _done(self) -> int:
        """The run's tokens so far."""
        return len(self.output) - self.start

    def _draft(self, held: int) -> list[int]:
        """A copy draft after the output, within the session's room after `held` final tokens and
        no longer than the run's tokens left need (a forward gives one token past its draft)."""
        room = min(self.max_output_len - held, self.steps - self._done() - 1)
        return self.drafter.propose(self.output, room).ids if room > 0 else []
