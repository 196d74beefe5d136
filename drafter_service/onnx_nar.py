"""The NAR block drafter on ONNX Runtime: one graph call per draft.

Graphs come from `seq2seq_models.onnx_export` (role "nar_drafter", exported on demand and cached by
bundle fingerprint). A draft feeds the committed tokens the cache does not hold yet followed by
k [MASK]s, in one call: the committed tokens attend causally, the masks see everything, and the
graph returns the masks' argmax ids. The torch drafter makes two passes for the same thing (append,
then masks), and in eager mode each pass is a few dozen small ops; on CPU this is the cost that
decides whether GAD beats greedy (BENCHMARKS.md, "where the time goes").

The past K/V are kept as the last call returned them, masks included; the graph slices the past to
`past_len`, so the masks' K/V are simply never counted again, and a rollback is a smaller
`past_len` with no copy. The graphs run through `seq2seq_models.ort_runner`, the verifier's runner,
on the CPU execution provider only: on a GPU machine the drafter's torch backend already keeps its
cache on the device.
"""

from __future__ import annotations

from core.checks import check_session_step
from seq2seq_models.onnx_model import OnnxModel


class OnnxNarDrafter(OnnxModel):
    """The exported NAR drafter, on the CPU execution provider; `open` gives the per-source state a
    `DrafterSession` drafts with."""

    role = "nar_drafter"

    def open(self, source_ids: list[int]) -> OnnxNarState:
        return OnnxNarState(self, source_ids)


class OnnxNarState:
    """The NAR drafter's view of one source and the client's output prefix (the `PrefixState`
    protocol: `tokens`, `max_tokens`, `sync`), drafting with `draft_block`.

    `sync` only records the new prefix; the tokens the cache lacks are fed with the next draft's
    masks, so a step costs one graph call whatever it appends.
    """

    def __init__(self, drafter: OnnxNarDrafter, source_ids: list[int]) -> None:
        cfg = drafter.config
        self._runner = drafter.runner
        self._config = cfg
        self.tokens: list[int] = []  # the client's output prefix after BOS
        self._cross = self._runner.encode(source_ids, cfg.eos_id)
        self._past = self._runner.empty_past(cfg)
        self._valid = 0  # leading positions (BOS first) whose K/V in the past are of real tokens

    @property
    def max_tokens(self) -> int:
        return self._config.max_len - 1

    @property
    def cache_bytes(self) -> int:
        return sum(self._runner.nbytes(t) for t in (*self._past, *self._cross))

    def sync(self, committed_len: int, append_ids: list[int]) -> None:
        check_session_step(committed_len, len(self.tokens), len(append_ids), 0, self._config)
        self.tokens = [*self.tokens[:committed_len], *append_ids]
        self._valid = min(self._valid, 1 + committed_len)

    def draft_block(self, k: int) -> list[int]:
        cfg = self._config
        fed = [cfg.bos_id, *self.tokens][self._valid :]
        present_k, present_v, ids = self._runner.decode(
            self._past, self._cross, tokens=[[*fed, *([cfg.mask_id] * k)]], past_len=self._valid, mask_from=len(fed)
        )
        self._past = (present_k, present_v)
        self._valid = 1 + len(self.tokens)
        return ids.tolist()
